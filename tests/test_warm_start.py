"""Warm starts from saved artifacts, with real Inductor compiles on the CPU: the cold worker saves the cache
entries and the kernel binaries (and Dynamo's precompiled frames where torch has them), and a fresh worker
with an empty Inductor cache loads them, builds no kernel, and starts faster than the cold compile."""

from __future__ import annotations

import pytest
from joulepilot.compiler import CompileConfig
from joulepilot.compiler.budget import worker_budget
from joulepilot.compiler.runner import run_worker_job
from joulepilot.compiler.warmstart import precompile_available

pytestmark = pytest.mark.slow

SPEC = "tests.block_models:block_stack"


def _cold_then_warm(tmp_path, config: CompileConfig, precompile: bool) -> tuple[dict, dict]:
    job = {"kind": "bench", "spec": SPEC, "device": "cpu", "config": config.to_row(), "min_seconds": 0.2,
           "latency_s": 0.2, "warmup_max_s": 0.3, "precompile": precompile,
           "artifacts_path": str(tmp_path / f"{config.id}.bin")}
    budget = worker_budget(900, 0.2)
    cold = run_worker_job(job, budget=budget)
    assert cold["status"] == "ok", cold.get("reason")
    warm = run_worker_job(dict(job, kind="warm_start", artifacts_path=cold["artifacts_path"]), budget=budget)
    assert warm["status"] == "ok", warm.get("reason")
    return cold, warm


def test_regional_warm_start_loads_kernels_and_frames_and_builds_nothing(tmp_path):
    cold, warm = _cold_then_warm(tmp_path, CompileConfig("default", regional=True), precompile=True)
    saved = cold["extra"]["artifacts"]
    assert cold["extra"]["regional"]["instances"] == 4 and cold["extra"]["dynamo_frames_first_call"] == 1
    assert saved["entries"]["inductor"] == 1 and saved["entries"]["aot_autograd"] == 1
    assert saved["kernels"] > 0 and (tmp_path / f"{CompileConfig('default', regional=True).id}.kernels.tar").is_file()
    assert warm["artifacts"]["kernels"] == saved["kernels"]
    assert warm["kernels_built"] == 0  # every C++ kernel came from the packed binaries
    assert "inductor_codegen_s" not in warm["compile_timers_s"]  # and no code was generated
    if precompile_available():
        assert saved["precompile"] and warm["artifacts"]["precompile"]
        assert warm["dynamo_frames"] == 0  # the precompiled frames were installed: nothing traced
    else:
        assert warm["caches"] == {"fxgraph_cache_hit": 1, "autograd_cache_hit": 1}
    assert warm["warm_start_s"] == pytest.approx(warm["artifacts_load_s"] + warm["apply_s"] + warm["first_call_s"])
    assert warm["warm_start_s"] < cold["compile_s"]
    assert warm["max_rel_error"] == cold["max_rel_error"]  # the same compiled code, the same inputs


def test_whole_model_warm_start_without_precompile_hits_the_inductor_caches(tmp_path):
    cold, warm = _cold_then_warm(tmp_path, CompileConfig("default"), precompile=False)
    assert cold["extra"]["compile_caches"] == {"fxgraph_cache_miss": 1, "autograd_cache_miss": 1}
    assert "precompile" not in cold["extra"]["artifacts"]["entries"]
    assert warm["caches"] == {"fxgraph_cache_hit": 1, "autograd_cache_hit": 1}
    assert warm["dynamo_frames"] == 1  # traced again, but compiled from the caches
    assert warm["kernels_built"] == 0 and warm["artifacts"]["kernels"] > 0
    assert warm["warm_start_s"] < cold["compile_s"]
    assert warm["max_rel_error"] == cold["max_rel_error"]


def test_a_model_with_graph_breaks_warm_starts_every_frame(tmp_path):
    job_spec = "tests.block_models:breaking_stack"
    config = CompileConfig("default")
    job = {"kind": "bench", "spec": job_spec, "device": "cpu", "config": config.to_row(), "min_seconds": 0.2,
           "latency_s": 0.2, "warmup_max_s": 0.3, "precompile": True, "artifacts_path": str(tmp_path / "a.bin")}
    cold = run_worker_job(job, budget=worker_budget(900, 0.2))
    assert cold["status"] == "ok", cold.get("reason")
    assert cold["graph_breaks"] >= 1 and cold["extra"]["dynamo_frames_first_call"] > 1
    warm = run_worker_job(dict(job, kind="warm_start", artifacts_path=cold["artifacts_path"]),
                          budget=worker_budget(900, 0.2))
    assert warm["status"] == "ok", warm.get("reason")
    assert warm["artifacts"]["entries"]["inductor"] == cold["extra"]["artifacts"]["entries"]["inductor"] > 1
    assert warm["kernels_built"] == 0 and warm["max_rel_error"] == cold["max_rel_error"]
    if precompile_available():
        assert warm["dynamo_frames"] == 0
    else:
        assert warm["caches"]["fxgraph_cache_hit"] == cold["extra"]["compile_caches"]["fxgraph_cache_miss"]
