"""`joulepilot status`: text and JSON views of the daemon, its queue and each policy's decision."""

from __future__ import annotations

import json
import os
import time

from click.testing import CliRunner
from joulepilot.controller.instance_lock import InstanceLock
from joulepilot.controller.status import daemon_status
from joulepilot.store import open_db, upsert_workload
from joulepilot.store.daemon_state import add_request, claim_job, enqueue_job, write_heartbeat
from joulepilot.store.decisions import write_decision

from joulepilot.cli import main


def test_status_of_a_database_no_daemon_ever_used(tmp_path):
    db = tmp_path / "j.db"
    open_db(db).close()
    result = CliRunner().invoke(main, ["status", "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert "daemon: never ran on this database" in result.output
    data = json.loads(CliRunner().invoke(main, ["status", "--db", str(db), "--json"]).output)
    assert data["daemon"]["alive"] is False and data["decisions"] == [] and data["queue"]["next"] == []


def test_status_refuses_a_database_that_does_not_exist(tmp_path):
    typo = tmp_path / "jp.dbb"
    result = CliRunner().invoke(main, ["status", "--db", str(typo)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert f"database {typo} does not exist" in result.output
    assert not typo.exists()  # nothing created


def test_status_shows_daemon_queue_and_decisions(tmp_path):
    path = tmp_path / "j.db"
    db = open_db(path)
    upsert_workload(db, {"id": "w1", "spec": "mlp", "batch_size": 8})
    for i in range(3):
        enqueue_job(db, policy="mlp", workload_id="w1", config_id=f"c{i}", provenance_key="k")
    claim_job(db, 1)
    add_request(db, "bert")
    write_decision(db, {"policy": "mlp", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                        "config_id": None, "state": "fallback", "reason": "nothing measured",
                        "decided_at": time.time() - 7200, "details": {}})
    write_heartbeat(db, "sweeping", {"doing": "measuring mlp: default/fp32/b8 on cpu", "hostname": os.uname().nodename,
                                     "job": {"id": 1, "config": "default/fp32/b8"},
                                     "last_pass": {"policy_errors": [{"file": "/p/bad.toml", "error": "bad key"}]}})
    with InstanceLock(path):
        status = daemon_status(db, path)
        text = CliRunner().invoke(main, ["status", "--db", str(path)]).output
    db.close()

    d = status["daemon"]
    assert d["alive"] and d["pid"] == os.getpid() and d["pid_alive"] and d["state"] == "sweeping"
    assert d["current_job"]["id"] == 1 and d["last_heartbeat_age_s"] < 60
    assert status["queue"]["counts"] == {"queued": 2, "running": 1, "done": 0, "failed": 0}
    assert [j["id"] for j in status["queue"]["next"]] == [1, 2, 3]  # the running one first
    assert status["queue"]["next"][0]["workload"] == "mlp"
    assert status["requests_pending"] == 1
    assert status["decisions"][0]["state"] == "fallback" and 7100 < status["decisions"][0]["age_s"] < 7300
    assert status["policy_errors"] == [{"file": "/p/bad.toml", "error": "bad key"}]

    assert f"daemon: running (pid {os.getpid()}), sweeping" in text
    assert "doing: measuring mlp" in text
    assert "queue: queued 2, running 1, done 0, failed 0; 1 request(s) pending" in text
    assert "fallback" in text and "2.0h" in text


def test_status_shows_which_host_of_a_fleet_measures_what(tmp_path, monkeypatch):
    from joulepilot.store import host_identity, upsert_host

    path = tmp_path / "j.db"
    db = open_db(path)
    upsert_workload(db, {"id": "w1", "spec": "mlp", "batch_size": 8})
    hosts = {}
    for name in ("gpu-a", "gpu-b"):
        monkeypatch.setenv("JOULEPILOT_HOSTNAME", name)
        hosts[name] = upsert_host(db, host_identity())
    for i, name in enumerate(("gpu-a", "gpu-b")):
        job, _ = enqueue_job(db, policy="mlp", workload_id="w1", config_id=f"c{i}", provenance_key="k")
        claim_job(db, job, host_id=hosts[name], lease_s=90)
        write_heartbeat(db, "sweeping", {"doing": f"measuring job {job}", "hostname": name}, host_id=hosts[name])
    enqueue_job(db, policy="mlp", workload_id="w1", config_id="c9", provenance_key="k")
    # this host is gpu-a: its own daemon's heartbeat is the one `daemon` reports, though gpu-b's is newer
    monkeypatch.setenv("JOULEPILOT_HOSTNAME", "gpu-a")
    with InstanceLock(path):  # gpu-a's daemon runs
        status = daemon_status(db, path)
        text = CliRunner().invoke(main, ["status", "--db", str(path)], env={"COLUMNS": "200"}).output
    db.close()

    assert status["daemon"]["doing"] == "measuring job 1"
    fleet = {h["host"]: h for h in status["fleet"]}
    assert sorted(fleet) == ["gpu-a", "gpu-b"]
    assert [m["job"] for m in fleet["gpu-b"]["measuring"]] == [2] and 85 < fleet["gpu-b"]["measuring"][0]["lease_left_s"] <= 90
    assert [(j["id"], j["host"]) for j in status["queue"]["next"]] == [(1, "gpu-a"), (2, "gpu-b"), (3, None)]
    assert "fleet: 2 hosts share this store" in text
    assert "gpu-b" in text and "job 2 mlp" in text and "measuring job 1" in text
