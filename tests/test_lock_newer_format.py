"""A lock file written by a newer joulepilot (a newer `format`) is never replaced by this one: replacing it
dropped every entry the newer version had written (other device kinds included) with only a warning. The write
is refused with one line naming the file, and no lock file is written elsewhere in its place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from joulepilot.policies import LockWriteError, load_policy, read_lock, resolve, write_lock
from joulepilot.policies.lock import LOCK_FORMAT, lock_dir_path, lock_path
from joulepilot.store import open_db
from joulepilot.store.decisions import list_decisions

POLICY = 'name = "svc"\nworkload = "mlp"\nbatch_size = 8\n'
NEWER = LOCK_FORMAT + 1


def newer_document(entries) -> str:
    return json.dumps({"format": NEWER, "policy": "svc", "entries": entries})


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / "svc.toml"
    path.write_text(POLICY)
    return load_policy(path)


def assert_refusal(message: str, file: Path) -> None:
    assert "\n" not in message and str(file) in message
    assert "newer joulepilot" in message and f"format {NEWER}" in message and "upgrade joulepilot" in message


@pytest.mark.parametrize("entries", [
    {"NVIDIA H100": {"2.11": {"written": "by a newer version"}}},
    [{"device": "NVIDIA H100"}],  # a newer format may shape its entries otherwise
])
def test_a_newer_lock_file_beside_the_policy_is_left_as_it_is(db, policy, tmp_path, entries):
    lock = lock_path(policy.path)
    lock.write_text(newer_document(entries))
    before = lock.read_bytes()
    decision = resolve(policy, db, "cpu", torch_version="2.11")
    with pytest.raises(LockWriteError) as raised:
        write_lock(policy.path, decision, lock_dir=tmp_path / "locks")
    assert_refusal(str(raised.value), lock)
    assert lock.read_bytes() == before
    # Not written to the lock directory either: the newer version's hook reads it too.
    assert not lock_dir_path(tmp_path / "locks", "svc").exists()


def test_a_newer_lock_file_in_the_lock_dir_is_left_as_it_is(db, policy, tmp_path):
    locked = lock_dir_path(tmp_path / "locks", "svc")
    locked.parent.mkdir()
    locked.write_text(newer_document({"NVIDIA H100": {"2.11": {"written": "by a newer version"}}}))
    before = locked.read_bytes()
    decision = resolve(policy, db, "cpu", torch_version="2.11")
    unwritable = Path("/sys/joulepilot-test") / "svc.toml"  # the policy's folder cannot be written
    with pytest.raises(LockWriteError) as raised:
        write_lock(unwritable, decision, lock_dir=tmp_path / "locks")
    message = str(raised.value)
    assert_refusal(message, locked)
    assert str(lock_path(unwritable)) in message  # why the policy's own folder was not used
    assert locked.read_bytes() == before


def test_policy_lock_on_a_newer_lock_file_stores_the_decision_and_says_so_in_one_line(tmp_path):
    (tmp_path / "svc.toml").write_text(POLICY)
    lock = tmp_path / "svc.lock.json"
    lock.write_text(newer_document({"NVIDIA H100": {"2.11": {"written": "by a newer version"}}}))
    before = lock.read_bytes()
    db = tmp_path / "j.db"
    open_db(db).close()
    proc = subprocess.run([sys.executable, "-m", "joulepilot", "policy", "lock", "svc.toml", "--db", str(db),
                           "--device-name", "cpu", "--torch-version", "2.11"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "JOULEPILOT_LOCK_DIR": str(tmp_path / "locks")})
    assert proc.returncode != 0
    [line] = proc.stderr.strip().splitlines()
    assert_refusal(line, lock)
    assert "Traceback" not in proc.stderr and "is stored" in line
    assert lock.read_bytes() == before and not (tmp_path / "locks").exists()
    database = open_db(db)
    try:
        assert len(list_decisions(database)) == 1
    finally:
        database.close()


def test_a_damaged_lock_file_of_no_newer_format_is_still_mended(db, policy):
    lock = lock_path(policy.path)
    lock.write_text(json.dumps({"format": LOCK_FORMAT, "entries": [1, 2]}))
    write_lock(policy.path, resolve(policy, db, "cpu", torch_version="2.11"))
    assert read_lock(policy.path, "cpu", "2.11") is not None
