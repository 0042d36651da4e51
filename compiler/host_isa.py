"""Inductor's test programs for the CPU's vector instructions, built once per host and copied into each job.

Before Inductor generates C++ for a CPU, it checks which vector instruction sets the compiler can build and
the machine can run: per set it writes a small test program into its cache folder, builds it unless the
binary is already there, and loads it in a subprocess. Building them is about 7 s of CPU on a small machine.
That is a fact about the host, not about a compile configuration: a deployed process finds the binaries in
its Inductor cache and only loads them. A benchmark job compiles into a fresh cache folder of its own (so
that its compile is cold), where Inductor would build every test program again and count it in the
configuration's `compile_s` (and the binaries among its kernels).

So the parent builds the test programs once per host and torch version, in a subprocess of their own
(`ensure_programs`: `joulepilot` itself never imports torch), into `programs_dir()`, and copies them into
each job's fresh Inductor cache before a job that compiles on the CPU starts (`seed`). The job's compile then
loads them, as a deployed process on this host would, and builds only its own kernels. Nothing is done
where TORCHINDUCTOR_VEC_ISA_OK is set (Inductor then trusts the CPU's flags and checks nothing), and a
failure to build them leaves each job to check for itself, as before.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

PROGRAMS_DIR_ENV = "JOULEPILOT_VEC_ISA_DIR"
VEC_ISA_OK_ENV = "TORCHINDUCTOR_VEC_ISA_OK"
READY = "ready"
BUILD_TIMEOUT_S = 600.0
_BUILD = "from torch._inductor import cpu_vec_isa\nprint(cpu_vec_isa.pick_vec_isa())\n"
_failed: set[Path] = set()  # folders whose build failed in this process: not tried again for every job


def programs_dir() -> Path:
    """`JOULEPILOT_VEC_ISA_DIR`, else `cache/vec-isa` under joulepilot's home, per torch version and machine."""
    configured = os.environ.get(PROGRAMS_DIR_ENV, "").strip()
    if configured:
        base = Path(configured).expanduser()
    else:
        from joulepilot.store.db import default_home

        base = default_home() / "cache" / "vec-isa"
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "unknown"
    return base / f"torch-{torch_version}-{platform.machine()}"


def job_compiles_on_cpu(job: Mapping[str, Any]) -> bool:
    """Whether a job may generate C++ for the CPU: on the CPU, and not an eager bench job."""
    if str(job.get("device") or "") != "cpu":
        return False
    return job.get("kind", "bench") != "bench" or (job.get("config") or {}).get("mode") != "eager"


def ensure_programs(env: Mapping[str, str]) -> Path | None:
    """The folder holding the host's built test programs (an Inductor cache), building them first if they are
    not there yet; None where Inductor checks nothing (VEC_ISA_OK set in `env`) or the build failed."""
    if env.get(VEC_ISA_OK_ENV) is not None:
        return None
    folder = programs_dir()
    cache = folder / "inductor-cache"
    if (folder / READY).is_file():
        return cache
    if folder in _failed:
        return None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        built = subprocess.run([sys.executable, "-c", _BUILD], env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)},
                               capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        _failed.add(folder)
        return None
    if built.returncode != 0:
        _failed.add(folder)
        return None
    try:
        (folder / READY).write_text(built.stdout.strip() + "\n")
    except OSError:
        _failed.add(folder)
        return None
    return cache


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
