"""A compiled configuration that uses more energy per call than eager never breaks even against it: the
decision says so (`break_even_never`, `break_even_inferences` null) and in words, and no JSON joulepilot
writes (lock files, decisions' details) ever holds `Infinity` or `NaN`, which SQLite's JSON functions and
strict readers refuse. Decisions stored with `Infinity` by an older joulepilot still read."""

from __future__ import annotations

import json
import math

import pytest
from bill_factories import store_run, write_policy
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig
from joulepilot.policies import decide, load_policy, stored_decision, sync_lock, torch_minor
from joulepilot.policies.lock import lock_path
from joulepilot.policies.resolve import BREAK_EVEN_NEVER
from joulepilot.store import open_db
from joulepilot.store.decisions import latest_decision, write_decision

from joulepilot.cli import main

DEFAULT = CompileConfig("default", batch_size=8)
EAGER = CompileConfig("eager", batch_size=8)


def refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def strict(text: str):
    """JSON as any strict reader takes it: `NaN`, `Infinity` and `-Infinity` refused."""
    return json.loads(text, parse_constant=refuse)


def store_costlier_than_eager(db) -> None:
    """Eager at 0.01 J per call but 50 W; compiled default at 0.02 J per call and 10 W. A 20 W envelope
    forces the compiled one, which uses more energy per call than eager."""
    for _ in range(3):
        store_run(db, "eager", "fp32", 0.01, avg_w=50.0)
        store_run(db, "default", "fp32", 0.02, avg_w=10.0)


def write_capped_policy(folder):
    return write_policy(folder, "svc", modes=("eager", "default"), precisions=("fp32",),
                        limits="[limits]\nmax_avg_power_w = 20")


def test_a_configuration_costlier_than_eager_never_breaks_even_and_writes_strict_json(tmp_path, monkeypatch):
    path = tmp_path / "j.db"
    db = open_db(path)
    store_costlier_than_eager(db)
    db.close()
    policy = write_capped_policy(tmp_path)

    locked = CliRunner().invoke(main, ["policy", "lock", str(policy), "--db", str(path)])
    assert locked.exit_code == 0, locked.output
    entry = strict(lock_path(policy).read_text())["entries"]["cpu"][torch_minor()]
    assert entry["config_id"] == DEFAULT.id
    assert entry["break_even_inferences"] is None and entry["break_even_never"] is True

    db = open_db(path)
    try:
        rows = db.execute("SELECT json_valid(details), json_extract(details, '$.break_even_inferences'), "
                          "json_extract(details, '$.break_even_never') FROM decisions").fetchall()
        details = [strict(d) for (d,) in db.execute("SELECT details FROM decisions").fetchall()]
    finally:
        db.close()
    assert rows == [(1, None, 1)]
    by_config = {c["config"]["id"]: c for c in details[0]["candidates"]}
    assert by_config[DEFAULT.id]["break_even_never"] is True and by_config[DEFAULT.id]["break_even_inferences"] is None
    assert by_config[EAGER.id]["break_even_never"] is False and by_config[EAGER.id]["break_even_inferences"] == 0

    monkeypatch.setenv("COLUMNS", "300")
    explain = CliRunner().invoke(main, ["policy", "explain", str(policy), "--db", str(path)])
    assert explain.exit_code == 0, explain.output
    lines = explain.output.splitlines()
    assert f"break-even vs eager fp32: {BREAK_EVEN_NEVER}" in lines
    assert "inf" not in " ".join(line for line in lines if "break-even" in line)
    chosen = next(line for line in lines if line.startswith("chosen") and DEFAULT.label in line)
    assert " never " in chosen and " inf " not in chosen

    as_json = CliRunner().invoke(main, ["policy", "explain", str(policy), "--db", str(path), "--json"])
    data = strict(as_json.stdout)
    assert data["break_even_inferences"] is None and data["break_even_never"] is True


def test_a_decision_stored_with_infinity_by_an_older_joulepilot_still_reads(db, tmp_path):
    store_costlier_than_eager(db)
    policy = load_policy(write_capped_policy(tmp_path))
    fresh = decide(db, policy, "cpu", record=False, lock=False).decision
    # What the older writer stored: the break-even as an infinity, written as `Infinity`.
    old = fresh.to_dict()
    old.pop("break_even_never")
    old["break_even_inferences"] = math.inf
    for cand in old["candidates"]:
        if cand.pop("break_even_never"):
            cand["break_even_inferences"] = math.inf
    columns = ("policy", "policy_hash", "device_kind", "torch_version", "state", "reason", "decided_at")
    details = {k: v for k, v in old.items() if k not in (*columns, "id")}
    text = json.dumps(details, sort_keys=True, default=str)
    assert "Infinity" in text
    write_decision(db, {**{k: old[k] for k in columns}, "config_id": fresh.config_id, "details": text})
    assert latest_decision(db, "svc", "cpu").details["break_even_inferences"] == math.inf

    decision = stored_decision(db, "svc", "cpu", torch_minor())
    assert decision.config_id == DEFAULT.id
    assert decision.break_even_inferences is None and decision.break_even_never is True
    by_config = {c.config_id: c for c in decision.candidates}
    assert by_config[DEFAULT.id].break_even_never and by_config[DEFAULT.id].break_even_inferences is None
    assert not by_config[EAGER.id].break_even_never and by_config[EAGER.id].break_even_inferences == 0

    # A lock written from it (a lock write retried) is strict JSON.
    written = sync_lock(db, policy, "cpu")
    assert written == lock_path(policy.path)
    entry = strict(written.read_text())["entries"]["cpu"][torch_minor()]
    assert entry["break_even_inferences"] is None and entry["break_even_never"] is True


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_decision_details_are_written_as_strict_json(db, bad):
    write_decision(db, {"policy": "p", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                        "config_id": None, "state": "fallback", "reason": "", "decided_at": 1.0,
                        "details": {"score": bad, "candidates": [{"figures": {"max_rel_error": bad}}]}})
    (text,) = db.execute("SELECT details FROM decisions").fetchone()
    assert strict(text) == {"score": None, "candidates": [{"figures": {"max_rel_error": None}}]}
