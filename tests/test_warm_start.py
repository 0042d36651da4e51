"""Warm starts from saved artifacts, with real Inductor compiles on the CPU: the cold worker saves the cache
entries and the kernel binaries (and Dynamo's precompiled frames where torch has them), and a worker with an
empty Inductor cache loads them, builds no kernel, and starts faster than the cold compile. Both workers are
forked from the workload's zygote, as `bench` runs a configuration and its warm start (the zygote never
compiles: each worker starts with fresh caches); the serving process that warm-starts through the hook is a
process of its own."""

from __future__ import annotations

import pytest
from cache_checks import assert_compiled_from_caches
from joulepilot.compiler import CompileConfig, ZygotePool
from joulepilot.compiler.artifacts import kernels_path
from joulepilot.compiler.budget import worker_budget
from joulepilot.compiler.runner import run_worker_job
from joulepilot.compiler.warmstart import precompile_available
from joulepilot.compiler.zygote import FORKED

pytestmark = pytest.mark.slow

SPEC = "tests.block_models:block_stack"



def cold_then_warm(job: dict, *, repeat: bool = False) -> tuple[dict, ...]:
    """The job's cold compile, then a warm start from its artifacts, all forked from one zygote as bench runs them;
    with `repeat`, then the job again in a fresh worker that starts from them (as the daemon's repeats do)."""
    with ZygotePool() as zygotes:
        cold = run_worker_job(job, budget=worker_budget(900, 0.2), zygotes=zygotes)
        assert cold["status"] == "ok", cold.get("reason")
        warm = run_worker_job(dict(job, kind="warm_start", artifacts_path=cold["artifacts_path"]),
                              budget=worker_budget(900, 0.2), zygotes=zygotes)
        more = [run_worker_job(dict(job, artifacts_path=None, warm_from=cold["artifacts_path"], warm_from_run_id=41),
                               budget=worker_budget(900, 0.2), zygotes=zygotes)] if repeat else []
    assert cold["worker_process"] == warm["worker_process"] == FORKED
    return cold, warm, *more


def test_a_model_with_graph_breaks_warm_starts_every_frame_from_the_inductor_caches(tmp_path):
    """The default path (no precompile): every frame is traced again and compiled from the saved caches. A repeat
    of the configuration in a fresh process (`warm_from`) starts the same way and then measures as a bench job."""
    config = CompileConfig("default")
    job = {"kind": "bench", "spec": "tests.block_models:breaking_stack", "device": "cpu", "config": config.to_row(),
           "min_seconds": 0.2, "latency_s": 0.2, "warmup_max_s": 0.3, "precompile": False,
           "artifacts_path": str(tmp_path / "a.bin")}
    cold, warm, repeat = cold_then_warm(job, repeat=True)
    frames = cold["extra"]["dynamo_frames_first_call"]
    assert cold["graph_breaks"] >= 1 and frames > 1
    entries = cold["extra"]["artifacts"]["entries"]
    assert "precompile" not in entries and entries["inductor"] > 1
    misses = cold["extra"]["compile_caches"]
    assert misses["fxgraph_cache_miss"] == entries["inductor"] and misses["autograd_cache_miss"] == entries["inductor"]
    assert warm["status"] == "ok", warm.get("reason")
    assert warm["artifacts"]["entries"]["inductor"] == entries["inductor"]
    assert_compiled_from_caches(warm["caches"], warm["cache_bypasses"], entries["inductor"])
    assert warm["dynamo_frames"] == frames  # traced again, but compiled from the caches
    assert warm["kernels_built"] == 0 and warm["artifacts"]["kernels"] > 0
    # how much faster it starts is measured by benchmarks/ on a quiet machine, not asserted on a shared one
    assert warm["max_rel_error"] == cold["max_rel_error"]  # the same compiled code, the same inputs

    # The repeat: a warm start in place of a compile, then the run's own measurement.
    assert repeat["status"] == "ok", repeat.get("reason")
    assert repeat.get("compile_s") is None and "compile_energy_j" not in repeat and "artifacts_path" not in repeat
    assert repeat["warm_start_s"] > repeat["extra"]["warm_start"]["first_call_s"] > 0
    assert repeat["extra"]["warm_start_from"] == 41 and "warm_start_error" not in repeat["extra"]
    assert repeat["extra"]["warm_start"]["kernels_built"] == 0
    assert_compiled_from_caches(repeat["extra"]["compile_caches"], repeat["extra"].get("compile_cache_bypasses"),
                                entries["inductor"])
    assert repeat["energy_j_per_inference"] > 0 and repeat["window_s"] > 0
    assert repeat["max_rel_error"] == cold["max_rel_error"] and repeat["graph_breaks"] == cold["graph_breaks"]


HOOK_START = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
from joulepilot.runtime import compile as jp_compile
from tests.block_models import block_stack

model, (x,) = block_stack(2)
started = time.perf_counter()
compiled = jp_compile(model, policy=sys.argv[1], db=sys.argv[2])
compiled(x)
print(json.dumps({"start_s": time.perf_counter() - started, "details": compiled.decision.details,
                  "frames": counters["frames"]["total"], "block": compiled.regional.name}, default=str))
"""


def test_regional_artifacts_warm_start_a_worker_and_the_hook_with_nothing_built(tmp_path, monkeypatch):
    """One cold regional compile with precompile on, saved where the hook looks: a warm-start worker loads the
    kernels and frames and builds nothing, and a serving process starts the decided configuration from them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from joulepilot.compiler import artifact_path_for, workload_id
    from joulepilot.compiler.provenance import device_name
    from joulepilot.policies import Decision, load_policy, torch_minor, write_lock

    home = tmp_path / "home"
    monkeypatch.setenv("JOULEPILOT_HOME", str(home))
    policy_path = tmp_path / "stack.toml"
    policy_path.write_text(f'name = "stack"\nworkload = "{SPEC}"\nbatch_size = 2\n[search]\nregional = [false, true]\n'
                           '[fallback]\nmode = "eager"\n')
    policy = load_policy(policy_path)
    config = CompileConfig("default", regional=True, batch_size=2)
    wid = workload_id(SPEC, 2)
    artifacts = artifact_path_for(wid, config.id, device_name("cpu"))  # where the hook looks
    job = {"kind": "bench", "spec": SPEC, "device": "cpu", "config": config.to_row(), "min_seconds": 0.2,
           "latency_s": 0.2, "warmup_max_s": 0.3, "precompile": True, "artifacts_path": str(artifacts)}
    cold, warm = cold_then_warm(job)
    saved = cold["extra"]["artifacts"]
    assert cold["extra"]["regional"]["instances"] == 4 and cold["extra"]["dynamo_frames_first_call"] == 1
    assert saved["entries"]["inductor"] == 1 and saved["entries"]["aot_autograd"] == 1
    assert saved["kernels"] > 0 and kernels_path(artifacts).is_file()
    assert warm["status"] == "ok", warm.get("reason")
    # unpacked, but for the host's vector-instruction test programs, copied into the job's cache beforehand
    assert 0 < warm["artifacts"]["kernels"] <= saved["kernels"]
    assert warm["kernels_built"] == 0  # every C++ kernel came from the packed binaries
    assert "inductor_codegen_s" not in warm["compile_timers_s"]  # and no code was generated
    if precompile_available():
        assert saved["precompile"] and warm["artifacts"]["precompile"]
        assert warm["dynamo_frames"] == 0  # the precompiled frames were installed: nothing traced
    else:
        assert_compiled_from_caches(warm["caches"], warm["cache_bypasses"], 1)
    assert warm["warm_start_s"] == pytest.approx(warm["artifacts_load_s"] + warm["apply_s"] + warm["first_call_s"])
    # how much faster it starts is measured by benchmarks/ on a quiet machine, not asserted on a shared one
    assert warm["max_rel_error"] == cold["max_rel_error"]  # the same compiled code, the same inputs

    write_lock(policy_path, Decision(
        policy=policy.name, policy_hash=policy.hash, device_kind="cpu", torch_version=torch_minor(), workload=SPEC,
        workload_id=wid, config=config.to_row(), state="verified", reason="test", objective="energy",
        expected_inferences=1000))

    # The serving process opts in to the precompiled frames, as it must: precompile is off by default.
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "serving-cache"),
               PYTHONPATH=str(Path(__file__).parent.parent), JOULEPILOT_PRECOMPILE="1")
    out = subprocess.run([sys.executable, "-c", HOOK_START, str(policy_path), str(tmp_path / "none.db")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    served = json.loads(out.stdout.strip().splitlines()[-1])
    assert served["block"] == "Block"
    assert served["details"]["artifacts_loaded"] is True
    assert served["details"]["artifacts"]["kernels"] == cold["extra"]["artifacts"]["kernels"] > 0
    if precompile_available():
        assert served["frames"] == 0  # the saved frames were installed; nothing was traced
