"""`extra`'s policy, first_run_id and pending_id in indexed columns of their own (schema version 10): filled on
every insert and import, backfilled for the runs an older joulepilot stored, and what the store looks runs up by."""

from __future__ import annotations

import json
import sqlite3

from joulepilot.store import export_runs, import_runs, insert_run, open_db, schema_version
from joulepilot.store.pending import _stored_pending_run
from joulepilot.store.runs import daemon_runs, further_window_run_ids
from joulepilot.store.schema import SCHEMA_VERSION
from store_factories import database_at


def _run(extra) -> dict:
    return {"workload_id": "w1", "config_id": "c1", "host_id": "h1", "device": "cpu", "status": "ok",
            "started_at": 3.0, "energy_j_per_inference": 0.5, "extra": extra}


def test_an_older_database_gets_the_columns_backfilled_from_extra(tmp_path):
    path = database_at(tmp_path / "old.db", 9)
    conn = sqlite3.connect(path, isolation_level=None)
    extras = [json.dumps({"policy": "mlp", "pending_id": "p-first"}),
              # NaN, as a worker's result keys may leave it: SQLite's JSON functions refuse this text
              '{"policy": "mlp", "first_run_id": 2, "pending_id": "p-first", "spread": NaN}',
              json.dumps({"policy": 7, "first_run_id": "2"}),  # values of another type index nothing
              "not json"]
    for extra in extras:
        conn.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at, extra)"
                     " VALUES ('w1', 'c1', 'h1', 'cpu', 'ok', 2.0, ?)", [extra])
    conn.close()

    db = open_db(path)

    assert schema_version(db) == SCHEMA_VERSION
    stored = db.execute("SELECT id, policy, first_run_id, pending_id FROM runs ORDER BY id").fetchall()
    assert [row[1:] for row in stored] == [(None, None, None), ("mlp", None, "p-first"), ("mlp", 2, "p-first"),
                                           (None, None, None), (None, None, None)]
    assert [r.id for r in daemon_runs(db, "mlp")] == [3, 2] and {r.id for r in daemon_runs(db)} == {2, 3}
    assert further_window_run_ids(db, 2) == [3]
    assert _stored_pending_run(db, "p-first") == 2 and _stored_pending_run(db, "p-other") is None
    indexes = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"runs_policy", "runs_first_run", "runs_pending"} <= indexes
    db.close()


def test_inserted_and_imported_runs_fill_the_columns_from_extra(tmp_path):
    db = open_db(database_at(tmp_path / "a.db", SCHEMA_VERSION))
    run_id = insert_run(db, _run({"policy": "bert", "pending_id": "p1", "first_run_id": 1}))
    row = db.execute("SELECT policy, first_run_id, pending_id FROM runs WHERE id = ?", [run_id]).fetchone()
    assert row == ("bert", 1, "p1")
    records = export_runs(db)
    db.close()

    other = open_db(tmp_path / "b.db")
    [new_id] = import_runs(other, [r for r in records if r["run"]["id"] == run_id])
    assert [r.id for r in daemon_runs(other, "bert")] == [new_id] and _stored_pending_run(other, "p1") == new_id
    other.close()
