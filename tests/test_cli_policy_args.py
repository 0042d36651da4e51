"""Arguments of the policy, frontier and report commands that once slipped through or misled: a torch version
that cannot exist (stored, locked and shown as current), a plot format matplotlib cannot write (found out after
the work), a batch size of 0 (taken as the default), a report error naming no database, and policies given by
name (documented, refused)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from joulepilot.store import open_db
from joulepilot.store.decisions import list_decisions

from joulepilot.cli import main

POLICY = 'name = "{name}"\nworkload = "mlp"\nbatch_size = 8\n'


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder with svc.toml and an empty database, as the current directory."""
    (tmp_path / "svc.toml").write_text(POLICY.format(name="svc"))
    db = tmp_path / "j.db"
    open_db(db).close()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def decisions(db) -> list:
    database = open_db(db)
    try:
        return list_decisions(database)
    finally:
        database.close()


# --- --torch-version ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["not a version", "", "2", "2.x", "latest", "v2.11", "2.11.0 cu130",
                                     "2.11\n", "2." + "1" * 100])
@pytest.mark.parametrize("command", [["policy", "lock"], ["policy", "explain", "--record"], ["policy", "explain"]])
def test_a_torch_version_that_cannot_exist_is_refused_before_anything_is_stored(work, command, version):
    result = invoke(*command, "svc.toml", "--db", "j.db", "--device-name", "cpu", "--torch-version", version)
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines() or [""]
    assert line.startswith("Error: --torch-version ") and "2.11" in line and "2.11.0+cu130" in line
    assert len(line) < 250
    assert decisions(work / "j.db") == [] and not (work / "svc.lock.json").exists()


@pytest.mark.parametrize("version, minor", [("2.11", "2.11"), ("2.11.0", "2.11"), ("2.11.0+cu130", "2.11"),
                                            ("2.12.0a0+git1a2b3c4", "2.12"), ("2.10.0.dev20250101+cpu", "2.10"),
                                            ("2.9.1rc1", "2.9"), ("10.0", "10.0")])
def test_each_spelling_of_a_torch_version_decides_for_its_major_minor(work, version, minor):
    result = invoke("policy", "lock", "svc.toml", "--db", "j.db", "--device-name", "cpu", "--torch-version", version,
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["torch_version"] == minor
    [stored] = decisions(work / "j.db")
    assert stored.torch_version == minor
    assert list(json.loads((work / "svc.lock.json").read_text())["entries"]["cpu"]) == [minor]
