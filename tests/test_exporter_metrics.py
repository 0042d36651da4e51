"""The Prometheus exporter: scrape /metrics over HTTP and compare every documented series with the DB."""

from __future__ import annotations

import time
import urllib.request

import pytest
from joulepilot.compiler import CompileConfig
from joulepilot.controller.exporter import start_exporter
from joulepilot.controller.instance_lock import InstanceLock
from joulepilot.store import insert_run, open_db, upsert_config, upsert_host, upsert_workload
from joulepilot.store.daemon_state import claim_job, enqueue_job, write_heartbeat
from joulepilot.store.decisions import write_decision
from joulepilot.store.deployments import insert_samples, insert_violation, register_deployment
from prometheus_client.parser import text_string_to_metric_families

DOCUMENTED = {
    "joulepilot_policy_decision_info", "joulepilot_policy_decision_timestamp_seconds",
    "joulepilot_policy_energy_joules_per_inference", "joulepilot_policy_power_watts",
    "joulepilot_policy_latency_p95_seconds", "joulepilot_energy_joules_total", "joulepilot_inferences_total",
    "joulepilot_deployment_power_watts", "joulepilot_violations_total", "joulepilot_daemon_up",
    "joulepilot_daemon_last_heartbeat_timestamp_seconds", "joulepilot_daemon_state", "joulepilot_daemon_queue_jobs",
    "joulepilot_compile_cache_up", "joulepilot_exporter_scrape_error", "joulepilot_store_up",
    "joulepilot_daemon_runs_waiting", *(GENERATION_SERIES := {"joulepilot_tokens_total",
                                                                "joulepilot_policy_energy_joules_per_token"}),
}


def populate(path):
    """A store as a daemon and one deployment leave it: a decision on a measured config, samples, a queue."""
    db = open_db(path)
    host = upsert_host(db)
    upsert_workload(db, {"id": "w-mlp", "spec": "mlp", "batch_size": 8})
    cfg = CompileConfig(mode="default", precision="bf16", batch_size=8)
    upsert_config(db, cfg.to_row())
    base = {"workload_id": "w-mlp", "config_id": cfg.id, "host_id": host, "device": "cpu", "status": "ok",
            "started_at": time.time() - 100, "finished_at": time.time() - 90, "energy_source": "estimate",
            "torch_version": "2.13.0"}
    insert_run(db, {**base, "energy_j_per_inference": 0.5, "avg_power_w": 300.0, "peak_power_w": 400.0,
                    "latency_ms_p95": 9.0})
    newer = insert_run(db, {**base, "energy_j_per_inference": 0.0353, "avg_power_w": 387.0, "peak_power_w": 512.5,
                            "latency_ms_p95": 2.92})
    decided_at = time.time() - 60
    write_decision(db, {"policy": "mlp", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                        "config_id": cfg.id, "state": "verified", "reason": "best", "decided_at": decided_at,
                        "details": {"workload_id": "w-mlp"}})
    dep = register_deployment(db, "mlp-prod", policy="mlp", workload_id="w-mlp", config_id=cfg.id, device="cpu")
    register_deployment(db, "mlp-idle", policy="mlp", details={"energy_source": "rapl"})
    register_deployment(db, "mlp-unknown", policy="mlp")  # no sample and no declared source: no energy series
    insert_samples(db, dep, [
        {"t_start": 0, "t_end": 5, "energy_j": 100.0, "inferences": 2000, "avg_power_w": 20.0, "peak_power_w": 25.0,
         "energy_source": "estimate"},
        {"t_start": 5, "t_end": 10, "energy_j": 150.5, "inferences": 3000, "avg_power_w": 30.1, "peak_power_w": 41.0,
         "energy_source": "estimate"},
    ])
    insert_violation(db, policy="mlp", deployment="mlp-prod", limit_name="max_avg_power_w", limit_value=25,
                     measured_value=30.1, config_id=cfg.id)
    for i in range(3):
        enqueue_job(db, policy="mlp", workload_id="w-mlp", config_id=f"c{i}", provenance_key="k")
    claim_job(db, 1)
    write_heartbeat(db, "sweeping", {"doing": "measuring", "compile_cache": {
        "url": "redis://cache:6379/0", "answers": False, "problem": "Redis at redis://cache:6379/0 did not answer"}})
    hb_at = db.execute("SELECT at FROM heartbeats ORDER BY id DESC LIMIT 1").fetchone()[0]
    db.close()
    return {"decided_at": decided_at, "heartbeat_at": hb_at, "run_id": newer, "label": cfg.label}


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    families = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            families.setdefault(sample.name, []).append(sample)
    return families


def value(families, name, **labels):
    matches = [s for s in families[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, families.get(name))
    return matches[0].value


@pytest.fixture
def exporter(tmp_path):
    path = tmp_path / "j.db"
    facts = populate(path)
    exp = start_exporter(path, port=0, bind="127.0.0.1")
    yield exp, path, facts
    exp.stop()


def test_metrics_hold_every_documented_series_with_db_values(exporter):
    exp, path, facts = exporter
    assert exp.address == "127.0.0.1"
    families = scrape(exp.port)
    # a store without a generation: its series are declared, with no sample (tests/test_generation_runtime.py)
    assert DOCUMENTED - GENERATION_SERIES <= set(families), DOCUMENTED - set(families)
    assert not GENERATION_SERIES & set(families)

    info = families["joulepilot_policy_decision_info"][0]
    assert info.value == 1
    assert info.labels == {"policy": "mlp", "device": "cpu", "config": facts["label"], "mode": "default",
                           "fusion": "default", "precision": "bf16", "state": "verified"}
    assert value(families, "joulepilot_policy_decision_timestamp_seconds", policy="mlp") == pytest.approx(
        facts["decided_at"])
    # The decision recorded no figures: the newest measurement of its configuration on its device and torch.
    assert value(families, "joulepilot_policy_energy_joules_per_inference", policy="mlp",
                 source="estimate") == pytest.approx(0.0353)
    assert value(families, "joulepilot_policy_power_watts", policy="mlp", stat="avg",
                 source="estimate") == pytest.approx(387.0)
    assert value(families, "joulepilot_policy_power_watts", policy="mlp", stat="peak") == pytest.approx(512.5)
    assert value(families, "joulepilot_policy_latency_p95_seconds", policy="mlp") == pytest.approx(0.00292)

    assert value(families, "joulepilot_energy_joules_total", deployment="mlp-prod",
                 source="estimate") == pytest.approx(250.5)
    assert value(families, "joulepilot_inferences_total", deployment="mlp-prod") == 5000
    assert value(families, "joulepilot_energy_joules_total", deployment="mlp-idle", source="rapl") == 0
    assert not [s for s in families["joulepilot_energy_joules_total"] if s.labels["deployment"] == "mlp-unknown"]
    assert value(families, "joulepilot_deployment_power_watts", deployment="mlp-prod", stat="avg",
                 source="estimate") == pytest.approx(30.1)
    assert value(families, "joulepilot_violations_total", policy="mlp", deployment="mlp-prod") == 1

    assert value(families, "joulepilot_daemon_up") == 0  # nobody holds the lock
    assert value(families, "joulepilot_exporter_scrape_error") == 0
    assert value(families, "joulepilot_daemon_last_heartbeat_timestamp_seconds") == pytest.approx(
        facts["heartbeat_at"])
    assert value(families, "joulepilot_daemon_state", state="sweeping") == 1
    assert value(families, "joulepilot_daemon_state", state="idle") == 0
    assert value(families, "joulepilot_daemon_queue_jobs", state="queued") == 2
    assert value(families, "joulepilot_daemon_queue_jobs", state="running") == 1
    assert value(families, "joulepilot_compile_cache_up") == 0  # the heartbeat's check found it silent


def test_values_are_read_at_scrape_time(exporter):
    exp, path, _ = exporter
    with InstanceLock(path):
        assert value(scrape(exp.port), "joulepilot_daemon_up") == 1
        db = open_db(path)
        dep = db.execute("SELECT id FROM deployments WHERE name = 'mlp-prod'").fetchone()[0]
        insert_samples(db, dep, [{"t_start": 10, "t_end": 15, "energy_j": 49.5, "inferences": 1000,
                                  "energy_source": "estimate"}])
        db.close()
        families = scrape(exp.port)
    assert value(families, "joulepilot_energy_joules_total", deployment="mlp-prod") == pytest.approx(300.0)
    assert value(families, "joulepilot_inferences_total", deployment="mlp-prod") == 6000
    assert value(scrape(exp.port), "joulepilot_daemon_up") == 0


def test_series_names_follow_prometheus_conventions(exporter):
    exp, _, _ = exporter
    with urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    assert types["joulepilot_energy_joules_total"] == "counter"
    assert types["joulepilot_inferences_total"] == "counter"
    assert types["joulepilot_violations_total"] == "counter"
    assert types["joulepilot_policy_decision_info"] == "gauge"  # an info metric in the text format
    assert set(types) == DOCUMENTED
    for name in types:
        assert not any(unit in name for unit in ("_kwh", "_ms", "_milli", "_watt_hours", "_kilo"))
