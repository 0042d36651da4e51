"""The exporter's per-policy gauges show the figures a decision was made from, on the decision's own device.

A store holds runs of one configuration on several device kinds (a CPU host and a GPU host share it, or
runs were imported); a decision for one kind must never show another kind's energy, power or latency.
"""

from __future__ import annotations

import time

import pytest
from bill_factories import WID, store_run, write_policy
from joulepilot.compiler import CompileConfig
from joulepilot.controller.exporter import make_registry
from joulepilot.policies import decide, load_policy, torch_minor
from joulepilot.store import insert_run, open_db, upsert_config, upsert_host
from joulepilot.store.decisions import write_decision
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

H200 = "NVIDIA H200"
POLICY_SERIES = ("joulepilot_policy_energy_joules_per_inference", "joulepilot_policy_power_watts",
                 "joulepilot_policy_latency_p95_seconds")


def scrape(db_path) -> list:
    text = generate_latest(make_registry(db_path)).decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def policy_samples(found: list) -> list:
    return [s for s in found if s.name in POLICY_SERIES]


def one(found: list, name: str, **labels) -> tuple[float, dict[str, str]]:
    matches = [s for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, policy_samples(found))
    return matches[0].value, matches[0].labels


def gpu_run(db, config: CompileConfig, *, j_per_call: float, avg_w: float, source: str = "nvml",
            device: str = "cuda:0", device_name: str | None = H200, torch_version: str | None = None,
            provenance_key: str | None = None) -> int:
    """One ok run of the mlp workload (batch 8) on `device` (a GPU unless told otherwise)."""
    host = upsert_host(db, {"id": "gpu-host", "hostname": "gpu", "cpu": "x86"})
    upsert_config(db, config.to_row())
    now = time.time()
    return insert_run(db, {
        "workload_id": WID, "config_id": config.id, "host_id": host, "device": device, "device_name": device_name,
        "status": "ok", "started_at": now, "finished_at": now + 20.0,
        "torch_version": torch_version or f"{torch_minor()}.0", "energy_j": j_per_call * 1000, "inferences": 1000,
        "energy_j_per_inference": j_per_call, "avg_power_w": avg_w, "peak_power_w": avg_w * 1.08,
        "energy_source": source, "latency_ms_p95": 0.3, "window_s": 2.0, "provenance_key": provenance_key})


def test_a_cpu_decision_never_shows_a_later_gpu_run_of_the_same_configuration(tmp_path):
    """The audit's case: a CPU decision from three runs, then one H200 run of the decided configuration."""
    db_path = tmp_path / "j.db"
    db = open_db(db_path)
    cpu_j, cpu_w = 0.005, 20.0
    for _ in range(3):
        store_run(db, "eager", "fp32", 0.01, avg_w=50.0)
        store_run(db, "default", "fp32", cpu_j, avg_w=cpu_w)
    decided = decide(db, load_policy(write_policy(tmp_path, "svc", modes=("eager", "default"),
                                                   precisions=("fp32",))), "cpu", lock=False).decision
    assert decided.config["mode"] == "default" and decided.device_kind == "cpu"
    before = policy_samples(scrape(db_path))
    gpu_j, gpu_w = 0.5, 650.0
    gpu_run(db, CompileConfig("default", precision="fp32", batch_size=8), j_per_call=gpu_j, avg_w=gpu_w)
    db.close()

    found = scrape(db_path)
    assert policy_samples(found) == before  # a run on another device changes nothing the CPU decision shows
    energy, labels = one(found, "joulepilot_policy_energy_joules_per_inference", policy="svc")
    assert labels == {"policy": "svc", "device": "cpu", "source": decided.measured["energy_source"]}
    assert energy == pytest.approx(cpu_j) and energy == pytest.approx(decided.measured["energy_j_per_inference"])
    assert one(found, "joulepilot_policy_power_watts", policy="svc", stat="avg")[0] == pytest.approx(cpu_w)
    assert one(found, "joulepilot_policy_power_watts", policy="svc", stat="peak")[0] == pytest.approx(
        decided.measured["peak_power_w"])
    assert one(found, "joulepilot_policy_latency_p95_seconds", policy="svc")[0] == pytest.approx(
        decided.measured["latency_ms_p95"] / 1000)
    assert not [s for s in policy_samples(found) if s.labels.get("source") == "nvml" or s.value >= gpu_w]


def test_a_gpu_decision_never_shows_a_later_cpu_estimate_run(tmp_path):
    """The reverse: a decision for the H200, then a CPU run of the same configuration metered by an estimate."""
    db_path = tmp_path / "j.db"
    db = open_db(db_path)
    store_run(db, "eager", "fp32", 0.01, avg_w=50.0)  # registers the host, workload and configurations
    eager, compiled = (CompileConfig(m, precision="fp32", batch_size=8) for m in ("eager", "default"))
    for _ in range(3):
        gpu_run(db, eager, j_per_call=0.09, avg_w=540.0)
        gpu_run(db, compiled, j_per_call=0.05, avg_w=570.0)
    decided = decide(db, load_policy(write_policy(tmp_path, "svc", modes=("eager", "default"),
                                                   precisions=("fp32",))), H200, lock=False).decision
    assert decided.config_id == compiled.id and decided.measured["energy_source"] == "nvml"
    store_run(db, "default", "fp32", 0.002, avg_w=9.0, source="estimate")
    db.close()

    found = scrape(db_path)
    energy, labels = one(found, "joulepilot_policy_energy_joules_per_inference", policy="svc")
    assert labels == {"policy": "svc", "device": H200, "source": "nvml"}
    assert energy == pytest.approx(decided.measured["energy_j_per_inference"])
    assert one(found, "joulepilot_policy_power_watts", policy="svc", stat="avg")[0] == pytest.approx(
        decided.measured["avg_power_w"])
    assert not [s for s in policy_samples(found) if s.labels.get("source") == "estimate"]


def _bare_decision(db, device_kind: str, config: CompileConfig, **details) -> None:
    """A decision stored without the measured figures (as written before they were kept, or by hand)."""
    write_decision(db, {"policy": "svc", "policy_hash": "h", "device_kind": device_kind,
                        "torch_version": torch_minor(), "config_id": config.id, "state": "verified",
                        "reason": "by hand", "decided_at": time.time(), "details": {"workload_id": WID, **details}})


def test_a_decision_without_recorded_figures_shows_its_own_device_and_torch_only(tmp_path):
    db_path = tmp_path / "j.db"
    db = open_db(db_path)
    store_run(db, "eager", "fp32", 0.01, avg_w=50.0)
    compiled = CompileConfig("default", precision="fp32", batch_size=8)
    own = gpu_run(db, compiled, j_per_call=0.05, avg_w=570.0)
    _bare_decision(db, H200, compiled)
    # Newer runs of the same configuration: another GPU model, another torch, a CPU estimate.
    gpu_run(db, compiled, j_per_call=0.04, avg_w=300.0, device_name="NVIDIA H100 80GB HBM3")
    gpu_run(db, compiled, j_per_call=0.03, avg_w=560.0, torch_version="1.13.1")
    store_run(db, "default", "fp32", 0.002, avg_w=9.0, source="estimate")
    db.close()

    found = scrape(db_path)
    energy, labels = one(found, "joulepilot_policy_energy_joules_per_inference", policy="svc")
    assert labels == {"policy": "svc", "device": H200, "source": "nvml"}
    db = open_db(db_path)
    expected = db.execute("SELECT energy_j_per_inference, avg_power_w FROM runs WHERE id = ?", [own]).fetchone()
    db.close()
    assert energy == pytest.approx(expected[0])
    assert one(found, "joulepilot_policy_power_watts", policy="svc", stat="avg")[0] == pytest.approx(expected[1])


def test_a_decision_without_recorded_figures_prefers_runs_under_its_provenance(tmp_path):
    db_path = tmp_path / "j.db"
    db = open_db(db_path)
    store_run(db, "eager", "fp32", 0.01, avg_w=50.0)
    compiled = CompileConfig("default", precision="fp32", batch_size=8)
    gpu_run(db, compiled, j_per_call=0.05, avg_w=570.0, provenance_key="stack-a")
    gpu_run(db, compiled, j_per_call=0.07, avg_w=590.0, provenance_key="stack-b")  # newer, another stack
    _bare_decision(db, H200, compiled, provenance_key="stack-a")
    db.close()
    found = scrape(db_path)
    assert one(found, "joulepilot_policy_power_watts", policy="svc", stat="avg")[0] == pytest.approx(570.0)


def test_a_decision_with_no_run_on_its_device_shows_no_measured_series(tmp_path):
    db_path = tmp_path / "j.db"
    db = open_db(db_path)
    store_run(db, "default", "fp32", 0.005, avg_w=20.0)  # measured on the CPU only
    _bare_decision(db, H200, CompileConfig("default", precision="fp32", batch_size=8))
    db.close()
    found = scrape(db_path)
    assert one(found, "joulepilot_policy_decision_info", policy="svc")[1]["device"] == H200
    assert policy_samples(found) == []
