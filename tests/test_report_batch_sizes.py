"""A deployment served at another batch size than its policy's (the batch-size lever): the hook records the
workload it serves, and the report finds the baselines at the policy's batch size and compares per sample
(J per call / batch size on each side), saying so in every format. Real SQLite, a real metered deployment
through `joulepilot.compile`; the decision is eager, so nothing is compiled."""

from __future__ import annotations

import csv
import io
import json
import statistics
import time
import warnings
from typing import Any

import pytest
import torch
from decision_factories import db_file
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.controller.report import build_report, build_summary, render
from joulepilot.controller.report_markdown import md
from joulepilot.policies import decide, load_policy
from joulepilot.runtime import compile as jp_compile
from joulepilot.store import get_deployment
from joulepilot.store.deployments import insert_samples, register_deployment
from test_batch_size_lever import store_repeats

POLICY = ('name = "svc"\nworkload = "mlp"\nbatch_size = 32\n[limits]\nmax_avg_power_w = 70\n'
          '[search]\nmodes = ["eager"]\nprecisions = ["fp32"]\nbatch_sizes = [8, 16]\n[fallback]\nmode = "eager"\n')
NOTE = "compared per sample: served at batch 8, baseline at batch 32"


def _decided(tmp_path: Any, db: Any) -> tuple[Any, Any]:
    """The lever's store: eager fp32 at 8, 16 and 32 and stock compile fp32 at 32 (the two baselines, at the
    policy's batch size), three repeats each. Under 70 W only eager at batch 8 fits, so that is decided."""
    path = tmp_path / "svc.toml"
    path.write_text(POLICY)
    policy = load_policy(path)
    store_repeats(db, policy, [("eager", 8), ("eager", 16), ("eager", 32), ("default", 32)])
    decision = decide(db, policy, "cpu", lock=False).decision
    assert decision.label == "eager/fp32/b8" and decision.workload_id == workload_id("mlp", 32)
    return policy, decision


def _baseline_j_per_call(db: Any, mode: str) -> float:
    cfg = CompileConfig(mode, precision="fp32", batch_size=32)
    rows = db.execute("SELECT energy_j_per_inference FROM runs WHERE config_id = ? AND workload_id = ?",
                      [cfg.id, workload_id("mlp", 32)]).fetchall()
    return statistics.median(r[0] for r in rows)


def _assert_per_sample(db: Any, report: Any) -> None:
    t = report["totals"]
    served_j_per_sample = t["j_per_inference"] / 8
    for key, mode in (("eager_fp32", "eager"), ("compile_default_fp32", "default")):
        b = report["baselines"][key]
        per_call = _baseline_j_per_call(db, mode)
        assert b["measured"] and b["runs"] == 3, b
        assert b["j_per_inference"] == pytest.approx(per_call)  # the baseline's own J per call, at batch 32
        assert (b["batch_size"], b["served_batch_size"], b["unit"]) == (32, 8, "J/sample")
        assert b["j_per_sample"] == pytest.approx(per_call / 32)
        assert b["deployment_j_per_sample"] == pytest.approx(served_j_per_sample)
        assert b["saving_fraction"] == pytest.approx(1 - served_j_per_sample / (per_call / 32))
        # joules saved over the samples served: calls x the served batch size
        assert b["saving_j"] == pytest.approx((per_call / 32 - served_j_per_sample) * t["inferences"] * 8)
        assert NOTE in b["note"]


def test_a_deployment_served_at_the_decided_batch_size_is_compared_per_sample(tmp_path, db):
    policy, decision = _decided(tmp_path, db)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hook says once that it does not change the caller's batch size
        served = jp_compile(model, policy=policy.path, db=db_file(db), deployment="svc-live")
    x = torch.randn(8, 16)
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:
        served(x)
    served.close()

    # What the hook recorded: the configuration decided at batch 8, and the workload it is served as (batch 8's,
    # where that configuration's runs are); the policy's own workload, where the baselines are, in its details.
    dep = get_deployment(db, "svc-live")
    assert dep["config_id"] == decision.config_id
    assert dep["workload_id"] == workload_id("mlp", 8)
    assert dep["details"]["baseline_workload_id"] == workload_id("mlp", 32)
    assert dep["details"]["batch_size"] == 8
    # The policy's [fallback] takes the same calls: a guard that trips swaps to it at the batch size served.
    metered = getattr(served, "metered", served)
    assert metered._fallback.config_id == CompileConfig("eager", precision="fp32", batch_size=8).id

    report = build_report(db, "svc-live")
    assert report["totals"]["inferences"] == served.inferences > 0 and report["totals"]["energy_j"] > 0
    assert report["deployment"]["batch_size"] == 8
    assert report["efficiency"]["flops_per_inference"] == pytest.approx(8e6)  # batch 8's workload row
    _assert_per_sample(db, report)

    # Every renderer labels the unit and says why.
    text = render(report, "md")
    table = next(line for line in text.splitlines() if line.startswith("| eager fp32 |"))
    assert "/sample" in table and md(NOTE) in table
    html = render(report, "html")
    assert "/sample" in html and NOTE in html
    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    figure = {(r["section"], r["metric"]): r for r in rows if r["section"] != "sample"}
    assert figure["baseline.eager_fp32", "j_per_sample"]["unit"] == "J/sample"
    assert float(figure["baseline.eager_fp32", "j_per_sample"]["value"]) == pytest.approx(
        report["baselines"]["eager_fp32"]["j_per_sample"])
    assert figure["baseline.eager_fp32", "saving_fraction"]["unit"] == "fraction per sample"
    assert figure["baseline.eager_fp32", "saving_j"]["unit"] == "J (over calls x 8 samples)"
    as_json = json.loads(render(report, "json"))
    assert as_json["baselines"]["eager_fp32"]["unit"] == "J/sample"
    assert as_json["baselines"]["eager_fp32"]["saving_fraction"] == pytest.approx(
        report["baselines"]["eager_fp32"]["saving_fraction"])

    # The summary's savings are the same per-sample fractions, and say so.
    summary = build_summary(db)
    row = next(r for r in summary["deployments"] if r["name"] == "svc-live")
    assert row["saving_vs_eager_fp32"] == pytest.approx(report["baselines"]["eager_fp32"]["saving_fraction"])
    assert row["per_sample"] == ["eager_fp32", "compile_default_fp32"]
    line = next(line for line in render(summary, "md").splitlines() if line.startswith("| svc-live |"))
    assert line.count(" per sample |") == 2
    assert "eager_fp32+compile_default_fp32" in render(summary, "csv")


def test_a_deployment_recorded_under_the_policys_workload_is_compared_per_sample_too(db, tmp_path):
    """A deployment registered before the hook recorded the served workload: the policy's batch-32 workload with
    the batch-8 configuration. The baselines are at that workload; the served batch size is the configuration's."""
    _policy, decision = _decided(tmp_path, db)
    from joulepilot.store import upsert_host

    dep = register_deployment(db, "svc-old", policy="svc", workload_id=decision.workload_id,
                              config_id=decision.config_id, host_id=upsert_host(db), device="cpu")
    insert_samples(db, dep, [{"t_start": 1.0, "t_end": 2.0, "energy_j": 0.5, "inferences": 10,
                              "avg_power_w": 0.5, "peak_power_w": 0.6, "energy_source": "estimate",
                              "config_id": decision.config_id}])
    report = build_report(db, "svc-old")
    _assert_per_sample(db, report)
    assert report["deployment"]["batch_size"] == 8
    # FLOPs per call of the batch-32 workload row, scaled to the 8 samples of a served call
    assert report["efficiency"]["flops_per_inference"] == pytest.approx(32e6 * 8 / 32)


def test_a_deployment_at_the_policys_batch_size_is_compared_per_call(db, tmp_path):
    """The same store and policy, a deployment serving eager fp32 at the policy's batch size: J per call on both
    sides, as before the lever."""
    _decided(tmp_path, db)
    from joulepilot.store import upsert_host

    eager_32 = CompileConfig("eager", precision="fp32", batch_size=32)
    dep = register_deployment(db, "svc-32", policy="svc", workload_id=workload_id("mlp", 32),
                              config_id=eager_32.id, host_id=upsert_host(db), device="cpu")
    insert_samples(db, dep, [{"t_start": 1.0, "t_end": 2.0, "energy_j": 8.0, "inferences": 10,
                              "avg_power_w": 8.0, "peak_power_w": 9.0, "energy_source": "estimate",
                              "config_id": eager_32.id}])
    stock = build_report(db, "svc-32")["baselines"]["compile_default_fp32"]
    per_call = _baseline_j_per_call(db, "default")
    assert (stock["unit"], stock["batch_size"], stock["served_batch_size"]) == ("J/call", 32, 32)
    assert stock["j_per_sample"] is None and stock["note"] is None
    assert stock["saving_fraction"] == pytest.approx(1 - 0.8 / per_call)
    assert stock["saving_j"] == pytest.approx((per_call - 0.8) * 10)
