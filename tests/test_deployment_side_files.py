"""The store's side of deployment side files: imported once, extended not doubled, damaged ones kept and named."""

from __future__ import annotations

import shutil
import time

from joulepilot.runtime.guard import Trip
from joulepilot.runtime.trips import trip_rows
from joulepilot.store import open_db
from joulepilot.store.deployment_side_files import (
    deployment_side_file,
    describe_deployment_import,
    import_deployment_side_files,
    set_aside_deployment,
)
from joulepilot.store.deployment_writes import store_samples
from joulepilot.store.deployments import get_deployment, list_violations, read_samples, register_deployment


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
