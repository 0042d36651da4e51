"""The daemon on a PostgreSQL store (`db = "postgresql://..."`): it measures, decides and keeps its lock and side files
under JOULEPILOT_HOME/postgresql; a password is taken from a config file only its owner may read, from the
environment, or from libpq's own files, never from the command line, and is never shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_factories import write_daemon_config, write_policy
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import DaemonConfigError, load_daemon_config
from joulepilot.store import list_runs, open_db, side_path
from joulepilot.store.decisions import latest_decisions

from joulepilot.cli import main


@pytest.fixture
def pg_url(postgres_server):
    return postgres_server.new_database()


def _password(url: str) -> str:
    return url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]


def test_the_daemon_measures_and_decides_into_postgresql(tmp_path, pg_url, flow_worker, own_tmpdir, restore_logging,
                                                         capfd):
    policies = tmp_path / "policies"
    write_policy(policies, "one", modes=("eager", "default"))
    config = write_daemon_config(tmp_path / "daemon.toml", db=pg_url, policies=policies, min_seconds=0.2)
    config.chmod(0o600)
    cfg = load_daemon_config(config)
    assert cfg.db == pg_url and _password(pg_url) not in str(cfg.to_dict())
    result = Daemon(cfg).run(once=True)
    assert result.exit_code == 0, result.summary
    db = open_db(pg_url)
    try:
        runs = list_runs(db)
        decisions = latest_decisions(db)
    finally:
        db.close()
    assert {r["status"] for r in runs} == {"ok"} and len(runs) >= 2
    assert [(d.policy, d.state) for d in decisions] and decisions[0].policy == "one"
    # the lock and the side files' folder are the URL's, under the home, not beside a file named after the URL
    assert side_path(pg_url).parent == Path(os.environ["JOULEPILOT_HOME"]) / "postgresql"
    assert not any(p.name.startswith("postgresql:") for p in tmp_path.rglob("*"))
    out, err = capfd.readouterr()
    assert _password(pg_url) not in out + err


def test_a_password_in_a_config_file_others_may_read_is_refused(tmp_path, pg_url):
    config = write_daemon_config(tmp_path / "daemon.toml", db=pg_url, policies=tmp_path)
    config.chmod(0o644)
    with pytest.raises(DaemonConfigError) as caught:
        load_daemon_config(config)
    message = str(caught.value)
    assert str(config) in message and "db (postgresql://joulepilot:***@" in message
    assert "mode 644" in message and f"chmod 600 {config}" in message and "PGPASSWORD" in message
    assert _password(pg_url) not in message
    config.chmod(0o600)
    assert load_daemon_config(config).db == pg_url
    # without a password in the URL the file's mode does not matter (libpq reads ~/.pgpass or PGPASSWORD)
    bare = pg_url.replace(f":{_password(pg_url)}@", "@")
    config = write_daemon_config(tmp_path / "bare.toml", db=bare, policies=tmp_path)
    config.chmod(0o644)
    assert load_daemon_config(config).db == bare


def test_a_password_on_the_command_line_is_refused_and_not_shown(pg_url):
    result = CliRunner().invoke(main, ["runs", "--db", pg_url])
    assert result.exit_code == 1
    assert "holds a password" in result.output and "JOULEPILOT_DB" in result.output
    assert _password(pg_url) not in result.output
    # the same URL from the environment is used
    open_db(pg_url).close()  # a joulepilot database (a read command refuses an empty one)
    result = CliRunner().invoke(main, ["runs", "--json"], env={"JOULEPILOT_DB": pg_url})
    assert result.exit_code == 0, result.output
    assert result.output.strip().startswith("[")
