"""The kernel binaries packed beside saved compile artifacts: what is packed, and that unpacking writes only
kernel files, each into the cache folder it came from, and keeps those already there."""

from __future__ import annotations

import io
import tarfile

from joulepilot.compiler.artifacts import _pack_kernels, count_kernels, kernels_path, unpack_kernels


def _tar(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_kernels_file_sits_beside_the_artifacts(tmp_path):
    assert kernels_path(tmp_path / "abc.bin") == tmp_path / "abc.kernels.tar"


def test_only_kernel_binaries_of_the_cache_folders_are_packed(tmp_path):
    inductor, triton = tmp_path / "inductor-cache", tmp_path / "triton-cache"
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab" / "cabc.so").write_bytes(b"kernel")
    (inductor / "ab" / "cabc.cpp").write_text("source")
    (inductor / "fxgraph").mkdir()
    (inductor / "fxgraph" / "entry").write_bytes(b"entry")
    (triton / "KEY").mkdir(parents=True)
    (triton / "KEY" / "cuda_utils.so").write_bytes(b"launcher")
    (triton / "KEY" / "kernel.cubin").write_bytes(b"cubin")
    caches = {"inductor": inductor, "triton": triton}
    blob, count = _pack_kernels(caches)
    assert count == 2 == count_kernels(caches)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert tar.getnames() == ["inductor/ab/cabc.so", "triton/KEY/cuda_utils.so"]
    assert _pack_kernels({"inductor": tmp_path / "empty"}) is None
    assert count_kernels({"inductor": tmp_path / "missing"}) == 0


def test_unpacking_writes_kernels_inside_their_cache_and_nothing_else(tmp_path):
    packed = tmp_path / "a.kernels.tar"
    packed.write_bytes(_tar({"inductor/ab/cabc.so": b"new", "inductor/cd/ccd.so": b"kernel",
                             "triton/KEY/cuda_utils.so": b"launcher", "inductor/../escape.so": b"x",
                             "/abs/olute.so": b"x", "inductor/ef/run.sh": b"x", "elsewhere/x/y.so": b"x",
                             "top.so": b"x"}))
    inductor, triton = tmp_path / "cache", tmp_path / "triton"
    (inductor / "ab").mkdir(parents=True)
    (inductor / "ab" / "cabc.so").write_bytes(b"already here")
    assert unpack_kernels(packed, {"inductor": inductor, "triton": triton}) == 2
    assert (inductor / "cd" / "ccd.so").read_bytes() == b"kernel"
    assert (triton / "KEY" / "cuda_utils.so").read_bytes() == b"launcher"
    assert (inductor / "ab" / "cabc.so").read_bytes() == b"already here"
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["a.kernels.tar", "cache/ab/cabc.so", "cache/cd/ccd.so", "triton/KEY/cuda_utils.so"]
