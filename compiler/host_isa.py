"""Inductor's test programs for the CPU's vector instructions, built once per host and copied into each job.

Before Inductor generates C++ for a CPU, it checks which vector instruction sets the compiler can build and
the machine can run: per set it writes a small test program into its cache folder, builds it unless the
binary is already there, and loads it in a subprocess. Building them is about 7 s of CPU on a small machine.
That is a fact about the host, not about a compile configuration: a deployed process finds the binaries in
its Inductor cache and only loads them. A benchmark job compiles into a fresh cache folder of its own (so
that its compile is cold), where Inductor would build every test program again and count it in the
configuration's `compile_s` (and the binaries among its kernels).

So the parent builds the test programs once per host and torch version, in a subprocess of their own
(`ensure_programs`: `bench` and the daemon never import torch on a CPU sweep; a cancelled job, a
stopping daemon, stops the build too, and a killed one takes it along: PR_SET_PDEATHSIG), into
`programs_dir()`, and copies them into each job's fresh Inductor cache before a job that compiles on the CPU
starts (`seed`). The job's compile then
loads them, as a deployed process on this host would, and builds only its own kernels. A failure to build
them leaves each job to check for itself, as before.

TORCHINDUCTOR_VEC_ISA_OK makes Inductor trust the CPU's flags for the base instruction set (AVX2, AVX-512)
instead of testing it, but it still builds and loads a test program for each extension it may use (AVX-512
BF16 and VNNI, AMX; about 1.5 s of CPU per compile on the 2-core VM). Those are built and copied the same
way, into a folder of their own (`programs_dir` names the variable's value), as the set differs.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

PROGRAMS_DIR_ENV = "JOULEPILOT_VEC_ISA_DIR"
VEC_ISA_OK_ENV = "TORCHINDUCTOR_VEC_ISA_OK"
READY = "ready"
BUILD_TIMEOUT_S = 600.0
# The build dies with the process that started it (a SIGKILLed bench or daemon), as the workers do.
_BUILD = ("import sys\nfrom joulepilot.compiler.worker import die_with_parent\ndie_with_parent(int(sys.argv[1]))\n"
          "from torch._inductor import cpu_vec_isa\nprint(cpu_vec_isa.pick_vec_isa())\n")
_failed: set[Path] = set()  # folders whose build failed in this process: not tried again for every job


def programs_dir(env: Mapping[str, str] | None = None) -> Path:
    """`JOULEPILOT_VEC_ISA_DIR`, else `cache/vec-isa` under joulepilot's home, per torch version, machine and
    TORCHINDUCTOR_VEC_ISA_OK (in `env`, else this process's environment)."""
    trusted = (os.environ if env is None else env).get(VEC_ISA_OK_ENV)
    configured = os.environ.get(PROGRAMS_DIR_ENV, "").strip()
    if configured:
        base = Path(configured).expanduser()
    else:
        from joulepilot.store.db import default_home

        base = default_home() / "cache" / "vec-isa"
    name = f"torch-{_torch_version()}-{platform.machine()}"
    if trusted is not None:
        name += f"-vec-isa-ok-{''.join(c if c.isalnum() else '_' for c in trusted)}"
    return base / name


@functools.cache
def _torch_version() -> str:
    """The installed torch's version, read from its metadata (torch itself is not imported)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def job_compiles_on_cpu(job: Mapping[str, Any]) -> bool:
    """Whether a job may generate C++ for the CPU: on the CPU, and neither an eager bench job nor a doctor job
    on a backend other than Inductor."""
    if str(job.get("device") or "") != "cpu":
        return False
    kind = job.get("kind", "bench")
    if kind == "doctor":
        return (job.get("backend") or "inductor") == "inductor"
    return kind != "bench" or (job.get("config") or {}).get("mode") != "eager"


def programs_to_build(env: Mapping[str, str]) -> bool:
    """Whether `ensure_programs(env)` would build the test programs now (for progress: a build takes seconds)."""
    folder = programs_dir(env)
    return not (folder / READY).is_file() and folder not in _failed


def ensure_programs(env: Mapping[str, str], cancel: Callable[[], str | None] | None = None,
                    poll_s: float = 0.2) -> tuple[Path | None, str | None]:
    """(the folder holding the host's built test programs, an Inductor cache, or None, and why it stopped
    when `cancel` asked it to). Builds them first if they are not there yet, under `env` (so with its
    VEC_ISA_OK, the programs Inductor then still builds); None where the build failed. The build runs in a
    session of its own, polled every `poll_s`: `cancel` returning a reason, or an exception here (a signal),
    kills it."""
    folder = programs_dir(env)
    cache = folder / "inductor-cache"
    if (folder / READY).is_file():
        return cache, None
    if folder in _failed:
        return None, None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(os.getpid())],
                                env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)},
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                text=True, start_new_session=True)
    except OSError:
        _failed.add(folder)
        return None, None
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    try:
        while True:
            try:
                out, _ = proc.communicate(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                stop = cancel() if cancel is not None else None
                if stop or time.monotonic() > deadline:
                    _kill(proc)
                    if stop:
                        return None, stop
                    _failed.add(folder)
                    return None, None
    except BaseException:
        _kill(proc)
        raise
    if proc.returncode != 0:
        _failed.add(folder)
        return None, None
    try:
        (folder / READY).write_text(out.strip() + "\n")
    except OSError:
        _failed.add(folder)
        return None, None
    return cache, None


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def seed(job_cache: Path, programs: Path | None) -> int:
    """Copy the built test programs into a job's fresh Inductor cache folder; how many files were copied."""
    if programs is None or not programs.is_dir():
        return 0
    copied = 0
    for source in programs.rglob("*"):
        relative = source.relative_to(programs)
        if not source.is_file() or relative.parts[0] == "locks" or source.suffix == ".lock":
            continue
        target = job_cache / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        copied += 1
    return copied
