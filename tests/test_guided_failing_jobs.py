"""A guided policy whose next job keeps failing without storing a run (its device cannot be metered, say) is
decided after the job's `max_attempts`: `fallback`, with the reason, and no job after it. The passes run in this
process (`Daemon.run(once=True)`) with the flow worker; the job's measurement raises before any worker starts,
as it does when the device cannot be metered."""

from __future__ import annotations

import logging

from daemon_factories import query, write_daemon_config, write_policy
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import load_daemon_config
from joulepilot.store import open_db
from joulepilot.store.decisions import latest_decision


def _pass(cfg) -> dict:
    logging.getLogger("joulepilot").handlers.clear()  # each pass sets the daemon's log handler up again
    result = Daemon(cfg).run(once=True)
    return result.summary


def test_a_guided_search_whose_job_never_stores_a_run_ends_in_the_fallback_with_the_reason(
        tmp_path, flow_worker, own_tmpdir, monkeypatch):
    write_policy(tmp_path / "policies", "mlp", modes=("eager", "default"), strategy="guided")
    path = write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=tmp_path / "policies",
                               min_seconds=0.2)
    path.write_text(path.read_text().replace("[bench]\n", "[bench]\nmax_attempts = 2\n"))
    cfg = load_daemon_config(path)

    def cannot_meter(self, device):
        raise RuntimeError(f"no meter can read {device}")

    monkeypatch.setattr(Daemon, "_pass_context", cannot_meter)
    summary = _pass(cfg)
    assert summary["runs_ok"] == 0 and summary["runs_failed"] == 2  # the first job, once per attempt
    database = open_db(tmp_path / "j.db")
    try:
        decision = latest_decision(database, "mlp", "cpu")
    finally:
        database.close()
    assert decision is not None and decision.state == "fallback"
    assert decision.config_id == decision.details["config"]["id"] and decision.details["config"]["mode"] == "eager"
    assert decision.reason.endswith("; the guided search stopped: eager/fp32/b8 could not be measured: its job "
                                    "failed 2 times without storing a run")
    assert [d["state"] for d in summary["decided"]] == ["fallback"]
    assert query(tmp_path / "j.db", "SELECT COUNT(*) AS n FROM runs")[0]["n"] == 0

    # No loop: the next pass queues nothing and keeps the decision.
    again = _pass(cfg)
    assert again["enqueued"] == 0 and again["decided"] == []
    assert query(tmp_path / "j.db", "SELECT COUNT(*) AS n FROM jobs WHERE state IN ('queued', 'running')")[0]["n"] == 0
