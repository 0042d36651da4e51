"""One validation of a policy's workload, for `policy check`, `policy explain`, `policy lock` and the daemon (issue
25, item 3): `policy check` accepted `os:system`, `subprocess:getoutput` and `builtins:exec`, which only failed in
a worker, and `policy explain` / `policy lock` accepted workloads `policy check` rejects (`mlpp`, a file that does
not exist) and wrote lock files for them. A factory spec naming anything of Python's standard library is refused
in one line with the fix, without importing anything it names."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from joulepilot.policies import checked_policy
from joulepilot.policies.load import load_policy_folders
from joulepilot.store import open_db
from joulepilot.store.decisions import list_decisions

from joulepilot.cli import main

STANDARD = ["os:system", "subprocess:getoutput", "builtins:exec", "os.path:join", "importlib:import_module",
            "shutil:rmtree", f"{os.__file__}:system"]


def policy_file(folder, workload: str, name: str = "svc"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(f'name = "{name}"\nworkload = {json.dumps(workload)}\nbatch_size = 8\n')
    return path


@pytest.mark.parametrize("workload", STANDARD)
def test_policy_check_refuses_a_factory_of_the_standard_library(tmp_path, workload):
    path = policy_file(tmp_path, workload)
    result = CliRunner().invoke(main, ["policy", "check", str(path), "--json"])
    assert result.exit_code == 1
    [problem] = json.loads(result.stdout)[0]["problems"]
    assert problem["key"] == "workload" and "standard library" in problem["found"]
    assert "your own code" in problem["hint"]


@pytest.mark.parametrize("workload", ["mlpp", "os:system", "missing_model.py:build"])
@pytest.mark.parametrize("command", ["explain", "lock"])
def test_explain_and_lock_refuse_what_check_refuses_and_write_nothing(tmp_path, command, workload):
    path = policy_file(tmp_path / "policies", workload)
    db = tmp_path / "j.db"
    open_db(db).close()
    result = CliRunner().invoke(main, ["policy", command, str(path), "--db", str(db), "--device-name", "cpu"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    [line] = [line for line in result.output.splitlines() if line.strip()]
    assert str(path) in line and "workload" in line
    assert not (tmp_path / "policies" / "svc.lock.json").exists()
    database = open_db(db)
    try:
        assert list_decisions(database) == []
    finally:
        database.close()


def test_a_library_missing_here_does_not_stop_explain(tmp_path, monkeypatch):
    """explain and lock decide from stored runs, often for another host: a library this one lacks is no refusal
    (as in `policy check`, where it is a warning)."""
    monkeypatch.setattr("joulepilot.compiler.spec_check._find_module", lambda name, locations=None: None)
    path = policy_file(tmp_path / "policies", "torchvision:resnet50")
    db = tmp_path / "j.db"
    open_db(db).close()
    result = CliRunner().invoke(main, ["policy", "explain", str(path), "--db", str(db), "--device-name", "cpu"])
    assert result.exit_code == 0, result.output
    _, warning = checked_policy(path)
    assert warning is not None and warning.severity == "warning" and "pip install torchvision" in warning.hint


def test_the_daemon_reports_a_standard_library_workload_as_a_policy_error(tmp_path):
    policy_file(tmp_path, "subprocess:getoutput", "shell")
    policy_file(tmp_path, "mlp", "good")
    policies, errors = load_policy_folders([tmp_path])
    assert [p.name for p in policies] == ["good"]
    [error] = errors
    assert error["file"].endswith("shell.toml") and "standard library" in error["error"]


def test_bench_refuses_a_standard_library_workload_before_any_worker(tmp_path):
    result = CliRunner().invoke(main, ["bench", "builtins:exec", "--device", "cpu", "--db", str(tmp_path / "j.db")])
    assert result.exit_code == 1 and "standard library" in result.output
    assert not (tmp_path / "j.db").exists() or open_db(tmp_path / "j.db").execute(
        "SELECT count(*) FROM runs").fetchone()[0] == 0


@pytest.mark.parametrize("workload", ["mlp", "tests.block_models:block_stack"])
def test_built_in_and_own_factories_still_check(tmp_path, workload):
    _, warning = checked_policy(policy_file(tmp_path, workload))
    assert warning is None
