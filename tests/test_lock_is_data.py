"""A lock file or a stored decision is data, never code (issue 25, item 1). The hook applies only what the policy
allows: a configuration of its [search] grid or its [fallback], Inductor options only from the knobs joulepilot
searches, a decided_at not in the future, a lock file of bounded size. Anything else is passed over with one warning
naming the file (or database) and the fix, and the next source applies; the writers (`policy lock`, the daemon's
lock upkeep) never write such an entry back."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_factories import write_daemon_config
from daemon_factories import write_policy as write_eager_policy
from decision_factories import compile_with_warnings, db_file, decided_policy, seed_runs, write_policy
from joulepilot.compiler import CompileConfig
from joulepilot.policies import LockWriteError, decide, load_policy, record_decision, sync_lock, write_lock
from joulepilot.policies.allowed import CLOCK_SKEW_S, decision_refusal
from joulepilot.policies.lock import MAX_LOCK_BYTES, lock_path
from joulepilot.store import open_db

from joulepilot.cli import main

FAR_FUTURE = 1e15  # the audit's decided_at: some 31 million years ahead


def cxx_wrapper(folder: Path) -> tuple[Path, Path]:
    """A compiler wrapper that leaves a marker file each time it runs, then compiles as g++ would."""
    marker = folder / "cxx-ran"
    script = folder / "cxx.sh"
    script.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec g++ "$@"\n')
    script.chmod(0o755)
    return script, marker


def row(mode: str = "eager", precision: str = "fp32", **more) -> dict:
    """A well-formed configuration row (its id and label those of its settings), at the test policy's batch 8."""
    return CompileConfig(mode, precision=precision, **{"batch_size": 8, **more}).to_row()


def tamper_lock(file: Path, config_row: dict | None = None, **entry_fields) -> None:
    document = json.loads(file.read_text())
    for by_torch in document["entries"].values():
        for entry in by_torch.values():
            if config_row is not None:
                entry.update(config=config_row, config_id=config_row["id"], label=config_row["label"])
            entry.update(entry_fields)
    file.write_text(json.dumps(document))


def store_decision(db, decision, config_row: dict | None = None, **fields) -> int:
    """A copy of `decision` stored as a new row, with another configuration and fields (decided_at, ...)."""
    copy = dataclasses.replace(decision, **({"config": config_row} if config_row else {}), **fields)
    return record_decision(db, copy)


# --- a configuration that names a program -------------------------------------------------------------------


@pytest.mark.parametrize("source", ["lock", "store"])
def test_inductor_options_naming_a_program_are_never_applied(tmp_path, db, monkeypatch, source):
    """The audit's case: `cpp.cxx` pointing at a script ran that script inside the serving process (a real compile
    on the CPU, in a fresh Inductor cache, builds C++ with it). It is passed over with one warning."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    policy_path, decision = decided_policy(tmp_path, db, lock=source == "lock")
    script, marker = cxx_wrapper(tmp_path)
    hostile = row("default", "bf16", options={"cpp.cxx": [str(script)]})  # bf16 casts: a C++ kernel to build
    if source == "lock":
        tamper_lock(lock_path(policy_path), hostile)
    else:
        store_decision(db, decision, hostile, decided_at=decision.decided_at + 1)

    served, said = compile_with_warnings(policy_path, db_file(db))

    assert not marker.exists(), "a compiler named by a decision ran in the serving process"
    assert served.decision.source == "store" and served.decision.config["id"] == decision.config_id
    [warning] = said
    where = str(lock_path(policy_path)) if source == "lock" else db_file(db)
    assert where in warning and "'cpp.cxx'" in warning and "joulepilot policy lock" in warning


def test_only_the_searched_knobs_pass_and_only_as_booleans(tmp_path):
    policy = load_policy(write_policy(tmp_path / "policies"))
    assert decision_refusal(policy, row("default", options={"epilogue_fusion": False}), time.time()) is None
    for options in ({"cpp.cxx": ["/bin/true"]}, {"epilogue_fusion": "/tmp/x.so"}, {"max_fusion_size": 8},
                    {"cuda.cutlass_dir": "/opt"}):
        refusal = decision_refusal(policy, row("default", options=options), time.time())
        assert refusal is not None and repr(next(iter(options))) in refusal.problem


# --- a configuration outside the policy's grid --------------------------------------------------------------

OUTSIDE = {  # the test policy searches modes eager and default, precisions fp32 and bf16, at batch 8
    "mode": (row("max-autotune"), "mode 'max-autotune'"),
    "precision": (row("eager", "fp16"), "precision 'fp16'"),
    "fusion": (row("default", fusion="aggressive-fusion"), "fusion preset 'aggressive-fusion'"),
    "batch": (CompileConfig("eager", batch_size=64).to_row(), "batch size 64"),
    "regional": (row("default", regional="auto"), "regional setting 'auto'"),
}


@pytest.mark.parametrize("where", ["lock", "store"])
@pytest.mark.parametrize("outside", list(OUTSIDE))
def test_a_configuration_outside_the_policys_grid_is_passed_over(tmp_path, db, where, outside):
    config_row, named = OUTSIDE[outside]
    policy_path, decision = decided_policy(tmp_path, db, lock=where == "lock")
    if where == "lock":
        tamper_lock(lock_path(policy_path), config_row)
        expected_source, expected_id = "store", decision.config_id
    else:
        store_decision(db, decision, config_row, decided_at=decision.decided_at + 1)
        expected_source, expected_id = "store", decision.config_id  # the earlier decision, the newest it allows
    served, said = compile_with_warnings(policy_path, db_file(db))
    assert (served.decision.source, served.decision.config["id"]) == (expected_source, expected_id)
    [warning] = said
    assert named in warning and "[search]" in warning and "joulepilot policy lock" in warning
    assert (str(lock_path(policy_path)) if where == "lock" else db_file(db)) in warning


def test_the_policys_fallback_is_allowed_though_outside_its_grid(tmp_path):
    path = write_policy(tmp_path / "policies")
    path.write_text(path.read_text().replace('[fallback]\nmode = "eager"', '[fallback]\nmode = "eager"\n'
                                                                           'precision = "fp16"'))
    policy = load_policy(path)
    assert decision_refusal(policy, row("eager", "fp16"), time.time()) is None
    assert decision_refusal(policy, row("default", "fp16"), time.time()) is not None


def test_a_row_whose_id_is_not_that_of_its_settings_is_refused(tmp_path):
    """A lock entry relabelled by hand: metering would record it under another configuration's id."""
    policy = load_policy(write_policy(tmp_path / "policies"))
    relabelled = {**row("default"), "id": row("eager")["id"]}
    refusal = decision_refusal(policy, relabelled, time.time())
    assert refusal is not None and "is not the id of its settings" in refusal.problem


# --- decided_at in the future --------------------------------------------------------------------------------


def test_a_lock_entry_dated_in_the_future_is_passed_over(tmp_path, db):
    policy_path, decision = decided_policy(tmp_path, db, lock=True)
    tamper_lock(lock_path(policy_path), row("eager", "fp32"), decided_at=FAR_FUTURE)
    served, said = compile_with_warnings(policy_path, db_file(db))
    assert served.decision.source == "store" and served.decision.config["id"] == decision.config_id
    [warning] = said
    assert str(lock_path(policy_path)) in warning and "ahead of this host's clock" in warning


def test_a_stored_decision_dated_in_the_future_does_not_outrank_the_decisions_after_it(tmp_path, db):
    """decided_at = 1e15 made a row the newest for good: every later decision lost to it."""
    policy_path, decision = decided_policy(tmp_path, db)
    store_decision(db, decision, row("eager", "fp32"), decided_at=FAR_FUTURE)
    later = store_decision(db, decision, decided_at=time.time())
    served, said = compile_with_warnings(policy_path, db_file(db))
    assert served.decision.source == "store" and served.decision.id == later
    assert served.decision.config["id"] == decision.config_id
    [warning] = said
    assert db_file(db) in warning and "ahead of this host's clock" in warning


def test_a_clock_a_little_ahead_is_allowed(tmp_path):
    policy = load_policy(write_policy(tmp_path / "policies"))
    now = time.time()
    assert decision_refusal(policy, row(), now + CLOCK_SKEW_S - 1, now=now) is None
    assert decision_refusal(policy, row(), now + CLOCK_SKEW_S + 1, now=now) is not None


# --- size ---------------------------------------------------------------------------------------------------


def test_an_oversized_lock_file_is_not_read(tmp_path, db):
    policy_path, decision = decided_policy(tmp_path, db, lock=True)
    lock = lock_path(policy_path)
    tamper_lock(lock, reason="x" * MAX_LOCK_BYTES)
    served, said = compile_with_warnings(policy_path, db_file(db))
    assert served.decision.source == "store"
    [warning] = said
    assert str(lock) in warning and f"larger than the {MAX_LOCK_BYTES:,} bytes" in warning


def test_the_writer_keeps_the_file_within_the_cap_by_dropping_the_oldest_entries(tmp_path, db, caplog):
    policy_path, decision = decided_policy(tmp_path, db)
    with caplog.at_level(logging.WARNING, logger="joulepilot.lock"):
        for i in range(12):  # other device kinds' entries of 100 KB each, the oldest first
            write_lock(policy_path, dataclasses.replace(decision, device_kind=f"gpu-{i}", reason="r" * 100_000,
                                                        decided_at=decision.decided_at - 100 + i))
        write_lock(policy_path, decision)
    lock = lock_path(policy_path)
    assert lock.stat().st_size <= MAX_LOCK_BYTES
    entries = json.loads(lock.read_text())["entries"]
    assert "cpu" in entries and "gpu-0" not in entries and "gpu-11" in entries
    assert any("oldest entr" in r.getMessage() for r in caplog.records)


# --- the writers -------------------------------------------------------------------------------------------


def test_write_lock_refuses_a_decision_its_policy_would_not_apply(tmp_path, db):
    policy_path, decision = decided_policy(tmp_path, db)
    hostile = dataclasses.replace(decision, config=row("default", options={"cpp.cxx": ["/bin/sh"]}))
    with pytest.raises(LockWriteError, match="cpp.cxx"):
        write_lock(policy_path, hostile, policy=load_policy(policy_path))
    assert not lock_path(policy_path).exists()


def test_the_lock_writer_drops_an_entry_a_reader_would_refuse(tmp_path, db, caplog):
    policy_path, decision = decided_policy(tmp_path, db)
    write_lock(policy_path, dataclasses.replace(decision, device_kind="NVIDIA H200"))
    tamper_lock(lock_path(policy_path), row("max-autotune"))
    with caplog.at_level(logging.WARNING, logger="joulepilot.lock"):
        write_lock(policy_path, decision, policy=load_policy(policy_path))
    entries = json.loads(lock_path(policy_path).read_text())["entries"]
    assert list(entries) == ["cpu"]
    [message] = [r.getMessage() for r in caplog.records if r.name == "joulepilot.lock"]
    assert "NVIDIA H200" in message and "max-autotune" in message


def test_the_daemons_lock_upkeep_never_copies_a_refused_row_and_replaces_a_refused_entry(tmp_path, db):
    policy_path, decision = decided_policy(tmp_path, db, lock=True)
    policy = load_policy(policy_path)
    store_decision(db, decision, row("default", options={"cpp.cxx": ["/bin/sh"]}), decided_at=time.time())
    assert sync_lock(db, policy, "cpu") is None  # the newest row it may copy is the one already locked
    assert "cpp.cxx" not in lock_path(policy_path).read_text()
    tamper_lock(lock_path(policy_path), decided_at=FAR_FUTURE)
    assert sync_lock(db, policy, "cpu") == lock_path(policy_path)  # it used to count as newer than the store's
    entry = json.loads(lock_path(policy_path).read_text())["entries"]["cpu"][decision.torch_version]
    assert entry["decided_at"] == decision.decided_at and entry["config_id"] == decision.config_id


def test_a_daemon_pass_is_not_fooled_by_a_stored_decision_dated_in_the_future(tmp_path, restore_logging):
    """A row of older policy content dated 1e15 made every pass re-decide (the newest decision looked made for
    another policy version) while the hook kept applying the fallback."""
    from joulepilot.controller.device_probe import probe_device

    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    path = write_eager_policy(policies, "mlp")
    provenance = probe_device("cpu").provenance_key
    store = open_db(db)
    seed_runs(store, {("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 30.0}})
    store.execute("UPDATE runs SET provenance_key = ?", [provenance])
    decide(store, load_policy(path), "cpu", provenance_key=provenance, decided_by="daemon")  # current: not stale
    store.execute("INSERT INTO decisions (policy, policy_hash, device_kind, torch_version, config_id, state, reason, "
                  "decided_at, details) SELECT policy, '0000000000000000', device_kind, torch_version, config_id, "
                  "state, reason, ?, details FROM decisions", [FAR_FUTURE])
    store.conn.commit()
    store.close()
    cfg = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)

    logging.getLogger("joulepilot").handlers.clear()
    result = CliRunner().invoke(main, ["daemon", "--config", str(cfg), "--once", "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    summary = json.loads(result.stdout)
    assert summary["stale"] == [] and summary["decided"] == []
