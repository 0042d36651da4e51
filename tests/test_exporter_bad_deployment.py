"""One deployment whose stored record cannot be read (a GPU index that is not a number in `details.gpus`) is left out
of the scrape alone: its series are missing, every other series is served, `joulepilot_exporter_scrape_error` is 1
and the log names the deployment, the field and the fix; once the record is put right it is served again."""

from __future__ import annotations

import logging
import urllib.request

import pytest
from joulepilot.controller.exporter import start_exporter
from joulepilot.store import open_db, upsert_host
from joulepilot.store.decisions import write_decision
from joulepilot.store.deployments import insert_samples, insert_violation, register_deployment
from prometheus_client.parser import text_string_to_metric_families

UUID_GOOD, UUID_BAD = "GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"
PER_DEPLOYMENT = ("joulepilot_energy_joules_total", "joulepilot_inferences_total", "joulepilot_deployment_power_watts")


def _deploy(db, name: str, gpus, joules: float) -> None:
    dep = register_deployment(db, name, policy="svc", device="cuda:0", host_id=upsert_host(db),
                              details={"energy_source": "nvml", "gpus": gpus})
    insert_samples(db, dep, [{"t_start": 0.0, "t_end": 5.0, "energy_j": joules, "inferences": 100,
                              "avg_power_w": joules / 5, "peak_power_w": joules / 4, "energy_source": "nvml"}])


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "jp.db"
    db = open_db(path)
    write_decision(db, {"policy": "svc", "policy_hash": "h", "device_kind": "H200", "torch_version": "2.13",
                        "config_id": None, "state": "verified", "reason": "best", "decided_at": 1.0, "details": {}})
    _deploy(db, "good-gpu", [{"index": 0, "uuid": UUID_GOOD}], 500.0)
    _deploy(db, "bad-index", [{"index": "zero", "uuid": UUID_BAD}], 700.0)
    _deploy(db, "bad-list", [{"index": [1], "uuid": UUID_BAD}], 900.0)
    cpu = register_deployment(db, "cpu-svc", policy="svc", device="cpu", host_id=upsert_host(db))
    insert_samples(db, cpu, [{"t_start": 0.0, "t_end": 5.0, "energy_j": 40.0, "inferences": 10, "avg_power_w": 8.0,
                              "peak_power_w": 9.0, "energy_source": "rapl"}])
    insert_violation(db, policy="svc", deployment="good-gpu", limit_name="max_avg_power_w", limit_value=50.0,
                     measured_value=100.0)
    db.close()
    return path


def _scrape(port: int) -> list:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _value(found, name, **labels) -> float:
    matches = [s.value for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels)
    return matches[0]


def test_a_deployment_with_a_bad_gpu_index_is_left_out_and_named(store, caplog):
    caplog.set_level(logging.INFO, logger="joulepilot.controller.exporter")
    exp = start_exporter(store, port=0)
    try:
        found = _scrape(exp.port)
        assert _value(found, "joulepilot_exporter_scrape_error") == 1
        # Every other series is served: the good deployments, the policy's, the violations, the daemon's.
        assert _value(found, "joulepilot_energy_joules_total", deployment="good-gpu", UUID=UUID_GOOD) == 500.0
        assert _value(found, "joulepilot_inferences_total", deployment="cpu-svc") == 10
        assert _value(found, "joulepilot_deployment_power_watts", deployment="good-gpu", stat="peak") == 125.0
        assert _value(found, "joulepilot_violations_total", deployment="good-gpu") == 1
        assert _value(found, "joulepilot_policy_decision_info", policy="svc") == 1
        assert _value(found, "joulepilot_daemon_up") == 0
        bad = [s for s in found if s.name in PER_DEPLOYMENT and s.labels["deployment"] in ("bad-index", "bad-list")]
        assert bad == []
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "deployment 'bad-index': details.gpus[0].index is 'zero', not a GPU index" in warnings[0]
        assert "deployment 'bad-list': details.gpus[0].index is [1], not a GPU index" in warnings[0]
        assert "its series are left out of the scrape; attach it again" in warnings[0]
        _scrape(exp.port)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # said once, not every scrape

        # The records put right (as attaching them again does): served again, and the error gauge back to 0.
        db = open_db(store)
        register_deployment(db, "bad-index", details={"energy_source": "nvml", "gpus": [{"index": 1, "uuid": UUID_BAD}]})
        register_deployment(db, "bad-list", details={"energy_source": "nvml", "gpus": [{"index": "1", "uuid": UUID_BAD}]})
        db.close()
        found = _scrape(exp.port)
        assert _value(found, "joulepilot_exporter_scrape_error") == 0
        assert _value(found, "joulepilot_energy_joules_total", deployment="bad-index", gpu="1") == 700.0
        assert _value(found, "joulepilot_energy_joules_total", deployment="bad-list", gpu="1") == 900.0
        assert any("reading" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    finally:
        exp.stop()
