"""The parent side of the worker: one subprocess per job, fresh compile caches, budgets, failure reasons.

Every job runs in a new session (its own process group) with fresh TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR folders under a temporary directory that is removed afterwards. The parent watches the
phase file the worker appends to: a job still compiling `compile_budget_s` after its compile began, or
alive `total_budget_s` after it started, has its whole process group killed (Inductor's compile workers
included). Whatever happens, the parent returns a result dict with `status` 'ok' or 'failed' and a
`reason` a person can act on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLL_S = 0.2
STDERR_TAIL_LINES = 12

# What a person reads for each phase the worker writes (see worker.Phases); a warm-start job's phases
# are told apart by PhaseFn's `kind`.
PHASE_TEXT = {
    "start": "starting the worker", "load": "loading the model", "reference": "computing the eager reference",
    "idle": "measuring idle power", "compile": "compiling", "compiled": "warming up", "warmup": "warming up",
    "latency": "measuring", "window": "measuring", "save_artifacts": "saving compile artifacts",
    "describe": "describing the workload",
}
WARM_START_PHASE_TEXT = {"load_artifacts": "warm start: loading artifacts", "compile": "warm start: first call"}

PhaseFn = Callable[[str, str], None]  # (job kind, worker phase), called when the worker enters a phase


def phase_text(kind: str, phase: str) -> str:
    """'compiling', 'warming up', 'measuring', ... for a worker phase name."""
    if kind == "warm_start":
        return WARM_START_PHASE_TEXT.get(phase, "warm start")
    return PHASE_TEXT.get(phase, phase.replace("_", " "))


def _child_pythonpath() -> str:
    """The parent's import roots (cwd, PYTHONPATH, sys.path outside the interpreter's own folders), so a
    `package.module:factory` the parent can import is importable in the worker too."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    entries = [os.getcwd()]
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for p in sys.path:
        if not p or not os.path.isdir(p):
            continue
        real = os.path.realpath(p)
        if any(real == pre or real.startswith(pre + os.sep) for pre in prefixes):
            continue
        entries.append(p)
    seen: list[str] = []
    for p in entries:
        if p not in seen:
            seen.append(p)
    return os.pathsep.join(seen)


def _last_phase(path: Path) -> tuple[str, float | None]:
    try:
        lines = path.read_text().strip().splitlines()
    except OSError:
        return "start", None
    if not lines:
        return "start", None
    name, _, at = lines[-1].partition("\t")
    try:
        return name, float(at)
    except ValueError:
        return name, None


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def run_worker_job(job: dict[str, Any], *, compile_budget_s: float, total_budget_s: float,
                   keep_dir: bool = False, on_phase: PhaseFn | None = None) -> dict[str, Any]:
    """Run one worker job in a fresh subprocess; always returns a result dict (never raises for the
    worker's failures). `on_phase(kind, phase)` hears each phase the worker enters, as the parent
    sees it (within POLL_S)."""
    workdir = Path(tempfile.mkdtemp(prefix="joulepilot-run-"))
    job = dict(job)
    job["result_path"] = str(workdir / "result.json")
    job["phase_path"] = str(workdir / "phases.tsv")
    (workdir / "job.json").write_text(json.dumps(job, default=str))
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor-cache")
    env["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")
    env["PYTHONPATH"] = _child_pythonpath()
    env.setdefault("PYTHONUNBUFFERED", "1")
    stderr_path = workdir / "stderr.txt"
    started = time.time()
    killed_reason: str | None = None
    kind = str(job.get("kind", "bench"))
    reported = "start"
    if on_phase is not None:
        on_phase(kind, reported)
    with open(workdir / "stdout.txt", "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "joulepilot.compiler.worker", str(workdir / "job.json")],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                now = time.time()
                phase, phase_at = _last_phase(Path(job["phase_path"]))
                if on_phase is not None and phase != reported:
                    reported = phase
                    on_phase(kind, phase)
                if phase == "compile" and phase_at is not None and now - phase_at > compile_budget_s:
                    killed_reason = f"compile exceeded budget of {compile_budget_s:g} s"
                elif now - started > total_budget_s:
                    killed_reason = f"run exceeded total budget of {total_budget_s:g} s (during {phase})"
                if killed_reason:
                    _kill_group(proc)
                    break
        except BaseException:
            _kill_group(proc)  # Ctrl-C or a parent error must not leave a compile running
            raise
    result = _collect(proc, job, workdir, stderr_path, killed_reason)
    result.setdefault("started_at", started)
    result.setdefault("finished_at", time.time())
    if keep_dir:
        result["workdir"] = str(workdir)
    else:
        _remove_tree(workdir)
    return result


def _collect(proc: subprocess.Popen, job: dict[str, Any], workdir: Path, stderr_path: Path,
             killed_reason: str | None) -> dict[str, Any]:
    phase, _ = _last_phase(Path(job["phase_path"]))
    if killed_reason:
        return {"status": "failed", "reason": killed_reason, "phase": phase}
    result_path = Path(job["result_path"])
    if result_path.is_file():
        try:
            return json.loads(result_path.read_text())
        except json.JSONDecodeError as exc:
            return {"status": "failed", "reason": f"worker wrote an unreadable result: {exc}", "phase": phase}
    code = proc.returncode
    tail = _tail(stderr_path)
    if code is not None and code < 0:
        what = f"worker killed by {_signal_name(-code)} during {phase}"
        if -code == signal.SIGKILL:
            what += " (the kernel's out-of-memory killer sends SIGKILL)"
    else:
        what = f"worker exited with code {code} during {phase} without a result"
    reason = what + (f"; last output:\n{tail}" if tail else "")
    return {"status": "failed", "reason": reason[:4000], "phase": phase}


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
