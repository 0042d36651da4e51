"""Hand-built kernel tars for the artifacts tests: members laid out as `write_kernels` packs them
(`<cache>/<path in the cache>`), each file's bytes naming the save it belongs to."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def tar_of(members: dict[str, bytes]) -> bytes:
    """An uncompressed tar of `members` (name -> bytes), in memory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def members_of(tag: str) -> dict[str, bytes]:
    """Three binaries, two Inductor and one Triton, whose contents start with their name and `tag`."""
    return {"inductor/ab/cabc.so": f"cabc {tag};".encode() * 200, "inductor/cd/ccd.so": f"ccd {tag};".encode() * 100,
            "triton/KEY/cuda_utils.so": f"launcher {tag};".encode() * 50}


def cache_folders(root: Path) -> dict[str, Path]:
    """An Inductor and a Triton cache folder under `root`, as `unpack_kernels` takes them (not created)."""
    return {"inductor": root / "inductor-cache", "triton": root / "triton-cache"}


def cache_files(caches: dict[str, Path]) -> dict[str, bytes]:
    """Every file in the cache folders, by the name its tar member would have."""
    return {f"{name}/{p.relative_to(root).as_posix()}": p.read_bytes()
            for name, root in caches.items() if root.is_dir() for p in sorted(root.rglob("*")) if p.is_file()}
