"""The tuning bill keeps its metered joules apart per source: a GPU run's compile call is metered in two parts
(the GPU by NVML, the CPU by RAPL or, where RAPL cannot be read, the labelled estimate), and an estimated
part is never billed as NVML energy. Every consumer of the bill (`policy explain`, `status`, the daemon's
pass bill, the decision's stored bill) says so. And a deployment short of its payback never reads 100%."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from bill_factories import WID, runs_of, store_run, write_policy
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig
from joulepilot.controller.pass_bill import PassBill
from joulepilot.controller.report import build_report, render
from joulepilot.controller.report_format import payback_headline
from joulepilot.policies import decide, load_policy
from joulepilot.policies.bill import bill_of, bill_text, deployment_payback, energy_text, run_cost
from joulepilot.store import open_db, upsert_host
from joulepilot.store.deployments import insert_samples, register_deployment

from joulepilot.cli import main

GPU = "NVIDIA H200"
GPU_COMPILE_J, CPU_COMPILE_J = 100.0, 900.0


def store_gpu_run(db, mode: str, precision: str, j_per_call: float, *, cpu_source: str = "estimate",
                  policy: str | None = "svc") -> int:
    """A run on an H200 whose window and compile GPU part NVML metered, and whose compile CPU part
    `cpu_source` metered (the estimate where RAPL is root-only, as on the lent GPU machines)."""
    parts = {"compile_energy_gpu_j": GPU_COMPILE_J, "compile_energy_gpu_source": "nvml",
             "compile_energy_cpu_j": CPU_COMPILE_J, "compile_energy_cpu_source": cpu_source}
    return store_run(db, mode, precision, j_per_call, source="nvml", device="cuda:0", device_name=GPU,
                     compile_parts=parts, policy=policy)


def split(runs) -> dict[str, float]:
    """What each source metered over `runs`, from their stored columns: the windows and the compiles' GPU
    parts by NVML, the compiles' CPU parts by their own source."""
    out: dict[str, float] = {}
    for run in runs:
        for joules, source in ((run.energy_j, run.energy_source),
                               (run.compile_energy_gpu_j, run.compile_energy_gpu_source),
                               (run.compile_energy_cpu_j, run.compile_energy_cpu_source)):
            out[source] = out.get(source, 0.0) + joules
    return out


def metered_text(by_source: dict[str, float]) -> str:
    return " + ".join(f"{energy_text(j)} {s}" for s, j in sorted(by_source.items(), key=lambda kv: kv[0] == "estimate"))


def test_an_estimated_cpu_compile_part_is_never_billed_as_nvml(db):
    run_id = store_gpu_run(db, "default", "fp32", 0.4)
    (run,) = runs_of(db, GPU)
    assert run.id == run_id and run.compile_energy_j == GPU_COMPILE_J + CPU_COMPILE_J
    expected = split([run])
    assert expected["estimate"] == CPU_COMPILE_J and expected["nvml"] == GPU_COMPILE_J + run.energy_j

    cost = run_cost(run)
    assert cost.metered_j_by_source == {k: pytest.approx(v) for k, v in expected.items()}
    assert cost.metered_j == pytest.approx(run.compile_energy_j + run.energy_j)
    assert cost.metered_source == "nvml+estimate"

    # Every second of this run metered (no warm-up, the window's calls timed): nothing is estimated for the
    # rest of the job, and still the bill's source says an estimate is in it.
    whole = dataclasses.replace(run, warmup_s=0.0, extra={"latency_source": "window",
                                                          "job_wall_s": run.compile_s + run.window_s})
    bill = bill_of([whole]).to_dict()
    assert bill["estimated_j"] == 0 and bill["energy_j"] == pytest.approx(cost.metered_j)
    assert bill["source"] == "nvml+estimate" and bill["metered_source"] == "nvml+estimate"
    assert bill["metered_j_by_source"] == {k: pytest.approx(v) for k, v in expected.items()}
    assert bill_text(bill).endswith(f"{energy_text(bill['metered_j'])} in compile calls and energy windows "
                                    f"({metered_text(expected)})")


def test_a_cpu_part_read_by_rapl_is_a_measurement(db):
    store_gpu_run(db, "default", "fp32", 0.4, cpu_source="rapl")
    (run,) = runs_of(db, GPU)
    bill = bill_of([run]).to_dict()
    assert bill["metered_j_by_source"] == {k: pytest.approx(v) for k, v in split([run]).items()}
    assert bill["metered_source"] == "nvml+rapl" and "estimate" not in bill["metered_j_by_source"]
    assert bill["source"] == "nvml+rapl+estimate"  # the unmetered rest of the job is still estimated


def test_a_bill_stored_before_the_split_still_reads(db):
    store_run(db, "default", "fp32", 0.4)  # one compile figure, no parts: the run's own source
    bill = bill_of(runs_of(db)).to_dict()
    assert bill["metered_j_by_source"] == {"rapl": pytest.approx(bill["metered_j"])}
    del bill["metered_j_by_source"]
    assert f"{energy_text(bill['metered_j'])} in compile calls and energy windows (rapl)" in bill_text(bill)


def _gpu_decision_store(db) -> None:
    store_gpu_run(db, "default", "fp32", 0.4)
    store_gpu_run(db, "default", "bf16", 0.2)


def test_a_decisions_bill_and_payback_name_the_estimate(db, tmp_path):
    _gpu_decision_store(db)
    decision = decide(db, load_policy(write_policy(tmp_path)), GPU, record=True, lock=False).decision
    assert decision.config_id == CompileConfig("default", precision="bf16", batch_size=8).id
    bill = decision.bill
    expected = split(runs_of(db, GPU))
    assert bill["search"]["metered_j_by_source"] == {k: pytest.approx(v) for k, v in expected.items()}
    assert bill["search"]["source"] == "nvml+estimate"
    assert bill["verdict"] == "pays_back" and bill["saving_source"] == "nvml"
    assert bill["payback_source"] == "nvml+estimate"  # the search energy it pays back holds the estimate
    assert f"in compile calls and energy windows ({metered_text(expected)})" in bill["text"]

    # The deployment report's tuning-bill section says the search holds an estimate.
    host = upsert_host(db, {"id": "test-host", "hostname": "test", "cpu": "x86"})
    dep = register_deployment(db, "svc-gpu", policy="svc", workload_id=WID, config_id=decision.config_id,
                              host_id=host, device="cuda:0", details={"device_kind": GPU})
    insert_samples(db, dep, [{"t_start": 1_700_000_000.0, "t_end": 1_700_000_010.0, "energy_j": 50.0,
                              "inferences": 100, "avg_power_w": 5.0, "peak_power_w": 6.0, "energy_source": "nvml",
                              "config_id": decision.config_id}])
    report = build_report(db, "svc-gpu")
    pb = report["payback"]
    assert pb["decision_id"] == decision.id
    assert pb["search_source"] == "nvml+estimate" and pb["payback_source"] == "nvml+estimate"
    assert "partly ESTIMATE · nvml+estimate" in render(report, "html")


def test_policy_explain_status_and_the_pass_bill_show_the_split(tmp_path, monkeypatch):
    path = tmp_path / "j.db"
    db = open_db(path)
    _gpu_decision_store(db)
    runs = runs_of(db, GPU)
    expected = split(runs)
    pass_bill = PassBill()
    for run in runs:
        pass_bill.job_ended("svc", run.id, run.extra["job_wall_s"])
    (entry,) = pass_bill.per_policy(db)
    db.close()
    assert entry["source"] == "nvml+estimate" and entry["metered_source"] == "nvml+estimate"
    assert entry["metered_j_by_source"] == {k: pytest.approx(v) for k, v in expected.items()}
    assert f"({metered_text(expected)})" in entry["text"]

    monkeypatch.setenv("COLUMNS", "400")  # one line, not wrapped
    policy = write_policy(tmp_path)
    out = CliRunner().invoke(main, ["policy", "explain", str(policy), "--db", str(path), "--device-name", GPU])
    assert out.exit_code == 0, out.output
    line = next(line for line in out.output.splitlines() if line.startswith("tuning"))
    assert f"in compile calls and energy windows ({metered_text(expected)})" in line

    status = CliRunner().invoke(main, ["status", "--db", str(path), "--json"])
    assert status.exit_code == 0, status.output
    (measuring,) = json.loads(status.stdout)["measuring"]
    assert measuring["source"] == "nvml+estimate"
    assert measuring["metered_j_by_source"] == {k: pytest.approx(v) for k, v in expected.items()}
    assert f"({metered_text(expected)})" in measuring["text"]
    text = CliRunner().invoke(main, ["status", "--db", str(path)]).stdout
    row = next(line for line in text.splitlines() if line.startswith("svc "))
    assert "nvml+estimate" in row


# -- a payback not reached yet never reads 100% -----------------------------------------------------------
def test_a_shortfall_never_reads_100_percent():
    needed = 100_000.0
    for calls in (99_600, 99_996, 99_999):
        reached = deployment_payback(needed, [(0.0, 1000.0, calls)])
        assert reached.verdict == "not_yet" and reached.fraction == calls / needed < 1
        assert "100%" not in reached.text and reached.text.startswith("is not paid back yet: 99")
        headline = payback_headline(reached.to_dict())
        assert headline.startswith("not yet (99") and "100" not in headline
    assert "99.6%" in deployment_payback(needed, [(0.0, 1000.0, 99_600)]).text
    assert deployment_payback(needed, [(0.0, 1000.0, 34_000)]).text.startswith("is not paid back yet: 34% after")
    assert payback_headline(deployment_payback(needed, [(0.0, 1000.0, 34_000)]).to_dict()) == "not yet (34.0%)"


def test_a_deployment_one_call_short_of_its_payback_says_so(db, tmp_path):
    store_run(db, "default", "fp32", 0.4)
    store_run(db, "default", "bf16", 0.2)
    decision = decide(db, load_policy(write_policy(tmp_path)), "cpu", record=True, lock=False).decision
    needed = decision.bill["payback_inferences"]
    calls = math.ceil(needed) - 1
    assert calls / needed >= 0.995  # would print as 100% rounded to whole percent
    host = upsert_host(db, {"id": "test-host", "hostname": "test", "cpu": "x86"})
    dep = register_deployment(db, "svc-prod", policy="svc", workload_id=WID, config_id=decision.config_id,
                              host_id=host, device="cpu")
    insert_samples(db, dep, [{"t_start": 1_700_000_000.0, "t_end": 1_700_000_010.0, "energy_j": 50.0,
                              "inferences": calls, "avg_power_w": 5.0, "peak_power_w": 6.0, "energy_source": "rapl",
                              "config_id": decision.config_id}])
    report = build_report(db, "svc-prod")
    pb = report["payback"]
    assert pb["verdict"] == "not_yet" and pb["fraction"] < 1
    assert "100%" not in pb["text"] and pb["text"].startswith("the tuning is not paid back yet: 99")
    md = render(report, "md")
    assert pb["text"] in md and "not yet (100" not in md and "not yet (99" in md

