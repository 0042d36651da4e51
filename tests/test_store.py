"""Store: round trips, migrations from older versions, WAL concurrency, atomic writes."""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
import time

import pytest
from joulepilot.store import (
    SCHEMA_VERSION,
    StoreError,
    export_runs,
    import_runs,
    insert_run,
    list_runs,
    open_db,
    power_samples,
    schema_version,
    stable_id,
    transaction,
    upsert_config,
    upsert_host,
    upsert_workload,
)
from joulepilot.store.connection import Store
from joulepilot.store.schema import MIGRATIONS


def _seed(db, n=1, started=1000.0):
    host_id = upsert_host(db, {"id": "h1", "hostname": "box", "cpu": "x86"})
    wid = upsert_workload(db, {"id": "w1", "spec": "mlp", "batch_size": 8, "params": 1234,
                               "flops_per_inference": 5e6, "op_mix": {"linear": 3}})
    cid = upsert_config(db, {"id": "c1", "label": "default/default/fp32/b8", "mode": "default",
                             "fusion": "default", "options": {}, "precision": "fp32", "dynamic": False,
                             "batch_size": 8})
    ids = []
    for i in range(n):
        ids.append(insert_run(db, {
            "workload_id": wid, "config_id": cid, "host_id": host_id, "device": "cpu", "status": "ok",
            "started_at": started + i, "finished_at": started + i + 5, "energy_j_per_inference": 0.5 + i,
            "avg_power_w": 40.0, "energy_source": "estimate", "extra": {"note": "x"},
        }, power_samples=[(0.0, "cpu:0", 41.0), (0.1, "cpu:0", 39.5)]))
    return ids


def test_new_database_is_at_current_version_in_wal(tmp_path):
    db = open_db(tmp_path / "a.db")
    assert schema_version(db) == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA busy_timeout").fetchone()[0] >= 5000
    assert {"runs", "configs", "workloads", "hosts", "devices", "decisions", "deployments",
            "deployment_samples", "power_samples", "jobs", "requests", "heartbeats",
            "violations"} <= set(db.table_names())


def test_run_round_trip(db):
    (run_id,) = _seed(db)
    rows = list_runs(db)
    assert len(rows) == 1
    row = rows[0]
    assert row["id"] == run_id
    assert row["workload"] == "mlp" and row["mode"] == "default" and row["precision"] == "fp32"
    assert row["energy_j_per_inference"] == pytest.approx(0.5)
    assert row["extra"] == '{"note": "x"}'
    assert [s["power_w"] for s in power_samples(db, run_id)] == [41.0, 39.5]
    assert list_runs(db, workload="other") == []
    assert len(list_runs(db, status="ok")) == 1


def test_unknown_run_field_is_refused_and_nothing_written(db):
    _seed(db)
    with pytest.raises(ValueError, match="energy_mj"):
        insert_run(db, {"workload_id": "w1", "config_id": "c1", "host_id": "h1", "device": "cpu",
                        "status": "ok", "started_at": 1.0, "energy_mj": 3})
    assert db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1


def test_failed_transaction_leaves_no_partial_run(db):
    _seed(db)
    with pytest.raises(RuntimeError):
        with transaction(db):
            db.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at)"
                       " VALUES ('w1', 'c1', 'h1', 'cpu', 'ok', 5.0)")
            raise RuntimeError("killed mid-write")
    assert db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1


def test_migration_from_version_1_keeps_rows(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    MIGRATIONS[0](Store(conn))
    conn.execute("PRAGMA user_version = 1")
    conn.execute("INSERT INTO hosts VALUES ('h1', 'box', 'x86', 1.0)")
    conn.execute("INSERT INTO workloads (id, spec, batch_size, created_at) VALUES ('w1', 'mlp', 8, 1.0)")
    conn.execute("INSERT INTO configs VALUES ('c1', 'eager', 'eager', 'default', '{}', 'fp32', 0, 8)")
    conn.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at,"
                 " energy_j_per_inference) VALUES ('w1', 'c1', 'h1', 'cpu', 'ok', 2.0, 0.25)")
    conn.close()

    db = open_db(path)
    assert schema_version(db) == SCHEMA_VERSION
    run = list_runs(db)[0]
    assert run["energy_j_per_inference"] == 0.25
    assert run["provenance_key"] is None  # column added by version 2
    assert "jobs" in db.table_names()  # table added by version 3


def test_migration_11_keys_the_runs_jobs_and_decisions_of_two_hosts_alike(tmp_path):
    # Before version 11 the provenance key named the host and its driver: two hosts of one device kind and
    # software stack never shared a run, a job or a decision. After it they do.
    from joulepilot.store import provenance_key, stable_id

    path = tmp_path / "v10.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for migration in MIGRATIONS[:10]:
        migration(Store(conn))
    conn.execute("PRAGMA user_version = 10")
    stack = ("NVIDIA H200", "2.11.0+cu130", "3.6.0", "0.9.0")
    old = {host: stable_id("provenance", host, stack[0], driver, *stack[1:])
           for host, driver in (("h1", "580.159.04"), ("h2", "580.95.05"))}
    conn.execute("INSERT INTO workloads (id, spec, batch_size, created_at) VALUES ('w1', 'mlp', 8, 1.0)")
    conn.execute("INSERT INTO configs (id, label, mode, fusion, options, precision, dynamic, batch_size) "
                 "VALUES ('c1', 'eager', 'eager', 'default', '{}', 'fp32', 0, 8)")
    for host, key in old.items():
        conn.execute("INSERT INTO hosts VALUES (?, ?, 'x86', 1.0)", [host, host])
        conn.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at, device_name, "
                     "torch_version, triton_version, joulepilot_version, provenance_key) "
                     "VALUES ('w1', 'c1', ?, 'cuda:0', 'ok', 2.0, ?, ?, ?, ?, ?)", [host, *stack, key])
        conn.execute("INSERT INTO jobs (policy, workload_id, config_id, provenance_key, state, attempts, created_at, "
                     "updated_at) VALUES ('p', 'w1', 'c1', ?, 'done', 1, 1.0, 1.0)", [key])
    conn.execute("INSERT INTO decisions (policy, policy_hash, device_kind, torch_version, config_id, state, "
                 "decided_at, details) VALUES ('p', 'x', 'NVIDIA H200', '2.11', 'c1', 'verified', 3.0, ?)",
                 [json.dumps({"provenance_key": old["h1"], "note": "kept"})])
    conn.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at) "
                 "VALUES ('w1', 'c1', 'h1', 'cpu', 'ok', 1.0)")  # no provenance: stays without one
    conn.close()

    db = open_db(path)
    try:
        fleet = provenance_key(*stack)
        assert [r[0] for r in db.execute("SELECT provenance_key FROM runs ORDER BY id").fetchall()] == \
            [fleet, fleet, None]
        assert db.execute("SELECT provenance_key, COUNT(*) FROM jobs GROUP BY provenance_key").fetchall() == \
            [(fleet, 1)]  # one measurement, one job: the two hosts' jobs became one
        details = json.loads(db.execute("SELECT details FROM decisions").fetchone()[0])
        assert details == {"provenance_key": fleet, "note": "kept"}
    finally:
        db.close()


def test_newer_schema_is_refused_with_advice(tmp_path):
    path = tmp_path / "new.db"
    open_db(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer than this joulepilot"):
        open_db(path)


def test_a_newer_schema_that_dropped_a_later_table_is_still_called_newer(tmp_path):
    """Of a newer schema only the first version's tables can be expected: a later one may have gone."""
    from joulepilot.store.db import joulepilot_tables

    path = tmp_path / "new.db"
    open_db(path).close()
    dropped = sorted(joulepilot_tables(SCHEMA_VERSION) - joulepilot_tables(1))[0]
    conn = sqlite3.connect(path)
    conn.execute(f"DROP TABLE {dropped}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="newer than this joulepilot"):
        open_db(path, read_only=True)


def test_unopenable_path_names_the_file(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="--db"):
        open_db(blocker / "sub" / "x.db")


def test_default_location_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_HOME", str(tmp_path / "home"))
    db = open_db()
    assert (tmp_path / "home" / "joulepilot.db").exists()
    db.close()
    monkeypatch.setenv("JOULEPILOT_DB", str(tmp_path / "elsewhere.db"))
    open_db().close()
    assert (tmp_path / "elsewhere.db").exists()


def test_stable_id_is_order_independent_for_mappings():
    assert stable_id({"a": 1, "b": 2}) == stable_id({"b": 2, "a": 1})
    assert stable_id("x", 1) != stable_id("x", 2)


def test_export_import_round_trip(tmp_path, db):
    _seed(db, n=3)
    records = export_runs(db)
    other = open_db(tmp_path / "other.db")
    assert len(import_runs(other, records)) == 3
    assert import_runs(other, records) == []  # idempotent
    assert [r["energy_j_per_inference"] for r in list_runs(other)] == [2.5, 1.5, 0.5]


def _writer(path: str, count: int, ready) -> None:
    db = open_db(path)
    ready.set()
    for i in range(count):
        insert_run(db, {"workload_id": "w1", "config_id": "c1", "host_id": "h1", "device": "cpu",
                        "status": "ok", "started_at": 10_000.0 + i, "energy_j_per_inference": 1.0},
                   power_samples=[(j * 0.1, "cpu:0", 10.0) for j in range(50)])


def test_reader_keeps_reading_while_a_writer_writes(tmp_path):
    path = tmp_path / "shared.db"
    db = open_db(path)
    _seed(db)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_writer, args=(str(path), 300, ready))
    proc.start()
    ready.wait(30)
    reader = open_db(path)
    seen, reads = [], 0
    deadline = time.time() + 60
    while proc.is_alive() and time.time() < deadline:
        n = reader.execute("SELECT count(*) FROM runs").fetchone()[0]
        # A run and its samples commit together: a reader never sees a run without its 50 samples.
        orphans = reader.execute(
            "SELECT count(*) FROM runs WHERE id > 1 AND"
            " (SELECT count(*) FROM power_samples p WHERE p.run_id = runs.id) != 50"
        ).fetchone()[0]
        assert orphans == 0
        seen.append(n)
        reads += 1
    proc.join(30)
    assert proc.exitcode == 0
    assert reads > 5
    assert seen == sorted(seen)  # counts only grow, no read failed
    assert reader.execute("SELECT count(*) FROM runs").fetchone()[0] == 301


def test_json_columns_and_strict_json():
    from joulepilot.store import json_column, json_safe

    assert json_column('{"a": 1}') == {"a": 1}
    assert json_column({"a": 1}) == {"a": 1}  # already decoded
    assert json_column("not json", {}) == {}
    assert json_column(None, []) == []
    assert json_safe({"x": float("nan"), "y": [1.5, float("inf")], "z": (2,)}) == {"x": None, "y": [1.5, None],
                                                                                  "z": [2]}


def test_threads_sharing_one_connection_write_whole_runs_one_after_another(db):
    """A process that stores from several threads (the daemon's measurements on several GPUs) through one
    connection: each transaction is its own, none joins another's, and every run is stored once."""
    import threading

    from joulepilot.store import commit_run

    _seed(db)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def store(thread: int) -> None:
        try:
            start.wait()
            for i in range(15):
                commit_run(db, {"workload_id": "w1", "config_id": "c1", "host_id": "h1", "device": f"cuda:{thread}",
                                "status": "ok", "started_at": 2000.0 + i, "finished_at": 2001.0 + i},
                           [(0.1 * k, f"gpu:{thread}", 100.0 + k) for k in range(20)])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=store, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    counts = {r[0]: r[1] for r in db.execute("SELECT device, COUNT(*) FROM runs WHERE started_at >= 2000 "
                                             "GROUP BY device").fetchall()}
    assert counts == {f"cuda:{n}": 15 for n in range(8)}
    # every run has all of its samples, none of another run's
    per_run = db.execute("SELECT runs.device, power_samples.device, COUNT(*) FROM runs JOIN power_samples "
                         "ON power_samples.run_id = runs.id WHERE runs.started_at >= 2000 GROUP BY runs.id").fetchall()
    assert len(per_run) == 120 and all(f"gpu:{run_device[5:]}" == sample_device and n == 20
                                       for run_device, sample_device, n in per_run)
