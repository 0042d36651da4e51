"""Lock files for read-only policy folders (the shipped systemd layout): the lock directory, retried
writes, and the unit itself."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from daemon_factories import daemon_cmd, query, write_daemon_config
from daemon_factories import write_policy as write_eager_policy
from decision_factories import (
    can_restrict,
    config,
    hook_in_new_process,
    make_unwritable,
    make_writable,
    restricted_cmd,
    seed_runs,
    write_policy,
)
from joulepilot.controller.daemon_config import load_daemon_config
from joulepilot.controller.device_probe import probe_device
from joulepilot.policies import load_policy, resolve, torch_minor, write_lock
from joulepilot.policies.lock import lock_path
from joulepilot.store import open_db

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "joulepilot.service"
needs_restriction = pytest.mark.skipif(not can_restrict(), reason="needs setpriv to drop root's overrides")


def test_lock_dir_is_a_daemon_key_and_defaults_under_the_state_dir(tmp_path, monkeypatch, _isolated_home):
    from joulepilot.policies import default_lock_dir

    assert load_daemon_config().lock_dir == _isolated_home / "locks" == default_lock_dir()
    monkeypatch.setenv("JOULEPILOT_LOCK_DIR", str(tmp_path / "elsewhere"))
    assert load_daemon_config().lock_dir == tmp_path / "elsewhere"
    cfg = tmp_path / "daemon.toml"
    cfg.write_text('lock_dir = "state/locks"\n')
    assert load_daemon_config(cfg).lock_dir == tmp_path / "state" / "locks"
    assert load_daemon_config(ROOT / "deploy" / "daemon.toml").lock_dir == Path("/var/lib/joulepilot/locks")


def test_a_read_only_policy_folder_locks_into_the_lock_dir_and_the_hook_reads_it(tmp_path, db):
    from joulepilot.policies.lock import lock_dir_path

    policies = tmp_path / "etc-policies"
    policy_path = write_policy(policies)
    seed_runs(db, {("eager", "bf16"): {"energy_j_per_inference": 0.01, "avg_power_w": 0.2}})
    decision = resolve(load_policy(policy_path), db, "cpu")
    written = write_lock(Path("/sys/joulepilot-test") / "svc.toml", decision, lock_dir=tmp_path / "locks")
    assert written == lock_dir_path(tmp_path / "locks", "svc") == tmp_path / "locks" / "svc.lock.json"
    # An older entry beside the policy loses to the newer one in the lock directory.
    older = resolve(load_policy(policy_path), db, "cpu")
    older.decided_at -= 3600
    older.config = config("eager", "fp32").to_row()
    write_lock(policy_path, older)
    applied = hook_in_new_process(policy_path, tmp_path / "none.db", env={"JOULEPILOT_LOCK_DIR": str(tmp_path / "locks")})
    assert applied["source"] == "lock" and applied["label"] == "eager/bf16/b8" and applied["warnings"] == []


def test_a_policy_name_cannot_reach_outside_the_lock_dir(tmp_path):
    from joulepilot.policies.lock import lock_dir_path

    path = lock_dir_path(tmp_path, "../../etc/passwd")
    assert path.parent == tmp_path and path.name.endswith(".lock.json")
    assert lock_dir_path(tmp_path, "a/b") != lock_dir_path(tmp_path, "a_b")


@needs_restriction
def test_the_daemon_locks_read_only_policies_and_retries_a_failed_write(tmp_path):
    """Item 17: as under the shipped unit, the policy folder is read-only to the daemon. Its lock file goes
    to the lock directory; when that cannot be written either, the decision stands and the next pass
    writes the file without deciding again."""
    db = tmp_path / "j.db"
    policies, locks = tmp_path / "policies", tmp_path / "locks"
    policy_file = write_eager_policy(policies, "mlp")
    # Measured already under this host's provenance, so the pass decides without running a benchmark.
    store = open_db(db)
    seed_runs(store, {("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 30.0}})
    store.execute("UPDATE runs SET provenance_key = ?", [probe_device("cpu").provenance_key])
    store.close()
    make_unwritable(policies)
    locks.mkdir()
    make_unwritable(locks)
    cfg = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)
    cfg.write_text(f'lock_dir = "{locks}"\n' + cfg.read_text())

    def once():
        proc = subprocess.run(restricted_cmd(daemon_cmd("--config", str(cfg), "--once", "--json")),
                              capture_output=True, text=True, timeout=400)
        assert proc.returncode in (0, 1), proc.stderr
        return json.loads(proc.stdout), proc.stderr

    try:
        summary, log = once()
        assert summary["enqueued"] == 0
        assert [d["policy"] for d in summary["decided"]] == ["mlp"] and summary["lock_files"] == []
        [error] = summary["policy_errors"]
        assert "retried next pass" in error["error"] and str(locks) in error["error"]
        assert not lock_path(policy_file).exists() and not (locks / "mlp.lock.json").exists()

        make_writable(locks)
        summary, log = once()
        assert summary["decided"] == [] and summary["policy_errors"] == [] and summary["enqueued"] == 0
        assert summary["lock_files"] == [str(locks / "mlp.lock.json")]
        [decision] = query(db, "SELECT * FROM decisions")
        entry = json.loads((locks / "mlp.lock.json").read_text())["entries"]["cpu"][torch_minor()]
        assert entry["decision_id"] == decision["id"] and entry["config_id"] == decision["config_id"]
        assert not lock_path(policy_file).exists()

        summary, _ = once()  # nothing to write any more
        assert summary["lock_files"] == [] and summary["policy_errors"] == []
    finally:
        make_writable(policies)
        make_writable(locks)


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_unit_verifies_and_its_security_score_is_the_one_the_readme_states(tmp_path):
    # ExecStart names where a site installs joulepilot; everything else must verify as shipped.
    unit = tmp_path / "joulepilot.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/joulepilot", shutil.which("true")))
    checked = _analyze("verify", str(unit))
    assert checked.returncode == 0, checked.stderr
    assert "ReadWritePaths=/var/lib/joulepilot" in UNIT.read_text()
    security = _analyze("security", "--offline=true", str(UNIT))
    found = re.search(r"Overall exposure level for joulepilot.service: ([0-9.]+) (\w+)", security.stdout)
    assert found, security.stdout + security.stderr
    score = found.group(1)
    assert float(score) <= 4.0
    assert f"exposure {score}" in UNIT.read_text()
    assert f"`systemd-analyze security` exposure {score}" in (ROOT / "README.md").read_text()
