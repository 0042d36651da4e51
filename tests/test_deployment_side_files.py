"""The store's side of deployment side files: imported once, extended not doubled, damaged ones kept and named."""

from __future__ import annotations

import json
import shutil
import sqlite3
import time

import pytest
from joulepilot.runtime.guard import Trip
from joulepilot.runtime.trips import trip_rows
from joulepilot.store import deployment_side_files as side_files_module
from joulepilot.store import open_db
from joulepilot.store.deployment_side_files import (
    deployment_side_file,
    describe_deployment_import,
    import_deployment_side_files,
    set_aside_deployment,
)
from joulepilot.store.deployment_writes import store_samples
from joulepilot.store.deployments import get_deployment, list_violations, read_samples, register_deployment
from pending_factories import write_lock_held


def _window(t_start: float, seconds: float = 5.0, calls: int = 100) -> dict:
    return {"t_start": t_start, "t_end": t_start + seconds, "energy_j": 8.0 * seconds, "inferences": calls,
            "avg_power_w": 8.0, "peak_power_w": 9.0, "energy_source": "nvml", "config_id": "cfg-a",
            "other_processes": 0, "share": 1.0}


def test_a_trip_kept_aside_is_recorded_once_with_its_violated_decision(tmp_path):
    db = open_db(tmp_path / "jp.db")
    trip = Trip(limit_w=450.0, window_powers_w=[569.0, 571.0], at=time.time())
    rows = trip_rows(trip, deployment="svc", policy="resnet", config_id="cfg-a", decision=None,
                     device_kind="NVIDIA H200", torch_version="2.13", source="nvml")
    side = set_aside_deployment(deployment_side_file(tmp_path / "jp.db", "1-a"), deployment="svc",
                                samples=[_window(trip.at - 10), _window(trip.at - 5)],
                                violations=[{"decision": rows["decision"], "violation": rows["violation"]}])
    copy = tmp_path / "copy.json"
    shutil.copy(side, copy)
    [first] = import_deployment_side_files(db)
    assert (first.windows, first.calls, first.violations, first.already) == (2, 200, 1, 0)
    assert describe_deployment_import(first).startswith(
        "imported 2 metered windows (200 calls) and 1 envelope violation of deployment 'svc'")
    shutil.copy(copy, side)  # the file outlived its import (a kill before it was removed)
    [second] = import_deployment_side_files(db)
    assert (second.windows, second.violations, second.already) == (0, 0, 3)
    assert "already stored" in describe_deployment_import(second)
    [violation] = list_violations(db, deployment="svc")
    assert violation["measured_value"] == trip.measured_w
    states = [r[0] for r in db.execute("SELECT state FROM decisions WHERE policy = 'resnet'")]
    assert states == ["violated"]
    assert violation["decision_id"] is not None  # cites the violated decision it came with
    assert not side.exists()


def test_a_longer_copy_of_a_stored_window_extends_it(tmp_path):
    db = open_db(tmp_path / "jp.db")
    dep_id = register_deployment(db, "svc")
    t0 = time.time() - 100
    store_samples(db, dep_id, [_window(t0), _window(t0 + 5)])
    folded = _window(t0 + 5, seconds=5.6, calls=112)  # the last window with its short tail folded in
    stored = store_samples(db, dep_id, [_window(t0), folded])
    assert (stored.inserted, stored.extended, stored.already, stored.calls) == (0, 1, 1, 12)
    rows = read_samples(db, dep_id)
    assert [(r["t_end"] - r["t_start"], r["inferences"]) for r in rows] == [(5.0, 100), (folded["t_end"] - (t0 + 5), 112)]
    assert store_samples(db, dep_id, [_window(t0 + 5)]).already == 1  # a shorter, older copy changes nothing
    assert read_samples(db, dep_id)[-1]["inferences"] == 112


def test_a_damaged_side_file_is_kept_and_named(tmp_path):
    db = open_db(tmp_path / "jp.db")
    side = deployment_side_file(tmp_path / "jp.db", "7-b")
    side.parent.mkdir()
    side.write_text('{"deployment": "svc", "samples": [')  # cut short by a full disk
    [item] = import_deployment_side_files(db)
    line = describe_deployment_import(item)
    assert "\n" not in line and str(side) in line and "unreadable side file" in line and "kept" in line
    assert side.exists()
    assert get_deployment(db, "svc") is None


def test_a_side_file_rewritten_during_its_import_keeps_the_newer_windows(tmp_path, monkeypatch):
    """The serving process still refused rewrites its file (one window more) while an importer stores it."""
    db = open_db(tmp_path / "jp.db")
    t0 = time.time() - 100
    side = set_aside_deployment(deployment_side_file(tmp_path / "jp.db", "4021-c"), deployment="svc",
                                samples=[_window(t0)], error="database is locked")
    real_store_samples = side_files_module.store_samples

    def store_while_the_server_rewrites(db_, deployment_id, samples):
        stored = real_store_samples(db_, deployment_id, samples)
        set_aside_deployment(side, deployment="svc", samples=[_window(t0), _window(t0 + 5)], error="locked")
        return stored

    monkeypatch.setattr(side_files_module, "store_samples", store_while_the_server_rewrites)
    [first] = import_deployment_side_files(db)
    assert (first.windows, first.path) == (1, side)
    assert side.exists()  # the rewrite made after the claim is a new file, left for the next import
    monkeypatch.setattr(side_files_module, "store_samples", real_store_samples)
    [second] = import_deployment_side_files(db)
    assert (second.windows, second.already) == (1, 1)  # the window stored before is not counted again
    assert [r["t_start"] for r in read_samples(db, get_deployment(db, "svc")["id"])] == [t0, t0 + 5]
    assert sorted(side.parent.iterdir()) == []


def test_side_files_on_a_locked_store_wait_once_and_a_stop_ends_the_wait(tmp_path):
    path = tmp_path / "jp.db"
    db = open_db(path)
    sides = [set_aside_deployment(deployment_side_file(path, f"{n}-d"), deployment=f"svc{n}",
                                  samples=[_window(time.time() - 50)]) for n in range(3)]
    db.conn.execute("PRAGMA busy_timeout = 1500")
    with write_lock_held(path):
        began = time.monotonic()
        items = import_deployment_side_files(db)
        waited_s = time.monotonic() - began
        # one file waited the busy timeout; the others were left for next time, untried (three waits: 4.5 s)
        assert [bool(i.error) for i in items] == [True, True, True] and [i.tried for i in items] == [True, False, False]
        assert waited_s >= 1.4
        assert "locked" in items[0].error
        db.conn.execute("PRAGMA busy_timeout = 30000")
        began = time.monotonic()
        asked = iter([False])  # the stop comes once the first file waits for the lock
        [stopped] = import_deployment_side_files(db, stop=lambda: next(asked, True))
        assert time.monotonic() - began < 15 and "locked" in stopped.error  # a stopping daemon does not wait 30 s
    assert all(s.exists() for s in sides) and len(list(sides[0].parent.iterdir())) == 3
    assert [i.windows for i in import_deployment_side_files(db)] == [1, 1, 1]


@pytest.mark.parametrize("violations", [["not a violation"], [{"decision": None}], "text",
                                        [{"decision": "x", "violation": {"deployment": "svc", "limit_name": "w",
                                                                          "at": 1.0}}]])
def test_a_side_file_with_a_malformed_violation_is_kept_and_named(tmp_path, violations):
    db = open_db(tmp_path / "jp.db")
    side = deployment_side_file(tmp_path / "jp.db", "9-e")
    side.parent.mkdir()
    side.write_text(json.dumps({"format": 1, "deployment": "svc", "samples": [_window(time.time() - 20)],
                                "violations": violations}))
    [item] = import_deployment_side_files(db)
    line = describe_deployment_import(item)
    assert "\n" not in line and str(side) in line and "unreadable side file" in line and "violation" in line
    assert side.exists() and get_deployment(db, "svc") is None


def test_a_file_given_back_never_replaces_one_rewritten_meanwhile(tmp_path, monkeypatch):
    """The import is refused after the claim and the server rewrote its file meanwhile: both are kept."""
    db = open_db(tmp_path / "jp.db")
    t0 = time.time() - 100
    side = set_aside_deployment(deployment_side_file(tmp_path / "jp.db", "4022-f"), deployment="svc",
                                samples=[_window(t0)])

    def refused_while_the_server_rewrites(db_, deployment_id, samples):
        set_aside_deployment(side, deployment="svc", samples=[_window(t0 + 5)])
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(side_files_module, "store_samples", refused_while_the_server_rewrites)
    [refused] = import_deployment_side_files(db)
    assert "full" in refused.error and len(list(side.parent.iterdir())) == 2
    monkeypatch.undo()
    assert sorted(i.windows for i in import_deployment_side_files(db)) == [1, 1]
    assert [r["t_start"] for r in read_samples(db, get_deployment(db, "svc")["id"])] == [t0, t0 + 5]
    assert list(side.parent.iterdir()) == []
