"""The trade-off regression on the synthetic sweep: fit, grouped cross-validation, uncertainty, frontier."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.compiler.config import CompileConfig
from joulepilot.controller import (
    TARGETS,
    TradeoffError,
    cross_validate,
    fit,
    frontier,
    pareto_front,
    plot_frontier,
)
from joulepilot.store import import_runs, read_export

from joulepilot.cli import main

SWEEP = Path(__file__).parent / "data" / "synthetic_sweep.json"
# The sweep's runs predate the CPU part of compile energy (GPU part only), so compile energy is not learnt
# from them (tests/test_compile_energy_model.py covers it); every other target is.
SWEEP_TARGETS = set(TARGETS) - {"compile_energy_j"}


@pytest.fixture
def sweep(db):
    import_runs(db, read_export(SWEEP))
    return db


def test_fit_predicts_every_target_with_finite_uncertainty(sweep):
    model = fit(sweep)
    assert set(model.forests) == SWEEP_TARGETS
    row = next(iter(sweep.query("SELECT * FROM workloads WHERE spec = 'torchvision:resnet50'")))
    eager = model.predict(row, CompileConfig("eager", batch_size=32), "NVIDIA H200")
    bf16 = model.predict(row, CompileConfig("default", precision="bf16", batch_size=32), "NVIDIA H200")
    for pred in (eager, bf16):
        assert set(pred) == SWEEP_TARGETS
        for mean, std in pred.values():
            assert math.isfinite(mean) and math.isfinite(std) and std >= 0 and mean >= 0
    # what the data says: compiled bf16 spends less energy and power than eager fp32, and takes longer to compile
    assert bf16["energy_j_per_inference"][0] < eager["energy_j_per_inference"][0]
    assert bf16["avg_power_w"][0] < eager["avg_power_w"][0]
    assert bf16["compile_s"][0] > eager["compile_s"][0] + 10


def test_unseen_device_and_knob_values_still_predict(sweep):
    model = fit(sweep)
    row = next(iter(sweep.query("SELECT * FROM workloads LIMIT 1")))
    pred = model.predict(row, {"mode": "max-autotune", "fusion": "coordinate-descent", "precision": "fp16",
                               "dynamic": 1}, "Some Other GPU")
    assert all(math.isfinite(m) for m, _ in pred.values())


def test_grouped_cross_validation_holds_out_whole_workloads(sweep):
    scores = cross_validate(sweep)
    assert set(scores) == SWEEP_TARGETS
    for target, m in scores.items():
        assert m["workloads"] == 4 and m["folds"] == 4 and m["n"] == 56
        assert 0 <= m["mape"] < 1.0, target  # within a factor of two on workloads it never saw
        assert m["r2_log"] is not None and m["r2_log"] > 0.5, target


def test_cross_validation_needs_two_workloads(db):
    records = [r for r in read_export(SWEEP) if r["workload"]["spec"] == "torchvision:resnet50"]
    import_runs(db, records)
    fit(db)  # one workload is enough to fit
    with pytest.raises(TradeoffError, match="at least 2 benchmarked workloads"):
        cross_validate(db)


def test_fit_with_no_runs_says_what_to_run(db):
    with pytest.raises(TradeoffError, match="joulepilot bench"):
        fit(db)


def test_pareto_front():
    points = [{"latency_ms_p95": 1, "energy_j_per_inference": 5}, {"latency_ms_p95": 2, "energy_j_per_inference": 3},
              {"latency_ms_p95": 3, "energy_j_per_inference": 4}, {"latency_ms_p95": 4, "energy_j_per_inference": 1}]
    assert pareto_front(points) == [0, 1, 3]


def test_frontier_separates_measured_and_predicted(sweep, tmp_path):
    sweep.execute("DELETE FROM runs WHERE config_id = ?", [CompileConfig("default", precision="bf16", batch_size=32).id])
    result = frontier(sweep, "torchvision:resnet50")
    assert result["device_kind"] == "NVIDIA H200" and result["batch_size"] == 32
    sources = {p["label"]: p["source"] for p in result["points"]}
    assert sources["default/bf16/b32"] == "predicted"
    assert sources["eager/fp32/b32"] == "measured"
    assert all(p["source"] == "measured" for p in result["points"] if p["measured_pareto"])
    assert set(result["measured_frontier"]) and set(result["frontier"])
    predicted = [p for p in result["points"] if p["source"] == "predicted"]
    assert all(p["energy_j_per_inference_std"] >= 0 for p in predicted)
    png = plot_frontier(result, tmp_path / "frontier.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_fit_and_frontier(sweep, tmp_path):
    db_path = sweep.execute("PRAGMA database_list").fetchone()[2]
    runner = CliRunner()
    out = runner.invoke(main, ["fit", "--db", db_path])
    assert out.exit_code == 0, out.output
    assert "MAPE %" in out.output and "energy_j_per_inference" in out.output
    data = json.loads(runner.invoke(main, ["fit", "--db", db_path, "--json"]).output)
    assert set(data["cross_validation"]) == SWEEP_TARGETS
    png = tmp_path / "f.png"
    out = runner.invoke(main, ["frontier", "transformers:BertConfig", "--db", db_path, "--plot", str(png), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["workload"] == "transformers:BertConfig" and png.exists()
    out = runner.invoke(main, ["frontier", "nope", "--db", db_path])
    assert out.exit_code != 0 and "joulepilot bench nope" in out.output
