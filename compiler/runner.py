"""The parent side of the worker: one process per job, fresh compile caches, budgets, failure reasons.

Each job's worker is forked from its workload's zygote (`zygote.py`, when the caller passes a
`ZygotePool`) or started as a fresh `python -m joulepilot.compiler.worker JOB.json` subprocess.
Every job runs in a new session (its own process group) with fresh TORCHINDUCTOR_CACHE_DIR and
TRITON_CACHE_DIR folders under a scratch folder named `joulepilot-run-<parent pid>-*` in the temporary
directory, removed afterwards. The parent watches the phase file the worker appends to and enforces
the budget model of `budget.py`: a job whose first forward calls (eager reference + cold compile) have
taken `budget.first_call_s`, or that is still alive `budget.total_s` after it started, has its whole
process tree killed (Inductor's compile workers included). The worker dies with its parent, the zygote
dies with this process (PR_SET_PDEATHSIG), and a scratch folder whose parent died is removed by the next `bench` or daemon
start (`remove_stale_workdirs`). Whatever happens, the parent returns a result dict with `status` 'ok',
'failed' or 'cancelled' and a `reason` a person can act on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from .budget import COMPILE_OVERRUN, FIRST_CALL_PHASES, WorkerBudget
from .host_isa import ensure_programs, job_compiles_on_cpu, programs_to_build, seed
from .window_gate import Gate
from .window_gate import answer as answer_gate
from .zygote import FRESH, ForkedWorker, Zygote, ZygoteGone, ZygoteKey, ZygotePool, kill_process_tree

POLL_S = 0.2
GATE_POLL_S = 0.05  # a worker waiting for the window gate's answer holds the compiled model: answer it quickly
STDERR_TAIL_LINES = 12
WORKER_MODULE = "joulepilot.compiler.worker"
# A testing hook: the module run as the worker instead of WORKER_MODULE (the test suite's fake worker).
WORKER_MODULE_ENV = "JOULEPILOT_WORKER_MODULE"
WORKDIR_PREFIX = "joulepilot-run-"
_WORKDIR_NAME = re.compile(rf"^{WORKDIR_PREFIX}(\d+)-[A-Za-z0-9_]+$")

CancelCheck = Callable[[], "str | None"]

# What a person reads for each phase the worker writes (see worker.Phases); a warm-start job's phases
# are told apart by PhaseFn's `kind`.
PHASE_TEXT = {
    "start": "starting the worker", "load": "loading the model", "reference": "computing the eager reference",
    "idle": "measuring idle power", "compile": "compiling", "compiled": "warming up", "warmup": "warming up",
    "latency": "measuring", "window": "measuring", "save_artifacts": "saving compile artifacts",
    "describe": "describing the workload", "window_gate": "asking whether to measure another window",
    "vec_isa": "building Inductor's CPU instruction-set test programs (once per host, about 10 s)",
}
WARM_START_PHASE_TEXT = {"load_artifacts": "warm start: loading artifacts", "compile": "warm start: first call"}

PhaseFn = Callable[[str, str], None]  # (job kind, worker phase), called when the worker enters a phase


def phase_text(kind: str, phase: str) -> str:
    """'compiling', 'warming up', 'measuring', ... for a worker phase name."""
    if kind == "warm_start":
        return WARM_START_PHASE_TEXT.get(phase, "warm start")
    return PHASE_TEXT.get(phase, phase.replace("_", " "))


def worker_module() -> str:
    """The module each job runs as `python -m MODULE JOB.json`: WORKER_MODULE unless JOULEPILOT_WORKER_MODULE
    names another (tests set it to run a fake worker where compiling is not what they test)."""
    return os.environ.get(WORKER_MODULE_ENV, "").strip() or WORKER_MODULE


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


def read_phases(path: Path) -> list[tuple[str, float]]:
    """The worker's phase file as (phase, time entered) pairs, oldest first."""
    try:
        lines = path.read_text().strip().splitlines()
    except OSError:
        return []
    phases: list[tuple[str, float]] = []
    for line in lines:
        name, _, at = line.partition("\t")
        try:
            phases.append((name, float(at)))
        except ValueError:
            continue  # a line still being written
    return phases


def first_call_seconds(phases: list[tuple[str, float]], now: float) -> float:
    """Seconds spent so far in first-call phases (the current one counted up to `now`)."""
    total = 0.0
    for i, (name, at) in enumerate(phases):
        if name in FIRST_CALL_PHASES:
            end = phases[i + 1][1] if i + 1 < len(phases) else now
            total += max(0.0, end - at)
    return total


def kill_reason(phases: list[tuple[str, float]], *, started: float, now: float, budget: WorkerBudget) -> str | None:
    """Why a worker must be killed now under `budget`, or None while it is within it."""
    phase = phases[-1][0] if phases else "start"
    if first_call_seconds(phases, now) > budget.first_call_s:
        if phase == "reference":
            return (f"the first forward call (eager reference) exceeded the compile budget of "
                    f"{budget.first_call_s:g} s")
        return f"{COMPILE_OVERRUN} of {budget.first_call_s:g} s"
    if now - started > budget.total_s:
        return (f"run exceeded its total budget of {budget.total_s:g} s (compile budget {budget.first_call_s:g} s "
                f"+ {budget.allowance_s:g} s for loading and measuring) during {phase}")
    return None


def _tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def kill_worker_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's process group and every descendant (one that started its own session too),
    then reap it."""
    kill_process_tree(proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def new_workdir() -> Path:
    """A scratch folder whose name carries this process's pid, so a later start can tell it is stale."""
    return Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))


def _owner_alive(pid: int, folder: Path) -> bool:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        created = proc.create_time()
    except psutil.Error:
        return False
    try:
        # The folder changed while its owner lived; a process started after that only reuses the pid.
        return created <= folder.stat().st_mtime + 1.0
    except OSError:
        return False


def remove_stale_workdirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove scratch folders left by a `bench` or daemon that died (SIGKILL, power loss); returns them.

    Only folders named `joulepilot-run-<pid>-*` whose owner process is gone are touched."""
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _WORKDIR_NAME.match(entry.name)
        if not match or not entry.is_dir() or entry.is_symlink():
            continue
        if _owner_alive(int(match.group(1)), entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    return removed


class SpawnedWorker:
    """A job's worker started as a fresh `python -m WORKER_MODULE JOB.json` process."""

    how = FRESH

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.note = ""

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self, timeout_s: float = 0.0) -> int | None:
        if timeout_s > 0:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.proc.poll()

    def kill_tree(self) -> None:
        kill_worker_tree(self.proc)


WorkerProcess = SpawnedWorker | ForkedWorker


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = _child_pythonpath()
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _zygote_starter(extra_env: Mapping[str, str]) -> Callable[[ZygoteKey], Zygote]:
    """Starts a zygote with `extra_env` over this process's environment (the GPU numbering of the workers it
    forks; each worker applies its own job's variables again when it is forked)."""

    def start(key: ZygoteKey) -> Zygote:
        return Zygote.start(key, module=worker_module(), workdir=new_workdir(), env={**_worker_env(), **extra_env})

    return start


def start_zygote_early(zygotes: ZygotePool, job: dict[str, Any], env: Mapping[str, str] | None = None) -> bool:
    """Have `zygotes` start the zygote for `job`'s workload now, to overlap its start with other waiting or
    measuring; True when one was started (see `ZygotePool.start_early`). `env`: the variables its workers will
    run with (see `run_worker_job`)."""
    return zygotes.start_early(job, _zygote_starter(env or {}))


def run_worker_job(job: dict[str, Any], *, budget: WorkerBudget, cancel: CancelCheck | None = None,
                   on_start: Callable[[int], None] | None = None, keep_dir: bool = False,
                   on_phase: PhaseFn | None = None, zygotes: ZygotePool | None = None,
                   env: Mapping[str, str] | None = None, window_gate: Gate | None = None) -> dict[str, Any]:
    """Run one worker job in a process of its own; always returns a result dict (never raises for the
    worker's failures).

    With `zygotes`, the process is forked from the zygote of the job's workload (started and waited for
    here, within `budget.allowance_s`, when this is the workload's first job), else, or where that zygote
    cannot fork, it is a fresh subprocess; the result's `worker_process` says which. Either way the job
    gets fresh compile caches, and its budget counts from the moment its process starts.

    `cancel`, polled every POLL_S, returns a reason to stop the worker now (the result then has status
    'cancelled'); `on_start` receives the worker's pid. An exception or signal in this process (Ctrl-C,
    SystemExit) kills the worker and removes the scratch folder before it propagates. `on_phase(kind, phase)`
    hears each phase the worker enters, as the parent sees it (within POLL_S). `env`: variables set for this
    worker only, over the parent's environment (the scheduler's compile-thread share and device order), in a
    forked worker as in a fresh one. `window_gate(runs)`: asked before each further window of a job of several
    (`compiler.window_gate`), with the runs-table fields of the windows so far; the worker takes it only on True."""
    extra_env = dict(env or {})
    kind = str(job.get("kind", "bench"))
    if on_phase is not None:
        on_phase(kind, "start")
    zygote = None
    waited_s = 0.0
    if zygotes is not None:
        waited = time.time()
        zygote, cancelled = zygotes.zygote_for(job, start=_zygote_starter(extra_env), limit_s=budget.allowance_s,
                                               cancel=cancel)
        waited_s = time.time() - waited
        if cancelled:
            return {"status": "cancelled", "reason": cancelled, "phase": "start", "started_at": waited,
                    "finished_at": time.time()}
    fallback = zygotes.fallback_reason(job) if zygotes is not None else ""
    workdir = new_workdir()
    try:
        result = _run_in(workdir, job, budget, cancel, on_start, keep_dir, on_phase, zygote, fallback, extra_env,
                         window_gate)
        if zygote is not None:  # what the job waited for its workload's zygote (a workload's first job only)
            result["zygote_wait_s"] = round(waited_s, 3)
            result["zygote_preload_s"] = zygote.info.get("preload_s")
            result["zygote_early"] = zygote.early
        return result
    finally:
        if not keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _start_worker(workdir: Path, job: dict[str, Any], zygote: Zygote | None,
                  extra_env: Mapping[str, str]) -> tuple[WorkerProcess, str]:
    """The job's worker, forked by `zygote` when there is one that still answers, else a fresh process;
    and why a fresh one when a zygote was meant to fork it.

    `job_env` is what this job sets in its worker's environment (the caller's `extra_env` and its own compile
    cache folders): a fresh worker gets it on top of this process's environment, a forked one applies it to
    the environment it inherited from the zygote before anything reads it."""
    job_env = {**extra_env, "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor-cache"),
               "TRITON_CACHE_DIR": str(workdir / "triton-cache")}
    job_path = workdir / "job.json"
    if zygote is not None:
        job_path.write_text(json.dumps({**job, "parent_pid": zygote.pid}, default=str))
        try:
            return zygote.fork({"job_path": str(job_path), "stdout": str(workdir / "stdout.txt"),
                                "stderr": str(workdir / "stderr.txt"), "env": job_env}), ""
        except ZygoteGone as exc:
            fallback = f"the zygote was gone: {exc}"
    else:
        fallback = ""
    job_path.write_text(json.dumps({**job, "parent_pid": os.getpid()}, default=str))
    env = {**_worker_env(), **job_env}
    with open(workdir / "stdout.txt", "wb") as out, open(workdir / "stderr.txt", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", worker_module(), str(job_path)],
            stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )
    return SpawnedWorker(proc), fallback


def _run_in(workdir: Path, job: dict[str, Any], budget: WorkerBudget, cancel: CancelCheck | None,
            on_start: Callable[[int], None] | None, keep_dir: bool, on_phase: PhaseFn | None,
            zygote: Zygote | None, fallback: str, extra_env: Mapping[str, str],
            window_gate: Gate | None = None) -> dict[str, Any]:
    job = dict(job)
    if window_gate is not None:
        job["window_gate"] = True
    job["result_path"] = str(workdir / "result.json")
    job["phase_path"] = str(workdir / "phases.tsv")
    job["budget"] = budget.to_dict()
    stderr_path = workdir / "stderr.txt"
    phase_path = Path(job["phase_path"])
    killed_reason: str | None = None
    cancelled: str | None = None
    kind = str(job.get("kind", "bench"))
    reported = "start"
    started = time.time()
    if job_compiles_on_cpu(job):  # the host's vector-instruction test programs, built once (host_isa.py)
        env = {**_worker_env(), **extra_env}
        if on_phase is not None and programs_to_build(env):
            on_phase(kind, "vec_isa")
        programs, cancelled = ensure_programs(env, cancel)
        if cancelled:
            return {"status": "cancelled", "reason": cancelled, "phase": "start", "started_at": started,
                    "finished_at": time.time()}
        seed(workdir / "inductor-cache", programs)
    worker, why_fresh = _start_worker(workdir, job, zygote, extra_env)
    try:
        if on_start is not None:
            on_start(worker.pid)
        answered = 1
        while worker.poll(GATE_POLL_S if window_gate is not None else POLL_S) is None:
            if window_gate is not None:
                answered, _ = answer_gate(workdir, window_gate, answered)
            phases_seen = read_phases(phase_path)
            if on_phase is not None and phases_seen and phases_seen[-1][0] != reported:
                reported = phases_seen[-1][0]
                on_phase(kind, reported)
            cancelled = cancel() if cancel is not None else None
            if not cancelled:
                killed_reason = kill_reason(phases_seen, started=started, now=time.time(), budget=budget)
            if cancelled or killed_reason:
                worker.kill_tree()
                break
    except BaseException:
        worker.kill_tree()  # Ctrl-C, SIGTERM or a parent error must not leave a compile running
        raise
    phases = read_phases(phase_path)
    phase = phases[-1][0] if phases else "start"
    if cancelled:
        result: dict[str, Any] = {"status": "cancelled", "reason": cancelled, "phase": phase}
    elif killed_reason:
        result = {"status": "failed", "reason": killed_reason, "phase": phase}
    else:
        result = _collect(worker, job, phase, stderr_path)
    why_fresh = why_fresh or fallback
    result["worker_process"] = worker.how + (f" ({why_fresh})" if worker.how == FRESH and why_fresh else "")
    result.setdefault("started_at", started)
    result.setdefault("finished_at", time.time())
    if keep_dir:
        result["workdir"] = str(workdir)
    return result


def _collect(worker: WorkerProcess, job: dict[str, Any], phase: str, stderr_path: Path) -> dict[str, Any]:
    result_path = Path(job["result_path"])
    if result_path.is_file():
        try:
            return json.loads(result_path.read_text())
        except json.JSONDecodeError as exc:
            return {"status": "failed", "reason": f"worker wrote an unreadable result: {exc}", "phase": phase}
    code = worker.returncode
    tail = _tail(stderr_path)
    if code is not None and code < 0:
        what = f"worker killed by {_signal_name(-code)} during {phase}"
        if -code == signal.SIGKILL:
            what += " (the kernel's out-of-memory killer sends SIGKILL)"
        if worker.note:
            what += f"; {worker.note}"
    else:
        what = f"worker exited with code {code} during {phase} without a result"
    reason = what + (f"; last output:\n{tail}" if tail else "")
    return {"status": "failed", "reason": reason[:4000], "phase": phase}
