"""Damaged kernel binaries must not stay in the Inductor cache, on real artifacts compiled on the CPU: a warm start
from the intact tar replaces the damaged binaries an earlier unpack left in the cache folder, and its first call
computes what the model does (before, the damaged files were kept, and every later process used them). A damaged
tar refused before anything is unpacked, artifacts saved before digests were kept, and a write cut short are
covered on hand-built tars in test_artifacts_kernels.py (one compile here, for the case that needs it)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from joulepilot.compiler.artifacts import VERIFIED, kernels_digest_path, kernels_path

pytestmark = pytest.mark.slow

MODEL = """
import json, sys, torch
from joulepilot.compiler import CompileConfig, apply_config
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
x = torch.randn(4, 16)
"""

BUILD = MODEL + """
from joulepilot.compiler.artifacts import kernel_cache_dirs, save_warm_start
apply_config(CompileConfig("default"), model, "cpu")(x)
print(json.dumps(save_warm_start(sys.argv[1], kernels_from=kernel_cache_dirs()).to_dict()))
"""

WARM_START = MODEL + """
from joulepilot.compiler.artifacts import load_warm_start
loaded = load_warm_start(sys.argv[1])  # as the hook does, before it compiles
out = apply_config(CompileConfig("default"), model, "cpu")(x)
with torch.no_grad():
    ref = model(x)
print(json.dumps({"artifacts": loaded.to_dict(), "max_abs_error": float((out - ref).abs().max())}))
"""


def run_python(code: str, artifacts, cache) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, str(artifacts)], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One cold compile of a small model, its artifacts saved with its kernel binaries."""
    root = tmp_path_factory.mktemp("saved")
    done = run_python(BUILD, root / "a.bin", root / "cold-cache")
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.splitlines()[-1])
    assert info["kernels"] > 0 and info["kernels_sha256"]
    return root / "a.bin"


def copy_artifacts(saved, folder):
    folder.mkdir()
    for path in (saved, kernels_path(saved), kernels_digest_path(saved)):
        shutil.copy(path, folder / path.name)
    return folder / saved.name


def damaged_copy(tar_bytes: bytes) -> bytes:
    """The tar with the middle third of every member's data overwritten, headers intact."""
    data = bytearray(tar_bytes)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar.getmembers():
            start = member.offset_data + member.size // 3
            data[start:start + member.size // 3] = bytes(member.size // 3)
    return bytes(data)


def members(tar_bytes: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def warm_start(artifacts, cache) -> dict:
    done = run_python(WARM_START, artifacts, cache)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["max_abs_error"] < 1e-4  # the first call computes what the model does
    result["stderr"] = done.stderr
    return result


def test_damaged_binaries_left_in_the_cache_are_replaced_from_the_verified_tar(saved, tmp_path):
    artifacts = copy_artifacts(saved, tmp_path / "artifacts")
    intact = members(kernels_path(artifacts).read_bytes())
    cache = tmp_path / "serving-cache"
    for name, data in members(damaged_copy(kernels_path(artifacts).read_bytes())).items():
        kind, relative = name.split("/", 1)  # where an unpack of the damaged tar put it
        target = cache / kind / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    result = warm_start(artifacts, cache)
    info = result["artifacts"]
    assert info["kernels_integrity"] == VERIFIED and info["kernels"] == len(intact)
    assert {name: (cache / name).read_bytes() for name in intact} == intact
