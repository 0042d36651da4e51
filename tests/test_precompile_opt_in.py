"""Dynamo's caching precompile is experimental and off unless asked for ($JOULEPILOT_PRECOMPILE, bench's
`precompile=True`); when it is asked for and fails, the configuration is measured as without it and the run
says why. On torch 2.11 it broke ordinary cold compiles; the fake worker replays that failure here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from joulepilot.compiler import ArtifactsInfo, CompileConfig, bench
from joulepilot.compiler.artifacts import save_warm_start
from joulepilot.compiler.warmstart import PRECOMPILE_ENV, precompile_available, precompile_opted_in
from joulepilot.runtime.hook import use_precompiled_frames

SPEC = "tests.block_models:block_stack"


def _bench(tmp_path, **kwargs):
    (run,) = bench(SPEC, [CompileConfig("default", batch_size=2)], device="cpu", db=tmp_path / "runs.db",
                   min_seconds=0.2, idle_s=0, warm_start=False, force=True, **kwargs)
    return run


def test_precompile_is_opted_in_only_by_the_environment(monkeypatch):
    monkeypatch.delenv(PRECOMPILE_ENV, raising=False)
    assert not precompile_opted_in()
    for value, expected in (("1", True), ("on", True), ("TRUE", True), ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv(PRECOMPILE_ENV, value)
        assert precompile_opted_in() is expected


def test_bench_compiles_without_precompile_by_default(tmp_path, fake_worker, monkeypatch):
    monkeypatch.delenv(PRECOMPILE_ENV, raising=False)
    # Were precompile on, this fake compile would fail: by default the run is plain and complete.
    monkeypatch.setenv("JOULEPILOT_FAKE_PRECOMPILE_FAILS", "1")
    run = _bench(tmp_path)
    assert run["status"] == "ok" and run["compile_s"] > 0
    assert "precompile" not in run["extra"] and "precompile_error" not in run["extra"]


@pytest.mark.skipif(not precompile_available(), reason="this torch has no caching precompile")
def test_opting_in_turns_precompile_on_for_the_compile(tmp_path, fake_worker, monkeypatch):
    monkeypatch.setenv(PRECOMPILE_ENV, "1")
    run = _bench(tmp_path)
    assert run["status"] == "ok" and run["extra"]["precompile"] is True
    assert "precompile_error" not in run["extra"]


@pytest.mark.skipif(not precompile_available(), reason="this torch has no caching precompile")
@pytest.mark.parametrize("opt_in", ["environment", "argument"])
def test_a_compile_that_fails_with_precompile_is_measured_without_it(tmp_path, fake_worker, monkeypatch, opt_in):
    monkeypatch.setenv("JOULEPILOT_FAKE_PRECOMPILE_FAILS", "1")
    if opt_in == "environment":
        monkeypatch.setenv(PRECOMPILE_ENV, "1")
        run = _bench(tmp_path)
    else:
        monkeypatch.delenv(PRECOMPILE_ENV, raising=False)
        run = _bench(tmp_path, precompile=True)
    assert run["status"] == "ok" and run["reason"] is None
    assert run["compile_s"] > 0 and run["energy_j_per_inference"] > 0
    assert "precompile" not in run["extra"]  # the measured run had it off
    assert run["extra"]["precompile_error"].startswith("compile with precompile: TypeError during compile: ")
    assert "cannot be saved into a torch.compile() package" in run["extra"]["precompile_error"]


@pytest.mark.skipif(not precompile_available(), reason="this torch has no caching precompile")
def test_saving_leaves_out_precompiled_frames_that_cannot_be_saved_and_says_why(tmp_path, monkeypatch):
    from torch._dynamo import config

    def save_cache_artifacts():
        if config.caching_precompile:
            raise TypeError("frame of a local class")
        return b"entries", SimpleNamespace(artifacts={"inductor": ["k1"], "aot_autograd": ["k2"]})

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save_cache_artifacts)
    with config.patch(caching_precompile=True):
        saved = save_warm_start(tmp_path / "a.bin")
    assert saved is not None and saved.path.read_bytes() == b"entries"
    assert saved.entries == {"inductor": 1, "aot_autograd": 1} and not saved.precompile
    assert saved.to_dict()["precompile_error"] == "TypeError: frame of a local class"
    with config.patch(caching_precompile=False), pytest.raises(TypeError):
        monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (_ for _ in ()).throw(TypeError("x")))
        save_warm_start(tmp_path / "b.bin")  # without precompile a failure is the caller's, as before


def test_the_hook_installs_precompiled_frames_only_when_opted_in(monkeypatch):
    with_frames = ArtifactsInfo(None, {"inductor": 1, "precompile": 1})
    monkeypatch.delenv(PRECOMPILE_ENV, raising=False)
    assert not use_precompiled_frames(with_frames, {})
    monkeypatch.setenv(PRECOMPILE_ENV, "1")
    assert use_precompiled_frames(with_frames, {})
    assert not use_precompiled_frames(with_frames, {"dynamic": False})
    assert not use_precompiled_frames(ArtifactsInfo(None, {"inductor": 1}), {})
    assert not use_precompiled_frames(None, {})
