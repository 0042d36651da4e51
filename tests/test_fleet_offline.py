"""The fleet's database goes away in the middle of a sweep: PostgreSQL is shut down while the daemon measures, then
started again. Meanwhile the daemon keeps the run it measured in a side file on its host and says so (the log,
`joulepilot status`, the exporter's `joulepilot_store_up` and `joulepilot_daemon_runs_waiting`); when the server
answers it stores that run and finishes the sweep: no run lost, none measured twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import servers
from click.testing import CliRunner
from daemon_factories import daemon_cmd, wait_for, write_policy
from test_fleet_daemons import _config, _query, measured_once_each

from joulepilot.cli import main


@pytest.fixture
def own_postgres():
    server = servers.start_postgres()  # its own: this test shuts it down
    yield server
    server.stop()


def _gauge(url: str, name: str) -> float | None:
    from joulepilot.controller.exporter import JoulepilotCollector

    for family in JoulepilotCollector(url).collect():
        if family.name == name:
            return family.samples[0].value if family.samples else None
    return None


def test_runs_measured_while_postgresql_is_down_wait_on_the_host_and_are_stored_when_it_returns(
        tmp_path, own_postgres, flow_worker, own_tmpdir, monkeypatch):
    from joulepilot.store import side_path
    from joulepilot.store.unreachable import unreachable_path, waiting_runs

    url = own_postgres.new_database()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("JOULEPILOT_HOME", str(home))  # this process finds the daemon's side files where it keeps them
    monkeypatch.setenv("JOULEPILOT_DB", url)
    policies = tmp_path / "policies"
    write_policy(policies, "offline", modes=("eager", "default"), precisions=("fp32", "bf16"))
    env = {**os.environ, "JOULEPILOT_FAKE_COMPILE_S": "2.0", "JOULEPILOT_FLOW_CALL_S": "0.01"}
    log = tmp_path / "daemon.log"
    daemon = subprocess.Popen(daemon_cmd("--config", str(_config(tmp_path / "daemon.toml", policies))), env=env,
                              stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _query(url, "SELECT 1 FROM jobs JOIN configs ON configs.id = jobs.config_id WHERE "
                                     "jobs.state = 'running' AND configs.mode <> 'eager'"), 90, "a compiled job")
        own_postgres.halt()
        # the job ends during the outage: its run waits in a side file, and the daemon recorded the outage
        wait_for(lambda: waiting_runs(url) >= 1 and unreachable_path(url).exists(), 60, "the run set aside")
        [side_file] = side_path(url).parent.glob("*.pending/run-*.json")
        set_aside = json.loads(side_file.read_text())["pending_id"]
        status = CliRunner().invoke(main, ["status"])
        assert status.exit_code == 1, status.output
        assert "unreachable" in status.output and "1 measured run(s) wait in side files" in status.output
        assert _gauge(url, "joulepilot_store_up") == 0.0 and _gauge(url, "joulepilot_daemon_runs_waiting") == 1.0
        own_postgres.resume()
        wait_for(lambda: _query(url, "SELECT 1 FROM decisions WHERE policy = 'offline'") and not _query(
            url, "SELECT 1 FROM jobs WHERE state IN ('queued', 'running')"), 120, "the sweep to end")
        assert _gauge(url, "joulepilot_store_up") == 1.0 and _gauge(url, "joulepilot_daemon_runs_waiting") == 0.0
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    text = log.read_text(errors="replace")
    assert "database unreachable" in text and "database reachable again" in text
    assert not unreachable_path(url).exists() and waiting_runs(url) == 0

    runs = measured_once_each(url, 4)  # none lost, none measured twice
    assert sum(r["pending_id"] == set_aside for r in runs) == 1  # the run kept aside, stored once
