"""Is the device free for benchmarking? Production work always wins over the daemon's sweeps.

A GPU is idle when its utilisation stays under a threshold for a configured time and no other
process computes on it; the daemon's own worker processes do not count. A CPU device is idle unless
a load threshold is configured, in which case the CPU use of everything but the daemon's own
process tree must stay under it.
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
        return LoadReading(False, f"GPU {index} utilisation {util:.0f}%", util, tuple(others))

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
            self.quiet_since = None
            return False
        if self.quiet_since is None:
            self.quiet_since = now
        return not self.needs_quiet_period or now - self.quiet_since >= self.probe.cfg.min_idle_s

    def busy_now(self, own_pids: Iterable[int] | None = None) -> bool:
        """During a job: has production load come back? (No quiet period needed to say yes.)"""
        reading = self.probe.read(own_pids, during_job=True)
        self.last = reading
        if reading.busy:
            self.quiet_since = None
        return reading.busy
