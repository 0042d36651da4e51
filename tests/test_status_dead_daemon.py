"""`joulepilot status` after the daemon was killed or crashed mid-pass (its last heartbeat is not `stopped` and
nobody holds its lock): no job is shown as running and `doing` says the daemon ended, quoting its last heartbeat."""

from __future__ import annotations

import json
import socket

from click.testing import CliRunner
from joulepilot.controller.instance_lock import InstanceLock
from joulepilot.controller.status import daemon_status
from joulepilot.store import open_db
from joulepilot.store.daemon_state import write_heartbeat

from joulepilot.cli import main

JOB = {"id": 1, "policy": "mlp", "config": "default/fp32/b8", "device": "cpu"}
DOING = "[job 1/2] mlp default/fp32/b8 on cpu: measuring"


def killed_mid_pass(path, hostname=None):
    db = open_db(path)
    write_heartbeat(db, "sweeping", {"doing": DOING, "hostname": hostname or socket.gethostname(), "job": JOB,
                                     "jobs": [JOB]})
    return db


def test_a_killed_daemon_shows_no_running_job(tmp_path):
    path = tmp_path / "j.db"
    killed_mid_pass(path).close()
    data = json.loads(CliRunner().invoke(main, ["status", "--db", str(path), "--json"]).output)
    d = data["daemon"]
    assert d["alive"] is False and d["state"] == "sweeping"
    assert d["current_job"] is None and d["current_jobs"] == []
    assert d["doing"].startswith("nothing: the daemon ended without stopping") and DOING in d["doing"]
    text = CliRunner().invoke(main, ["status", "--db", str(path)]).output
    assert "doing: nothing: the daemon ended without stopping" in text


def test_a_live_daemon_still_shows_its_job(tmp_path):
    path = tmp_path / "j.db"
    db = killed_mid_pass(path)
    with InstanceLock(path):
        d = daemon_status(db, path)["daemon"]
    db.close()
    assert d["alive"] and d["doing"] == DOING and d["current_jobs"] == [JOB]


def test_a_daemon_of_another_host_is_not_declared_dead(tmp_path):
    path = tmp_path / "j.db"
    db = killed_mid_pass(path, hostname=socket.gethostname() + "-elsewhere")
    d = daemon_status(db, path)["daemon"]
    db.close()
    assert d["doing"] == DOING and d["current_jobs"] == [JOB]
