"""The trade-off model predicts compile energy (GPU + CPU) directly, learning it only from runs that metered
both parts; the guided search's forecast and the resolver amortise that prediction, and fall back to
compile seconds x average power where the model could not learn it.

Data: the synthetic sweep (GPU runs stored before the CPU part was metered), and the same sweep with a CPU
part added to each compiled run as if the worker had metered it (RAPL at CPU_COMPILE_W while compiling)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

import pytest
from joulepilot.compiler.config import CompileConfig
from joulepilot.controller import fit
from joulepilot.controller.search_forecast import Arm, Forecaster
from joulepilot.policies import resolve
from joulepilot.policies.judge import Rules
from joulepilot.store import import_runs, list_runs, read_export
from test_resolver_replay import _cases, _policy

SWEEP = Path(__file__).parent / "data" / "synthetic_sweep.json"
CPU_COMPILE_W = 60.0


def _with_cpu_parts(records: list[dict], *, spec: str | None = None, source: str = "rapl") -> list[dict]:
    """The records with the compile window's CPU part metered (for workload `spec` only, when given); the
    others keep the shape of an export from before the parts existed."""
    out = []
    for rec in records:
        run = dict(rec["run"])
        if run.get("compile_energy_j") is not None and (spec is None or rec["workload"]["spec"] == spec):
            gpu_j, cpu_j = run["compile_energy_j"], run["compile_s"] * CPU_COMPILE_W
            run.update(compile_energy_gpu_j=gpu_j, compile_energy_gpu_source="nvml", compile_energy_cpu_j=cpu_j,
                       compile_energy_cpu_source=source, compile_energy_j=gpu_j + cpu_j)
        out.append({**rec, "run": run})
    return out


@pytest.fixture
def metered(db):
    import_runs(db, _with_cpu_parts(read_export(SWEEP)))
    return db


def test_gpu_only_compile_energy_is_not_learnt_and_the_model_says_so(db):
    import_runs(db, read_export(SWEEP))
    model = fit(db)
    assert "compile_energy_j" not in model.forests
    assert "both parts" in model.summary()["not_learnt"]["compile_energy_j"]
    row = next(iter(db.query("SELECT * FROM workloads LIMIT 1")))
    assert "compile_energy_j" not in model.predict(row, CompileConfig("default", precision="bf16"), "NVIDIA H200")


def test_the_model_learns_compile_energy_from_runs_with_both_parts(metered):
    model = fit(metered)
    runs = list_runs(metered, status="ok")
    assert model.n_samples["compile_energy_j"] == sum(r["compile_energy_j"] is not None for r in runs)
    assert model.summary()["compile_energy_cpu_sources"] == {"rapl": model.n_samples["compile_energy_j"]}
    assert "compile_energy_j" not in model.summary()["not_learnt"]
    # A measured compiled configuration: the prediction follows its GPU + CPU joules, not the GPU's alone.
    run = max((r for r in runs if r["mode"] != "eager"), key=lambda r: r["compile_s"])
    same = [r for r in runs if r["config_id"] == run["config_id"] and r["workload_id"] == run["workload_id"]]
    measured_j = statistics.median(r["compile_energy_j"] for r in same)
    gpu_j = statistics.median(r["compile_energy_gpu_j"] for r in same)
    workload = next(iter(metered.query("SELECT * FROM workloads WHERE id = ?", [run["workload_id"]])))
    predicted_j, std_j = model.predict(workload, run, run["device_name"])["compile_energy_j"]
    assert predicted_j == pytest.approx(measured_j, rel=0.25)
    assert predicted_j > gpu_j * 1.05 and std_j >= 0
    eager = model.predict(workload, {**run, "mode": "eager"}, run["device_name"])["compile_energy_j"][0]
    assert eager < predicted_j / 10


def test_runs_without_their_cpu_part_are_left_out_of_the_compile_energy_target(db):
    records = read_export(SWEEP)
    spec = records[0]["workload"]["spec"]
    import_runs(db, _with_cpu_parts(records, spec=spec, source="estimate"))
    model = fit(db)
    complete = [r for r in list_runs(db, status="ok") if r["compile_energy_cpu_j"] is not None]
    assert complete and {r["workload"] for r in complete} == {spec}
    assert model.n_samples["compile_energy_j"] == len(complete) < model.n_samples["energy_j_per_inference"]
    assert model.summary()["compile_energy_cpu_sources"] == {"estimate": len(complete)}


def _forecast_mean(raw: dict[str, tuple[float, float]], expected_inferences: int) -> float:
    config = {"id": "c", "label": "default/fp32/b8", "mode": "default", "precision": "fp32", "batch_size": 8}
    arm = Arm(config=config, raw=raw)
    return Forecaster({arm.id: arm}, Rules(expected_inferences=expected_inferences)).forecast(arm).mean


def test_the_forecast_amortises_the_predicted_compile_energy_and_falls_back_without_it():
    raw = {"energy_j_per_inference": (1.0, 0.05), "avg_power_w": (300.0, 15.0), "compile_s": (10.0, 0.5),
           "latency_ms_p95": (5.0, 0.25)}
    n = 1000
    predicted = {**raw, "compile_energy_j": (4500.0, 200.0)}
    assert _forecast_mean(predicted, n) == pytest.approx(1.0 + 4500.0 / n)
    assert _forecast_mean(raw, n) == pytest.approx(1.0 + 10.0 * 300.0 / n)  # seconds x power, as before


def test_the_resolver_amortises_the_predicted_compile_energy(metered):
    row, kind, tv, runs = next(_cases(metered))
    target = next(r for r in runs if r["mode"] != "eager")
    model = fit(metered)
    metered.execute("DELETE FROM runs WHERE config_id = ? AND workload_id = ?", [target["config_id"], row["id"]])
    policy = _policy(row, runs)
    policy = dataclasses.replace(policy, search=dataclasses.replace(
        policy.search, modes=(target["mode"],), precisions=(target["precision"],), fusion=(target["fusion"],)))

    (cand,) = resolve(policy, metered, kind, model, torch_version=tv).candidates

    assert cand.source == "predicted"
    energy, compile_j = cand.predicted["energy_j_per_inference"][0], cand.predicted["compile_energy_j"][0]
    seconds_x_power = cand.predicted["compile_s"][0] * cand.predicted["avg_power_w"][0]
    assert not math.isclose(compile_j, seconds_x_power, rel_tol=0.05)  # the two really differ here
    assert cand.amortised_energy_j == pytest.approx(energy + compile_j / policy.objective.expected_inferences)
