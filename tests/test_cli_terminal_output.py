"""What the CLI prints: tables that fit the width they are given, and progress on stderr while `bench` and
`daemon --once` work (a start line, "still ..." heartbeats during a long phase, an end line), with
`--json` output on stdout left clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_factories import write_daemon_config, write_policy
from joulepilot.store import import_runs, read_export

import joulepilot.clikit as clikit
from joulepilot.cli import main
from joulepilot.clikit import format_cell

TESTS = Path(__file__).parent
SWEEP = TESTS / "data" / "synthetic_sweep.json"
POLICY = TESTS.parent / "examples" / "policies" / "resnet50.toml"
EXPLAIN_ARGS = ["--device-name", "NVIDIA H200", "--torch-version", "2.11"]
PLAIN_WIDTH = 120  # the README's width for tables written to a pipe or a file when COLUMNS is not set


@pytest.fixture
def sweep_db(tmp_path, db):
    import_runs(db, read_export(SWEEP))
    return db.execute("PRAGMA database_list").fetchone()[2]


def _explain(db_path: str, columns: str | None) -> tuple[list[str], dict]:
    runner = CliRunner(env={"COLUMNS": columns})
    text = runner.invoke(main, ["policy", "explain", str(POLICY), "--db", db_path, *EXPLAIN_ARGS])
    assert text.exit_code == 0, text.output
    data = json.loads(runner.invoke(main, ["policy", "explain", str(POLICY), "--db", db_path, *EXPLAIN_ARGS,
                                           "--json"]).stdout)
    lines = text.stdout.splitlines()
    return lines[lines.index("") + 1:], data  # the candidates table follows the decision's summary


@pytest.mark.parametrize("columns", ["80", "120"])
def test_explain_table_fits_the_width_and_keeps_every_figure(sweep_db, columns):
    table, data = _explain(sweep_db, columns)
    assert table and max(len(line) for line in table) <= int(columns)
    joined = "\n".join(table)
    for cand in data["candidates"]:
        # numbers are never cut, whatever the width
        assert format_cell(cand["score"]) in joined and format_cell(cand["break_even_inferences"]) in joined
    if columns == "80":  # too narrow for eleven columns: one block of `header  value` lines per candidate
        labels = [line.split(None, 1)[1] for line in table if line.startswith("config ")]
        assert labels == [c["label"] for c in data["candidates"]]
    else:
        assert any(line.split()[:2] == ["status", "config"] for line in table[:3])


def test_tables_off_a_terminal_stay_within_120_columns(sweep_db):
    result = CliRunner(env={"COLUMNS": None}).invoke(main, ["runs", "--db", sweep_db, "--limit", "0"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= PLAIN_WIDTH
    header = next(line.split() for line in lines[:4] if line.startswith("id "))  # still a table at 120
    assert {"started", "workload", "status"} <= set(header)
    narrow = CliRunner(env={"COLUMNS": "60"}).invoke(main, ["runs", "--db", sweep_db, "--limit", "3"])
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 60
    runs = json.loads(CliRunner(env={"COLUMNS": "60"}).invoke(main, ["runs", "--db", sweep_db, "--limit", "3",
                                                                      "--json"]).stdout)
    assert [r["id"] for r in runs] == [int(line.split()[1]) for line in narrow.stdout.splitlines()
                                       if line.startswith("id ")]


def test_bench_shows_a_slow_phase_on_stderr_and_keeps_json_clean(tmp_path, monkeypatch, flow_worker):
    # A worker without a model (the CLI's output is the point), whose compile stands in as a 2.5 s wait;
    # heartbeats every 0.5 s instead of 30 s.
    monkeypatch.setattr(clikit, "HEARTBEAT_S", 0.5, raising=False)
    monkeypatch.setenv("JOULEPILOT_FAKE_COMPILE_S", "2.5")
    result = CliRunner(env={"COLUMNS": "80"}).invoke(main, [
        "bench", "mlp", "--modes", "default", "--device", "cpu", "--min-seconds", "0.1", "--no-warm-start",
        "--db", str(tmp_path / "b.db"), "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    runs = json.loads(result.stdout)  # stdout is the JSON and nothing else
    assert [r["config_label"] for r in runs] == ["default/fp32/b1"] and runs[0]["compile_s"] >= 2.5
    err = result.stderr.splitlines()
    assert err[0] == "[1/1] default/fp32/b1: compiling and measuring ..."
    still = [line for line in err if line.startswith("[1/1] default/fp32/b1: still compiling, ")]
    assert 2 <= len(still) <= 6, err  # at most one per heartbeat interval
    assert any(line.startswith("[1/1] default/fp32/b1: ok, compile ") for line in err)
    assert err[-1].startswith("bench: done, 1/1 configuration in ")
    assert "[1/1]" not in result.stdout


def test_daemon_once_shows_job_i_of_n_with_elapsed_time(tmp_path, monkeypatch, restore_logging, flow_worker):
    monkeypatch.setattr(clikit, "HEARTBEAT_S", 0.5, raising=False)
    policies = tmp_path / "policies"
    write_policy(policies, "mlp", modes=("eager",))
    # a 1 s window: the job measures for two heartbeats
    config = write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=policies, min_seconds=1.0)
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    summary = json.loads(result.stdout)
    assert summary["runs_ok"] == 1 and summary["decided"][0]["policy"] == "mlp"
    err = result.stderr.splitlines()
    assert "[job 1/1] mlp eager/fp32/b8 on cpu: measuring ..." in err
    assert any(line.startswith("[job 1/1] mlp eager/fp32/b8 on cpu: still measuring, ") for line in err), err
    assert any(line.startswith("[job 1/1] mlp eager/fp32/b8 on cpu: ok, run 1 [") for line in err), err
    assert err[-1].startswith("daemon pass: done, 1/1 job in ")
    assert "[job" not in result.stdout
