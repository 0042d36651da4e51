"""Saved compilation artifacts (torch.compiler cache artifacts) for warm starts.

One file per (workload, configuration, device name, torch version, triton version) under
`$JOULEPILOT_HOME/artifacts/<key>.bin`. Loading them before the first call lets a fresh process skip
most of the compile: the saved Inductor/AOTAutograd entries (and, when the compile recorded them,
Dynamo's precompiled frames) are replayed into its cache.

Beside it, `<key>.kernels.tar` holds the compiled binaries (`*.so`) the compile left in its Inductor
and Triton cache folders: the cache entries name them but do not carry them, so without them a CPU warm
start rebuilds every C++ kernel with the system compiler, and a GPU one Triton's launchers (the Triton
kernels themselves travel inside the entries). Loading unpacks them into this process's cache folders,
where Inductor and Triton find them by the hash of their source and skip the build.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from joulepilot.store import default_home, stable_id
from joulepilot.store.files import write_file_atomic

from .provenance import package_version

log = logging.getLogger("joulepilot.artifacts")

KERNELS_SUFFIX = ".kernels.tar"
KERNEL_SUFFIXES = (".so",)
# Kernel binaries are tens of kilobytes each; a cache folder holding more than this is not packed whole.
MAX_KERNELS_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class ArtifactsInfo:
    """What a saved (or loaded) set of artifacts holds: the cache entries by kind ('inductor',
    'aot_autograd', 'precompile', ...), and how many kernel binaries came with them."""

    path: Path | None
    entries: dict[str, int] = field(default_factory=dict)
    kernels: int = 0
    precompile_error: str | None = None  # why Dynamo's precompiled frames were left out of a save

    @property
    def precompile(self) -> bool:
        """Dynamo's precompiled frames are among the entries: compile under `precompile_scope` to use them."""
        return bool(self.entries.get("precompile"))

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"entries": dict(self.entries), "kernels": self.kernels,
                                  "precompile": self.precompile}
        if self.precompile_error:
            out["precompile_error"] = self.precompile_error
        return out


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


def kernels_path(artifacts_path: str | os.PathLike) -> Path:
    """The kernel binaries' file beside an artifacts file (`<key>.bin` -> `<key>.kernels.tar`)."""
    path = Path(artifacts_path)
    return path.with_name(path.stem + KERNELS_SUFFIX)


def inductor_cache_dir() -> Path:
    """This process's Inductor cache folder (TORCHINDUCTOR_CACHE_DIR, else torch's default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def triton_cache_dir() -> Path:
    """This process's Triton cache folder (TRITON_CACHE_DIR, else Triton's default under the home folder)."""
    configured = os.environ.get("TRITON_CACHE_DIR", "").strip()
    return Path(configured) if configured else Path.home() / ".triton" / "cache"


def kernel_cache_dirs() -> dict[str, Path]:
    """The folders kernel binaries are packed from and unpacked into, by the name they have in the tar."""
    return {"inductor": inductor_cache_dir(), "triton": triton_cache_dir()}


def _entry_counts(info: object) -> dict[str, int]:
    artifacts = getattr(info, "artifacts", None) or {}
    return {str(kind): len(keys) for kind, keys in dict(artifacts).items() if keys}


def _kernel_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.suffix in KERNEL_SUFFIXES and p.is_file() and not p.is_symlink())


def count_kernels(caches: Mapping[str, Path] | None = None) -> int:
    """Kernel binaries in `caches` (default: this process's Inductor and Triton cache folders)."""
    caches = kernel_cache_dirs() if caches is None else caches
    return sum(len(_kernel_files(cache)) for cache in caches.values() if cache.is_dir())


def _pack_kernels(caches: Mapping[str, Path]) -> tuple[bytes, int] | None:
    """The kernel binaries under each cache folder as one tar (`<name>/<path in the folder>`), and their number."""
    files = [(name, cache, file) for name, cache in caches.items() if cache.is_dir() for file in _kernel_files(cache)]
    if not files or sum(file.stat().st_size for _, _, file in files) > MAX_KERNELS_BYTES:
        return None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, cache, file in files:
            tar.add(file, arcname=f"{name}/{file.relative_to(cache).as_posix()}", recursive=False)
    return buffer.getvalue(), len(files)


def _serialise_caches() -> tuple[tuple[bytes, object] | None, str | None]:
    """(torch.compiler.save_cache_artifacts(), None); when Dynamo's precompiled frames cannot be serialised,
    the Inductor and AOTAutograd entries alone (a warm start then traces again, but still skips codegen)
    and why the frames were left out."""
    import torch

    try:
        return torch.compiler.save_cache_artifacts(), None
    except Exception as exc:
        from .warmstart import precompile_enabled

        if not precompile_enabled():
            raise
        reason = f"{type(exc).__name__}: {exc}".strip()[:500]
        log.warning("Dynamo's precompiled frames could not be saved (%s); saving the Inductor caches alone", reason)
        from torch._dynamo import config

        with config.patch(caching_precompile=False):
            return torch.compiler.save_cache_artifacts(), reason


def save_warm_start(path: str | os.PathLike, *, kernels_from: Mapping[str, Path] | None = None
                    ) -> ArtifactsInfo | None:
    """Write everything this process compiled to `path` (torch.compiler.save_cache_artifacts), each file
    atomically, and with `kernels_from` (cache folders by name, as `kernel_cache_dirs` gives them, that hold
    only this compile's files, as a benchmark worker's fresh ones do) their kernel binaries beside. The files get ordinary
    permissions (the umask decides), so a serving process running as another user than the daemon can
    load them. None when torch has nothing to save (eager, or caches disabled)."""
    saved, precompile_error = _serialise_caches()
    if not saved:
        return None
    blob, info = saved
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    written = write_file_atomic(target, blob)
    packed = _pack_kernels(kernels_from) if kernels_from is not None else None
    kernels = kernels_path(written)
    if packed:
        write_file_atomic(kernels, packed[0])
    elif kernels.exists():
        kernels.unlink()  # from an earlier compile of this configuration; these entries do not name them
    return ArtifactsInfo(written, _entry_counts(info), packed[1] if packed else 0, precompile_error)


def save_artifacts(path: str | os.PathLike, *, kernels_from: Mapping[str, Path] | None = None) -> Path | None:
    """`save_warm_start`, returning the artifacts file's path (or None)."""
    saved = save_warm_start(path, kernels_from=kernels_from)
    return saved.path if saved else None


def _member_target(member: tarfile.TarInfo, caches: Mapping[str, Path]) -> tuple[Path, str] | None:
    """(cache folder, path inside it) for a kernel binary of the tar; None for anything else."""
    name = PurePosixPath(member.name)
    if (not member.isfile() or name.is_absolute() or ".." in name.parts or name.suffix not in KERNEL_SUFFIXES
            or len(name.parts) < 2 or name.parts[0] not in caches):
        return None
    return caches[name.parts[0]], PurePosixPath(*name.parts[1:]).as_posix()


def unpack_kernels(path: str | os.PathLike, caches: Mapping[str, Path] | None = None) -> int:
    """Unpack kernel binaries from `path` into the cache folders they came from (by default this process's,
    `kernel_cache_dirs`); files already there are kept. Returns how many were written."""
    caches = kernel_cache_dirs() if caches is None else caches
    written = 0
    with tarfile.open(path, mode="r") as tar:
        for member in tar.getmembers():
            target = _member_target(member, caches)
            if target is None or (target[0] / target[1]).exists():
                continue
            member.name = target[1]
            if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
                tar.extract(member, target[0], filter="data")
            else:
                tar.extract(member, target[0])
            written += 1
    return written


def _resolve(key_or_path: str | os.PathLike) -> Path:
    path = Path(key_or_path)
    if not path.suffix and not path.exists():
        path = artifacts_dir() / f"{key_or_path}.bin"
    return path


def load_warm_start(key_or_path: str | os.PathLike) -> ArtifactsInfo | None:
    """Load saved artifacts into this process's caches, kernel binaries first; call before compiling.

    Accepts a key (as from artifact_key) or a file path. None when there is nothing to load. A kernel
    file that cannot be unpacked only costs the kernels' build."""
    import torch

    path = _resolve(key_or_path)
    if not path.is_file():
        return None
    kernels = 0
    if kernels_path(path).is_file():
        try:
            kernels = unpack_kernels(kernels_path(path))
        except (OSError, tarfile.TarError) as exc:
            log.warning("could not unpack kernel binaries %s: %s", kernels_path(path), exc)
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    if info is None:
        return None
    return ArtifactsInfo(path, _entry_counts(info), kernels)


def load_artifacts(key_or_path: str | os.PathLike) -> bool:
    """`load_warm_start`: True when something was loaded."""
    return load_warm_start(key_or_path) is not None
