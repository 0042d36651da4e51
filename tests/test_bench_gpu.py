"""On a CUDA GPU with NVML: measured energy, CUDA graphs, bf16 autocast and a warm start from artifacts."""

from __future__ import annotations

import pytest
from joulepilot.compiler import CompileConfig, bench, load_workload
from joulepilot.store import power_samples


@pytest.mark.gpu
def test_mlp_on_the_gpu(db):
    configs = [CompileConfig(mode="eager", precision="bf16"), CompileConfig(mode="reduce-overhead", precision="bf16")]
    eager, graphs = bench("mlp", configs, device="cuda:0", min_seconds=1.0, db=db, batch_size=64, budget_s=300)
    for run in (eager, graphs):
        assert run["status"] == "ok", run.get("reason")
        assert run["energy_source"] == "nvml"
        assert run["avg_power_w"] > 10 and run["peak_power_w"] > 0
        assert run["idle_power_w"] > 0 and run["energy_above_idle_j_per_inference"] >= 0
        assert run["peak_memory_bytes"] > 0 and run["driver_version"]
        assert 0 < run["max_rel_error"] < 0.05  # bf16 against the fp32 reference
        assert power_samples(db, run["run_id"])
    assert graphs["extra"]["torch_compile_kwargs"] == {"dynamic": False, "mode": "reduce-overhead"}
    assert graphs["warm_start_s"] is not None and graphs["warm_start_s"] < graphs["compile_s"]
    warm = graphs["extra"]["warm_start"]
    if warm["artifacts"]["precompile"]:  # Dynamo's precompiled frames were installed: nothing traced again
        assert warm["dynamo_frames"] == 0
    else:
        assert graphs["extra"]["warm_start_caches"].get("fxgraph_cache_hit") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("spec, kwargs", [
    ("transformers:GPT2Config", {"seq_len": 32}),
    ("transformers:ViTConfig", {}),
    ("torchvision:resnet18", {"image_size": 64}),
])
def test_library_adapters_build_on_the_gpu(spec, kwargs):
    pytest.importorskip(spec.split(":")[0])
    wl = load_workload(spec, batch_size=2, device="cuda:0", **kwargs)
    out = wl.model(*wl.example_inputs)
    assert out.shape[0] == 2 and out.is_cuda
    row = wl.describe(graph=False)
    assert row["params"] > 1_000_000 and row["flops_per_inference"] > 0


@pytest.mark.gpu
def test_a_generation_on_the_gpu(db):
    """Eager with the dynamic cache against the static cache compiled with CUDA graphs (transformers' recipe),
    bf16 as the model's dtype: metered by NVML, no recompile between calls, TTFT and TPOT timed per token."""
    from joulepilot.compiler.generation_workloads import Generation

    pytest.importorskip("transformers")
    configs = [CompileConfig("eager", precision="bf16"),
               CompileConfig("reduce-overhead", precision="bf16", cache="static")]
    eager, graphs = bench("tiny-llama", configs, device="cuda:0", min_seconds=1.0, db=db, batch_size=4,
                          budget_s=300, generation=Generation(64, 32))
    for run in (eager, graphs):
        assert run["status"] == "ok", run.get("reason")
        assert run["energy_source"] == "nvml" and run["avg_power_w"] > 10
        assert run["energy_j_per_token"] == pytest.approx(run["energy_j_per_inference"] / (4 * 32))
        assert 0 < run["ttft_ms_p50"] and 0 < run["tpot_ms_p50"] <= run["tpot_ms_p95"]
        assert run["extra"]["generation"]["prefill_energy_source"] == "nvml"
        assert run["max_rel_error"] is not None and run["max_rel_error"] < 0.1
        assert power_samples(db, run["run_id"])
    assert graphs["extra"]["torch_compile_kwargs"] == {"dynamic": False, "mode": "reduce-overhead"}
    assert graphs["recompiles"] == 0 and graphs["graph_breaks"] == 0
