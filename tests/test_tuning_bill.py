"""The tuning bill: what measuring cost (metered where a meter read it, the rest a labelled estimate), the
search energy and payback every decision records, `policy explain`'s line, and the zero-saving case."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
from bill_factories import IDLE_W, JOB_WALL_S, WID, runs_of, store_run, write_policy
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig
from joulepilot.controller.report import build_report, build_summary, render
from joulepilot.policies import decide, load_policy, torch_minor
from joulepilot.policies.bill import bill_of, calls_text, duration_text, energy_text, run_cost
from joulepilot.store import open_db, upsert_host
from joulepilot.store.decisions import latest_decision, write_decision
from joulepilot.store.deployments import insert_samples, register_deployment

from joulepilot.cli import main


def expected_cost(run) -> tuple[float, float]:
    """(metered J, estimated J) of a stored ok run, as the README defines them, from its stored figures."""
    metered = run.compile_energy_j + run.energy_j
    loaded_s = run.warmup_s + run.extra["latency_calls"] * run.extra["latency_ms_mean"] / 1000.0
    rest_s = run.extra["job_wall_s"] - run.compile_s - run.window_s - loaded_s
    return metered, loaded_s * run.avg_power_w + rest_s * run.idle_power_w


def test_a_run_is_metered_for_compile_and_window_and_estimated_for_the_rest(db):
    ok_id = store_run(db, "default", "fp32", 0.4)
    bench_id = store_run(db, "eager", "fp32", 0.5, policy=None, job_wall_s=None)  # made by `bench`: no job
    failed_id = store_run(db, "default", "bf16", None, status="failed")
    runs = {r.id: r for r in runs_of(db)}

    metered, estimated = expected_cost(runs[ok_id])
    cost = run_cost(runs[ok_id])
    assert cost.seconds_basis == "job" and cost.seconds == JOB_WALL_S
    assert cost.metered_j == pytest.approx(metered) and cost.metered_source == "rapl"
    assert cost.estimated_j(None) == (pytest.approx(estimated), 0.0)

    bench = run_cost(runs[bench_id])  # no job recorded: the worker's own run, started_at to finished_at
    assert bench.seconds_basis == "run"
    assert bench.seconds == pytest.approx(runs[bench_id].finished_at - runs[bench_id].started_at)

    failed = run_cost(runs[failed_id])  # nothing metered, no idle power of its own
    assert failed.metered_j is None and failed.idle_w is None and failed.idle_s == JOB_WALL_S

    bill = bill_of(runs.values())
    assert bill.runs == 3 and bill.failed_runs == 1
    assert bill.seconds == pytest.approx(sum(run_cost(r).seconds for r in runs.values()))
    assert bill.metered_j == pytest.approx(metered + runs[bench_id].compile_energy_j + runs[bench_id].energy_j)
    # The failed run is priced at the median idle power of the others: all its seconds, never metered.
    assert bill.estimated_j == pytest.approx(estimated + bench.estimated_j(None)[0] + JOB_WALL_S * IDLE_W)
    assert bill.energy_j == pytest.approx(bill.metered_j + bill.estimated_j)
    assert bill.source == "rapl+estimate" and bill.metered_source == "rapl" and bill.unpriced_s == 0


def test_seconds_with_no_power_to_price_them_are_never_guessed(db):
    store_run(db, "default", "bf16", None, status="failed")  # the only run: no idle power anywhere
    bill = bill_of(runs_of(db))
    assert bill.energy_j == 0 and bill.unpriced_s == JOB_WALL_S and bill.source is None
    assert bill.to_dict()["unpriced_s"] == JOB_WALL_S


def _decide(db, policy_file: Path):
    return decide(db, load_policy(policy_file), "cpu", record=True, lock=False).decision


def test_every_decision_records_its_search_energy_and_payback(db, tmp_path):
    figures = {("eager", "fp32"): 0.5, ("default", "fp32"): 0.4, ("eager", "bf16"): 0.3, ("default", "bf16"): 0.2}
    for (mode, precision), j in figures.items():
        store_run(db, mode, precision, j)
    store_run(db, "default", "bf16", 0.21, policy=None, job_wall_s=None)  # a `bench` run of the same workload
    decision = _decide(db, write_policy(tmp_path))
    assert decision.label == CompileConfig("default", precision="bf16", batch_size=8).label

    stored = latest_decision(db, "svc", "cpu")
    bill = stored.details["bill"]
    assert bill == json.loads(json.dumps(decision.bill))  # what the decision holds is what is stored
    search = bill_of(runs_of(db))
    assert bill["search"]["energy_j"] == pytest.approx(search.energy_j)
    assert bill["search"]["metered_j"] == pytest.approx(search.metered_j)
    assert bill["search"]["estimated_j"] == pytest.approx(search.estimated_j)
    assert bill["search"]["source"] == "rapl+estimate" and bill["search"]["runs"] == len(figures) + 1
    assert sorted(bill["search"]["run_ids"]) == sorted(r.id for r in runs_of(db))
    assert bill["daemon_runs"] == len(figures)

    chosen_j = (0.2 + 0.21) / 2  # the median over both runs of the chosen configuration
    assert bill["baseline"]["kind"] == "stock compile default fp32"
    assert bill["baseline"]["energy_j_per_inference"] == pytest.approx(figures[("default", "fp32")])
    assert bill["applied"]["energy_j_per_inference"] == pytest.approx(chosen_j)
    saving = figures[("default", "fp32")] - chosen_j
    assert bill["saving_j_per_inference"] == pytest.approx(saving) and bill["saving_source"] == "rapl"
    assert bill["verdict"] == "pays_back"
    assert bill["payback_inferences"] == pytest.approx(search.energy_j / saving)
    assert bill["payback_source"] == "rapl+estimate"
    assert bill["text"].startswith(f"the search cost {energy_text(search.energy_j)} over {len(figures) + 1} runs, "
                                   f"{duration_text(search.seconds)}: {energy_text(search.metered_j)} in compile "
                                   f"calls and energy windows (rapl), {energy_text(search.estimated_j)} estimated "
                                   f"for the rest of the jobs (estimate);")
    assert bill["text"].endswith(f"at {energy_text(saving)} saved per call against stock compile default fp32 "
                                 f"(rapl, a baseline of one run) it pays back after "
                                 f"{calls_text(search.energy_j / saving)} calls")


def test_baseline_is_eager_fp32_when_stock_compile_is_not_measured(db, tmp_path):
    store_run(db, "eager", "fp32", 0.5)
    store_run(db, "default", "bf16", 0.2)
    bill = _decide(db, write_policy(tmp_path)).bill
    assert bill["baseline"]["kind"] == "eager fp32" and bill["saving_j_per_inference"] == pytest.approx(0.3)
    assert bill["payback_inferences"] == pytest.approx(bill["search"]["energy_j"] / 0.3)
    assert "against eager fp32" in bill["text"]


def test_a_decision_that_saves_nothing_never_pays_back(db, tmp_path):
    # Only the baseline itself is allowed: the decision keeps it, so nothing is saved.
    store_run(db, "default", "fp32", 0.4)
    bill = _decide(db, write_policy(tmp_path, "stock", modes=("default",), precisions=("fp32",))).bill
    assert bill["verdict"] == "never" and bill["payback_inferences"] is None
    assert bill["saving_j_per_inference"] == 0
    assert "it never pays back: the decision keeps the baseline, stock compile default fp32" in bill["text"]

    # A power envelope that rules out the cheaper-per-call baseline: the decision costs more per call.
    store_run(db, "eager", "fp32", 0.5, avg_w=10.0)
    capped = write_policy(tmp_path, "capped", modes=("eager", "default"), precisions=("fp32",),
                          limits="[limits]\nmax_avg_power_w = 15")
    decision = _decide(db, capped)
    assert decision.label == CompileConfig("eager", batch_size=8).label
    assert decision.bill["verdict"] == "never" and decision.bill["payback_inferences"] is None
    assert decision.bill["saving_j_per_inference"] == pytest.approx(-0.1)
    assert f"uses {energy_text(0.1)} more per call than stock compile default fp32" in decision.bill["text"]


def test_a_saving_inside_the_noise_is_no_measurable_saving_not_a_payback(db, tmp_path):
    """Stock compile fp32 and the chosen bf16 differ by 0.5% with runs 2% apart: the saving per call is inside
    the noise of both medians, so no payback is computed on it (it would read billions of calls)."""
    for j in (1.000, 1.010, 0.990):
        store_run(db, "default", "fp32", j)
    for j in (0.995, 1.005, 0.985):
        store_run(db, "default", "bf16", j)
    decision = _decide(db, write_policy(tmp_path))
    assert decision.label == CompileConfig("default", precision="bf16", batch_size=8).label
    bill = decision.bill
    assert bill["verdict"] == "unknown" and bill["no_measurable_saving"] and bill["payback_inferences"] is None
    assert "pays back" not in bill["text"]
    assert bill["text"].endswith(f"; no measurable saving: {decision.label} and stock compile default fp32 use the "
                                 f"same energy per call within the noise of their runs ({energy_text(0.995)} +- "
                                 f"1% against {energy_text(1.0)} +- 1%)")


def test_savings_against_a_baseline_of_one_run_say_so():
    from joulepilot.controller.report_format import versus_baseline

    baseline = {"measured": True, "like_for_like": True, "served_is_baseline": False, "saving_fraction": 0.214,
                "runs": 1, "unit": "J/call"}
    assert versus_baseline(baseline) == "21.4% less (against a baseline of one run)"
    assert versus_baseline({**baseline, "runs": 3}) == "21.4% less"
    assert versus_baseline({**baseline, "served_is_baseline": True}) == "this deployment is the baseline"


def test_payback_is_unknown_without_a_measured_baseline(db, tmp_path):
    store_run(db, "default", "bf16", 0.2)
    bill = _decide(db, write_policy(tmp_path)).bill
    assert bill["verdict"] == "unknown" and bill["baseline"] is None and bill["payback_inferences"] is None
    assert "payback not known: no baseline is measured" in bill["text"]


def test_policy_explain_shows_the_bill(tmp_path, monkeypatch):
    path = tmp_path / "j.db"
    db = open_db(path)
    store_run(db, "default", "fp32", 0.4)
    store_run(db, "default", "bf16", 0.2)
    expected = bill_of(runs_of(db)).energy_j / 0.2
    db.close()
    policy = write_policy(tmp_path)
    monkeypatch.setenv("COLUMNS", "400")  # one line, not wrapped
    text = CliRunner().invoke(main, ["policy", "explain", str(policy), "--db", str(path), "--device-name", "cpu"])
    assert text.exit_code == 0, text.output
    line = next(line for line in text.output.splitlines() if line.startswith("tuning"))
    assert "the search cost" in line and "windows (rapl)" in line and "the rest of the jobs (estimate)" in line
    assert line.endswith(f"it pays back after {calls_text(expected)} calls")

    out = CliRunner().invoke(main, ["policy", "explain", str(policy), "--db", str(path), "--device-name", "cpu",
                                    "--json"])
    data = json.loads(out.output)
    assert data["bill"]["payback_inferences"] == pytest.approx(expected)
    assert data["bill"]["search"]["source"] == "rapl+estimate" and data["bill"]["verdict"] == "pays_back"


# -- deployment reports: when this deployment paid the tuning back --------------------------------------
T0 = 1_700_000_000.0
WINDOW = 5.0


def deploy(db, name: str, policy: str, config: CompileConfig, calls: list[int], *, first_config=None) -> None:
    """A deployment of `config` with one 5-s window per entry of `calls`; `first_config`: one window
    before them serving another configuration (the fallback before the decision)."""
    host = upsert_host(db, {"id": "test-host", "hostname": "test", "cpu": "x86"})
    dep = register_deployment(db, name, policy=policy, workload_id=WID, config_id=config.id, host_id=host,
                              device="cpu")
    windows = [(first_config, 10_000)] if first_config is not None else []
    windows += [(config, n) for n in calls]
    insert_samples(db, dep, [{"t_start": T0 + WINDOW * i, "t_end": T0 + WINDOW * (i + 1), "energy_j": 50.0,
                              "inferences": n, "avg_power_w": 10.0, "peak_power_w": 12.0, "energy_source": "rapl",
                              "config_id": cfg.id} for i, (cfg, n) in enumerate(windows)])


def test_a_deployment_report_says_when_the_tuning_was_paid_back(db, tmp_path):
    store_run(db, "default", "fp32", 0.4)
    store_run(db, "default", "bf16", 0.2)
    decision = _decide(db, write_policy(tmp_path))
    chosen = CompileConfig("default", precision="bf16", batch_size=8)
    assert decision.config_id == chosen.id
    needed = decision.bill["payback_inferences"]
    per_window = math.ceil(needed / 3.5)  # crossed within the fourth window of the tuned configuration
    deploy(db, "svc-prod", "svc", chosen, [per_window] * 6, first_config=CompileConfig("eager", batch_size=8))
    deploy(db, "svc-canary", "svc", chosen, [per_window])

    report = build_report(db, "svc-prod")
    pb = report["payback"]
    # Counted from the first window of the tuned configuration (the fallback's calls save nothing).
    after = 3 * WINDOW + WINDOW * (needed - 3 * per_window) / per_window
    assert pb["verdict"] == "paid_back" and pb["decision_id"] == decision.id
    assert pb["paid_back_after_s"] == pytest.approx(after)
    assert pb["paid_back_at"] == pytest.approx(T0 + WINDOW + after)
    assert pb["calls"] == 6 * per_window and pb["calls_per_s"] == pytest.approx(per_window / WINDOW)
    assert pb["payback_inferences"] == pytest.approx(needed) and pb["search_source"] == "rapl+estimate"
    assert pb["text"] == f"the tuning was paid back after {duration_text(after)} ({calls_text(needed)} calls)"
    assert build_report(db, "svc-prod", since=T0 + 100)["payback"]["paid_back_after_s"] == pytest.approx(after)

    assert pb["text"] in render(report, "md") and f"after {duration_text(after)}" in render(report, "md")
    html = render(report, "html")
    assert pb["text"] in html and "partly ESTIMATE · rapl+estimate" in html  # metered parts and an estimate
    rows = list(csv.reader(io.StringIO(render(report, "csv"))))
    assert ["svc-prod", "payback", "payback_inferences", str(needed), "calls", "rapl+estimate", "", "", ""] in rows
    data = json.loads(render(report, "json"))
    assert data["payback"]["paid_back_at_epoch"] == pytest.approx(T0 + WINDOW + after)

    canary = build_report(db, "svc-canary")["payback"]
    assert canary["verdict"] == "not_yet" and canary["fraction"] == pytest.approx(per_window / needed)
    assert canary["remaining_s"] == pytest.approx((needed - per_window) / (per_window / WINDOW))
    assert canary["text"].startswith(f"the tuning is not paid back yet: {per_window / needed:.0%} after "
                                     f"{per_window:,} calls")
    summary = {row["name"]: row for row in build_summary(db)["deployments"]}
    assert summary["svc-prod"]["paid_back_after_s"] == pytest.approx(after)
    assert summary["svc-canary"]["payback"] == canary["text"]


def test_a_deployment_of_the_baseline_never_pays_back_and_an_old_decision_says_it_has_no_bill(db, tmp_path):
    stock = CompileConfig("default", batch_size=8)
    store_run(db, "default", "fp32", 0.4)
    _decide(db, write_policy(tmp_path, "stock", modes=("default",), precisions=("fp32",)))
    deploy(db, "stock-prod", "stock", stock, [1000, 1000])
    report = build_report(db, "stock-prod")
    pb = report["payback"]
    assert pb["verdict"] == "never" and pb["paid_back_after_s"] is None and pb["calls"] == 2000
    assert pb["text"] == "the tuning never pays back: the decision keeps the baseline, stock compile default fp32: " \
                         "nothing is saved"
    assert "| tuning paid back | never |" in render(report, "md")

    # A decision stored before bills were recorded: no figure is made up.
    write_decision(db, {"policy": "legacy", "policy_hash": "h", "device_kind": "cpu", "torch_version": torch_minor(),
                        "config_id": stock.id, "state": "verified", "reason": "old", "decided_at": T0,
                        "details": {}})
    deploy(db, "legacy-prod", "legacy", stock, [1000])
    old = build_report(db, "legacy-prod")["payback"]
    assert old["verdict"] == "unknown" and old["payback_inferences"] is None
    assert "stored before joulepilot recorded tuning bills" in old["text"]


def test_a_warm_started_repeat_bills_its_metered_first_call_not_an_estimate(db):
    cold_id = store_run(db, "default", "fp32", 0.4)
    warm_id = store_run(db, "default", "fp32", 0.4, warm_first_call=(1.5, 27.0))
    runs = {r.id: r for r in runs_of(db)}
    cold, warm = run_cost(runs[cold_id]), run_cost(runs[warm_id])
    assert warm.metered_j == pytest.approx(27.0 + runs[warm_id].energy_j) and warm.metered_source == "rapl"
    assert warm.metered_s == pytest.approx(1.5 + runs[warm_id].window_s)
    assert warm.idle_s == pytest.approx(JOB_WALL_S - warm.metered_s - warm.loaded_s)
    # A cold run's first call is its compile columns, never counted twice from its compile window.
    runs[cold_id].extra["compile_window"] = {"duration_s": 5.0, "devices": [{"source": "rapl", "energy_j": 99.0}]}
    assert run_cost(runs[cold_id]).metered_j == pytest.approx(cold.metered_j)
