"""Numbers the CLI's options refuse at the door: nan and inf (which click.FloatRange lets through), values out
of range, and a negative `runs --limit`; each is click's usage error naming the option, and nothing runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.store import open_db

from joulepilot.cli import main

REPO = Path(__file__).resolve().parents[1]
BENCH = ["bench", "mlp", "--modes", "eager", "--device", "cpu", "--min-seconds", "0.2"]
DOCTOR = ["doctor", "mlp", "--device", "cpu", "--backend", "eager"]


def assert_usage_error(result, option: str, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert error and error[0].startswith(f"Error: Invalid value for '{option}': "), result.output
    for needle in needles:
        assert needle in error[0], (needle, error[0])


@pytest.mark.parametrize("args,option,value,needle", [
    (BENCH, "--budget-s", "nan", "not a finite number"),
    (BENCH, "--budget-s", "inf", "not a finite number"),
    (BENCH, "--budget-s", "-inf", "not a finite number"),
    (DOCTOR, "--budget-s", "nan", "not a finite number"),
    (DOCTOR, "--budget-s", "inf", "not a finite number"),
    (["measure"], "--idle-s", "nan", "not a finite number"),
    (["measure"], "--idle-s", "inf", "not a finite number"),
    (["measure"], "--idle-s", "-1", "not in the range x>=0"),
    (["measure"], "--sample-hz", "nan", "not a finite number"),
    (["measure"], "--sample-hz", "inf", "not a finite number"),
    (["measure"], "--sample-hz", "0", "not in the range 0<x<=10"),
    (["measure"], "--sample-hz", "50", "not in the range 0<x<=10"),
])
def test_float_options_refuse_nan_inf_and_out_of_range(tmp_path, flow_worker, args, option, value, needle):
    db = tmp_path / "j.db"
    tail = ["--", sys.executable, "-c", "pass"] if args == ["measure"] else ["--db", str(db)] if args == BENCH else []
    result = CliRunner().invoke(main, [*args, option, value, *tail])
    assert_usage_error(result, option, needle)
    assert not db.exists()  # nothing ran, so nothing was stored


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_window_that_would_never_end_is_refused(tmp_path, value):
    # In a subprocess with a timeout: before the check, `--min-seconds nan` measured forever.
    db = tmp_path / "j.db"
    env = dict(os.environ, JOULEPILOT_WORKER_MODULE="tests.flow_worker", JOULEPILOT_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "joulepilot", *BENCH, "--min-seconds", value, "--db", str(db)],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"Error: Invalid value for '--min-seconds': {value} is not a finite number." in proc.stderr
    assert not db.exists()


def test_runs_limit_refuses_a_negative_count(tmp_path):
    db = tmp_path / "j.db"
    open_db(db).close()
    runner = CliRunner()
    assert_usage_error(runner.invoke(main, ["runs", "--db", str(db), "--limit", "-1"]), "--limit",
                       "-1 is not in the range x>=0")
    result = runner.invoke(main, ["runs", "--db", str(db), "--limit", "0", "--json"])  # 0 stays "all"
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == []


POLICY = str(REPO / "examples" / "policies" / "mlp.toml")


@pytest.mark.parametrize("args,option", [
    (BENCH, "--modes"), (BENCH, "--fusion"), (BENCH, "--precision"), (BENCH, "--devices"), (BENCH, "--device"),
    (BENCH, "--shapes"), (BENCH, "--buckets"), (BENCH, "--option"), (BENCH, "--regional-block"), (BENCH, "--db"),
    (DOCTOR, "--device"), (["exporter", "--port", "0"], "--bind"), (["frontier", "mlp"], "--device-name"),
    (["frontier", "mlp"], "--policy"), (["policy", "explain", POLICY], "--device-name"),
    (["policy", "lock", POLICY], "--device-name"), (["report", "--all"], "--output"), (["report"], "--deployment"),
    (["runs"], "--workload"), (["daemon", "--once"], "--policies"), (["daemon", "--once"], "--config"),
    (["measure"], "--device"),
])
def test_an_empty_name_or_list_is_refused_naming_the_option_not_taken_for_the_default(tmp_path, args, option):
    """`--device ''` measured on the default device and `--modes ''` swept the default modes, silently; every
    option that takes a name or a list now refuses an empty value (or an empty item: 'eager,,default')."""
    db = tmp_path / "j.db"
    tail = ["--", sys.executable, "-c", "pass"] if args == ["measure"] else []
    with_db = [] if option == "--db" or args in (["measure"], DOCTOR) else ["--db", str(db)]
    result = CliRunner().invoke(main, [*args, option, "", *with_db, *tail])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: {option} "), result.output
    assert "is empty; give" in lines[0] or "has an empty value; give values separated by commas" in lines[0]
    assert not db.exists()  # nothing ran, so nothing was stored


@pytest.mark.parametrize("args", [["frontier", ""], ["policy", "check", ""], ["policy", "explain", ""],
                                  [*BENCH, "--modes", "eager,,default"], [*BENCH, "--devices", "0,"]])
def test_an_empty_argument_or_list_item_is_refused_too(tmp_path, args):
    result = CliRunner().invoke(main, [*args, "--db", str(tmp_path / "j.db")] if args[0] != "policy" or
                                args[1] != "check" else args)
    assert result.exit_code == 1, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert " is empty; give a value" in line or " has an empty value; " in line, line
