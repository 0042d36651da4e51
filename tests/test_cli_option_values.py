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
