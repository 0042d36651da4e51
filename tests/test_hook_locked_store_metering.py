"""A store another process holds write-locked while `joulepilot.compile(..., deployment=...)` runs (a daemon's
brief write at start-up) does not leave the deployment unmetered for the process: compile() still returns within
about a second per store use, the deployment is attached, and its metering thread registers it once the lock is
released; the windows served meanwhile reach the store. A store unusable for other reasons still serves
unmetered (tests/test_hook_unusable_decisions.py)."""

from __future__ import annotations

import sqlite3
import time
import warnings
from pathlib import Path

import torch
from decision_factories import db_file, seed_runs, write_policy
from joulepilot.policies import load_policy, record_decision, resolve
from joulepilot.runtime import compile as jp_compile
from joulepilot.runtime.lookup import SERVING_BUSY_TIMEOUT_MS
from joulepilot.store import open_db
from joulepilot.store.db import BUSY_TIMEOUT_MS
from joulepilot.store.deployments import get_deployment, read_samples
from pending_factories import write_lock_held

FIGURES = {("eager", "bf16"): {"energy_j_per_inference": 0.01, "avg_power_w": 0.2},
           ("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 0.3}}
# compile() meets the locked store at most twice (a benchmark request, then the deployment's registration), each
# after one serving busy timeout (1 s); had it waited the store's own (30 s) even once, it would take longer than
# this. The rest is slack for a loaded machine. The lock is released only once compile() has returned.
BOUND_S = BUSY_TIMEOUT_MS / 1000 / 2
assert BOUND_S > 2 * SERVING_BUSY_TIMEOUT_MS / 1000 + 5


def test_a_deployment_compiled_while_the_store_is_write_locked_is_metered_once_it_is_released(tmp_path, db):
    policy_path = write_policy(tmp_path / "policies")
    seed_runs(db, FIGURES)
    decision = resolve(load_policy(policy_path), db, "cpu")
    record_decision(db, decision)
    path = Path(db_file(db))
    db.close()
    model = torch.nn.Sequential(torch.nn.Linear(16, 4)).eval()
    x = torch.randn(8, 16)
    with write_lock_held(path):  # released after compile() returned: it cannot have registered the deployment
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            served = jp_compile(model, policy=policy_path, db=str(path), deployment="svc-started-under-a-lock")
        took_s = time.monotonic() - start
        calls = 5
        for _ in range(calls):
            assert torch.allclose(served(x).float(), model(x), rtol=5e-2, atol=5e-2)
    assert took_s < BOUND_S, took_s
    assert hasattr(served, "close"), "the deployment was served unmetered"
    assert [str(w.message) for w in caught if "not metered" in str(w.message)] == []
    assert served.decision.source == "store" and served.decision.config["id"] == decision.config_id
    served.close()
    assert list(path.with_name(path.name + ".pending").glob("deployment-*.json")) == []  # nothing left aside
    store = open_db(path)
    try:
        row = get_deployment(store, "svc-started-under-a-lock")
        assert row is not None and row["config_id"] == decision.config_id
        windows = read_samples(store, row["id"])
    finally:
        store.close()
    assert windows and sum(w["inferences"] for w in windows) == calls
    assert served.samples_written == len(windows)


def test_a_deployment_whose_decision_could_not_be_read_for_a_lock_is_metered_on_the_fallback(tmp_path, db):
    """Locked for readers too (exclusive locking mode): the lookup gives up and says so, the fallback serves,
    and the deployment is still attached; it is registered once the lock is released."""
    policy_path = write_policy(tmp_path / "policies")
    seed_runs(db, FIGURES)
    record_decision(db, resolve(load_policy(policy_path), db, "cpu"))
    path = Path(db_file(db))
    db.close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:  # released after compile() returned
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            served = jp_compile(torch.nn.Sequential(torch.nn.Linear(16, 4)).eval(), policy=policy_path,
                                db=str(path), deployment="svc-fallback-under-a-lock")
        took_s = time.monotonic() - start
        served(torch.randn(8, 16))
    finally:
        holder.close()
    said = [str(w.message) for w in caught if "joulepilot" in str(w.message)]
    assert took_s < BOUND_S
    assert served.decision.source == "none"
    assert len(said) == 1 and "locked" in said[0] and "not metered" not in said[0]
    served.close()
    store = open_db(path)
    try:
        row = get_deployment(store, "svc-fallback-under-a-lock")
        assert row is not None and sum(w["inferences"] for w in read_samples(store, row["id"])) == 1
    finally:
        store.close()
