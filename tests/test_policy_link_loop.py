"""A symbolic link that loops (`loop.toml -> loop.toml`) in a policy folder is one policy's error, like a FIFO:
the daemon's pass reads every other policy and decides it, `policy check` and the hook name the loop in one
line. It used to end every pass with Path.resolve()'s RuntimeError (exit 2), so that no policy was decided."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
from click.testing import CliRunner
from daemon_factories import TESTS_DIR, write_daemon_config, write_policy
from joulepilot.policies import PolicyError, find_policy
from joulepilot.policies.load import load_policy_folders

from joulepilot.cli import main

LOOPS = "a symbolic link that loops"


@pytest.fixture
def folder(tmp_path):
    """A policy folder holding `good.toml` and `loop.toml -> loop.toml`."""
    policies = tmp_path / "policies"
    write_policy(policies, "good", workload=f"{TESTS_DIR / 'workload_factories.py'}:steady")
    (policies / "loop.toml").symlink_to("loop.toml")
    return policies


def test_the_folder_reader_skips_the_loop_and_loads_the_rest(folder, tmp_path):
    (tmp_path / "lost").symlink_to(tmp_path / "lost")  # a policy folder that is itself a loop
    policies, errors = load_policy_folders([folder, tmp_path / "lost"])
    assert [p.name for p in policies] == ["good"]
    assert [e["file"] for e in errors] == [str(folder / "loop.toml"), str(tmp_path / "lost")]
    assert errors[0]["error"].startswith(f"skipped: {LOOPS}")
    assert LOOPS in errors[1]["error"] and "does not exist" not in errors[1]["error"]


def test_finding_a_looping_policy_names_the_loop(folder):
    for given, dirs in ((str(folder / "loop.toml"), None), ("loop", [folder])):
        with pytest.raises(PolicyError, match=LOOPS) as err:
            find_policy(given, dirs=dirs)
        assert "no such file" not in str(err.value)


@pytest.mark.parametrize("given", [["loop.toml", "good.toml"], ["."]], ids=["files", "folder"])
def test_policy_check_names_the_loop_and_still_checks_the_others(folder, given):
    """Each file given, or a folder given as a path (every *.toml in it, as the daemon reads it)."""
    result = CliRunner().invoke(main, ["policy", "check", *(str(folder / g) for g in given)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert f"{folder / 'loop.toml'}: 1 problem(s)" in result.output
    assert f"(file): expected a regular policy file, found {LOOPS}" in result.output
    assert f"{folder / 'good.toml'}: ok (policy good" in result.output


def test_the_hook_given_a_looping_policy_serves_the_model_after_one_warning(folder):
    import torch

    import joulepilot

    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = joulepilot.compile(model, policy=str(folder / "loop.toml"))
    assert [str(w.message) for w in caught if LOOPS in str(w.message)], [str(w.message) for w in caught]
    assert served.decision.state == "fallback"
    assert served(torch.ones(1, 4)).shape == (1, 2)


def test_a_daemon_pass_decides_every_other_policy_and_status_lists_the_loop(folder, tmp_path, flow_worker,
                                                                          restore_logging):
    db = tmp_path / "j.db"
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=folder, min_seconds=0.2)
    logging.getLogger("joulepilot").handlers.clear()  # the daemon logs to the stderr the runner gives it
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert result.exit_code == 1, (result.output, result.stderr)  # a policy file was skipped, nothing failed
    assert "Traceback" not in result.stderr and "RuntimeError" not in result.stderr
    summary = json.loads(result.stdout)
    assert [d["policy"] for d in summary["decided"]] == ["good"]
    assert [e["file"] for e in summary["policy_errors"]] == [str(folder / "loop.toml")]
    status = CliRunner().invoke(main, ["status", "--db", str(db), "--json"])
    assert status.exit_code == 0, status.output
    listed = json.loads(status.stdout)
    assert [d["policy"] for d in listed["decisions"]] == ["good"]
    assert [(e["file"], LOOPS in e["error"]) for e in listed["policy_errors"]] == [(str(folder / "loop.toml"), True)]


def test_a_database_path_that_loops_is_one_line_for_the_daemon_and_the_fallback_for_the_hook(folder, tmp_path,
                                                                                         restore_logging):
    import torch

    import joulepilot

    loop_db = tmp_path / "j.db"
    loop_db.symlink_to("j.db")
    logging.getLogger("joulepilot").handlers.clear()  # the daemon logs to the stderr the runner gives it
    result = CliRunner().invoke(main, ["daemon", "--once", "--policies", str(folder), "--db", str(loop_db)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "RuntimeError" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: cannot open database {loop_db}"), result.output
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = joulepilot.compile(torch.nn.Linear(4, 2), policy=str(folder / "good.toml"), db=loop_db)
    assert served.decision.source == "none" and served.decision.state == "fallback"
    assert served(torch.ones(1, 4)).shape == (1, 2)
