"""A lock file with damaged entries, or one that is no lock file at all, is rewritten with the new decision's
entry: what could not be read is dropped with one line naming the file and what went, well-formed entries for
other device kinds and torch versions stay. `policy lock` once stored its decision and then died on such a file
("unexpected TypeError: 'int' object does not support item assignment"), leaving the lock file stale."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from joulepilot.policies import load_policy, read_lock, resolve, write_lock
from joulepilot.policies.lock import lock_path
from joulepilot.store import open_db
from joulepilot.store.decisions import list_decisions

POLICY = 'name = "svc"\nworkload = "mlp"\nbatch_size = 8\n'


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / "svc.toml"
    path.write_text(POLICY)
    return load_policy(path)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "joulepilot.lock" and r.levelno == logging.WARNING]


def test_policy_lock_replaces_a_damaged_entry_with_one_line_and_stores_the_decision(tmp_path):
    (tmp_path / "svc.toml").write_text(POLICY)
    lock = tmp_path / "svc.lock.json"
    lock.write_text('{"entries": {"cpu": 5}}')
    db = tmp_path / "j.db"
    open_db(db).close()
    proc = subprocess.run([sys.executable, "-m", "joulepilot", "policy", "lock", "svc.toml", "--db", str(db),
                           "--device-name", "cpu", "--torch-version", "2.11"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"{lock}: dropped damaged lock data") and "the entry for cpu: integer 5" in line
    assert "cpu / torch 2.11" in line and "unexpected" not in line
    entry = read_lock(tmp_path / "svc.toml", "cpu", "2.11")
    database = open_db(db)
    try:
        [stored] = list_decisions(database)
    finally:
        database.close()
    assert entry["decision_id"] == stored.id and entry["state"] == stored.state


@pytest.mark.parametrize("text, what", [
    ("not json at all", "the whole file: not valid JSON"),
    ('{"entries": [1, 2]}', "the whole file: expected an object with an 'entries' table"),
    ('[{"entries": {}}]', "the whole file: expected an object with an 'entries' table"),
    ('{"entries": {"cpu": {"2.11": 7}}}', "the entry for cpu / torch 2.11: integer 7"),
    ('{"entries": {"cpu": {"2.11": {"state": "verified"}}}}',
     "the entry for cpu / torch 2.11: no configuration or an unknown state"),
    ('{"entries": {"cpu": {"2.11": {"config": {"id": "c1"}, "state": "bogus"}}}}',
     "the entry for cpu / torch 2.11: no configuration or an unknown state"),
    ('{"entries": {"cpu": null}}', "the entry for cpu: null, not a table of entries by torch version"),
])
def test_damaged_lock_data_is_replaced_and_named(db, policy, caplog, text, what):
    lock = lock_path(policy.path)
    lock.write_text(text)
    decision = resolve(policy, db, "cpu", torch_version="2.11")
    with caplog.at_level(logging.WARNING, logger="joulepilot.lock"):
        assert write_lock(policy.path, decision) == lock
    [message] = warnings_of(caplog)
    assert message.startswith(f"{lock}: dropped damaged lock data (") and what in message
    assert "\n" not in message and "cpu / torch 2.11" in message
    document = json.loads(lock.read_text())
    assert document["entries"] == {"cpu": {"2.11": read_lock(policy.path, "cpu", "2.11")}}
    assert document["entries"]["cpu"]["2.11"]["decided_at"] == decision.decided_at


def test_well_formed_entries_are_kept_and_only_the_damaged_ones_dropped(db, policy, caplog):
    lock = lock_path(policy.path)
    write_lock(policy.path, resolve(policy, db, "NVIDIA H200", torch_version="2.11"))
    write_lock(policy.path, resolve(policy, db, "cpu", torch_version="2.10"))
    h200 = read_lock(policy.path, "NVIDIA H200", "2.11")
    cpu_210 = read_lock(policy.path, "cpu", "2.10")
    document = json.loads(lock.read_text())
    document["entries"]["cpu"]["2.9"] = "broken"
    document["entries"]["NVIDIA A100"] = [1, 2, 3]
    lock.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING, logger="joulepilot.lock"):
        write_lock(policy.path, resolve(policy, db, "cpu", torch_version="2.11"))
    [message] = warnings_of(caplog)
    assert "the entry for cpu / torch 2.9: string \"broken\"" in message
    assert "the entry for NVIDIA A100: array [1, 2, 3]" in message and "kept the 2 other entries" in message
    entries = json.loads(lock.read_text())["entries"]
    assert set(entries) == {"NVIDIA H200", "cpu"} and set(entries["cpu"]) == {"2.10", "2.11"}
    assert read_lock(policy.path, "NVIDIA H200", "2.11") == h200
    assert read_lock(policy.path, "cpu", "2.10") == cpu_210


def test_a_sound_lock_file_is_merged_without_a_word(db, policy, caplog):
    write_lock(policy.path, resolve(policy, db, "NVIDIA H200", torch_version="2.11"))
    with caplog.at_level(logging.WARNING, logger="joulepilot.lock"):
        write_lock(policy.path, resolve(policy, db, "cpu", torch_version="2.11"))
    assert warnings_of(caplog) == []
    assert read_lock(policy.path, "NVIDIA H200", "2.11") is not None


def test_a_file_of_many_damaged_entries_gets_one_short_line(db, policy, caplog):
    lock = lock_path(policy.path)
    lock.write_text(json.dumps({"entries": {f"gpu-{i}": i for i in range(1000)}}))
    with caplog.at_level(logging.WARNING, logger="joulepilot.lock"):
        write_lock(policy.path, resolve(policy, db, "cpu", torch_version="2.11"))
    [message] = warnings_of(caplog)
    assert "995 more" in message and len(message) < 1000
    assert list(json.loads(lock.read_text())["entries"]) == ["cpu"]
