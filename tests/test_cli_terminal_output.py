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


@pytest.mark.parametrize("columns", ["80", "100", "120"])
def test_explain_table_fits_the_width_and_keeps_every_figure(sweep_db, columns):
    table, data = _explain(sweep_db, columns)
    assert table and max(len(line) for line in table) <= int(columns)
    joined = "\n".join(table)
    left_out = next((line for line in table if line.startswith("(left out to fit")), "")
    for cand in data["candidates"]:
        # numbers are never cut, whatever the width: shown whole, or their column named as left out
        assert format_cell(cand["score"]) in joined
        assert format_cell(cand["break_even_inferences"]) in joined or "break-even" in left_out
        # every candidate's reason, under the table where it does not fit in it
        assert any(line.startswith(f"{cand['label']}: ") for line in table) or cand["label"] + " " in joined
    if columns == "80":  # too narrow even for the labels and the median: a block of `header  value` lines each
        labels = [line.split(None, 1)[1] for line in table if line.startswith("config ")]
        assert labels == [c["label"] for c in data["candidates"]]
    else:  # a table, one line per candidate with its whole label (the longest is 54 characters)
        assert any(line.split()[:2] == ["status", "config"] for line in table[:3])
        rows = [line.split() for line in table if line.split()[:1] and line.split()[0] in STATUSES]
        assert [r[1] for r in rows] == [c["label"] for c in data["candidates"]]


STATUSES = ("chosen", "kept", "rejected", "infeasible", "fallback", "predicted")


def _bench_rows():
    """Two runs as `bench` prints them (the README's example at batch 8)."""
    common = {"status": "ok", "warm_start_s": None, "energy_source": "estimate"}
    return [dict(common, run_id=2, config_label="default/fp32/b8", compile_s=15.66, latency_ms_p50=0.1479,
                 latency_ms_p95=19.65, throughput_per_s=830.0, energy_j_per_inference=0.009386, avg_power_w=7.79,
                 peak_power_w=16.96, max_rel_error=2.556e-07),
            dict(common, run_id=1, config_label="eager/fp32/b8", compile_s=0.02385, latency_ms_p50=0.1117,
                 latency_ms_p95=0.3954, throughput_per_s=579.0, energy_j_per_inference=0.01255, avg_power_w=7.27,
                 peak_power_w=10.0, max_rel_error=0.0)]


@pytest.mark.parametrize("columns", [100, 120])
def test_benchs_table_stays_a_table_with_whole_labels(monkeypatch, capsys, columns):
    from joulepilot.cli_bench import SUMMARY_COLUMNS, SUMMARY_DROP_FIRST, SUMMARY_HEADERS

    monkeypatch.setenv("COLUMNS", str(columns))
    rows = _bench_rows()
    clikit.echo_table(rows, SUMMARY_COLUMNS, SUMMARY_HEADERS, drop_first=SUMMARY_DROP_FIRST)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= columns
    # a header, then one line per run holding its whole label and its figures (was 28 lines of blocks at 100,
    # and 'eager/fp32/b' over '8' at 120)
    body = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert [b[1] for b in body] == ["default/fp32/b8", "eager/fp32/b8"]
    for row, cells in zip(rows, body, strict=True):
        assert {format_cell(row["energy_j_per_inference"]), format_cell(row["latency_ms_p50"]), "estimate"} <= set(cells)
    assert len(lines) <= 6
    left_out = [line for line in lines if line.startswith("(left out")]
    if columns == 100:  # the empty warm-start column and the least needed ones go, named under the table
        assert left_out and "warm s" in left_out[0] and "--json has every field" in left_out[0]
    else:
        assert not left_out


def test_a_label_is_never_broken_however_long(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "60")
    label = "max-autotune-no-cudagraphs/no-epilogue-fusion/bf16/b32"
    clikit.echo_table([{"config": label, "reason": "a reason of several words that wraps where it must", "n": 1.5}],
                      ["config", "reason", "n"])
    out = capsys.readouterr().out
    assert label in out.splitlines()[1] or any(line.split()[-1:] == [label] for line in out.splitlines()), out


def test_tables_off_a_terminal_stay_within_120_columns(sweep_db):
    result = CliRunner(env={"COLUMNS": None}).invoke(main, ["runs", "--db", sweep_db, "--limit", "0"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= PLAIN_WIDTH
    header = next(line.split() for line in lines[:4] if line.startswith("id "))  # still a table at 120
    assert {"workload", "config_label", "status"} <= set(header)
    labels = {r["config_label"] for r in json.loads(CliRunner().invoke(main, ["runs", "--db", sweep_db, "--limit", "0",
                                                                             "--json"]).stdout)}
    shown = {line.split()[2] for line in lines if line.split()[:1] and line.split()[0].isdigit()}
    assert shown == labels  # whole labels, up to 54 characters; columns that no longer fit are named instead
    assert any(line.startswith("(left out to fit 120 columns: started") for line in lines), lines
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
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = CliRunner(env={"COLUMNS": "80"}).invoke(main, [
        "bench", "mlp", "--modes", "default", "--device", "cpu", "--min-seconds", "0.1", "--no-warm-start",
        "--db", str(tmp_path / "b.db"), "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    runs = json.loads(result.stdout)  # stdout is the JSON and nothing else
    assert [r["config_label"] for r in runs] == ["default/fp32/b1"] and runs[0]["compile_s"] >= 2.5
    err = result.stderr.splitlines()
    # first how many threads torch runs on, then the configuration
    assert err[0] == "bench: torch runs on 1 thread on the CPU (OMP_NUM_THREADS; --threads N to change)"
    assert err[1] == "[1/1] default/fp32/b1: compiling and measuring ..."
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


def test_daemon_once_says_how_far_a_guided_pass_is(tmp_path, restore_logging, flow_worker):
    policies = tmp_path / "policies"
    write_policy(policies, "g", modes=("eager",), precisions=("fp32",), strategy="guided")
    config = write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=policies, min_seconds=0.1)
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    jobs = json.loads(result.stdout)["runs_ok"]
    starts = [line for line in result.stderr.splitlines() if line.startswith("[job ") and line.endswith(": measuring ...")]
    assert len(starts) >= 2, result.stderr
    # the guided search plans its next measurement after each job: no job claims to be the last of the pass (it
    # read '[job 5/5]' on every job), and each says which step of the search it is
    for number, line in enumerate(starts, 1):
        assert line.startswith(f"[job {number} of {number} so far] g eager/"), line
        assert " on cpu (guided search: " in line, line
    assert result.stderr.splitlines()[-1].startswith(f"daemon pass: done, {len(starts)}/{len(starts)} jobs in ")
    assert jobs >= len(starts)
