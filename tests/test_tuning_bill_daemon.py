"""The tuning bill of the daemon: each pass logs and returns the seconds and joules it spent measuring per
policy, and `joulepilot status` shows them (text and JSON) beside every run the daemon ever made for it.
The workers are the flow worker (tests/flow_worker.py): this is about the bookkeeping, not about compiling. The daemon
passes and `status` run in this process (the CLI through click), which saves a process start with its imports each
and checks the same summary, log and output."""

from __future__ import annotations

import json
import logging

import pytest
from bill_factories import JOB_WALL_S, runs_of, store_run
from click.testing import CliRunner
from daemon_factories import use_flow_worker, write_daemon_config, write_policy
from joulepilot.policies.bill import bill_of, calls_text, duration_text, energy_text
from joulepilot.store import open_db
from joulepilot.store.runs import daemon_runs

from joulepilot.cli import main


def once(config):
    """`joulepilot daemon --once --json` in this process. The daemon logs to the stderr it finds when it first
    configures logging; each pass here gets a stderr of its own, so its handler is set up again."""
    logging.getLogger("joulepilot").handlers.clear()
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    return json.loads(result.stdout), result.stderr


def status(db, *args):
    result = CliRunner().invoke(main, ["status", "--db", str(db), *args])
    assert result.exit_code == 0, (result.output, result.stderr)
    return result.stdout


def test_each_pass_and_status_show_what_measuring_cost_per_policy(tmp_path, monkeypatch, restore_logging):
    use_flow_worker(monkeypatch)
    monkeypatch.setenv("COLUMNS", "300")
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "alpha", modes=("eager", "default"))
    write_policy(policies, "beta", modes=("eager",), precisions=("bf16",))  # no job shared with alpha
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)

    summary, log = once(config)
    assert summary["runs_ok"] == 3
    store = open_db(db)
    try:
        made = {name: daemon_runs(store, name) for name in ("alpha", "beta")}
    finally:
        store.close()
    assert [len(made["alpha"]), len(made["beta"])] == [2, 1]
    spent = {m["policy"]: m for m in summary["measuring"]}
    assert sorted(spent) == ["alpha", "beta"]
    for name, runs in made.items():
        bill = bill_of(runs)
        entry = spent[name]
        # Seconds are the daemon's whole jobs, which the runs record; joules metered plus the estimated rest.
        assert entry["seconds"] == pytest.approx(sum(r.extra["job_wall_s"] for r in runs), abs=1e-3)
        assert entry["seconds"] > sum(r.compile_s + r.window_s for r in runs)
        assert entry["runs"] == len(runs) and entry["unstored_s"] == 0
        assert entry["energy_j"] == pytest.approx(bill.energy_j) and entry["energy_j"] > 0
        assert entry["metered_j"] == pytest.approx(sum(r.compile_energy_j + r.energy_j for r in runs))
        assert entry["estimated_source"] == "estimate" and "estimate" in entry["source"]
        assert entry["metered_source"] == runs[0].energy_source
        assert f"policy {name}: measuring this pass cost {entry['text']}" in log
        assert entry["text"].startswith(energy_text(entry["energy_j"]))

    data = json.loads(status(db, "--json"))
    rows = {m["policy"]: m for m in data["measuring"]}
    assert sorted(rows) == ["alpha", "beta"]
    for name, entry in spent.items():
        assert rows[name]["seconds"] == pytest.approx(entry["seconds"], abs=1e-2)
        assert rows[name]["energy_j"] == pytest.approx(entry["energy_j"])
        assert rows[name]["source"] == entry["source"]
        assert rows[name]["last_pass"]["energy_j"] == pytest.approx(entry["energy_j"])
    text = status(db)
    assert "measuring, per policy" in text
    alpha = next(line for line in text.splitlines() if line.startswith("alpha ") and "run" in line)
    assert duration_text(spent["alpha"]["seconds"]) in alpha and energy_text(spent["alpha"]["energy_j"]) in alpha
    # Each decision's row says when its search pays back, from the bill the decision recorded.
    assert "payback" in next(line for line in text.splitlines() if line.startswith("policy  device"))
    for decided in data["decisions"]:
        bill = decided["bill"]
        assert bill["search"]["energy_j"] > 0 and "run_ids" not in bill["search"]
        words = {"pays_back": f"after {calls_text(bill['payback_inferences'])} calls", "never": "never",
                 "unknown": "no measurable saving" if bill.get("no_measurable_saving") else "unknown"}[bill["verdict"]]
        row = next(line for line in text.splitlines() if line.startswith(f"{decided['policy']} ") and " cpu " in line)
        assert words in row

    # A second pass (which re-measures only what a contended host flagged "repeat this run", if anything):
    # status totals every run the daemon made for a policy, and shows the last pass's share apart.
    summary, _ = once(config)
    second = {m["policy"]: m for m in summary["measuring"]}
    assert sum(m["runs"] for m in second.values()) == summary["runs_ok"] + summary["runs_failed"]
    again = {m["policy"]: m for m in json.loads(status(db, "--json"))["measuring"]}
    store = open_db(db)
    try:
        for name in ("alpha", "beta"):
            runs = daemon_runs(store, name)
            assert again[name]["runs"] == len(runs)
            assert again[name]["energy_j"] == pytest.approx(bill_of(runs).energy_j)
            if name in second:
                assert again[name]["last_pass"]["energy_j"] == pytest.approx(second[name]["energy_j"])
            else:
                assert again[name]["last_pass"] is None
    finally:
        store.close()


def test_a_pass_prices_stored_runs_and_counts_jobs_that_stored_none_apart(db):
    from joulepilot.controller.pass_bill import PassBill
    stored = store_run(db, "default", "fp32", 0.4, policy="alpha")
    bill = PassBill()
    bill.job_ended("alpha", stored, JOB_WALL_S)
    bill.job_ended("alpha", None, 12.5)  # pre-empted: killed before it stored a run
    bill.job_ended("beta", None, 0.0)  # never started (the device could not be metered): nothing to count
    [entry] = bill.per_policy(db)
    expected = bill_of(runs_of(db))
    assert entry["policy"] == "alpha" and entry["runs"] == 1 and entry["seconds"] == JOB_WALL_S
    assert entry["energy_j"] == pytest.approx(expected.energy_j) and entry["unstored_s"] == 12.5
    assert entry["text"].endswith("; 12.5 s more in jobs that stored no run")
