"""Timing primitives for one configuration: cold first call, warm-up, latency pass, energy window.

How the figures are taken (the same on every device):
- compile_s: wall time of the first call, device-synchronised; it includes tracing, Inductor
  compilation (fresh cache) and the first execution.
- warm-up: per-call synchronised calls until the median of the last 5 latencies is within 10% of the
  median of the 5 before (so CUDA-graph recording and autotuning leftovers are behind us), bounded
  by `warmup_max_s`.
- latency_ms_p50/p95: on a GPU, a separate pass of per-call synchronised calls (at least 10, about
  `latency_s` long); percentiles by linear interpolation. On a device whose calls return only when their
  work is done (the CPU: no queue to synchronise), every call of the energy window is timed instead: the
  same per-call latencies, without a separate pass (`timed_back_to_back`).
- throughput and energy: a window of back-to-back calls with one synchronisation at the end, at least
  `min_seconds` long, so per-call sync gaps (idle GPU between launches) do not distort the energy
  per inference. throughput_per_s = batch_size x calls / window seconds.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def is_synchronous(device: str) -> bool:
    """Whether a call on `device` returns only once its work is done (the CPU), so that timing each call
    of the energy window disturbs nothing and a separate latency pass would only repeat it."""
    return not str(device).startswith("cuda")


def synchronizer(device: str) -> Callable[[], None]:
    import torch

    if not is_synchronous(device):
        index = torch.device(device)

        def sync() -> None:
            torch.cuda.synchronize(index)

        return sync
    return lambda: None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def timed_call(call: Callable[[], Any], sync: Callable[[], None]) -> tuple[Any, float]:
    sync()
    start = time.perf_counter()
    out = call()
    sync()
    return out, time.perf_counter() - start


def warm_up(call: Callable[[], Any], sync: Callable[[], None], *, max_s: float, min_calls: int = 3,
            window: int = 5, tolerance: float = 0.10) -> tuple[int, float]:
    """Call until latency is stable or `max_s` passes; returns (calls, seconds)."""
    latencies: list[float] = []
    start = time.perf_counter()
    while True:
        latencies.append(timed_call(call, sync)[1])
        elapsed = time.perf_counter() - start
        if len(latencies) >= max(min_calls, 2 * window):
            recent = statistics.median(latencies[-window:])
            before = statistics.median(latencies[-2 * window:-window])
            if abs(recent - before) <= tolerance * before:
                break
        if len(latencies) >= min_calls and elapsed >= max_s:
            break
    return len(latencies), time.perf_counter() - start


def latency_pass(call: Callable[[], Any], sync: Callable[[], None], *, seconds: float, min_calls: int = 10,
                 max_calls: int = 100_000) -> list[float]:
    """Per-call synchronised latencies in milliseconds."""
    latencies: list[float] = []
    start = time.perf_counter()
    while len(latencies) < max_calls:
        latencies.append(timed_call(call, sync)[1] * 1000.0)
        if len(latencies) >= min_calls and time.perf_counter() - start >= seconds:
            break
    return latencies


def back_to_back(call: Callable[[], Any], sync: Callable[[], None], *, min_seconds: float,
                 min_calls: int = 3) -> int:
    """Call without synchronising until `min_seconds` have passed; one sync at the end. Returns calls."""
    calls = 0
    start = time.perf_counter()
    while True:
        call()
        calls += 1
        if calls >= min_calls and time.perf_counter() - start >= min_seconds:
            break
    sync()
    return calls


LATENCY_SAMPLE_CAP = 100_000


def timed_back_to_back(call: Callable[[], Any], *, min_seconds: float, min_calls: int = 3,
                       cap: int = LATENCY_SAMPLE_CAP) -> tuple[int, list[float]]:
    """`back_to_back` on a synchronous device, timing each call: returns (calls, latencies in ms). Beyond
    `cap` calls the latencies kept are a uniform sample of all of them (reservoir sampling, seeded), so a
    long window of very short calls keeps a bounded list."""
    latencies: list[float] = []
    chooser = random.Random(0)
    clock = time.perf_counter
    calls = 0
    start = last = clock()
    while True:
        call()
        now = clock()
        calls += 1
        if len(latencies) < cap:
            latencies.append((now - last) * 1000.0)
        else:
            slot = chooser.randrange(calls)
            if slot < cap:
                latencies[slot] = (now - last) * 1000.0
        last = now
        if calls >= min_calls and now - start >= min_seconds:
            break
    return calls, latencies


@dataclass
class TimedWindow:
    """A configuration's latencies and its energy window, as `latencies_and_window` took them."""

    calls: int
    latencies_ms: list[float]
    measurement: Any  # what meter.end("window") returned
    latency_pass_s: float  # the separate latency pass; 0.0 when the window's own calls were timed
    latency_source: str  # "latency_pass" or "window"

    def latency_columns(self) -> dict[str, float]:
        """The run's latency columns."""
        return {"latency_ms_p50": percentile(self.latencies_ms, 50),
                "latency_ms_p95": percentile(self.latencies_ms, 95)}

    def latency_extra(self) -> dict[str, Any]:
        """What the run's `extra` says of its latencies: where they came from and how many."""
        values = self.latencies_ms
        return {"latency_s": self.latency_pass_s, "latency_source": self.latency_source,
                "latency_calls": len(values), "latency_ms_mean": sum(values) / len(values),
                "latency_ms_min": min(values)}


def latencies_and_window(call: Callable[[], Any], sync: Callable[[], None], meter: Any, *, device: str,
                         min_seconds: float, latency_s: float, phases: Any = None,
                         before_window: Callable[[], None] | None = None) -> TimedWindow:
    """The latency pass (on a GPU) and the metered energy window of back-to-back calls. On a synchronous
    device the window's calls are timed one by one instead of making a separate pass."""
    synchronous = is_synchronous(device)
    latencies: list[float] = []
    pass_s = 0.0
    if not synchronous:
        if phases is not None:
            phases.enter("latency")
        started = time.perf_counter()
        latencies = latency_pass(call, sync, seconds=latency_s)
        pass_s = time.perf_counter() - started
    if phases is not None:
        phases.enter("window")
    if before_window is not None:
        before_window()
    calls, timed, measurement = metered_window(call, sync, meter, device=device, min_seconds=min_seconds)
    return TimedWindow(calls=calls, latencies_ms=timed if synchronous else latencies, measurement=measurement,
                       latency_pass_s=pass_s, latency_source="window" if synchronous else "latency_pass")


def metered_window(call: Callable[[], Any], sync: Callable[[], None], meter: Any, *, device: str,
                   min_seconds: float, name: str = "window") -> tuple[int, list[float], Any]:
    """One metered window of back-to-back calls, at least `min_seconds` long (and 3 calls), synchronised before
    it opens and before it closes: (calls, the calls' latencies in ms on a synchronous device, else [], what
    `meter.end(name)` returned)."""
    sync()
    meter.begin(name)
    latencies: list[float] = []
    if is_synchronous(device):
        calls, latencies = timed_back_to_back(call, min_seconds=min_seconds)
    else:
        calls = back_to_back(call, sync, min_seconds=min_seconds)
    return calls, latencies, meter.end(name)



# --- disturbed runs --------------------------------------------------------------------------------------
# A run's latency that is this many times a reference it should not exceed (the configuration's other stored
# runs on this kind of device, or the workload's eager calls on one thread just before the window) was slowed
# by something outside the configuration: on a busy 2-core host, eager calls took 24-40 ms against 0.23 ms
# possible. Far, not merely noisy: runs of one configuration differ by up to about a quarter between windows.
FAR_SLOWER = 2.0
# The thread probe: this many pairs of eager calls (the worker's threads, then one thread), fewer where they would
# take longer than PROBE_MAX_S (at least one pair, however slow the model).
PROBE_PAIRS = 5
PROBE_MAX_S = 0.5


def add_flag(extra: dict[str, Any], warning: str) -> None:
    """Flag a run "repeat this run" (`extra.window_warning`, which the resolver and the planner read through
    `policies.resolve.run_flag`), beside any warning it already carries."""
    before = extra.get("window_warning")
    extra["window_warning"] = f"{before}; {warning}" if before else warning


def far_slower(latency_ms: float | None, reference_ms: float | None) -> bool:
    """Whether `latency_ms` is more than FAR_SLOWER times `reference_ms` (False when either is unknown)."""
    return bool(latency_ms and reference_ms and latency_ms > FAR_SLOWER * reference_ms)


@dataclass(frozen=True)
class ThreadProbe:
    """Eager calls of the workload with the worker's torch threads and on one thread, just before the window."""

    threads: int
    ms_at_threads: float  # median call with `threads` threads
    ms_one_thread: float  # median call on one thread
    pairs: int

    def to_dict(self) -> dict[str, Any]:
        return {"threads": self.threads, "ms_at_threads": self.ms_at_threads, "ms_one_thread": self.ms_one_thread,
                "pairs": self.pairs}

    def warning(self, window_p50_ms: float | None = None) -> str | None:
        """The flag when the worker's threads ran the eager calls far slower than one thread did, or, given
        `window_p50_ms` (the median call of the energy window of a configuration whose call is the probe's: eager
        fp32), when the window's calls were far slower than one thread's. None when neither."""
        if self.threads > 1 and far_slower(self.ms_at_threads, self.ms_one_thread):
            return (f"eager calls took {self.ms_at_threads:.3g} ms with torch's {self.threads} threads against "
                    f"{self.ms_one_thread:.3g} ms on one thread just before the energy window: the cores are "
                    "contended (other processes, or more threads than free cores); repeat this run before relying "
                    "on its figures, or measure with fewer threads (bench --threads)")
        if far_slower(window_p50_ms, self.ms_one_thread):
            return (f"calls took {window_p50_ms:.3g} ms (median) in the energy window against {self.ms_one_thread:.3g} "
                    "ms on one thread just before it: something slowed the window (host contention); repeat this run "
                    "before relying on its figures")
        return None


def thread_probe(call: Callable[[], Any], threads: int, *, pairs: int = PROBE_PAIRS,
                 max_s: float = PROBE_MAX_S) -> ThreadProbe:
    """Time `call` (an eager call of the workload, on the CPU) alternately with `threads` torch threads and with
    one, `pairs` times or until `max_s` passed (at least once each); torch is left at `threads`. Alternating
    puts both under the same load, so a gap between them is the threads' contention, not the machine's speed."""
    import torch

    at_threads: list[float] = []
    one_thread: list[float] = []
    started = time.perf_counter()
    try:
        while True:
            for count, into in ((threads, at_threads), (1, one_thread)):
                torch.set_num_threads(count)
                into.append(timed_call(call, lambda: None)[1] * 1000.0)
            if len(at_threads) >= pairs or time.perf_counter() - started >= max_s:
                break
    finally:
        torch.set_num_threads(threads)
    return ThreadProbe(threads, statistics.median(at_threads), statistics.median(one_thread), len(at_threads))
