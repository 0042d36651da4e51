"""The worker zygote: one process per workload that does once what each configuration's worker would
otherwise do again (start Python; import torch, Dynamo, Inductor, joulepilot's measuring code and the
model's library; build the model), then forks one worker per job.

Run as `python -m joulepilot.compiler.worker --zygote SETUP.json` by `compiler/zygote.py`. Commands come
as JSON lines on stdin; answers go to the zygote's original stdout, the pipe to the parent (fd 1 itself
is pointed at stderr, so whatever the preloaded code prints cannot garble them):
  <- {"event": "ready", "fork_safe", "why", "preloaded", "built", ...}   once, after preloading
  -> {"op": "run", "job_path", "stdout", "stderr", "env"}
  <- {"event": "started", "pid"} ... {"event": "exited", "pid", "code"}  code as Popen.returncode has it
  -> {"op": "exit"}, or the end of stdin: the zygote exits.
One job at a time. When preloading found forking unsafe (`fork_safe` false, `why` says why), the zygote
exits after answering, and the parent runs that workload's jobs as fresh processes.

What is preloaded, and why a fork stays safe:
- torch, with its intra-op thread count at 1 while preloading: an OpenMP pool started in the parent hangs
  a forked child's first parallel region (GNU libgomp keeps the pool's bookkeeping but not its threads).
  Each child sets torch's own default count again.
- what `torch.compile(model)` imports before a worker's timed first call (Dynamo, and in recent torch
  Inductor's compile_fx), by wrapping a function that is never called; what the first call imports itself
  stays in that call, so `compile_s` counts what it counted in a fresh worker. Also torch.export and the
  FLOP counter (the description). On a GPU, the compiler's part (COMPILER_MODULES and torch.compile's
  imports) is imported after forking a first job that does not compile, while it runs, and the fork
  checks below are made again; if they fail, the zygote ends after that job and the parent runs the next
  jobs as fresh processes. Inductor starts its compile-worker pool at the first compile, which
  happens in a child, never here.
- joulepilot's worker modules and telemetry (no meter is opened here).
- the model's library (torchvision, timm, transformers) or the factory's module, and the model with its
  example inputs, built on the CPU with the worker's seed; a child takes its copy and moves it to its
  device. A factory is not built here for a GPU (it may build on the device it is given): there each child
  builds it. A build that fails here is left to each child, which fails as a fresh worker would.
- CUDA is never initialised: availability checks go through NVML (`PYTORCH_NVML_BASED_CUDA_CHECK=1`,
  set by the parent), and before the first fork the zygote checks that CUDA is not initialised, that no
  other Python thread runs and no child process was started, and, for a GPU, with a probe child, that
  torch does not consider a forked child unable to use CUDA.
Each child starts a session of its own (its whole process tree can be killed), dies with the zygote (which
dies with the parent), points TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at its job's fresh folders,
clears Inductor's in-process caches, and runs the job as a fresh worker would (`worker.main`). The zygote
never compiles, so no child inherits compiled code or cache entries.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

ZYGOTE_FLAG = "--zygote"

# Imported before the first fork; a module that fails to import is left to the child that needs it.
PRELOAD_MODULES = (
    "torch._dynamo",
    "torch.export",
    "torch.utils.flop_counter",
    "joulepilot.telemetry",
    "joulepilot.compiler.apply",
    "joulepilot.compiler.artifacts",
    "joulepilot.compiler.describe",
    "joulepilot.compiler.measure",
    "joulepilot.compiler.numerics",
    "joulepilot.compiler.precision",
    "joulepilot.compiler.provenance",
    "joulepilot.compiler.workloads",
)

# The compiler's part of PRELOAD_MODULES. On a GPU the zygote imports it after forking a first job that does
# not compile (the eager baseline), while that job measures: its seconds (several on a GPU host) then overlap
# the job instead of delaying it. On a CPU device it is imported before the first fork, as the overlap would
# load the CPU that job meters.
COMPILER_MODULES = ("torch._dynamo", "torch.export")

RunChild = Callable[[list[str]], int]


def _send(protocol: TextIO, message: dict[str, Any]) -> None:
    protocol.write(json.dumps(message) + "\n")
    protocol.flush()


def _never_called(x: Any) -> Any:
    return x


def _import_all(names: Sequence[str], info: dict[str, Any]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
            info["preloaded"].append(name)
        except Exception as exc:
            info.setdefault("preload_errors", []).append(f"{name}: {type(exc).__name__}: {exc}")


def preload_compiler(info: dict[str, Any]) -> None:
    """Import what `torch.compile(model)` imports before its first call, and COMPILER_MODULES."""
    import torch

    try:
        torch.compile(_never_called)  # imports only: nothing is traced or compiled until a call
        info["preloaded"].append("torch.compile")
    except Exception as exc:
        info.setdefault("preload_errors", []).append(f"torch.compile: {type(exc).__name__}: {exc}")
    _import_all([name for name in PRELOAD_MODULES if name in COMPILER_MODULES], info)
    info["compiler"] = "loaded"


def preload_modules(info: dict[str, Any], compiler: bool = True) -> None:
    """Import torch (one intra-op thread while preloading) and PRELOAD_MODULES (without COMPILER_MODULES and
    torch.compile's imports unless `compiler`); records what was loaded."""
    import torch

    info["threads"] = torch.get_num_threads()
    torch.set_num_threads(1)
    info["preloaded"] = ["torch"]
    if compiler:
        preload_compiler(info)
    else:
        info["compiler"] = "deferred"
    _import_all([name for name in PRELOAD_MODULES if name not in COMPILER_MODULES], info)


def preload_workload(setup: dict[str, Any], info: dict[str, Any]) -> None:
    """Import the workload's library or module and, where `can_prebuild`, build it on the CPU."""
    from .generation_workloads import from_job
    from .workloads import ADAPTERS, can_prebuild, prebuild_workload, resolve_factory, split_spec

    spec, device = setup["spec"], setup["device"]
    info["built"] = False
    try:
        kind, name = split_spec(spec)
        if kind in ADAPTERS:
            importlib.import_module(kind)
            info["preloaded"].append(kind)
        elif kind == "factory":
            if not can_prebuild(spec, device):  # else building imports it (a file path would run twice)
                resolve_factory(name)
            info["preloaded"].append(name.rpartition(":")[0])
        if can_prebuild(spec, device):
            generation, model_options = from_job(json.loads(setup["variant"]) if setup.get("variant") else {})
            prebuild_workload(spec, int(setup["batch_size"]), setup.get("seq_len"), setup.get("image_size"),
                              int(setup["seed"]), model_options=model_options, generation=generation)
            info["built"] = True
    except Exception as exc:  # each child builds it again and fails with the worker's own message
        info["build_error"] = f"{type(exc).__name__}: {exc}"[:500]


def _fork_poisoned_for_cuda() -> bool:
    """Whether torch would refuse CUDA in a child forked now (a CUDA call while preloading)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            code = 1 if torch.cuda._is_in_bad_fork() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def fork_hazard(device: str, workers: Sequence[int] = ()) -> str | None:
    """Why forking workers from this process now would be unsafe, or None (`workers`: its own running
    workers, which are not a hazard)."""
    import psutil
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialised while preloading"
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        return f"preloading started {len(others)} Python thread(s) ({', '.join(others[:3])})"
    children = [child for child in psutil.Process().children() if child.pid not in workers]
    if children:
        return f"preloading started {len(children)} child process(es)"
    if str(device).startswith("cuda") and _fork_poisoned_for_cuda():
        return "a CUDA call while preloading leaves forked children unable to use CUDA"
    return None


def _redirect(fd: int, path: str, flags: int) -> None:
    target = os.open(path, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _fresh_compile_state() -> None:
    """Empty Inductor's in-process caches (nothing was compiled here; this keeps it so if a preloaded
    module filled one), and decide again the Inductor settings it read from the environment when the
    zygote imported it, so that a job's environment counts as it would in a fresh worker."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None and getattr(config, "compile_threads", None) is not None \
            and hasattr(config, "decide_compile_threads"):
        config.compile_threads = config.decide_compile_threads()  # TORCHINDUCTOR_COMPILE_THREADS
    utils = sys.modules.get("torch._inductor.utils")  # not imported here: nothing to empty, and no import to pay
    clear_caches = getattr(utils, "clear_caches", None)
    if clear_caches is not None:
        clear_caches()


def enter_child(command: dict[str, Any], protocol: TextIO) -> None:
    """A forked child's first steps: a session of its own, off the zygote's pipe, its job's stdout and stderr
    files, and its job's environment variables."""
    os.setsid()
    os.close(protocol.fileno())
    _redirect(0, os.devnull, os.O_RDONLY)
    _redirect(1, command["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    _redirect(2, command["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.environ.update({str(k): str(v) for k, v in (command.get("env") or {}).items()})


def exit_child(code: int) -> NoReturn:
    """End a forked child with `code`, its output flushed (os._exit: none of the zygote's exit handlers)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _child(command: dict[str, Any], threads: int, protocol: TextIO, run_child: RunChild) -> NoReturn:
    code = 1
    try:
        enter_child(command, protocol)
        _fresh_compile_state()
        import torch

        torch.set_num_threads(threads)
        code = run_child([command["job_path"]])
    except BaseException:
        traceback.print_exc()
    finally:
        exit_child(code)


def _job_compiles(command: dict[str, Any]) -> bool:
    """Whether the job `command` runs calls torch.compile or Dynamo: all but an eager bench job that does not
    describe its workload."""
    try:
        job = json.loads(Path(command["job_path"]).read_text())
    except (OSError, ValueError, KeyError):
        return True
    # describing imports Dynamo too (the FLOP count, the graph capture)
    return job.get("kind", "bench") != "bench" or (job.get("config") or {}).get("mode") != "eager" \
        or bool(job.get("describe"))


def _load_compiler(info: dict[str, Any], device: str, workers: Sequence[int] = ()) -> bool:
    """Import the deferred compiler modules; False when forking is no longer safe afterwards (said on stderr)."""
    started = time.perf_counter()
    preload_compiler(info)
    hazard = fork_hazard(device, workers)
    print(f"joulepilot zygote: compiler preloaded in {time.perf_counter() - started:.2f} s"
          + (f"; forking stops: {hazard}" if hazard else ""), file=sys.stderr, flush=True)
    return hazard is None


def serve(setup_path: str, run_child: RunChild) -> int:
    """The zygote's life: preload, say whether it can fork, then fork a worker per command."""
    from .worker import die_with_parent

    setup = json.loads(Path(setup_path).read_text())
    die_with_parent(setup.get("parent_pid"))
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    info: dict[str, Any] = {"event": "ready", "pid": os.getpid()}
    started = time.perf_counter()
    defer_compiler = str(setup["device"]).startswith("cuda")
    preload_modules(info, compiler=not defer_compiler)
    modules_s = time.perf_counter() - started
    preload_workload(setup, info)
    info["preload_s"] = {"modules": round(modules_s, 3), "workload": round(time.perf_counter() - started - modules_s, 3)}
    hazard = fork_hazard(setup["device"])
    info.update(fork_safe=hazard is None, why=hazard)
    _send(protocol, info)
    if hazard is not None:
        return 0
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        command = json.loads(line)
        if command.get("op") != "run":
            return 0
        after_fork = info["compiler"] == "deferred" and not _job_compiles(command)
        if info["compiler"] == "deferred" and not after_fork and not _load_compiler(info, setup["device"]):
            return 0  # not safe to fork any more: the parent runs this job, and the next ones, as fresh processes
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(command, int(info["threads"]), protocol, run_child)
        _send(protocol, {"event": "started", "pid": pid})
        safe = _load_compiler(info, setup["device"], [pid]) if after_fork else True
        _, status = os.waitpid(pid, 0)
        _send(protocol, {"event": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
        if not safe:
            return 0
