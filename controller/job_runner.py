"""Run one queued measurement so the daemon can stop it at any moment.

The daemon starts the workload's zygote, which forks the compiler's benchmark worker (daemon -> zygote
-> worker; a fresh worker started by the daemon itself where forking is not possible, see
`compiler/zygote.py`); the worker isolates its compile caches, enforces the one budget model and writes its result, and the
daemon stores the run and marks the job done in one transaction. This module supplies the stop
check the worker's runner polls: a stop request (`cancel()`, safe from a signal handler or another
thread) and, every `preempt_every_s`, the daemon's production-load check. Either one kills the
worker's whole process tree at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

log = logging.getLogger(__name__)

GRACE_S = 3.0  # between SIGTERM and SIGKILL when ending a worker left by an earlier daemon

StopCheck = Callable[[], "str | None"]
OnStart = Callable[[int], None]


@dataclass
class JobOutcome:
    kind: str  # 'measured' (result holds a run, ok or failed) | 'stopped' | 'preempted' | 'error' (no run)
    result: Any = None
    reason: str = ""
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def kill_tree_of_pid(pid: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM a process that is not our child (left by a previous daemon) and its descendants, then
    SIGKILL what is left after `grace_s`."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for proc in family:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


class JobRunner:
    """Runs one measurement at a time; `cancel()` may be called from a signal handler or another thread."""

    def __init__(self) -> None:
        self._cancel = threading.Event()
        self._cancel_reason = ""
        self.worker_pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The running worker's pid, None between measurements."""
        return self.worker_pid

    def cancel(self, reason: str = "stopped") -> None:
        self._cancel_reason = reason
        self._cancel.set()

    def run(self, measure: Callable[[StopCheck, OnStart], Any], *,
            preempt_check: Callable[[], str | None] | None = None, preempt_every_s: float = 5.0,
            on_start: OnStart | None = None) -> JobOutcome:
        """Call `measure(stop_check, on_start)`, which runs the worker and polls `stop_check`; returns
        'measured' with its result, or 'stopped' / 'preempted' when the worker was killed for that.

        `measure` returns an object or dict whose `status` is 'cancelled' when it obeyed `stop_check`.
        A `cancel()` is final: once called, every later run stops at once (the daemon is shutting down)."""
        stopped_by: list[tuple[str, str]] = []
        next_check = time.monotonic() + preempt_every_s

        def stop_check() -> str | None:
            nonlocal next_check
            if self._cancel.is_set():
                stopped_by.append(("stopped", self._cancel_reason or "stopped"))
                return stopped_by[-1][1]
            now = time.monotonic()
            if preempt_check is not None and now >= next_check:
                next_check = now + preempt_every_s
                why = preempt_check()
                if why:
                    stopped_by.append(("preempted", why))
                    return why
            return None

        def started(pid: int) -> None:
            self.worker_pid = pid
            if on_start is not None:
                on_start(pid)

        t0 = time.monotonic()
        try:
            if self._cancel.is_set():
                return JobOutcome("stopped", reason=self._cancel_reason or "stopped")
            result = measure(stop_check, started)
        finally:
            self.worker_pid = None
        wall_s = time.monotonic() - t0
        status = result.get("status") if isinstance(result, dict) else getattr(result, "status", None)
        if status == "cancelled" or (stopped_by and status is None):
            kind, reason = stopped_by[-1] if stopped_by else ("stopped", self._cancel_reason or "stopped")
            return JobOutcome(kind, result, reason, wall_s)
        return JobOutcome("measured", result, "", wall_s)
