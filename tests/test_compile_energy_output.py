"""Where users meet compile energy: `bench`'s end line, and `policy explain` (text and JSON) show the GPU
and CPU parts with their sources, and the decision amortises their sum."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from decision_factories import db_file, seed_runs, write_policy
from joulepilot.compiler import CompileConfig
from joulepilot.policies.judge import Rules, Run, run_objective

from joulepilot.cli import main
from joulepilot.cli_bench import _end_line

GPU = "NVIDIA H200"
PARTS = {"compile_energy_gpu_j": 1120.0, "compile_energy_gpu_source": "nvml", "compile_energy_cpu_j": 186.0,
         "compile_energy_cpu_source": "estimate"}
COMPILED = {"energy_j_per_inference": 1.0, "avg_power_w": 300.0, "compile_energy_j": 1306.0, **PARTS}
EAGER = {"energy_j_per_inference": 2.0, "avg_power_w": 300.0}


def test_bench_end_line_names_both_parts_and_their_sources():
    run = {"status": "ok", "device": "cuda:0", "compile_s": 14.2, "latency_ms_p50": 1.5,
           "energy_j_per_inference": 1.0, "energy_source": "nvml", "compile_energy_j": 1306.0, **PARTS}
    line, _warning = _end_line(run)
    assert "compile 14.20 s, 1,306 J (GPU 1,120 J nvml + CPU 186 J estimate)," in line
    old = {**run, "compile_energy_gpu_j": 1306.0, "compile_energy_cpu_j": None, "compile_energy_cpu_source": None}
    assert "(GPU 1,306 J nvml + CPU not metered)" in _end_line(old)[0]


@pytest.fixture
def explained(db, tmp_path):
    seed_runs(db, {("eager", "fp32"): EAGER, ("default", "fp32"): COMPILED}, device_name=GPU)
    policy = write_policy(tmp_path / "policies", limit_w=1000.0)
    runner = CliRunner()
    args = ["policy", "explain", str(policy), "--db", db_file(db), "--device-name", GPU]
    text = runner.invoke(main, args)
    data = runner.invoke(main, [*args, "--json"])
    assert text.exit_code == 0, text.output
    assert data.exit_code == 0, data.output
    return text.stdout, json.loads(data.stdout)


def test_policy_explain_shows_the_applied_configurations_compile_energy_parts(explained):
    text, data = explained
    assert data["config"]["id"] == CompileConfig("default", batch_size=8).id
    assert "compile    1,306 J (GPU 1,120 J nvml + CPU 186 J estimate)" in text
    (chosen,) = [c for c in data["candidates"] if c["config"]["id"] == data["config"]["id"]]
    assert {k: chosen["figures"][k] for k in PARTS} == PARTS
    assert {k: data["measured"][k] for k in PARTS} == PARTS


def test_the_decision_and_the_search_amortise_the_sum_of_both_parts(explained):
    _text, data = explained
    (chosen,) = [c for c in data["candidates"] if c["config"]["id"] == data["config"]["id"]]
    total = PARTS["compile_energy_gpu_j"] + PARTS["compile_energy_cpu_j"]
    n = data["expected_inferences"]
    assert chosen["amortised_energy_j"] == pytest.approx(COMPILED["energy_j_per_inference"] + total / n)
    assert data["break_even_inferences"] == pytest.approx(
        total / (EAGER["energy_j_per_inference"] - COMPILED["energy_j_per_inference"]))
    obs = Run.from_row({"status": "ok", "started_at": 0.0, "finished_at": 30.0, **COMPILED})
    assert run_objective(obs, chosen["config"], Rules(objective="energy", expected_inferences=n)) == \
        pytest.approx(COMPILED["energy_j_per_inference"] + total / n)
