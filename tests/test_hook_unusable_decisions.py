"""A decision this joulepilot cannot use (a lock entry or a stored row naming an unknown mode or precision, options
that are not JSON, a batch size that is not a number, a configuration with no mode, a decided_at that is not a
time, a lock file of a newer format) never takes `joulepilot.compile` down: it is skipped with one warning naming
where it came from and the fix, the next source is tried (the other lock file, the store), else the fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from decision_factories import (
    compile_with_warnings,
    config,
    db_file,
    decided_policy,
)
from joulepilot.policies import find_locked, load_policy, resolve, write_lock
from joulepilot.policies.lock import LOCK_FORMAT, lock_dir_path


def _break_config(field: str, value):
    def change(entry: dict) -> None:
        entry["config"][field] = value
    return change


def _only_an_id(entry: dict) -> None:
    entry["config"] = {"id": entry["config"]["id"]}


def _decided_yesterday(entry: dict) -> None:
    entry["decided_at"] = "yesterday"


ENTRY_DAMAGE = {
    "mode-turbo": _break_config("mode", "turbo"),
    "precision-fp7": _break_config("precision", "fp7"),
    "options-not-json": _break_config("options", "{not json"),
    "batch-size-text": _break_config("batch_size", "eight"),
    "unknown-inductor-option": lambda e: e["config"].update(mode="default", options='{"no_such_knob": 1}'),
    "config-id-only": _only_an_id,
    "decided-at-text": _decided_yesterday,
}


def _damage_lock(file: Path, change) -> None:
    document = json.loads(file.read_text())
    for by_torch in document["entries"].values():
        for entry in by_torch.values():
            change(entry)
    file.write_text(json.dumps(document))


@pytest.mark.parametrize("damage", list(ENTRY_DAMAGE.values()), ids=list(ENTRY_DAMAGE))
def test_a_lock_entry_this_version_cannot_use_falls_back_with_one_warning(tmp_path, db, damage):
    policy_path, decision = decided_policy(tmp_path, db)
    lock = write_lock(policy_path, decision)
    _damage_lock(lock, damage)
    served, said = compile_with_warnings(policy_path, str(tmp_path / "no-store.db"), deployment="svc-prod")
    assert served.decision.source == "none" and served.decision.state == "fallback"
    assert served.decision.config["id"] == config("eager", "fp32").id  # the policy's [fallback]
    assert len(said) == 1 and str(lock) in said[0] and "joulepilot policy lock" in said[0]
    assert "svc" in said[0]
    served.close()


@pytest.mark.parametrize("damage", list(ENTRY_DAMAGE.values()), ids=list(ENTRY_DAMAGE))
def test_a_lock_entry_this_version_cannot_use_gives_way_to_the_store(tmp_path, db, damage):
    policy_path, decision = decided_policy(tmp_path, db)
    lock = write_lock(policy_path, decision)
    _damage_lock(lock, damage)
    served, said = compile_with_warnings(policy_path, db)
    assert served.decision.source == "store" and served.decision.config["id"] == decision.config_id
    assert len(said) == 1 and str(lock) in said[0] and "joulepilot policy lock" in said[0]


@pytest.mark.parametrize("bad_one", ["beside", "lock_dir"])
def test_an_unusable_entry_in_one_lock_file_gives_way_to_the_other(tmp_path, db, monkeypatch, bad_one):
    """The audit's case: a lock file beside the policy and one in <home>/locks whose decided_at is not a time."""
    monkeypatch.setenv("JOULEPILOT_LOCK_DIR", str(tmp_path / "locks"))
    policy_path, decision = decided_policy(tmp_path, db)
    files = {"beside": write_lock(policy_path, decision),
             "lock_dir": write_lock(None, decision, lock_dir=tmp_path / "locks")}
    assert files["lock_dir"] == lock_dir_path(tmp_path / "locks", "svc")
    _damage_lock(files[bad_one], _decided_yesterday)
    good = files["lock_dir" if bad_one == "beside" else "beside"]
    served, said = compile_with_warnings(policy_path, str(tmp_path / "no-store.db"))
    assert served.decision.source == "lock" and served.decision.details["lock_file"] == str(good)
    assert len(said) == 1 and str(files[bad_one]) in said[0] and "decided_at" in said[0]
    locked, problems = find_locked(policy_path, "svc", "cpu", decision.torch_version, policy_hash=decision.policy_hash,
                                   lock_dir=tmp_path / "locks")
    assert locked is not None and locked.path == str(good)
    assert len(problems) == 1 and str(files[bad_one]) in problems[0]


@pytest.mark.parametrize("bad_one", ["beside", "lock_dir"])
def test_a_newer_entry_this_torch_cannot_apply_gives_way_to_the_other_lock_file(tmp_path, db, monkeypatch, bad_one):
    """The newest entry names an Inductor option the installed torch lacks; the other file's older entry applies
    (it used to be skipped along with it, so the fallback applied)."""
    monkeypatch.setenv("JOULEPILOT_LOCK_DIR", str(tmp_path / "locks"))
    policy_path, decision = decided_policy(tmp_path, db)
    older = resolve(load_policy(policy_path), db, "cpu")
    older.decided_at = decision.decided_at - 100
    write = {"beside": lambda d: write_lock(policy_path, d),
             "lock_dir": lambda d: write_lock(None, d, lock_dir=tmp_path / "locks")}
    bad = write[bad_one](decision)
    good = write["lock_dir" if bad_one == "beside" else "beside"](older)
    _damage_lock(bad, ENTRY_DAMAGE["unknown-inductor-option"])
    served, said = compile_with_warnings(policy_path, str(tmp_path / "no-store.db"))
    assert served.decision.source == "lock" and served.decision.details["lock_file"] == str(good)
    assert served.decision.config["id"] == older.config_id
    assert len(said) == 1 and str(bad) in said[0] and "no_such_knob" in said[0]


def test_find_locked_asks_the_caller_newest_first_until_an_entry_passes(tmp_path, db):
    policy_path, decision = decided_policy(tmp_path, db)
    older = resolve(load_policy(policy_path), db, "cpu")
    older.decided_at = decision.decided_at - 100
    newest_file = write_lock(policy_path, decision)
    older_file = write_lock(None, older, lock_dir=tmp_path / "locks")
    asked: list[float] = []

    def refuse_the_newest(entry: dict) -> str | None:
        asked.append(entry["decided_at"])
        return "is refused by the caller" if entry["decided_at"] == decision.decided_at else None

    locked, problems = find_locked(policy_path, "svc", "cpu", decision.torch_version,
                                   policy_hash=decision.policy_hash, lock_dir=tmp_path / "locks",
                                   usable=refuse_the_newest)
    assert locked is not None and locked.path == str(older_file)
    assert asked == [decision.decided_at, older.decided_at]
    [problem] = problems
    assert problem.startswith(f"{newest_file}: the entry for cpu / torch {decision.torch_version} is refused by")
    asked.clear()
    locked, problems = find_locked(policy_path, "svc", "cpu", decision.torch_version,
                                   policy_hash=decision.policy_hash, lock_dir=tmp_path / "locks",
                                   usable=lambda entry: asked.append(entry["decided_at"]))
    assert locked is not None and locked.path == str(newest_file) and problems == []
    assert asked == [decision.decided_at]  # the older entry, which loses anyway, is not checked


def test_an_unusable_entry_made_for_other_policy_content_is_not_reported(tmp_path, db):
    """An entry for an older version of the policy is never applied, so it is not checked either."""
    policy_path, decision = decided_policy(tmp_path, db)
    decision.policy_hash = "0" * 16
    lock = write_lock(policy_path, decision)
    _damage_lock(lock, _break_config("mode", "turbo"))
    served, said = compile_with_warnings(policy_path, db)
    assert served.decision.source == "store" and said == []


def test_a_lock_file_of_a_newer_format_is_skipped_with_its_own_message(tmp_path, db):
    policy_path, decision = decided_policy(tmp_path, db)
    lock = write_lock(policy_path, decision)
    document = json.loads(lock.read_text())
    document["format"] = LOCK_FORMAT + 1
    lock.write_text(json.dumps(document))
    served, said = compile_with_warnings(policy_path, db)
    assert served.decision.source == "store" and served.decision.config["id"] == decision.config_id
    assert len(said) == 1 and str(lock) in said[0]
    assert "newer joulepilot" in said[0] and "upgrade joulepilot" in said[0]
    assert f"format {LOCK_FORMAT + 1}" in said[0]


@pytest.mark.parametrize("fmt", ["1", 0, True, None])
def test_a_lock_file_whose_format_is_not_a_version_is_skipped(tmp_path, db, fmt):
    policy_path, decision = decided_policy(tmp_path, db)
    lock = write_lock(policy_path, decision)
    document = json.loads(lock.read_text())
    document["format"] = fmt
    lock.write_text(json.dumps(document))
    served, said = compile_with_warnings(policy_path, db)
    assert served.decision.source == "store"
    assert len(said) == 1 and str(lock) in said[0] and "format" in said[0]


@pytest.mark.parametrize(("path", "value"), [
    ("$.config.precision", "fp8"),
    ("$.config.mode", "turbo"),
    ("$.config.options", "{not json"),
    ("$.config.batch_size", "eight"),
], ids=["precision-fp8", "mode-turbo", "options-not-json", "batch-size-text"])
def test_a_stored_decision_this_version_cannot_use_falls_back_with_one_warning(tmp_path, db, path, value):
    """The audit's store case: a decision row naming a configuration this joulepilot cannot parse (as a newer
    joulepilot sharing the database might write), with no lock file."""
    policy_path, decision = decided_policy(tmp_path, db)
    db.execute(f"UPDATE decisions SET details = json_set(details, '{path}', ?)", [value])
    db.conn.commit()
    served, said = compile_with_warnings(policy_path, db_file(db), deployment="svc-prod")
    assert served.decision.source == "none" and served.decision.state == "fallback"
    assert served.decision.config["id"] == config("eager", "fp32").id
    assert len(said) == 1 and db_file(db) in said[0] and "svc" in said[0]
    assert "upgrade joulepilot" in said[0] and "joulepilot policy lock" in said[0]
    served.close()


def test_a_stored_decision_this_version_cannot_use_gives_way_to_the_lock_files_first(tmp_path, db):
    """Lock files come first, so a good one serves even when the stored row cannot be parsed."""
    policy_path, decision = decided_policy(tmp_path, db)
    write_lock(policy_path, decision)
    db.execute("UPDATE decisions SET details = json_set(details, '$.config.precision', 'fp8')")
    db.conn.commit()
    served, said = compile_with_warnings(policy_path, db_file(db))
    assert served.decision.source == "lock" and served.decision.config["id"] == decision.config_id
    assert said == []


def test_a_good_decision_is_still_applied_from_either_source(tmp_path, db):
    """The checks do not refuse what this version writes."""
    policy_path, decision = decided_policy(tmp_path, db)
    stored, said = compile_with_warnings(policy_path, db)
    assert stored.decision.source == "store" and said == []
    write_lock(policy_path, decision)
    locked, said = compile_with_warnings(policy_path, db)
    assert locked.decision.source == "lock" and locked.decision.config["id"] == decision.config_id and said == []


def test_a_stored_decision_whose_workload_id_is_not_text_is_served_and_metered_under_the_policys(tmp_path, db):
    policy_path, decision = decided_policy(tmp_path, db)
    db.execute("UPDATE decisions SET details = json_set(details, '$.workload_id', json('[\"a\"]'))")
    db.conn.commit()
    served, said = compile_with_warnings(policy_path, db_file(db), deployment="svc-prod")
    assert served.decision.source == "store" and served.decision.workload_id is None and said == []
    assert type(served).__name__ == "MeteredModel"
    served.close()
