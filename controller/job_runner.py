"""Run one queued measurement in a child process the daemon can stop at any moment.

The child (`python -m joulepilot.controller.job_child`) measures one configuration through the
compiler's benchmark worker and writes the finished run as JSON to a result file (atomically, by
rename); it never touches the database. The daemon then stores the run and marks the job done in
one transaction, so a kill at any moment leaves either no run or a complete run linked to its job.

The child is started in its own session; stopping it signals its whole process group and then every
descendant still alive (a compiler worker that started its own session included).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

GRACE_S = 3.0  # between SIGTERM and SIGKILL when stopping a child
CHILD_MODULE = "joulepilot.controller.job_child"


@dataclass
class JobOutcome:
    kind: str  # 'measured' (result holds a run, ok or failed) | 'crashed' | 'stopped' | 'preempted' | 'timeout'
    result: dict[str, Any] | None = None
    reason: str = ""
    wall_s: float = 0.0
    stderr_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def kill_tree(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM the child's process group and descendants, then SIGKILL what is left after `grace_s`."""
    try:
        family = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    except psutil.Error:
        family = [proc.pid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in family:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
            # The child is gone; give any descendant a moment, then fall through to SIGKILL the stragglers.
            alive = [p for p in family[1:] if psutil.pid_exists(p)]
            if not alive:
                return
            time.sleep(0.2)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("job child %d did not exit after SIGKILL", proc.pid)


def kill_tree_of_pid(pid: int, grace_s: float = GRACE_S) -> None:
    """kill_tree for a process that is not our child (left by a previous daemon)."""
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
    """Starts one child at a time; `cancel()` may be called from a signal handler or another thread."""

    def __init__(self, work_dir: str | os.PathLike | None = None) -> None:
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.gettempdir())
        self._proc: subprocess.Popen | None = None
        self._cancel = threading.Event()
        self._cancel_reason = ""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def cancel(self, reason: str = "stopped") -> None:
        self._cancel_reason = reason
        self._cancel.set()

    def run(self, request: dict[str, Any], *, hard_timeout_s: float, poll_s: float = 1.0,
            preempt_check: Callable[[], str | None] | None = None, preempt_every_s: float = 5.0,
            on_start: Callable[[int], None] | None = None) -> JobOutcome:
        """Run the child to completion, cancellation, pre-emption (production load) or timeout."""
        self._cancel.clear()
        self._cancel_reason = ""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        fd, req_path = tempfile.mkstemp(prefix="jp-job-", suffix=".json", dir=self.work_dir)
        with os.fdopen(fd, "w") as fh:
            json.dump(request, fh, default=str)
        result_path = Path(req_path[: -len(".json")] + ".result.json")
        err_path = Path(req_path[: -len(".json")] + ".stderr")
        started = time.monotonic()
        try:
            with open(err_path, "wb") as err:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", CHILD_MODULE, req_path, str(result_path)],
                    stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, start_new_session=True,
                )
                if on_start is not None:
                    on_start(self._proc.pid)
                outcome = self._supervise(hard_timeout_s, poll_s, preempt_check, preempt_every_s, started)
            outcome.wall_s = time.monotonic() - started
            outcome.stderr_tail = _tail(err_path)
            if outcome.kind == "measured":
                try:
                    outcome.result = json.loads(result_path.read_text())
                except (OSError, ValueError) as exc:
                    outcome.kind = "crashed"
                    outcome.reason = f"job child exited 0 without a readable result ({exc})"
            return outcome
        finally:
            self._proc = None
            for path in (Path(req_path), result_path, err_path):
                path.unlink(missing_ok=True)

    def _supervise(self, hard_timeout_s: float, poll_s: float, preempt_check: Callable[[], str | None] | None,
                   preempt_every_s: float, started: float) -> JobOutcome:
        proc = self._proc
        assert proc is not None
        next_check = time.monotonic() + preempt_every_s
        while True:
            if self._cancel.is_set():
                kill_tree(proc)
                return JobOutcome("stopped", reason=self._cancel_reason or "stopped")
            try:
                code = proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                if code == 0:
                    return JobOutcome("measured")
                return JobOutcome("crashed", reason=f"job child exited with {_exit_text(code)}")
            now = time.monotonic()
            if now - started > hard_timeout_s:
                kill_tree(proc)
                return JobOutcome("timeout", reason=f"job child overran its hard limit of {hard_timeout_s:.0f} s")
            if preempt_check is not None and now >= next_check:
                next_check = now + preempt_every_s
                why = preempt_check()
                if why:
                    kill_tree(proc)
                    return JobOutcome("preempted", reason=why)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode(errors="replace")
