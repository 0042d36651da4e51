"""The trade-off model learns generation runs on their own features and targets, apart from forward passes."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.compiler.generation_workloads import Generation
from joulepilot.controller import cross_validate, fit
from joulepilot.controller.tradeoff import GENERATION_TARGETS
from joulepilot.store import import_runs, insert_run, read_export, upsert_config, upsert_host, upsert_workload

SWEEP = Path(__file__).parent / "data" / "synthetic_sweep.json"
KIND = "NVIDIA H200"


def _generation_runs(db, spec: str, params: int, scale: float) -> dict:
    """Eager and a static-cache compile of one causal LM at batch 1 and 8: J per token falls with the batch and
    with compiling, as measured on the H200."""
    upsert_host(db, {"id": "host", "hostname": "gpu"})
    rows = {}
    for batch in (1, 8):
        generation = Generation(512, 256)
        wid = upsert_workload(db, {"id": workload_id(spec, batch, generation=generation), "spec": spec,
                                   "batch_size": batch, "params": params, "task": "generate", "prompt_len": 512,
                                   "new_tokens": 256})
        rows[batch] = wid
        for config, per_token, tpot in ((CompileConfig("eager", precision="bf16", batch_size=batch), 2.4, 14.4),
                                        (CompileConfig("reduce-overhead", precision="bf16", cache="static",
                                                       batch_size=batch), 0.6, 3.0)):
            upsert_config(db, config.to_row())
            for repeat in range(2):
                start = time.time() - 1000 + repeat
                insert_run(db, {"workload_id": wid, "config_id": config.id, "host_id": "host", "device": "cuda:0",
                                "device_name": KIND, "status": "ok", "started_at": start, "finished_at": start + 60,
                                "energy_j_per_token": scale * per_token / batch ** 0.8, "tpot_ms_p50": tpot,
                                "tpot_ms_p95": tpot * 1.1, "ttft_ms_p50": 20.0 * scale,
                                "energy_j_per_inference": scale * per_token * 256 * batch ** 0.2,
                                "latency_ms_p95": tpot * 256, "avg_power_w": 150.0 + 30 * batch ** 0.5,
                                "compile_s": 15.0 if config.compiles else 0.0, "energy_source": "nvml",
                                "torch_version": "2.11.0"})
    return rows


def test_generation_runs_never_reach_the_forward_model(db, tmp_path):
    import_runs(db, read_export(SWEEP))
    forward = fit(db)
    row = next(iter(db.query("SELECT * FROM workloads WHERE spec = 'torchvision:resnet50'")))
    config = CompileConfig("default", precision="bf16", batch_size=32)
    before = forward.predict(row, config, KIND)
    assert forward.generation is None

    _generation_runs(db, "transformers:LlamaConfig", 800_000_000, 1.0)
    _generation_runs(db, "transformers:Qwen2Config", 980_000_000, 1.2)
    both = fit(db)
    assert both.predict(row, config, KIND) == before  # the forward forests are the same forests
    assert both.n_samples == forward.n_samples
    generation = both.generation
    assert generation is not None and set(generation.forests) == set(GENERATION_TARGETS) - {"compile_energy_j"}
    assert "log2_cache_positions" in generation.space.names and "static_cache" in generation.space.names
    assert not any(name.startswith("op:") for name in generation.space.names)


def test_a_generation_workload_is_predicted_in_its_own_units(db):
    rows = _generation_runs(db, "transformers:LlamaConfig", 800_000_000, 1.0)
    _generation_runs(db, "transformers:Qwen2Config", 980_000_000, 1.2)
    model = fit(db)
    assert model.forests == {}  # no forward pass measured: nothing learnt for one
    workload = next(iter(db.query("SELECT * FROM workloads WHERE id = ?", [rows[8]])))
    eager, static = model.predict_many(workload, [CompileConfig("eager", precision="bf16", batch_size=8),
                                                  CompileConfig("reduce-overhead", precision="bf16", cache="static",
                                                                batch_size=8)], KIND)
    assert "energy_j_per_inference" not in eager and "latency_ms_p95" not in eager
    for pred in (eager, static):
        assert all(math.isfinite(mean) and std >= 0 for mean, std in pred.values())
    assert static["energy_j_per_token"][0] < eager["energy_j_per_token"][0]
    assert static["tpot_ms_p50"][0] < eager["tpot_ms_p50"][0]
    # a forward workload gets nothing from a model that learnt only generations
    assert model.predict_many({"spec": "mlp", "batch_size": 8}, [CompileConfig("eager")], KIND) == [{}]
    scores = cross_validate(db)
    assert "generate:energy_j_per_token" in scores and "energy_j_per_inference" not in scores
    assert scores["generate:energy_j_per_token"]["workloads"] == 2



def test_the_frontier_of_a_generation_is_time_per_token_against_joules_per_token(db, tmp_path):
    from click.testing import CliRunner
    from joulepilot.controller import frontier

    from joulepilot.cli import main

    _generation_runs(db, "transformers:LlamaConfig", 800_000_000, 1.0)
    _generation_runs(db, "transformers:Qwen2Config", 980_000_000, 1.2)
    result = frontier(db, "transformers:LlamaConfig", device_name=KIND, batch_size=1)
    assert result["task"] == "generate" and result["axes"] == {"x": "tpot_ms_p50", "y": "energy_j_per_token"}
    measured = {p["label"]: p for p in result["points"] if p["source"] == "measured"}
    static = measured["reduce-overhead/static-cache/bf16/b1"]
    assert static["energy_j_per_token"] == pytest.approx(0.6) and static["tpot_ms_p50"] == 3.0
    assert static["ttft_ms_p50"] == 20.0 and static["tpot_ms_p95"] == pytest.approx(3.3)
    assert result["frontier"] == ["reduce-overhead/static-cache/bf16/b1"]  # faster and cheaper per token
    path = tmp_path / "f.db"
    db.conn.execute("VACUUM INTO ?", [str(path)])
    out = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["frontier", "transformers:LlamaConfig", "--db", str(path),
                                                         "--batch-size", "1", "--no-predict"])
    assert out.exit_code == 0, out.output
    assert "time per output token against J per generated token" in out.stdout
    header = out.stdout.splitlines()[1]
    assert "TPOT ms" in header and "J/token" in header and "TTFT ms" in header
