"""The kernel binaries packed beside saved compile artifacts: what is packed, and that unpacking writes only
kernel files inside the Inductor cache folder and keeps those already there."""

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


def test_only_kernel_binaries_of_the_folder_are_packed(tmp_path):
    cache = tmp_path / "inductor-cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "cabc.so").write_bytes(b"kernel")
    (cache / "ab" / "cabc.cpp").write_text("source")
    (cache / "fxgraph").mkdir()
    (cache / "fxgraph" / "entry").write_bytes(b"entry")
    blob, count = _pack_kernels(cache)
    assert count == 1 == count_kernels(cache)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        assert tar.getnames() == ["ab/cabc.so"]
    assert _pack_kernels(tmp_path / "empty") is None and count_kernels(tmp_path / "missing") == 0


def test_unpacking_writes_kernels_inside_the_cache_and_nothing_else(tmp_path):
    packed = tmp_path / "a.kernels.tar"
    packed.write_bytes(_tar({"ab/cabc.so": b"new", "cd/ccd.so": b"kernel", "../escape.so": b"x",
                             "/abs/olute.so": b"x", "ef/run.sh": b"x"}))
    cache = tmp_path / "cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "cabc.so").write_bytes(b"already here")
    assert unpack_kernels(packed, cache) == 1
    assert (cache / "cd" / "ccd.so").read_bytes() == b"kernel"
    assert (cache / "ab" / "cabc.so").read_bytes() == b"already here"
    assert not (tmp_path / "escape.so").exists() and not (cache / "ef").exists()
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) == [
        "ab/cabc.so", "cd/ccd.so"]
