"""Is the device free for benchmarking? Production work always wins over the daemon's sweeps.

A GPU is idle when its utilisation stays under a threshold for a configured time and no other
process computes on it; the daemon's own worker processes do not count. A CPU device is idle unless
a load threshold is configured, in which case the CPU use of everything but the daemon's own
process tree must stay under it.

The quiet period a GPU waits out is also its idle baseline: the tracker reads the GPU's energy counter
with each quiet reading, and `quiet_power_w` is the average power from the period's first reading to
its last (nothing of the daemon's runs on the GPU meanwhile; a zygote that starts then works on the CPU).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from .daemon_config import IdleConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReading:
    busy: bool
    reason: str
    utilization_pct: float | None = None
    other_pids: tuple[int, ...] = ()
    energy_j: float | None = None  # the GPU's energy counter at this reading, where it has one


def own_process_tree(root_pid: int | None = None) -> set[int]:
    """The daemon and every process below it (its workers and their children)."""
    try:
        root = psutil.Process(root_pid or os.getpid())
        return {root.pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return {root_pid or os.getpid()}


def _default_gpu_activity(index: int) -> Any:
    from joulepilot.telemetry import gpu_activity

    return gpu_activity(index)


class LoadProbe:
    """One reading of one device's load, with the daemon's own processes left out."""

    def __init__(self, device: str, cfg: IdleConfig,
                 gpu_activity: Callable[[int], Any] | None = None) -> None:
        self.device = device
        self.cfg = cfg
        self._gpu_activity = gpu_activity or _default_gpu_activity
        self._cpu_primed = False

    def read(self, own_pids: Iterable[int] | None = None, *, during_job: bool = False) -> LoadReading:
        """`during_job`: the daemon's own measurement is on the device now, so device-wide utilisation
        is partly ours and only other processes count."""
        own = set(own_pids) if own_pids is not None else own_process_tree()
        if self.device == "cpu":
            return self._read_cpu(own)
        index = int(self.device.split(":", 1)[1]) if ":" in self.device else int(self.device)
        return self._read_gpu(index, own, during_job)

    def _read_gpu(self, index: int, own: set[int], during_job: bool) -> LoadReading:
        try:
            act = self._gpu_activity(index)
        except Exception as exc:  # a probe failure must not stop the daemon; treat as busy to be safe
            return LoadReading(True, f"cannot read GPU {index} activity: {exc}")
        pids = [int(p) for p in (getattr(act, "compute_pids", None) or [])]
        others = [p for p in pids if p not in own]
        if during_job:
            # In a container NVML may report host pids that do not exist in our pid namespace; while our
            # worker computes, such a pid is most likely that worker, so only visible strangers count.
            others = [p for p in others if psutil.pid_exists(p)]
        util = getattr(act, "utilization_pct", None)
        per_proc = getattr(act, "process_utilization", None)
        if others and not self.cfg.allow_other_processes:
            return LoadReading(True, f"other compute processes on GPU {index}: {others}", util, tuple(others))
        if util is None or getattr(act, "available", True) is False:
            why = getattr(act, "reason", "") or "no utilisation reading"
            return LoadReading(False, f"GPU {index}: {why}; cannot judge load, assuming idle", None, tuple(others))
        if during_job:
            if per_proc:
                foreign = sum(v for p, v in per_proc.items() if int(p) in others)
                if foreign >= self.cfg.max_utilization_pct:
                    return LoadReading(True, f"GPU {index}: other processes use {foreign:.0f}%", util,
                                       tuple(others))
            return LoadReading(False, f"GPU {index}: only the daemon's worker is computing", util, tuple(others))
        if util >= self.cfg.max_utilization_pct:
            return LoadReading(True, f"GPU {index} utilisation {util:.0f}% >= {self.cfg.max_utilization_pct:g}%",
                               util, tuple(others))
        return LoadReading(False, f"GPU {index} utilisation {util:.0f}%", util, tuple(others),
                           getattr(act, "energy_j", None))

    def _read_cpu(self, own: set[int]) -> LoadReading:
        if self.cfg.cpu_max_load_pct >= 100:
            return LoadReading(False, "cpu device: no load threshold configured")
        total = psutil.cpu_percent(interval=None if self._cpu_primed else 0.2)
        self._cpu_primed = True
        mine = 0.0
        for pid in own:
            try:
                mine += psutil.Process(pid).cpu_percent(interval=None)
            except psutil.Error:
                continue
        other = max(0.0, total - mine / (psutil.cpu_count() or 1))
        if other >= self.cfg.cpu_max_load_pct:
            return LoadReading(True, f"cpu load from other processes {other:.0f}% >= {self.cfg.cpu_max_load_pct:g}%",
                               other)
        return LoadReading(False, f"cpu load from other processes {other:.0f}%", other)


class IdleTracker:
    """Turns readings into a decision: idle only after `min_idle_s` of continuous quiet.

    A CPU device without a load threshold is idle at once (there is nothing to wait for).
    """

    def __init__(self, probe: LoadProbe, clock: Callable[[], float] = time.monotonic) -> None:
        self.probe = probe
        self.clock = clock
        self.quiet_since: float | None = None
        self.last: LoadReading | None = None
        # (time, energy counter) at the first and the latest quiet reading of the current quiet period
        self._quiet_energy: list[tuple[float, float]] = []

    @property
    def needs_quiet_period(self) -> bool:
        return not (self.probe.device == "cpu" and self.probe.cfg.cpu_max_load_pct >= 100)

    def poll(self, own_pids: Iterable[int] | None = None) -> bool:
        reading = self.probe.read(own_pids)
        self.last = reading
        now = self.clock()
        if reading.busy:
            if self.quiet_since is not None:
                log.info("device %s became busy: %s", self.probe.device, reading.reason)
            self._end_quiet()
            return False
        if self.quiet_since is None:
            self.quiet_since = now
        self._note_energy(now, reading.energy_j)
        return not self.needs_quiet_period or now - self.quiet_since >= self.probe.cfg.min_idle_s

    def _end_quiet(self) -> None:
        self.quiet_since = None
        self._quiet_energy = []

    def _note_energy(self, now: float, energy_j: float | None) -> None:
        if energy_j is None:
            self._quiet_energy = []  # a gap in the counter's readings: the period's energy is unknown
        elif not self._quiet_energy:
            self._quiet_energy = [(now, energy_j)]
        else:
            self._quiet_energy = [self._quiet_energy[0], (now, energy_j)]

    def quiet_power_w(self, min_span_s: float) -> tuple[float, float] | None:
        """(average power in W, seconds it spans) of the GPU over the current quiet period, from its first
        quiet reading to its latest, when that spans at least `min_span_s` and the latest was just taken (at
        most two polls ago); None otherwise (no counter, a shorter period, busy since, an old period, or a
        counter that went backwards: a driver reload)."""
        readings = self._quiet_energy  # replaced, never changed in place: a job's thread may read it
        if len(readings) < 2:
            return None
        (t0, e0), (t1, e1) = readings
        span_s = t1 - t0
        fresh = self.clock() - t1 <= 2 * self.probe.cfg.poll_s + 1.0
        if not fresh or span_s < min_span_s or span_s <= 0 or e1 < e0:
            return None
        return (e1 - e0) / span_s, span_s

    def busy_now(self, own_pids: Iterable[int] | None = None) -> bool:
        """During a job: has production load come back? (No quiet period needed to say yes.)"""
        reading = self.probe.read(own_pids, during_job=True)
        self.last = reading
        self._quiet_energy = []  # our own job computes there: not idle power
        if reading.busy:
            self.quiet_since = None
        return reading.busy
