"""Power envelopes over repeats: average power on the upper end of its median's interval, `[limits]
margin_pct`, and the `infeasible` state when nothing measured fits (the lowest-power configuration that
meets the other limits, with the shortfall), applied by the hook and stated by the report. Real SQLite;
nothing is compiled (the infeasible choice is eager fp32)."""

from __future__ import annotations

import time

import pytest
import torch
from decision_factories import config, db_file, seed_runs, write_policy
from joulepilot.controller.report import build_report, render
from joulepilot.policies import PolicyError, decide, load_policy, resolve, validate
from joulepilot.runtime import compile as jp_compile
from joulepilot.store import open_db, upsert_devices, upsert_host
from joulepilot.store.deployments import insert_samples, register_deployment

EAGER32, EAGER16, DEF32, DEF16 = ("eager", "fp32"), ("eager", "bf16"), ("default", "fp32"), ("default", "bf16")


def _seed(db, series):
    for i in range(max(len(v) for v in series.values())):
        seed_runs(db, {key: runs[i] for key, runs in series.items() if i < len(runs)})


def _cand(decision, key):
    return next(c for c in decision.candidates if c.config_id == config(*key).id)


def _policy(tmp_path, limit_w, **limits):
    path = write_policy(tmp_path / "policies", limit_w=limit_w)
    if limits:
        text = path.read_text().replace("[search]", "".join(f"{k} = {v}\n" for k, v in limits.items()) + "[search]")
        path.write_text(text)
    return load_policy(path)


def test_average_power_is_checked_on_the_upper_bound(tmp_path, db):
    # eager bf16: median 100 W under the 110 W limit, but noisy (80..120 W), so its upper bound is over.
    # Its newest run reads 100 W: the latest run alone would have passed.
    _seed(db, {EAGER16: [{"energy_j_per_inference": 0.5, "avg_power_w": w} for w in (80.0, 120.0, 100.0)],
               EAGER32: [{"energy_j_per_inference": 1.0, "avg_power_w": w} for w in (60.0, 61.0, 62.0)]})
    decision = resolve(_policy(tmp_path, 110.0), db, "cpu")
    bf16 = _cand(decision, EAGER16)
    assert bf16.figures["avg_power_w"] < 110.0 < bf16.avg_power_w_high
    assert bf16.status == "rejected" and any(r.startswith("max_avg_power_w:") and "upper bound" in r
                                             for r in bf16.reasons)
    assert decision.state == "verified" and decision.config_id == config(*EAGER32).id


def test_margin_pct_holds_every_limit_below_its_value(tmp_path, db):
    _seed(db, {EAGER16: [{"energy_j_per_inference": 0.5, "avg_power_w": w} for w in (90.0, 90.5, 91.0)],
               EAGER32: [{"energy_j_per_inference": 1.0, "avg_power_w": w} for w in (60.0, 61.0, 62.0)]})
    assert resolve(_policy(tmp_path, 100.0), db, "cpu").config_id == config(*EAGER16).id
    decision = resolve(_policy(tmp_path, 100.0, margin_pct=15), db, "cpu")
    bf16 = _cand(decision, EAGER16)
    assert bf16.status == "rejected" and any("less the 15% margin" in r for r in bf16.reasons)
    assert decision.config_id == config(*EAGER32).id


@pytest.mark.parametrize("value", [60, -1, "true", '"5"', "nan"])
def test_margin_pct_must_be_a_number_from_0_to_50(tmp_path, value):
    path = tmp_path / "p.toml"
    path.write_text(f'name = "p"\nworkload = "mlp"\nbatch_size = 8\n[limits]\nmargin_pct = {value}\n')
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "limits.margin_pct" in message
    assert validate({"name": "p", "workload": "mlp", "batch_size": 8,
                     "limits": {"margin_pct": 12.5}}).limits.margin_pct == 12.5


def _infeasible_store(db):
    """Every configuration over the 0.5 W envelope; eager bf16 draws least but breaks the error limit,
    so eager fp32 is the lowest-power one that meets the other limits."""
    _seed(db, {EAGER16: [{"energy_j_per_inference": 0.3, "avg_power_w": w, "max_rel_error": 0.5} for w in (0.60,) * 3],
               EAGER32: [{"energy_j_per_inference": 1.0, "avg_power_w": w} for w in (0.70, 0.71, 0.72)],
               DEF32: [{"energy_j_per_inference": 0.8, "avg_power_w": w} for w in (0.90, 0.91, 0.92)],
               DEF16: [{"energy_j_per_inference": 0.4, "avg_power_w": w} for w in (1.00, 1.01, 1.02)]})


def test_nothing_fits_the_envelope_the_lowest_power_config_is_infeasible(tmp_path, db):
    _infeasible_store(db)
    policy = _policy(tmp_path, 0.5, max_rel_error=0.01)
    decision = resolve(policy, db, "cpu")
    chosen = _cand(decision, EAGER32)
    assert decision.state == "infeasible" and decision.config_id == chosen.config_id
    excess = chosen.avg_power_w_high / 0.5 - 1
    shortfall = f"exceeds 0.5 W by {excess:.0%}"
    assert "the power envelope cannot be met" in decision.reason and shortfall in decision.reason
    assert decision.confidence.startswith("lowest measured average power") and shortfall in decision.confidence
    assert _cand(decision, EAGER16).status == "rejected"  # lower power, but over the error limit


def test_nothing_measured_still_applies_the_fallback(tmp_path, db):
    decision = resolve(_policy(tmp_path, 0.5), db, "cpu")
    assert decision.state == "fallback" and decision.config_id == config(*EAGER32).id


def test_infeasible_is_applied_by_the_hook_and_stated_by_the_report(tmp_path, db):
    _infeasible_store(db)
    policy = _policy(tmp_path, 0.5, max_rel_error=0.01)
    decided = decide(db, policy, "cpu", lock=False)
    assert decided.decision.state == "infeasible"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    served = jp_compile(model, policy=policy.path, db=db_file(db))
    assert served.decision.state == "infeasible" and served.decision.source == "store"
    assert served.decision.id == decided.decision.id and served.decision.config_id == config(*EAGER32).id
    assert served(torch.randn(8, 16)).dtype == torch.float32

    host = upsert_host(db)
    upsert_devices(db, host, [{"id": "cpu:0", "kind": "cpu", "name": "some cpu", "source": "estimate"}])
    dep = register_deployment(db, "svc-live", policy=policy.name, workload_id=decided.decision.workload_id,
                              config_id=decided.decision.config_id, host_id=host, device="cpu")
    now = time.time()
    insert_samples(db, dep, [{"t_start": now, "t_end": now + 1, "energy_j": 0.7, "inferences": 10,
                              "avg_power_w": 0.7, "peak_power_w": 0.8, "energy_source": "estimate",
                              "config_id": decided.decision.config_id}])
    report = build_report(db, "svc-live")
    statement = report["envelope"]["cannot_be_met"]
    assert statement == f"the envelope cannot be met: {decided.decision.confidence}"
    assert statement in render(report, "md") and statement in render(report, "html")


def test_an_envelope_that_fits_states_nothing(tmp_path, db):
    other = open_db(tmp_path / "other.db")
    _seed(other, {EAGER32: [{"energy_j_per_inference": 1.0, "avg_power_w": 0.2}] * 3})
    decided = decide(other, _policy(tmp_path, 0.5), "cpu", lock=False)
    assert decided.decision.state == "verified"
    host = upsert_host(other)
    dep = register_deployment(other, "fits", policy="svc", workload_id=decided.decision.workload_id,
                              config_id=decided.decision.config_id, host_id=host, device="cpu")
    insert_samples(other, dep, [{"t_start": 1.0, "t_end": 2.0, "energy_j": 0.2, "inferences": 10,
                                 "avg_power_w": 0.2, "peak_power_w": 0.3, "energy_source": "estimate"}])
    assert build_report(other, "fits")["envelope"]["cannot_be_met"] is None
    other.close()


def test_the_report_names_which_figure_says_the_envelope_cannot_be_met_beside_a_deployment_within_it(
        tmp_path, db, monkeypatch):
    """The decision judges benchmark runs by the upper bound of their median; a deployment whose own windows
    average under the limit must not read as a contradiction: the statement names the upper bound and the
    median it rests on, and says this deployment's average is within the limit."""
    _infeasible_store(db)
    policy = _policy(tmp_path, 0.5, max_rel_error=0.01)
    monkeypatch.setenv("JOULEPILOT_POLICIES", str(tmp_path / "policies"))  # where the report reads the limits
    decided = decide(db, policy, "cpu", lock=False)
    assert decided.decision.state == "infeasible"
    assert "(the upper bound of its 3 runs, whose median is" in decided.decision.confidence
    host = upsert_host(db)
    upsert_devices(db, host, [{"id": "cpu:0", "kind": "cpu", "name": "some cpu", "source": "estimate"}])
    dep = register_deployment(db, "calm", policy=policy.name, workload_id=decided.decision.workload_id,
                              config_id=decided.decision.config_id, host_id=host, device="cpu")
    insert_samples(db, dep, [{"t_start": 1.0, "t_end": 2.0, "energy_j": 0.4, "inferences": 10, "avg_power_w": 0.4,
                              "peak_power_w": 0.45, "energy_source": "estimate",
                              "config_id": decided.decision.config_id}])
    report = build_report(db, "calm")
    statement = report["envelope"]["cannot_be_met"]
    assert report["totals"]["avg_power_w"] == pytest.approx(0.4)
    assert statement == (f"the envelope cannot be met: {decided.decision.confidence}; this deployment's own average "
                         f"power, estimated 0.4 W (ESTIMATE, not measured) over its windows, is within the 0.5 W "
                         f"limit: the decision judges the benchmark's runs by the upper bound of their median, "
                         f"which is over it")
    shown = "is within the 0.5 W limit: the decision judges the benchmark"
    assert shown in render(report, "md") and shown in render(report, "html")
