"""A report's baselines are medians over runs of one energy source: the deployment's own when the baseline has runs
of it, so a RAPL deployment is compared with the RAPL benchmarks although estimated runs of the same baselines
exist on the same device kind (not "rapl+estimate" and "not like for like"); else the most trustworthy source's,
never a mix."""

from __future__ import annotations

import json
import time

import pytest
from bill_factories import WID, store_run
from joulepilot.compiler import CompileConfig
from joulepilot.controller.report import build_report, build_summary, render
from joulepilot.store import open_db
from joulepilot.store.deployments import insert_samples, register_deployment

RAPL_J = {"eager": 0.02, "default": 0.01}  # what the RAPL benchmarks measured per call
ESTIMATE_J = {"eager": 0.09, "default": 0.08}  # estimated runs of the same configurations: another meter
SERVED_J = 0.005


def _store(path, deployment_source: str, *, with_rapl: bool = True):
    db = open_db(path)
    for mode in ("eager", "default"):
        for _ in range(2 if with_rapl else 0):
            store_run(db, mode, "fp32", RAPL_J[mode], source="rapl")
        for _ in range(3):  # more estimated runs than measured ones: a median over both would be an estimate's
            store_run(db, mode, "fp32", ESTIMATE_J[mode], source="estimate")
        store_run(db, mode, "fp32", 0.5, source="nvml", device="cuda:0", device_name="NVIDIA H200")  # other kind
    served = CompileConfig("default", precision="bf16", batch_size=8)
    dep = register_deployment(db, "svc-dep", workload_id=WID, config_id=served.id, host_id="test-host", device="cpu",
                              details={"device_kind": "cpu", "energy_source": deployment_source, "batch_size": 8})
    t = time.time() - 100
    insert_samples(db, dep, [{"t_start": t + 5 * i, "t_end": t + 5 * (i + 1), "energy_j": 50.0,
                              "inferences": round(50.0 / SERVED_J), "avg_power_w": 10.0, "peak_power_w": 12.0,
                              "energy_source": deployment_source, "config_id": served.id} for i in range(4)])
    return db


@pytest.mark.parametrize("deployment_source", ["rapl", "estimate"])
def test_the_baselines_are_medians_of_the_deployments_own_source(tmp_path, deployment_source):
    db = _store(tmp_path / "j.db", deployment_source)
    report = build_report(db, "svc-dep")
    own = RAPL_J if deployment_source == "rapl" else ESTIMATE_J
    other = "estimate" if deployment_source == "rapl" else "rapl"
    for key, mode in (("eager_fp32", "eager"), ("compile_default_fp32", "default")):
        b = report.baselines[key]
        assert b.energy_source == deployment_source and b.like_for_like is True
        assert b.j_per_inference == pytest.approx(own[mode]) and b.runs == (2 if deployment_source == "rapl" else 3)
        assert b.saving_fraction == pytest.approx(1 - SERVED_J / own[mode]) and b.no_saving_reason is None
        assert b.left_out_runs == {other: 3 if other == "estimate" else 2}
        assert f"metered by {other} not counted" in b.note
    md = render(report, "md")
    assert "not like for like" not in md and "rapl+estimate" not in md and "estimate+rapl" not in md
    data = json.loads(render(report, "json"))["baselines"]["eager_fp32"]
    assert data["energy_source"] == deployment_source and data["left_out_runs"] == {other: report.baselines[
        "eager_fp32"].left_out_runs[other]}
    assert build_summary(db)["deployments"][0]["not_like_for_like"] == []
    db.close()


def test_without_runs_of_its_source_the_most_trustworthy_source_is_shown_alone(tmp_path):
    db = _store(tmp_path / "j.db", "nvml")
    b = build_report(db, "svc-dep").baselines["eager_fp32"]
    # RAPL is measured and outranks the estimate; the NVML run is of another device kind and does not count.
    assert b.energy_source == "rapl" and b.j_per_inference == pytest.approx(RAPL_J["eager"]) and b.runs == 2
    assert b.like_for_like is False and b.saving_fraction is None
    assert "metered by rapl and this deployment by nvml" in b.no_saving_reason
    db.close()

    db = _store(tmp_path / "k.db", "nvml", with_rapl=False)
    b = build_report(db, "svc-dep").baselines["eager_fp32"]
    assert b.energy_source == "estimate" and b.j_per_inference == pytest.approx(ESTIMATE_J["eager"])
    assert b.left_out_runs == {} and b.like_for_like is False
    db.close()
