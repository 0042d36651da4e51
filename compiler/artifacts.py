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

torch checks the `.bin` itself; the tar's SHA-256 is recorded at save in `<key>.kernels.tar.sha256` (the
format `sha256sum -c` reads) and checked before anything is unpacked: a damaged binary in the cache folder
would be loaded by every later process. A tar that fails the check is not used (the kernels are built
again); one saved before digests were recorded is used, reported unverified. The two are replaced together
under `<key>.kernels.lock` (`artifacts_lock`), so saves of the same artifacts at once leave one save's pair,
and a warm start reads a pair that one save wrote.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from joulepilot.store import default_home, stable_id
from joulepilot.store.files import stage_file, write_file_atomic

from .artifacts_lock import KernelsLockBusy, kernels_lock
from .provenance import package_version

log = logging.getLogger("joulepilot.artifacts")

KERNELS_SUFFIX = ".kernels.tar"
DIGEST_SUFFIX = ".sha256"
VERIFIED, UNVERIFIED, REFUSED = "verified", "unverified", "refused"
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
    # The kernel binaries' tar against its recorded digest, on load: VERIFIED, UNVERIFIED (saved before digests
    # were recorded: used), REFUSED (not used: `kernels_error` says why); None with no tar.
    kernels_integrity: str | None = None
    kernels_error: str | None = None  # on a save: why the kernel binaries were not saved (KernelsLockBusy)
    kernels_sha256: str | None = None  # the tar's, as recorded at save (and checked on load)

    @property
    def precompile(self) -> bool:
        """Dynamo's precompiled frames are among the entries: compile under `precompile_scope` to use them."""
        return bool(self.entries.get("precompile"))

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"entries": dict(self.entries), "kernels": self.kernels,
                                  "precompile": self.precompile}
        if self.precompile_error:
            out["precompile_error"] = self.precompile_error
        for name in ("kernels_integrity", "kernels_error", "kernels_sha256"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out


class KernelsDigestMismatch(ValueError):
    """A kernel binaries' tar whose content is not what was saved (its SHA-256 differs from the recorded one)."""


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


def recorded_artifacts(recorded: str | os.PathLike | None, workload_id: str, config_id: str,
                       origin: Mapping[str, Any]) -> Path | None:
    """The artifacts a stored run recorded (`recorded`, its `artifacts_path`), when that is where this host saves
    them for the workload, configuration and provenance `origin` (device name, torch and triton versions) and the
    file is there; else None. A path read from the store is never loaded as it is: whoever can write the store
    could name a file of their own, and loading artifacts runs the code compiled into them."""
    if not recorded:
        return None
    saved = artifact_path_for(workload_id, config_id, origin["device_name"], origin["torch_version"],
                              origin.get("triton_version") or "")
    return saved if Path(recorded) == saved and saved.is_file() else None


def kernels_path(artifacts_path: str | os.PathLike) -> Path:
    """The kernel binaries' file beside an artifacts file (`<key>.bin` -> `<key>.kernels.tar`)."""
    path = Path(artifacts_path)
    return path.with_name(path.stem + KERNELS_SUFFIX)


def kernels_digest_path(artifacts_path: str | os.PathLike) -> Path:
    """The recorded SHA-256 of the kernel binaries' tar (`<key>.bin` -> `<key>.kernels.tar.sha256`)."""
    kernels = kernels_path(artifacts_path)
    return kernels.with_name(kernels.name + DIGEST_SUFFIX)


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


def write_kernels(artifacts_path: str | os.PathLike, packed: bytes | None) -> str | None:
    """The kernel binaries' tar beside `artifacts_path` and its SHA-256 (returned), each written atomically; with
    None, any earlier ones removed (they came from an earlier compile of this configuration: these entries do
    not name them). Both are written to temporary names first, then renamed into place together under the
    kernels' lock, so that concurrent saves leave one save's tar and digest and a reader (`load_kernels`) never
    finds one save's digest beside another's tar. Raises KernelsLockBusy (nothing changed) when the lock stays
    held by another process."""
    kernels, digest_path = kernels_path(artifacts_path), kernels_digest_path(artifacts_path)
    if packed is None:
        if kernels.exists() or digest_path.exists():
            with kernels_lock(artifacts_path, exclusive=True):
                digest_path.unlink(missing_ok=True)
                kernels.unlink(missing_ok=True)
        return None
    digest = hashlib.sha256(packed).hexdigest()
    staged = [stage_file(kernels, packed)]
    try:
        staged.append(stage_file(digest_path, f"{digest}  {kernels.name}\n".encode()))
        with kernels_lock(artifacts_path, exclusive=True):
            os.replace(staged[0], kernels)
            os.replace(staged[1], digest_path)
    finally:
        for leftover in staged:
            leftover.unlink(missing_ok=True)  # renamed already, or not used
    return digest


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
    try:
        digest = write_kernels(written, packed[0] if packed else None)
    except KernelsLockBusy as exc:
        # Another save of these artifacts (or a stuck reader) holds the lock: what is there stays, a pair.
        error = f"kernel binaries not saved: {exc}"
        log.warning("%s; a warm start from %s builds the kernels it does not find", error, written)
        return ArtifactsInfo(written, _entry_counts(info), 0, precompile_error, kernels_error=error)
    return ArtifactsInfo(written, _entry_counts(info), packed[1] if packed else 0, precompile_error,
                         kernels_sha256=digest)


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


def _file_sha256(fh: io.BufferedIOBase) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: fh.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def recorded_kernels_digest(artifacts_path: str | os.PathLike) -> str | None:
    """The SHA-256 recorded for the kernel binaries' tar at save; None when none was (saved by an older joulepilot).
    Raises KernelsDigestMismatch for a digest file that holds no digest, OSError for one that cannot be read."""
    path = kernels_digest_path(artifacts_path)
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return None
    recorded = text.split()[0].lower() if text.split() else ""
    if len(recorded) != 64 or any(c not in "0123456789abcdef" for c in recorded):
        raise KernelsDigestMismatch(f"{path} holds no SHA-256 digest")
    return recorded


def _inside(cache: Path, relative: str) -> Path | None:
    """`cache / relative`, unless a link in the cache folder leads it elsewhere."""
    target = cache / relative
    root, parent = os.path.realpath(cache), os.path.realpath(target.parent)
    return target if parent == root or parent.startswith(root.rstrip(os.sep) + os.sep) else None


def _same_content(path: Path, data: bytes) -> bool:
    try:
        return path.stat().st_size == len(data) and path.read_bytes() == data
    except OSError:
        return False


def _write_kernel(target: Path, data: bytes, executable: bool) -> None:
    """`data` to `target` through a temporary name beside it, then renamed over it: a crash leaves the old file
    or a complete new one (and at most a `.tmp` file, which nothing loads), never a part of a binary. A process
    that has the old file loaded keeps its copy. Not synced (each sync would lengthen the warm start): a file a
    power loss damaged differs from the verified tar at the next load, which replaces it."""
    write_file_atomic(target, data, mode=0o777 if executable else 0o666, durable=False)  # mode less the umask


def unpack_kernels(path: str | os.PathLike, caches: Mapping[str, Path] | None = None, *,
                   expected_sha256: str | None = None) -> int:
    """Unpack kernel binaries from `path` into the cache folders they came from (by default this process's,
    `kernel_cache_dirs`), each through a temporary name. Returns how many files were written.

    With `expected_sha256` the whole tar is checked first, and KernelsDigestMismatch raised (nothing written)
    when it differs; its binaries then replace files of the same name whose content differs (a damaged binary
    left by an earlier unpack would otherwise be loaded by every process). Without it (a tar saved before
    digests were recorded) nothing vouches for the binaries: files already there are kept, with a warning
    when they differ."""
    with open(path, "rb") as fh:
        return _unpack_open_kernels(fh, path, caches, expected_sha256)


def _unpack_open_kernels(fh: io.BufferedReader, path: str | os.PathLike, caches: Mapping[str, Path] | None,
                         expected_sha256: str | None) -> int:
    """`unpack_kernels` of the tar open as `fh` (at its start), `path` naming it in messages."""
    caches = kernel_cache_dirs() if caches is None else caches
    written, kept = 0, []
    with fh:
        if expected_sha256 is not None:
            actual = _file_sha256(fh)
            if actual != expected_sha256.lower():
                raise KernelsDigestMismatch(f"{path} is damaged: its SHA-256 is {actual}, {expected_sha256} was "
                                            "recorded when it was saved")
            fh.seek(0)  # the same open file: a tar replaced meanwhile is not the one checked
        with tarfile.open(fileobj=fh, mode="r:") as tar:
            for member in tar:
                found = _member_target(member, caches)
                target = _inside(*found) if found else None
                source = tar.extractfile(member) if target else None
                if source is None:
                    continue
                data = source.read()
                if target.exists() or target.is_symlink():
                    if _same_content(target, data):
                        continue
                    if expected_sha256 is None:
                        kept.append(target)
                        continue
                target.parent.mkdir(parents=True, exist_ok=True)
                _write_kernel(target, data, executable=bool(member.mode & 0o111))
                written += 1
    if kept:
        log.warning("%d kernel binaries already in the cache folders differ from those in %s, which has no "
                    "recorded digest (saved by an older joulepilot): kept %s%s; if the first call fails, delete "
                    "them, or run bench again to save the artifacts with a digest", len(kept), path, kept[0],
                    f" and {len(kept) - 1} more" if len(kept) > 1 else "")
    return written


class KernelsLoaded(NamedTuple):
    written: int  # kernel files written into the cache folders
    integrity: str | None  # VERIFIED, UNVERIFIED or REFUSED; None with no tar
    error: str | None = None  # why a REFUSED tar was not used
    sha256: str | None = None  # the recorded digest it matched


def load_kernels(artifacts_path: str | os.PathLike, caches: Mapping[str, Path] | None = None) -> KernelsLoaded:
    """The kernel binaries beside `artifacts_path` unpacked into `caches` (default: this process's) once their
    tar is verified. A tar that fails its digest, or cannot be read, is refused with a warning naming it: the
    kernels are then built again, as on a cold start. One saved before digests were recorded is used."""
    kernels = kernels_path(artifacts_path)
    if not kernels.is_file():
        return KernelsLoaded(0, None)
    try:
        # The digest and the tar read under the kernels' lock, so that they are one save's; the open file is
        # hashed and unpacked afterwards, without holding up a save.
        with kernels_lock(artifacts_path, exclusive=False):
            if not kernels.is_file():  # removed by a save of artifacts without kernels
                return KernelsLoaded(0, None)
            expected = recorded_kernels_digest(artifacts_path)
            fh = open(kernels, "rb")  # closed by _unpack_open_kernels
    except KernelsLockBusy as exc:
        error = f"{kernels}: {exc}"
        log.warning("kernel binaries not used, they will be built: %s (a save that did not finish?)", error)
        return KernelsLoaded(0, REFUSED, error)
    except (OSError, KernelsDigestMismatch) as exc:
        return _refused(kernels, exc)
    try:
        written = _unpack_open_kernels(fh, kernels, caches, expected)
    except (OSError, tarfile.TarError, KernelsDigestMismatch) as exc:
        return _refused(kernels, exc)
    return KernelsLoaded(written, VERIFIED, sha256=expected) if expected else KernelsLoaded(written, UNVERIFIED)


def _refused(kernels: Path, exc: Exception) -> KernelsLoaded:
    error = str(exc) if isinstance(exc, KernelsDigestMismatch) else f"{kernels}: {type(exc).__name__}: {exc}"
    log.warning("kernel binaries not used, they will be built again: %s; run bench for this configuration "
                "again to save them anew, or delete %s", error, kernels)
    return KernelsLoaded(0, REFUSED, error)


def _resolve(key_or_path: str | os.PathLike) -> Path:
    path = Path(key_or_path)
    if not path.suffix and not path.exists():
        path = artifacts_dir() / f"{key_or_path}.bin"
    return path


def load_warm_start(key_or_path: str | os.PathLike) -> ArtifactsInfo | None:
    """Load saved artifacts into this process's caches, kernel binaries first; call before compiling.

    Accepts a key (as from artifact_key) or a file path. None when there is nothing to load. A kernel
    file that fails its digest or cannot be unpacked only costs the kernels' build (`load_kernels`)."""
    import torch

    path = _resolve(key_or_path)
    if not path.is_file():
        return None
    kernels = load_kernels(path)
    info = torch.compiler.load_cache_artifacts(path.read_bytes())
    if info is None:
        return None
    return ArtifactsInfo(path, _entry_counts(info), kernels.written, kernels_integrity=kernels.integrity,
                         kernels_error=kernels.error, kernels_sha256=kernels.sha256)


def load_artifacts(key_or_path: str | os.PathLike) -> bool:
    """`load_warm_start`: True when something was loaded."""
    return load_warm_start(key_or_path) is not None
