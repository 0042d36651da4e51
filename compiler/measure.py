"""Timing primitives for one configuration: cold first call, warm-up, latency pass, energy window.

How the figures are taken (the same on every device):
- compile_s: wall time of the first call, device-synchronised; it includes tracing, Inductor
  compilation (fresh cache) and the first execution.
- warm-up: per-call synchronised calls until the median of the last 5 latencies is within 10% of the
  median of the 5 before (so CUDA-graph recording and autotuning leftovers are behind us), bounded
  by `warmup_max_s`.
- latency_ms_p50/p95: a separate pass of per-call synchronised calls (at least 10, about
  `latency_s` long); percentiles by linear interpolation.
- throughput and energy: a window of back-to-back calls with one synchronisation at the end, at least
  `min_seconds` long, so per-call sync gaps (idle GPU between launches) do not distort the energy
  per inference. throughput_per_s = batch_size x calls / window seconds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def synchronizer(device: str) -> Callable[[], None]:
    import torch

    if str(device).startswith("cuda"):
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
