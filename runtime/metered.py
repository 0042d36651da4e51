"""Live metering of a deployed model: count calls on the hot path, meter energy off it.

`runtime.attach.attach(model, "name")` returns a `MeteredModel`. Calling it runs the wrapped model and
bumps an `itertools.count` (atomic under the GIL, no lock, no device call). A daemon thread wakes every
`interval_s`, reads the cumulative energy counter of the deployment's device (plus a few instant
power reads in between, for the peak), and appends one sample per window. Samples are written to
the store in batches, one transaction per batch, and flushed on `close()` and at interpreter exit
(`atexit`). A SIGTERM handler that flushes (chained to the previous one) is opt-in
(`flush_on_sigterm()`): a serving process's signals belong to its framework. Without it, a SIGTERM
that ends the process without a normal exit, like a SIGKILL, loses at most the unflushed batch
(`flush_interval_s`, 30 s by default).

The envelope guard (`runtime.guard`) sees every window. When it trips with `action = "fallback"`,
the metering thread only *requests* a swap; the next call on the caller's thread builds (compiles)
the fallback configuration and serves with it from then on, so that compile happens where a
`torch.compile` call would normally happen and never races the model from another thread.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlite_utils
from joulepilot.policies.resolve import torch_minor
from joulepilot.store import open_db, transaction
from joulepilot.store.deployments import insert_samples, set_deployment_config
from joulepilot.store.sample_amend import amend_newest_sample

from .guard import EnvelopeGuard
from .trips import record_trip

log = logging.getLogger("joulepilot.deployment")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_FLUSH_INTERVAL_S = 30.0
POWER_READS_PER_WINDOW = 4
# A last window (at close) shorter than this many seconds, or than this fraction of the interval, is folded
# into the window before it: the energy counter steps every ~100 ms, so a sliver of a window reads 0 J
# (0 W in the exporter, a drop in plots) or one whole step (a spike).
MIN_TAIL_S = 1.0
MIN_TAIL_FRACTION = 0.2


@dataclass
class Fallback:
    """A configuration to swap to: its id and label, and how to build the callable (lazily)."""

    config_id: str | None
    label: str
    build: Callable[[], Callable[..., Any]]


def _torch_version() -> str:
    """major.minor, as decisions record it."""
    try:
        return torch_minor()
    except Exception:  # noqa: BLE001 - torch metadata missing: the decision's own version is used
        return ""


def _own_pids() -> set[int]:
    pids = {os.getpid()}
    try:
        import psutil

        pids |= {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:  # noqa: BLE001 - psutil is best effort here
        pass
    return pids


def _shared_gpu(index: int) -> tuple[int, float | None]:
    """(other compute processes on the GPU, this process tree's share of their utilisation)."""
    from joulepilot.telemetry import gpu_activity  # looked up per call: tests stand in a shared GPU

    activity = gpu_activity(index)
    pids = set(getattr(activity, "compute_pids", None) or [])
    mine = _own_pids()
    others = pids - mine
    if not others:
        return 0, 1.0
    util = getattr(activity, "process_utilization", None)
    if not util:
        return len(others), None
    ours = sum(pct for pid, pct in util.items() if pid in mine)
    total = sum(util.values())
    return len(others), (ours / total if total > 0 else None)


class MeteredModel:
    """A callable deployment: forwards calls to the model, counts them, meters energy in the background."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        deployment_id: int,
        db_path: str | None,
        shared_db: sqlite_utils.Database | None,
        meter: Any,
        own_meter: bool,
        device: str,
        interval_s: float,
        flush_interval_s: float,
        config_id: str | None,
        config_label: str | None,
        policy_name: str | None,
        decision: dict[str, Any] | None,
        device_kind: str | None,
        guard: EnvelopeGuard | None,
        fallback: Fallback | Callable[[], Fallback | None] | None,
    ) -> None:
        self._fn = fn
        self._calls = itertools.count()
        self._pending_swap: Fallback | None = None
        self.name = name
        self.deployment_id = deployment_id
        self.device = device
        self.interval_s = float(interval_s)
        self.flush_interval_s = float(flush_interval_s)
        self.config_id = config_id
        self.config_label = config_label
        self.policy_name = policy_name
        self.decision_row = decision
        self.device_kind = device_kind
        self.guard = guard
        self.trips: list[dict[str, Any]] = []
        self._fallback = fallback
        self._meter = meter
        self._own_meter = own_meter
        self._db_path = db_path
        self._shared_db = shared_db
        self._db: sqlite_utils.Database | None = None
        self._buffer: list[dict[str, Any]] = []
        self._buffer_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._written_config_id = config_id
        self._newest: dict[str, Any] | None = None  # the newest window taken (buffered or written)
        self.samples_written = 0
        gpus = [d for d in meter.devices if getattr(d, "kind", "") == "gpu"]
        self._gpu_index = gpus[0].index if gpus else None
        self.energy_source = meter.primary_source
        self._last_mono = time.monotonic()  # windows are timed by this clock; the wall clock only stamps them
        self._last_t_end = time.time()  # the stamped end of the newest window (here: where the first starts)
        self._last_e = self._energy_now()
        self._last_n = 0
        self._last_flush = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"joulepilot-meter:{name}", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        _flush_at_exit()

    # -- hot path ---------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._pending_swap is not None:
            self._apply_swap()
        out = self._fn(*args, **kwargs)
        next(self._calls)
        return out

    @property
    def inferences(self) -> int:
        """Completed calls so far (read without advancing the counter: `count(N)` reprs as N)."""
        return int(repr(self._calls)[6:-1])

    def __getattr__(self, item: str) -> Any:
        # Only reached for names MeteredModel lacks: behave like the wrapped model (eval(), .training, ...).
        if item.startswith("__") or "_fn" not in self.__dict__:
            raise AttributeError(item)
        return getattr(self.__dict__["_fn"], item)

    # -- fallback swap (caller's thread) ----------------------------------------------------------
    def _apply_swap(self) -> None:
        with self._swap_lock:
            target = self._pending_swap
            if target is None:
                return
            log.warning("deployment %r: switching to fallback configuration %s (building it now)",
                        self.name, target.label)
            self._fn = target.build()
            self.config_id = target.config_id
            self.config_label = target.label
            if self.guard is not None:
                self.guard.reset()
            self._pending_swap = None

    def request_swap(self, target: Fallback) -> None:
        """Serve `target` from the next call on (it is built on the caller's thread at that call)."""
        self._pending_swap = target

    # -- metering thread --------------------------------------------------------------------------
    def _energy_now(self) -> float:
        return float(sum(self._meter.read_energy_j().values()))

    def _power_now(self) -> float | None:
        try:
            readings = self._meter.read_power_w()
        except Exception:  # noqa: BLE001 - a failed instant read only loses the peak
            return None
        return float(sum(readings.values())) if readings else None

    def _database(self) -> sqlite_utils.Database:
        if self._db is None:
            # The thread writes through its own connection so a caller's open transaction never mixes in.
            self._db = open_db(self._db_path) if self._db_path else self._shared_db
        return self._db

    def _run(self) -> None:
        step_s = self.interval_s / POWER_READS_PER_WINDOW
        next_sample = time.monotonic() + self.interval_s
        powers: list[float] = []
        try:
            while not self._stop.wait(max(0.0, min(step_s, next_sample - time.monotonic()))):
                if time.monotonic() < next_sample:
                    power = self._power_now()
                    if power is not None:
                        powers.append(power)
                    continue
                self._take_sample(powers)
                powers = []
                next_sample += self.interval_s
                if next_sample < time.monotonic():  # a stall: don't queue up a burst of short windows
                    next_sample = time.monotonic() + self.interval_s
                self._maybe_flush()
            self._take_sample(powers, final=True)
            self.flush()
        except Exception:  # noqa: BLE001 - metering must never take the served model down
            log.exception("deployment %r: metering stopped", self.name)
        finally:
            if self._db is not None and self._db is not self._shared_db:
                self._db.close()
                self._db = None

    def _take_sample(self, powers: list[float], final: bool = False) -> None:
        mono_end = time.monotonic()
        t_end = time.time()
        energy = self._energy_now()
        count = self.inferences
        # The window's length comes from the monotonic clock, so a wall-clock step (NTP, a VM resuming)
        # neither stretches nor squeezes it; see `_stamps` for where it is placed in wall-clock time.
        duration_s = mono_end - self._last_mono
        if final and duration_s <= 0:
            return
        if final and duration_s < max(MIN_TAIL_S, MIN_TAIL_FRACTION * self.interval_s) \
                and self._fold_tail(duration_s, mono_end, energy, count, powers):
            return
        energy_j = max(0.0, energy - self._last_e)
        inferences = count - self._last_n
        avg_power_w = energy_j / duration_s if duration_s > 0 else None
        # The window's mean power bounds its peak from below; sparse instant reads can miss the top.
        candidates = [p for p in powers if p is not None] + ([avg_power_w] if avg_power_w is not None else [])
        other_processes, share = 0, (1.0 if self.energy_source == "estimate" else None)
        if self._gpu_index is not None:
            try:
                other_processes, share = _shared_gpu(self._gpu_index)
            except Exception:  # noqa: BLE001 - attribution is best effort
                other_processes, share = 0, None
        t_start, t_end = self._stamps(t_end, duration_s)
        sample = {
            "t_start": t_start,
            "t_end": t_end,
            "energy_j": energy_j,
            "inferences": inferences,
            "avg_power_w": avg_power_w,
            "peak_power_w": max(candidates) if candidates else None,
            "energy_source": self.energy_source,
            "config_id": self.config_id,
            "other_processes": other_processes,
            "share": share,
        }
        self._last_mono, self._last_e, self._last_n, self._last_t_end = mono_end, energy, count, t_end
        with self._buffer_lock:
            self._buffer.append(sample)
        self._newest = sample
        if self.guard is not None and not final:
            trip = self.guard.feed(avg_power_w, inferences=inferences, at=t_end)
            if trip is not None:
                self._on_trip(trip)

    def _stamps(self, wall_end: float, duration_s: float) -> tuple[float, float]:
        """(t_start, t_end) of a window that lasted `duration_s` (monotonic) and ended at `wall_end` (wall clock).

        The length wins: t_end - t_start is always the metered duration. The window ends at the wall clock
        unless it would then start before the previous window ended (the wall clock stepped back): it then
        starts where that one ended. So windows never overlap and stay in order; after a step forward (a VM
        resuming) they follow the wall clock at once, leaving a gap; after a step back the stamps run ahead
        of the wall clock by at most the step, for as long as this deployment runs.
        """
        t_start = wall_end - duration_s
        if t_start < self._last_t_end:
            t_start = self._last_t_end
        return t_start, t_start + duration_s

    def _fold_tail(self, tail_s: float, mono_end: float, energy: float, count: int, powers: list[float]) -> bool:
        """Extend the newest window by the tail's `tail_s` seconds (monotonic) instead of writing a short last
        one; False when there is no window to extend (the tail is then written on its own)."""
        previous = self._newest
        if previous is None or previous["config_id"] != self.config_id:
            return False
        merged = dict(previous)
        # The window keeps its start stamp (the store finds the row to amend by it) and grows by the tail's
        # monotonic length, so its stamps still span exactly the time it metered.
        merged["t_end"] = previous["t_end"] + tail_s
        merged["energy_j"] = previous["energy_j"] + max(0.0, energy - self._last_e)
        merged["inferences"] = previous["inferences"] + count - self._last_n
        duration_s = merged["t_end"] - previous["t_start"]
        merged["avg_power_w"] = merged["energy_j"] / duration_s if duration_s > 0 else previous["avg_power_w"]
        # The tail's own mean power is what a counter step distorts, so only its instant reads count.
        peaks = [p for p in (previous["peak_power_w"], merged["avg_power_w"], *powers) if p is not None]
        merged["peak_power_w"] = max(peaks) if peaks else None
        with self._buffer_lock:
            buffered = bool(self._buffer) and self._buffer[-1] is previous
            if buffered:
                self._buffer[-1] = merged
        if not buffered:
            try:
                with self._write_lock:
                    if not amend_newest_sample(self._database(), self.deployment_id, previous["t_start"], merged):
                        return False
            except Exception:  # noqa: BLE001 - the store refused the amend: keep the tail as its own window
                log.warning("deployment %r: could not extend the last window; writing the tail alone",
                            self.name, exc_info=True)
                return False
        self._newest = merged
        self._last_mono, self._last_e, self._last_n = mono_end, energy, count
        self._last_t_end = merged["t_end"]
        return True

    def _on_trip(self, trip: Any) -> None:
        self.flush()  # the evidence is in the store before the violation that cites it
        with self._write_lock:
            written = record_trip(
                self._database(), trip, deployment=self.name, policy=self.policy_name,
                config_id=self.config_id, decision=self.decision_row, device_kind=self.device_kind,
                torch_version=_torch_version(), source=self.energy_source, config_label=self.config_label,
            )
        if self.guard is not None and self.guard.action == "fallback":
            self._request_fallback()
        self.trips.append(written)

    def _request_fallback(self) -> None:
        target = self._fallback() if callable(self._fallback) and not isinstance(self._fallback, Fallback) \
            else self._fallback
        if target is None:
            warnings.warn(f"deployment {self.name!r}: guard action is 'fallback' but no fallback "
                          "configuration is available (pass base_model= or fallback= to attach); keeping "
                          "the current configuration", RuntimeWarning, stacklevel=2)
            return
        if target.config_id is not None and target.config_id == self.config_id:
            warnings.warn(f"deployment {self.name!r} already serves its fallback configuration "
                          f"{target.label}; nothing lower to switch to", RuntimeWarning, stacklevel=2)
            return
        self.request_swap(target)

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the batch stays buffered; the next flush retries it
                log.warning("deployment %r: sample flush failed; will retry", self.name, exc_info=True)

    def flush(self) -> int:
        """Write the buffered samples now (one transaction); returns how many were written."""
        with self._write_lock:
            with self._buffer_lock:
                batch, self._buffer = self._buffer, []
            self._last_flush = time.monotonic()
            if not batch:
                return 0
            db = self._database()
            try:
                with transaction(db):
                    written = insert_samples(db, self.deployment_id, batch)
                    current = batch[-1]["config_id"]
                    if current != self._written_config_id:
                        set_deployment_config(db, self.deployment_id, current)
            except Exception:
                with self._buffer_lock:  # keep them for the next flush rather than drop them
                    self._buffer[:0] = batch
                raise
            if current != self._written_config_id:
                self._written_config_id = current
            self.samples_written += written
            return written

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Take the last (partial) window, flush every sample, stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        _LIVE.discard(self)
        if self._own_meter:
            try:
                self._meter.close()
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> MeteredModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"MeteredModel({self.name!r}, device={self.device!r}, config={self.config_label!r}, "
                f"inferences={self.inferences}, source={self.energy_source!r})")

# -- exit paths -----------------------------------------------------------------------------------
_LIVE: weakref.WeakSet[MeteredModel] = weakref.WeakSet()
_ATEXIT_REGISTERED = False
_SIGTERM_INSTALLED = False
_PREVIOUS_SIGTERM: Any = None


def close_all() -> None:
    """Flush and stop every live deployment in this process."""
    for model in list(_LIVE):
        try:
            model.close()
        except Exception:  # noqa: BLE001 - on the way out, one failure must not stop the others
            log.exception("deployment %r: final flush failed", model.name)


def _flush_at_exit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        _ATEXIT_REGISTERED = True
        atexit.register(close_all)


def _on_sigterm(signum: int, frame: Any) -> None:
    close_all()
    previous = _PREVIOUS_SIGTERM
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL or previous is None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def flush_on_sigterm() -> bool:
    """Opt in to flushing every live deployment on SIGTERM, then running the handler that was there
    before (the default one still ends the process by the signal). Python runs no `atexit` on a
    SIGTERM it has no handler for, so a process stopped that way (systemd, Kubernetes) otherwise loses
    the unflushed batch. Not installed by default: a serving framework's own handler decides how its
    process stops. Idempotent; returns False where no handler can be installed (not the main thread)."""
    global _SIGTERM_INSTALLED, _PREVIOUS_SIGTERM
    if _SIGTERM_INSTALLED:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return False
    _PREVIOUS_SIGTERM, _SIGTERM_INSTALLED = previous, True
    return True
