"""The hook never takes a serving process down: files the daemon writes are readable by other users, and
unreadable lock files, broken stores and unparsable policy files end in one warning, never a raise."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from decision_factories import (
    can_restrict,
    compile_with_warnings,
    config,
    db_file,
    decided_policy,
    give_away,
    hook_in_new_process,
    write_policy,
)
from joulepilot.policies import write_lock
from joulepilot.policies.lock import lock_path
from joulepilot.runtime import MeteredModel
from joulepilot.store import import_runs, open_db, read_export

H200_SWEEP = Path(__file__).parent / "data" / "gpu_sweep_h200.json"

needs_restriction = pytest.mark.skipif(not can_restrict(), reason="needs setpriv to drop root's overrides")


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_lock_files_are_created_as_ordinary_files(tmp_path, db, umask):
    """Item 2: not 0600 (mkstemp): the umask decides, as for any file."""
    policy_path, decision = decided_policy(tmp_path, db)
    old = os.umask(umask)
    try:
        written = write_lock(policy_path, decision)
    finally:
        os.umask(old)
    assert _mode(written) == 0o666 & ~umask
    assert not [p for p in written.parent.iterdir() if p.name.endswith(".tmp")]


@needs_restriction
def test_a_lock_file_written_by_the_daemon_user_is_read_by_another_user(tmp_path, db, umask_022):
    policy_path, decision = decided_policy(tmp_path, db)
    give_away(write_lock(policy_path, decision))  # the daemon's user wrote it
    applied = hook_in_new_process(policy_path, tmp_path / "no.db", restricted=True)
    assert applied["source"] == "lock" and applied["label"] == decision.label and applied["warnings"] == []


@needs_restriction
def test_an_unreadable_lock_file_costs_one_warning_never_a_raise(tmp_path, db, umask_022):
    policy_path, decision = decided_policy(tmp_path, db)
    lock = write_lock(policy_path, decision)
    lock.chmod(0o600)  # as an older joulepilot wrote it
    give_away(lock)
    applied = hook_in_new_process(policy_path, db_file(db), restricted=True)
    assert applied["source"] == "store" and applied["label"] == decision.label
    assert len(applied["warnings"]) == 1 and str(lock) in applied["warnings"][0]
    assert "chmod" in applied["warnings"][0]
    alone = hook_in_new_process(policy_path, tmp_path / "none.db", restricted=True)  # and no store at all
    assert alone["source"] == "none" and alone["state"] == "fallback"
    assert len(alone["warnings"]) == 1 and str(lock) in alone["warnings"][0]


@needs_restriction
def test_a_read_only_store_still_gives_its_decision(tmp_path, db):
    """A hook running as another user can read the daemon's database but not write it (nor its folder)."""
    policy_path, decision = decided_policy(tmp_path, db)
    folder = tmp_path / "state"
    folder.mkdir()
    path = folder / "jp.db"
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(db_file(db), path)
    if os.geteuid() == 0:
        give_away(folder, path)
    else:
        path.chmod(0o444)
        folder.chmod(0o555)
    try:
        applied = hook_in_new_process(policy_path, path, restricted=True)
    finally:
        folder.chmod(0o755)
    assert applied["source"] == "store" and applied["label"] == decision.label and applied["warnings"] == []


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def _truncated(path: Path) -> None:
    db = open_db(path)
    import_runs(db, read_export(H200_SWEEP))
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 3)


def _future_schema(path: Path) -> None:
    db = open_db(path)
    db.execute("PRAGMA user_version = 999")
    db.close()


@pytest.mark.parametrize("damage", [_garbage, _truncated, _future_schema], ids=["garbage", "truncated", "future"])
def test_a_broken_store_falls_back_with_one_warning(tmp_path, damage):
    policy_path = write_policy(tmp_path / "policies")
    path = tmp_path / "broken.db"
    damage(path)
    before = path.read_bytes()
    served, said = compile_with_warnings(policy_path, str(path))
    assert served.decision.source == "none" and served.decision.state == "fallback"
    assert served.decision.config["id"] == config("eager", "fp32").id
    assert len(said) == 1 and str(path) in said[0]
    assert path.read_bytes() == before  # nothing was written into it
    _, again = compile_with_warnings(policy_path, str(path))
    assert again == []  # once per process
    metered, said = compile_with_warnings(policy_path, str(path), deployment="svc-prod")  # metering needs the store
    assert not isinstance(metered, MeteredModel) and metered.flush() == 0 and said == []  # served unmetered


@pytest.mark.parametrize("content", [
    "name = \"svc\"\nworkload = \"mlp\"\n".encode("utf-16"),
    b"name = \"svc\xff\xfe\"\nworkload = \"mlp\"\nbatch_size = 8\n",
    ("x = " + "[" * 5000 + "]" * 5000 + "\n").encode(),
], ids=["utf-16", "invalid-bytes", "5000-deep"])
def test_an_unparsable_policy_file_runs_the_model_uncompiled(tmp_path, content):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    served, said = compile_with_warnings(path, str(tmp_path / "none.db"))
    assert served.decision.source == "none" and served.decision.config["mode"] == "eager"
    assert len(said) == 1 and str(path) in said[0]
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize("content", [
    "{\"entries\": {}}".encode("utf-16"),
    ("{\"entries\": " + "[" * 5000 + "]" * 5000 + "}").encode(),
    b"{\"entries\": {\"cpu\": 7}}",
], ids=["utf-16", "5000-deep", "malformed-entry"])
def test_an_unusable_lock_file_gives_way_to_the_store(tmp_path, db, content):
    policy_path, decision = decided_policy(tmp_path, db)
    lock_path(policy_path).write_bytes(content)
    served, said = compile_with_warnings(policy_path, db)
    assert served.decision.source == "store" and served.decision.config["id"] == decision.config_id
    assert len(said) == 1 and str(lock_path(policy_path)) in said[0]


@pytest.mark.slow
def test_saved_compile_artifacts_are_created_as_ordinary_files(tmp_path, umask_022):
    from joulepilot.compiler import save_artifacts

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(x) * 2 + 1)
    compiled(torch.randn(32))
    saved = save_artifacts(tmp_path / "artifacts" / "a.bin")
    assert saved is not None and _mode(saved) == 0o644
