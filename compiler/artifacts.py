"""Saved compilation artifacts (torch.compiler cache artifacts) for warm starts.

One file per (workload, configuration, device name, torch version, triton version) under
`$JOULEPILOT_HOME/artifacts/<key>.bin`. Loading them before the first call lets a fresh process skip
most of the compile: the saved Inductor/AOTAutograd entries are replayed into its cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from joulepilot.store import default_home, stable_id
from joulepilot.store.files import write_file_atomic

from .provenance import package_version


def artifacts_dir() -> Path:
    return default_home() / "artifacts"


def artifact_key(workload_id: str, config_id: str, device_name: str, torch_version: str | None = None,
                 triton_version: str | None = None) -> str:
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    if triton_version is None:
        triton_version = package_version("triton", "pytorch-triton") or ""
    return stable_id("artifacts", workload_id, config_id, device_name, torch_version, triton_version, length=24)


def artifact_path_for(workload_id: str, config_id: str, device_name: str, torch_version: str | None = None,
                      triton_version: str | None = None) -> Path:
    """Where the artifacts of this workload and configuration live for this device and these versions."""
    return artifacts_dir() / f"{artifact_key(workload_id, config_id, device_name, torch_version, triton_version)}.bin"


def save_artifacts(path: str | os.PathLike) -> Path | None:
    """Write everything this process compiled (torch.compiler.save_cache_artifacts) to `path`, atomically.

    The file gets ordinary permissions (the umask decides), so a serving process running as another user
    than the daemon can load it. Returns the path, or None when torch has nothing to save (eager, or
    caches disabled)."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if not saved:
        return None
    blob = saved[0]
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return write_file_atomic(target, blob)


def load_artifacts(key_or_path: str | os.PathLike) -> bool:
    """Load saved artifacts into this process's caches; call before the first compiled call.

    Accepts a key (as from artifact_key) or a file path. Returns False when there is nothing to load."""
    import torch

    path = Path(key_or_path)
    if not path.suffix and not path.exists():
        path = artifacts_dir() / f"{key_or_path}.bin"
    if not path.is_file():
        return False
    return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
