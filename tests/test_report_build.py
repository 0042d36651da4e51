"""Reports: totals equal the store's sums, baselines come from runs on the same device kind, all formats render."""

from __future__ import annotations

import csv
import io
import json
import re
import time

import pytest
from joulepilot.compiler import CompileConfig
from joulepilot.controller.report import (
    build_report,
    build_summary,
    device_peak,
    parse_since,
    render,
)
from joulepilot.store import insert_run, upsert_config, upsert_devices, upsert_host, upsert_workload
from joulepilot.store.decisions import write_decision
from joulepilot.store.deployments import insert_samples, insert_violation, register_deployment

GPU = "NVIDIA H200"
FLOPS_PER_CALL = 131e9  # ResNet-50, batch 32: ~4.1 GFLOP per image
EAGER, STOCK = CompileConfig(mode="eager", batch_size=32), CompileConfig(mode="default", batch_size=32)
SERVED = CompileConfig(mode="default", precision="bf16", batch_size=32)
T0 = 1_700_000_000.0


def _run(db, host_id, workload_id, config, j_per_call, device="cuda:0", device_name=GPU, source="nvml"):
    upsert_config(db, config.to_row())
    return insert_run(db, {"workload_id": workload_id, "config_id": config.id, "host_id": host_id,
                           "device": device, "device_name": device_name, "status": "ok", "started_at": T0,
                           "energy_j_per_inference": j_per_call, "energy_source": source})


@pytest.fixture
def gpu_store(db):
    """A store shaped like an H200 host serving ResNet-50 in bf16 (DESIGN.md's figures), with a guard trip."""
    host = upsert_host(db)
    upsert_devices(db, host, [{"id": "gpu:0", "kind": "gpu", "name": GPU, "source": "nvml"}])
    wl = upsert_workload(db, {"id": "wl-resnet", "spec": "torchvision:resnet50", "batch_size": 32,
                              "flops_per_inference": FLOPS_PER_CALL})
    _run(db, host, wl, EAGER, 0.0886)
    _run(db, host, wl, EAGER, 0.0900)
    _run(db, host, wl, STOCK, 0.0528)
    _run(db, host, wl, STOCK, 0.0600, device="cuda:0", device_name="NVIDIA H100 80GB HBM3")  # other kind
    _run(db, host, wl, SERVED, 0.0353)
    write_decision(db, {"policy": "resnet50", "policy_hash": "h", "device_kind": GPU, "torch_version": "2.13",
                        "config_id": SERVED.id, "state": "verified", "reason": "fewest J within 450 W",
                        "decided_at": T0, "details": {"limits": {"max_avg_power_w": 450.0,
                                                                 "max_peak_power_w": 600.0}}})
    dep = register_deployment(db, "resnet-prod", policy="resnet50", workload_id=wl, config_id=SERVED.id,
                              host_id=host, device="cuda:0")
    powers = [387, 391, 470, 480, 475, 390, 0]
    calls = [2840, 2800, 2900, 2950, 2880, 2700, 0]
    samples = []
    for i, (w, n) in enumerate(zip(powers, calls, strict=True)):
        samples.append({"t_start": T0 + 5 * i, "t_end": T0 + 5 * (i + 1), "energy_j": w * 5.0, "inferences": n,
                        "avg_power_w": float(w), "peak_power_w": w * 1.1 if w else 70.0, "energy_source": "nvml",
                        "config_id": SERVED.id, "other_processes": 1 if i == 5 else 0,
                        "share": 0.75 if i == 5 else 1.0})
    insert_samples(db, dep, samples)
    insert_violation(db, policy="resnet50", deployment="resnet-prod", limit_name="max_avg_power_w",
                     limit_value=450.0, measured_value=475.0, config_id=SERVED.id, at=T0 + 25)
    return db


def test_totals_equal_the_sums_in_the_store(gpu_store):
    db = gpu_store
    report = build_report(db, "resnet-prod")
    energy, calls, seconds, peak = db.execute(
        "SELECT SUM(energy_j), SUM(inferences), SUM(t_end - t_start), MAX(peak_power_w) FROM deployment_samples "
        "WHERE deployment_id = (SELECT id FROM deployments WHERE name = 'resnet-prod')").fetchone()
    t = report["totals"]
    assert t["energy_j"] == pytest.approx(energy)
    assert t["energy_kwh"] == pytest.approx(energy / 3.6e6)
    assert t["inferences"] == calls
    assert t["j_per_inference"] == pytest.approx(energy / calls)
    assert t["avg_power_w"] == pytest.approx(energy / seconds)
    assert t["peak_power_w"] == pytest.approx(peak)
    assert t["energy_source"] == "nvml" and not t["is_estimate"]
    assert report["samples"][-1]["cumulative_energy_j"] == pytest.approx(energy)
    assert report["samples"][-1]["j_per_inference"] is None  # an idle window has no J/inference


def test_baselines_envelope_configuration_and_efficiency(gpu_store):
    report = build_report(gpu_store, "resnet-prod", grid_gco2_per_kwh=400)
    j = report["totals"]["j_per_inference"]
    eager, stock = report["baselines"]["eager_fp32"], report["baselines"]["compile_default_fp32"]
    assert eager["measured"] and eager["runs"] == 2 and eager["j_per_inference"] == pytest.approx(0.0893)
    assert stock["runs"] == 1 and stock["j_per_inference"] == pytest.approx(0.0528)  # H100 run left out
    assert eager["saving_fraction"] == pytest.approx(1 - j / 0.0893)
    assert stock["saving_j"] == pytest.approx((0.0528 - j) * report["totals"]["inferences"])
    env = report["envelope"]
    assert (env["max_avg_power_w"], env["max_peak_power_w"]) == (450.0, 600.0)
    assert env["limits_from"] == "decision details"
    assert env["windows_above_avg_limit"] == 3 and len(env["violations"]) == 1
    conf = report["configuration"]
    assert conf["label"] == SERVED.label and conf["decision_state"] == "verified"
    assert conf["decision_reason"] == "fewest J within 450 W"
    assert report["co2"]["co2_g"] == pytest.approx(report["totals"]["energy_kwh"] * 400)
    eff = report["efficiency"]
    assert eff["flops_per_j"] == pytest.approx(FLOPS_PER_CALL / j)
    assert eff["device_peak"]["device"] == "NVIDIA H200 SXM"
    assert eff["device_peak"]["peak_flops_per_j"] == pytest.approx(989.5e12 / 700)  # bf16 served: tensor peak
    assert 0 < eff["fraction_of_peak_flops_per_j"] < 1
    assert report["sharing"]["windows_shared"] == 1
    assert any("shared device" in n and "75%" in n for n in report["notes"])


def test_no_baseline_measured_and_unknown_peak(db):
    host = upsert_host(db)
    upsert_devices(db, host, [{"id": "cpu:0", "kind": "cpu", "name": "some cpu", "source": "estimate"}])
    dep = register_deployment(db, "cpu-svc", workload_id="wl-never-benched", host_id=host, device="cpu")
    insert_samples(db, dep, [{"t_start": T0, "t_end": T0 + 1, "energy_j": 5.0, "inferences": 10,
                              "avg_power_w": 5.0, "peak_power_w": 6.0, "energy_source": "estimate"}])
    report = build_report(db, "cpu-svc")
    for b in report["baselines"].values():
        assert not b["measured"] and b["note"] == "no baseline measured for this workload on cpu"
    assert report["efficiency"]["device_peak"] is None
    assert report["totals"]["is_estimate"]
    assert report["co2"] is None
    html = render(report, "html")
    assert "ESTIMATE" in html and "Estimate, not a measurement" in html


def test_since_filter_and_unknown_deployment(gpu_store):
    report = build_report(gpu_store, "resnet-prod", since=T0 + 20)
    assert report["period"]["samples"] == 3
    assert report["totals"]["energy_j"] == pytest.approx(5 * (475 + 390 + 0))
    with pytest.raises(LookupError, match="resnet-prod"):
        build_report(gpu_store, "nope")


def test_parse_since():
    assert parse_since("24h", now=100_000.0) == 100_000.0 - 86_400
    assert parse_since("90s", now=1000.0) == 910.0
    assert parse_since("2024-05-01T00:00:00+00:00") == 1714521600.0
    assert parse_since(None) is None
    with pytest.raises(ValueError, match="duration"):
        parse_since("yesterday")


def test_device_peak_table():
    assert device_peak("NVIDIA H100 80GB HBM3", "fp32")["device"] == "NVIDIA H100 SXM"
    assert device_peak("NVIDIA H100 PCIe", "bf16")["tdp_w"] == 350
    assert device_peak("NVIDIA A100-SXM4-80GB", "fp32")["peak_flops_per_s"] == 19.5e12
    assert device_peak("NVIDIA L40S", "bf16")["device"] == "NVIDIA L40S"
    assert device_peak("NVIDIA L4", "fp32")["device"] == "NVIDIA L4"
    assert device_peak("NVIDIA GeForce RTX 4090", "fp32") is None


def test_renders_the_same_figures_in_every_format(gpu_store):
    report = build_report(gpu_store, "resnet-prod", grid_gco2_per_kwh=400)
    as_json = json.loads(render(report, "json"))
    assert as_json["totals"]["energy_j"] == pytest.approx(report["totals"]["energy_j"])

    rows = list(csv.DictReader(io.StringIO(render(report, "csv"))))
    figure = {(r["section"], r["metric"]): r for r in rows if r["section"] != "sample"}
    assert float(figure["totals", "energy_j"]["value"]) == pytest.approx(report["totals"]["energy_j"])
    assert figure["totals", "energy_j"]["source"] == "nvml"
    assert float(figure["baseline.eager_fp32", "saving_fraction"]["value"]) == pytest.approx(
        report["baselines"]["eager_fp32"]["saving_fraction"])
    sample_energy = [float(r["value"]) for r in rows if r["section"] == "sample" and r["metric"] == "energy_j"]
    assert sum(sample_energy) == pytest.approx(report["totals"]["energy_j"])

    md = render(report, "md")
    assert "resnet-prod" in md
    total_line = next(line for line in md.splitlines() if line.startswith("| total energy |"))
    # 12,965 J reads in kJ; 0.0036 kWh is too small to read well, so no kWh figure (it is in JSON/CSV)
    assert re.fullmatch(r"\| total energy \| 12\.9\d kJ \|", total_line), total_line
    assert f"{report['totals']['inferences']:,}" in md

    html = render(report, "html")
    assert html.startswith("<!DOCTYPE html>") and html.count("data:image/png;base64,") == 3
    # self-contained: nothing loaded from elsewhere (the datasheet's link is a link, not a resource)
    assert "<script" not in html and "<link" not in html and not re.search(r'src="(?!data:)', html)
    assert "Envelope violated 1 time(s)" in html and "ESTIMATE" not in html
    with pytest.raises(ValueError, match="format"):
        render(report, "pdf")


def test_summary_of_all_deployments(gpu_store):
    register_deployment(gpu_store, "idle-svc", device="cpu", host_id=upsert_host(gpu_store))
    summary = build_summary(gpu_store)
    by_name = {r["name"]: r for r in summary["deployments"]}
    assert set(by_name) == {"resnet-prod", "idle-svc"}
    assert by_name["resnet-prod"]["energy_j"] == pytest.approx(build_report(gpu_store, "resnet-prod")["totals"]["energy_j"])
    assert by_name["idle-svc"]["samples"] == 0 and by_name["idle-svc"]["energy_j"] == 0
    for fmt in ("json", "md", "csv", "html"):
        text = render(summary, fmt)
        assert "resnet-prod" in text and "idle-svc" in text


def test_report_of_a_real_cpu_deployment(tmp_path):
    import torch
    from joulepilot.runtime import attach
    from joulepilot.store import open_db

    db_path = tmp_path / "jp.db"
    dep = attach(torch.nn.Linear(64, 64).eval(), "cpu-live", db=db_path, device="cpu", interval_s=0.25)
    x = torch.randn(16, 64)
    t_end = time.monotonic() + 1.2
    with torch.no_grad():
        while time.monotonic() < t_end:
            dep(x)
            time.sleep(0.002)  # a steady pace: the report of the windows is the point, not the load
    dep.close()
    db = open_db(db_path)
    report = build_report(db, "cpu-live")
    energy, calls = db.execute("SELECT SUM(energy_j), SUM(inferences) FROM deployment_samples").fetchone()
    assert report["totals"]["energy_j"] == pytest.approx(energy) and report["totals"]["inferences"] == calls
    assert report["deployment"]["device_kind"] == "cpu"
    for fmt in ("html", "md", "json", "csv"):
        assert render(report, fmt)


@pytest.fixture
def db(backend_db):
    """Every test here on both backends (SQLite and PostgreSQL)."""
    return backend_db
