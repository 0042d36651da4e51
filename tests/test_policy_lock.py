"""Lock files and stored decisions: round trips, merging, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from joulepilot.policies import load_policy, read_lock, record_decision, resolve, stored_decision, write_lock
from joulepilot.policies.lock import lock_path
from joulepilot.store import import_runs, read_export
from joulepilot.store.decisions import latest_decision, list_decisions

from joulepilot.cli import main

SWEEP = Path(__file__).parent / "data" / "synthetic_sweep.json"
EXAMPLE = Path(__file__).parent.parent / "examples" / "policies" / "resnet50.toml"


def _policy(tmp_path):
    path = tmp_path / "resnet50.toml"
    path.write_text(EXAMPLE.read_text())
    return path, load_policy(path)


def test_lock_round_trip_and_merge(tmp_path, db):
    import_runs(db, read_export(SWEEP))
    path, policy = _policy(tmp_path)
    decision = resolve(policy, db, "NVIDIA H200", torch_version="2.11")
    written = write_lock(path, decision)
    assert written == lock_path(path) == tmp_path / "resnet50.lock.json"
    entry = read_lock(path, "NVIDIA H200", "2.11")
    # The sweep has one run of each configuration: the best within the envelope is applied, provisional.
    assert entry["config"] == decision.config and entry["state"] == decision.state == "provisional"
    assert entry["config_id"] == next(c.config_id for c in decision.candidates if c.status == "chosen")
    assert entry["policy_hash"] == policy.hash and entry["decided_at"] == decision.decided_at
    assert entry["measured"]["avg_power_w"] <= 450
    # another device kind is added beside it, not over it
    cpu = resolve(policy, db, "cpu", torch_version="2.11")
    write_lock(path, cpu)
    assert read_lock(path, "cpu", "2.11")["state"] == "fallback"
    assert read_lock(path, "NVIDIA H200", "2.11") == entry
    assert read_lock(path, "NVIDIA H200", "2.99") is None
    assert list(json.loads(written.read_text())["entries"]) == ["NVIDIA H200", "cpu"]


def test_decisions_table_keeps_the_latest(tmp_path, db):
    import_runs(db, read_export(SWEEP))
    _, policy = _policy(tmp_path)
    first = resolve(policy, db, "NVIDIA H200", torch_version="2.11")
    record_decision(db, first)
    second = resolve(policy, db, "NVIDIA H200", torch_version="2.11")
    second.decided_at = first.decided_at + 10
    record_decision(db, second)
    row = latest_decision(db, "resnet50", "NVIDIA H200", "2.11")
    assert row["id"] == second.id
    again = stored_decision(db, "resnet50", "NVIDIA H200", "2.11")
    assert again.config == second.config and again.candidates[0].label == second.candidates[0].label
    assert len(list_decisions(db, "resnet50")) == 2 and len(list_decisions(db, latest_only=True)) == 1
    assert next(db.query("SELECT * FROM configs WHERE id = ?", [second.config_id]))["label"] == second.label


def test_cli_explain_and_lock(tmp_path, db):
    import_runs(db, read_export(SWEEP))
    path, _ = _policy(tmp_path)
    db_path = db.execute("PRAGMA database_list").fetchone()[2]
    runner = CliRunner(env={"COLUMNS": "300"})  # wide enough that no reason is wrapped across lines
    args = ["--db", db_path, "--device-name", "NVIDIA H200", "--torch-version", "2.11"]
    out = runner.invoke(main, ["policy", "explain", str(path), *args])
    assert out.exit_code == 0, out.output
    assert "[provisional]" in out.output and "max_avg_power_w: measured" in out.output
    assert "it has 1 of the 3 runs a verified decision needs" in out.output
    data = json.loads(runner.invoke(main, ["policy", "explain", str(path), *args, "--json"]).output)
    assert data["state"] == "provisional" and len(data["candidates"]) == 14
    assert data["config"]["id"] == next(c["config"]["id"] for c in data["candidates"] if c["status"] == "chosen")
    out = runner.invoke(main, ["policy", "lock", str(path), *args])
    assert out.exit_code == 0, out.output
    assert read_lock(path, "NVIDIA H200", "2.11")["config_id"] == data["config"]["id"]
    assert latest_decision(db, "resnet50", "NVIDIA H200", "2.11") is not None
