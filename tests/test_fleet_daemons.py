"""A fleet on one PostgreSQL store: three daemons, each as its own host (a home and a JOULEPILOT_HOSTNAME of its
own), sweep one exhaustive policy on the CPU (the estimate meter, the flow worker's stand-in model). They share the
queue: every configuration is measured as often as the policy asks and never more, though one daemon is killed
(SIGKILL) in the middle of a job; the claim it held runs out and another host measures that job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_factories import daemon_cmd, wait_for, write_policy

LEASE_S = 3.0
HOSTS = ("fleet-host-0", "fleet-host-1", "fleet-host-2")


@pytest.fixture
def pg_url(postgres_server):
    return postgres_server.new_database()


def _query(url: str, sql: str, params: tuple = ()) -> list[dict]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(url, row_factory=dict_row, connect_timeout=5) as conn:
        try:
            return list(conn.execute(sql, params).fetchall())
        except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):  # the first daemon is still
            return []                                                           # creating the tables


def measured_once_each(url: str, configs: int) -> list[dict]:
    """The runs stored (with their configuration's label, host name, status, extra, pending_id), checked: `configs`
    configurations, each measured once as min_repeats = 1 asks, and once more only for a run bench flagged "repeat
    this run" (a loaded machine's), which asks for it."""
    runs = _query(url, "SELECT configs.label, hosts.hostname, runs.status, runs.extra, runs.pending_id FROM runs "
                       "JOIN configs ON configs.id = runs.config_id JOIN hosts ON hosts.id = runs.host_id")
    per_config: dict[str, list[dict]] = {}
    for run in runs:
        run["flagged"] = '"window_warning"' in (run["extra"] or "")
        per_config.setdefault(run["label"], []).append(run)
    assert len(per_config) == configs, sorted(per_config)
    for label, config_runs in per_config.items():
        clean = [r for r in config_runs if r["status"] == "ok" and not r["flagged"]]
        assert len(clean) == 1 and len(config_runs) == 1 + sum(r["flagged"] for r in config_runs), (label, config_runs)
    return runs


def _config(path: Path, policies: Path) -> Path:
    # no `db`: the URL, which holds a password, comes from JOULEPILOT_DB, as the README tells a fleet to give it
    path.write_text(f'policies = ["{policies}"]\ninterval_s = 1\nlog_level = "INFO"\n'
                    "[bench]\nmin_seconds = 0.2\nbudget_s = 300\n"
                    "[idle]\npoll_s = 0.2\nmin_idle_s = 0\n"
                    "[exporter]\nenabled = false\n"
                    f"[fleet]\nlease_s = {LEASE_S}\n")
    return path


def _start(index: int, tmp_path: Path, config: Path, url: str) -> subprocess.Popen:
    home = tmp_path / f"home-{index}"
    home.mkdir()
    env = {**os.environ, "JOULEPILOT_HOME": str(home), "JOULEPILOT_HOSTNAME": HOSTS[index], "JOULEPILOT_DB": url,
           # a compiled configuration's stand-in compile is long enough to be killed in
           "JOULEPILOT_FAKE_COMPILE_S": "2.0", "JOULEPILOT_FLOW_CALL_S": "0.01"}
    log = (tmp_path / f"daemon-{index}.log").open("wb")
    return subprocess.Popen(daemon_cmd("--config", str(config)), env=env, stdout=log, stderr=subprocess.STDOUT)


def test_three_daemons_split_one_sweep_and_a_killed_ones_claim_is_measured_by_another(
        tmp_path, pg_url, flow_worker, own_tmpdir):
    policies = tmp_path / "policies"
    write_policy(policies, "fleet", modes=("eager", "default"), precisions=("fp32", "bf16", "fp16"))
    config = _config(tmp_path / "daemon.toml", policies)
    daemons = [_start(i, tmp_path, config, pg_url) for i in range(3)]
    try:
        # the victim: the first host seen measuring a compiled configuration (its stand-in compile waits 2 s)
        claimed = wait_for(lambda: _query(
            pg_url, "SELECT jobs.id, hosts.hostname FROM jobs JOIN hosts ON hosts.id = jobs.claimed_by JOIN configs "
                    "ON configs.id = jobs.config_id WHERE jobs.state = 'running' AND configs.mode <> 'eager'"),
            90, "a host to claim a compiled job")
        victim, victim_host = claimed[0]["id"], claimed[0]["hostname"]
        killed = daemons[HOSTS.index(victim_host)]
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        wait_for(lambda: _query(pg_url, "SELECT 1 FROM decisions WHERE policy = 'fleet'") and not _query(
            pg_url, "SELECT 1 FROM jobs WHERE state IN ('queued', 'running')"), 150, "the fleet to decide")
    finally:
        for daemon in daemons:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in daemons:
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
    logs = {i: (tmp_path / f"daemon-{i}.log").read_text(errors="replace") for i in range(3)}
    sys.stderr.write("".join(f"--- daemon {i}\n{text[-3000:]}" for i, text in logs.items()))

    runs = measured_once_each(pg_url, 6)
    # the killed host's job was measured by another host, once
    [job] = _query(pg_url, "SELECT jobs.state, hosts.hostname FROM jobs JOIN runs ON runs.id = jobs.run_id "
                           "JOIN hosts ON hosts.id = runs.host_id WHERE jobs.id = %s", (victim,))
    assert job["state"] == "done" and job["hostname"] != victim_host
    assert len({r["hostname"] for r in runs}) >= 2  # the work was split
    # decided once between them (again only where a flagged run asked for a repeat)
    decisions = _query(pg_url, "SELECT state FROM decisions WHERE policy = 'fleet'")
    flagged = sum(r["flagged"] for r in runs)
    assert 1 <= len(decisions) <= 1 + flagged and decisions[-1]["state"] == "verified", decisions
