"""`joulepilot daemon` as a new install meets it: with no configuration the default policy folder may not exist
yet (no policies, and a notice saying where to put them), while a folder the user named must exist; `--json`
means something only with `--once`, and is refused without it.

NVML is the fake with no GPU, so `devices = "auto"` is the CPU on any host; no policy means no worker starts."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest
from click.testing import CliRunner
from daemon_factories import daemon_cmd
from fakes import fake_pynvml

from joulepilot.cli import main

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    fake_pynvml.install_everywhere(monkeypatch, [])


def daemon(*args: str):
    logging.getLogger("joulepilot").handlers.clear()  # the daemon logs to the stderr of this invocation
    return CliRunner().invoke(main, ["daemon", *args])


def test_a_missing_default_policy_folder_is_no_policies_with_a_notice(_isolated_home):
    result = daemon("--once", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["policies"] == 0 and summary["policy_errors"] == []
    folder = _isolated_home / "policies"
    notices = [line for line in result.stderr.splitlines() if "no policies yet" in line]
    assert len(notices) == 1 and "WARNING" in notices[0]
    assert f"the default policy folder {folder} does not exist; put policy files (*.toml" in notices[0]
    assert "--policies DIR" in notices[0]
    assert not folder.exists()  # the daemon says where, and creates nothing there


def test_the_default_folder_is_read_once_it_exists(_isolated_home):
    folder = _isolated_home / "policies"
    folder.mkdir()
    (folder / "broken.toml").write_text("name = \n")
    result = daemon("--once", "--json")
    assert result.exit_code == 1  # the folder is read: its bad file is reported
    assert [e["file"] for e in json.loads(result.stdout)["policy_errors"]] == [str(folder / "broken.toml")]
    assert "no policies yet" not in result.stderr


def test_a_named_folder_that_does_not_exist_is_still_an_error(_isolated_home, tmp_path):
    missing = tmp_path / "nope"
    by_option = daemon("--once", "--json", "--policies", str(missing))
    config = tmp_path / "daemon.toml"
    config.write_text(f'policies = "{missing}"\n')
    by_config = daemon("--once", "--json", "--config", str(config))
    for result in (by_option, by_config):
        assert result.exit_code == 1
        (error,) = json.loads(result.stdout)["policy_errors"]
        assert error["file"] == str(missing) and error["error"].startswith("policy folder does not exist")
        assert "no policies yet" not in result.stderr


@pytest.mark.parametrize("args", [[], ["--policies", "somewhere"]])
def test_json_without_once_is_refused_in_one_line(_isolated_home, tmp_path, args):
    """In a process of its own, under a time limit: a daemon that ignored --json would run for good."""
    config = tmp_path / "daemon.toml"
    config.write_text("[exporter]\nenabled = false\n")
    result = subprocess.run(daemon_cmd("--json", "--config", str(config), *args), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "Error: --json needs --once: it prints the summary of that one pass; a daemon that keeps running logs to "
        "stderr, and `joulepilot status --json` gives its state"]
    assert not (_isolated_home / "joulepilot.db").exists()  # refused before the daemon started


def test_the_help_says_json_needs_once():
    result = CliRunner().invoke(main, ["daemon", "--help"])
    assert "needs --once" in " ".join(result.stdout.split())


def test_a_sqlite_error_mid_pass_names_the_database_of_the_config(_isolated_home, tmp_path, monkeypatch):
    import sqlite3

    from daemon_factories import write_daemon_config
    from joulepilot.controller.daemon import Daemon

    policies = tmp_path / "policies"
    policies.mkdir()
    db = tmp_path / "from-config.db"
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)

    def locked(self, once):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(Daemon, "run", locked)
    result = daemon("--config", str(config), "--once")
    assert result.exit_code == 1
    assert f"database {db} stayed locked" in result.output, result.output
    assert "joulepilot.db" not in result.output and "Traceback" not in result.output


def test_a_policy_file_named_as_the_folder_says_so_and_how_to_fix_it(_isolated_home, tmp_path):
    """`policies = "svc.toml"` in the config: the file exists, so 'does not exist; create it' would mislead."""
    policy = tmp_path / "svc.toml"
    policy.write_text('name = "svc"\nworkload = "mlp"\nbatch_size = 8\n')
    config = tmp_path / "daemon.toml"
    config.write_text(f'policies = "{policy}"\n[exporter]\nenabled = false\n')
    result = daemon("--once", "--json", "--config", str(config))
    assert result.exit_code == 1
    (error,) = json.loads(result.stdout)["policy_errors"]
    assert error["file"] == str(policy)
    assert error["error"].startswith("not a folder: `policies` names folders of *.toml files; name the folder "
                                     "that holds this file")
    assert "does not exist" not in error["error"]


def test_a_folder_named_twice_or_through_a_link_is_read_once(tmp_path):
    """The same folder in the config and with --policies, or beside a symbolic link to it, holds no second policy
    of each name: reading it twice once reported every policy as defined twice (and `--once` exited 1)."""
    from joulepilot.policies.load import load_policy_folders

    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / "svc.toml").write_text('name = "svc"\nworkload = "mlp"\nbatch_size = 8\n')
    link = tmp_path / "link"
    link.symlink_to(folder)
    other = tmp_path / "other"
    other.mkdir()
    (other / "svc2.toml").symlink_to(folder / "svc.toml")  # the same file under another name elsewhere
    policies, errors = load_policy_folders([folder, tmp_path / "policies/", link, other])
    assert errors == []
    assert [(p.name, p.path) for p in policies] == [("svc", str((folder / "svc.toml").resolve()))]
    # Two different files of one name are still reported, as before.
    (other / "copy.toml").write_text((folder / "svc.toml").read_text())
    policies, errors = load_policy_folders([folder, other])
    assert [p.name for p in policies] == ["svc"]
    assert [e["file"] for e in errors] == [str(other / "copy.toml")]
    assert "is already defined by" in errors[0]["error"]


def test_a_policy_folder_the_daemon_cannot_list_is_an_error_not_an_empty_folder(tmp_path, monkeypatch):
    """A folder the daemon's user may not read (root-owned, mode 0700, under systemd) raises PermissionError
    when listed. The tests run as root, for whom no mode refuses a listing, so the refusal is the kernel's as
    os.scandir reports it, for that folder only: Path.glob used to take it for a folder without policies."""
    import errno
    import os

    from joulepilot.policies.load import load_policy_folders

    locked, readable = tmp_path / "locked", tmp_path / "readable"
    for folder in (locked, readable):
        folder.mkdir()
        (folder / f"{folder.name}.toml").write_text(f'name = "{folder.name}"\nworkload = "mlp"\nbatch_size = 8\n')
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(locked):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    policies, errors = load_policy_folders([locked, readable])
    assert [p.name for p in policies] == ["readable"]
    assert [e["file"] for e in errors] == [str(locked)]
    assert errors[0]["error"].startswith("cannot list the policy folder (Permission denied)")


@pytest.mark.parametrize("named", [True, False], ids=["named-in-the-config", "the-default"])
def test_status_says_plainly_that_the_daemon_has_no_policy_folder_and_what_to_create(_isolated_home, tmp_path,
                                                                                     named):
    folder = tmp_path / "etc-joulepilot" / "policies" if named else _isolated_home / "policies"
    config = tmp_path / "daemon.toml"
    config.write_text(f'policies = ["{folder}"]\n[exporter]\nenabled = false\n' if named else
                      "[exporter]\nenabled = false\n")
    assert daemon("--once", "--config", str(config)).exit_code == (1 if named else 0)
    text = CliRunner().invoke(main, ["status"])
    assert text.exit_code == 0, text.output
    (line,) = [line for line in text.stderr.splitlines() if line.startswith("policies: none;")]
    assert f"the daemon has no policy folder: {folder} does not exist" in line
    assert f"create it (mkdir -p {folder}) and put a policy file in it" in line
    assert "policy error" not in text.stderr  # said once, plainly
    data = json.loads(CliRunner().invoke(main, ["status", "--json"]).stdout)
    assert data["no_policy_folder"]["folders"] == [str(folder)] and data["policy_errors"] == []

    folder.mkdir(parents=True)  # created: the next pass reads it, and status has nothing to say about it
    assert daemon("--once", "--config", str(config)).exit_code == 0
    text = CliRunner().invoke(main, ["status"])
    assert "no policy folder" not in text.output and json.loads(
        CliRunner().invoke(main, ["status", "--json"]).stdout)["no_policy_folder"] is None
