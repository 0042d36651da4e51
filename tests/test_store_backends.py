"""The store on both of its backends: every test here runs on a SQLite file and on a PostgreSQL database of a real,
throwaway server (`servers.start_postgres`, skipped without the operating system's package), and checks that the
same calls give the same rows, figures and errors."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner
from joulepilot.store import (
    SCHEMA_VERSION,
    DatabaseCorrupt,
    DatabaseMissing,
    StoreError,
    as_store_error,
    commit_run,
    enqueue_job,
    export_runs,
    import_runs,
    insert_run,
    insert_samples,
    latest_decision,
    list_runs,
    ok_runs,
    open_db,
    open_for_reading,
    queue_counts,
    read_samples,
    register_deployment,
    schema_version,
    transaction,
    upsert_config,
    upsert_host,
    upsert_workload,
    write_decision,
    write_heartbeat,
)
from joulepilot.store.daemon_state import (
    add_request,
    claim_job,
    extend_leases,
    finish_job,
    fleet_heartbeats,
    get_job,
    latest_heartbeat,
    list_jobs,
    recover_jobs,
    renew_leases,
)
from joulepilot.store.db import joulepilot_tables
from joulepilot.store.deployment_figures import calls_progress, config_totals, sample_timeline, sample_totals
from joulepilot.store.pending import _stored_pending_run
from joulepilot.store.runs import daemon_runs, further_window_run_ids

from joulepilot.cli import main

HOST = {"id": "h1", "hostname": "box", "cpu": "x86"}
WORKLOAD = {"id": "w1", "spec": "mlp", "batch_size": 8, "op_mix": {"linear": 3}}
CONFIG = {"id": "c1", "label": "default/fp32/b8", "mode": "default", "fusion": "default", "options": {"a": 1},
          "precision": "fp32", "dynamic": False, "batch_size": 8}


def _run(started_at: float = 2.0, **fields) -> dict:
    return {"workload_id": "w1", "config_id": "c1", "host_id": "h1", "device": "cpu", "status": "ok",
            "started_at": started_at, "finished_at": started_at + 1.5, "energy_j_per_inference": 0.25,
            "inferences": 40, "energy_source": "estimate", **fields}


def _references(db) -> None:
    upsert_host(db, HOST)
    upsert_workload(db, WORKLOAD)
    upsert_config(db, CONFIG)


def test_a_new_database_holds_the_schema_at_this_version(backend_db):
    assert schema_version(backend_db) == SCHEMA_VERSION
    assert set(backend_db.table_names()) == joulepilot_tables(SCHEMA_VERSION)
    types = {c.name: c.type for c in backend_db.columns("runs")}
    assert (types["id"], types["started_at"], types["status"]) == ("INTEGER", "REAL", "TEXT")


def test_runs_go_in_and_come_back_with_the_same_values(backend_db):
    _references(backend_db)
    upsert_config(backend_db, {**CONFIG, "label": "renamed"})  # an upsert replaces the columns it names
    run_id = insert_run(backend_db, _run(started_at=1_777_636_803.412345, extra={"policy": "mlp", "x": 1.5}),
                        [(0.1, "cpu:0", 7.5), (0.2, "cpu:0", 8.25)])
    [row] = list_runs(backend_db)
    assert row["id"] == run_id and row["config_label"] == "renamed" and row["workload"] == "mlp"
    assert row["started_at"] == 1_777_636_803.412345  # double precision: an epoch keeps its microseconds
    assert isinstance(row["inferences"], int) and row["dynamic"] == 0 and row["policy"] == "mlp"
    [run] = ok_runs(backend_db)
    assert run.extra == {"policy": "mlp", "x": 1.5} and run.options == {"a": 1}
    assert [r.id for r in daemon_runs(backend_db, "mlp")] == [run_id]
    samples = backend_db.execute("SELECT t_s, power_w FROM power_samples ORDER BY t_s").fetchall()
    assert [tuple(s) for s in samples] == [(0.1, 7.5), (0.2, 8.25)]


def test_a_commit_with_further_windows_is_one_transaction_and_found_by_its_ids(backend_db):
    run_id = commit_run(backend_db, _run(extra={"pending_id": "p1"}), host=HOST, workload=WORKLOAD, config=CONFIG,
                        further=[(_run(started_at=4.0, extra={"pending_id": "p1"}), [])])
    assert further_window_run_ids(backend_db, run_id) == [run_id + 1]
    assert _stored_pending_run(backend_db, "p1") == run_id


def test_a_failed_transaction_leaves_nothing(backend_db):
    _references(backend_db)
    with pytest.raises(RuntimeError), transaction(backend_db):
        insert_run(backend_db, _run())
        raise RuntimeError("killed mid-write")
    assert list_runs(backend_db) == []
    insert_run(backend_db, _run())  # the connection is usable after it
    assert len(list_runs(backend_db)) == 1


def test_the_queue_claims_each_job_once(backend_db):
    _references(backend_db)
    job, queued = enqueue_job(backend_db, policy="p", workload_id="w1", config_id="c1", provenance_key="k")
    assert queued and enqueue_job(backend_db, policy="p", workload_id="w1", config_id="c1",
                                  provenance_key="k") == (job, False)
    assert claim_job(backend_db, job, host_id="h1", lease_s=60) and not claim_job(backend_db, job, host_id="h2")
    assert recover_jobs(backend_db, "h2") == []  # h1's claim holds: h2 leaves it alone
    assert recover_jobs(backend_db, "h1") == [job]  # h1's daemon started again: its claims were a dead process's
    assert claim_job(backend_db, job, host_id="h1", lease_s=60)
    with transaction(backend_db):
        finish_job(backend_db, job, state="done", run_id=insert_run(backend_db, _run()))
    assert queue_counts(backend_db)["done"] == 1
    assert add_request(backend_db, "p") == add_request(backend_db, "p")
    beats = [write_heartbeat(backend_db, "idle", keep=2) for _ in range(4)]
    assert backend_db.execute("SELECT id FROM heartbeats ORDER BY id").fetchall() == [(beats[2],), (beats[3],)]


def test_a_claim_lasts_its_lease_and_the_fleet_takes_it_back_when_it_runs_out(backend_db):
    _references(backend_db)
    jobs = [enqueue_job(backend_db, policy="p", workload_id="w1", config_id=c, provenance_key="k",
                        windows=w)[0] for c, w in (("c1", 3), ("c2", None))]
    assert [get_job(backend_db, j).windows for j in jobs] == [3, None]  # what any host that claims it takes
    assert claim_job(backend_db, jobs[0], host_id="h1", lease_s=0.5)
    assert claim_job(backend_db, jobs[1], host_id="h1", lease_s=60)
    [running] = [j for j in list_jobs(backend_db, state="running") if j.id == jobs[0]]
    assert running.claimed_by == "h1" and running.hostname == HOST["hostname"] and running.lease_expires_at > time.time()
    assert recover_jobs(backend_db) == []  # both leases hold
    assert renew_leases(backend_db, "h1", jobs[:1], 0.5) == []  # renewed: still h1's
    assert renew_leases(backend_db, "h1", jobs[1:], 60) == []
    time.sleep(0.6)
    assert recover_jobs(backend_db) == [jobs[0]]  # h1 stopped renewing: back in the queue, for any host
    assert get_job(backend_db, jobs[0]).state == "queued" and get_job(backend_db, jobs[0]).claimed_by is None
    assert renew_leases(backend_db, "h1", jobs, 60) == [jobs[0]]  # h1 is told it no longer holds it
    assert claim_job(backend_db, jobs[0], host_id="h2", lease_s=60)
    assert get_job(backend_db, jobs[0]).attempts == 2  # the attempt h1 started counts
    # The database was away for longer than a lease: no host could renew, so each holder gets a lease from now.
    backend_db.execute("UPDATE jobs SET lease_expires_at = ?", [time.time() - 1])
    assert extend_leases(backend_db, 60) == 2 and recover_jobs(backend_db) == []
    assert extend_leases(backend_db, 30) == 0  # never shortened


def test_the_newest_heartbeat_of_each_host(backend_db):
    for host, doing in (("h1", "a"), ("h2", "b"), ("h1", "c")):
        write_heartbeat(backend_db, "idle", {"doing": doing, "hostname": f"name-{host}"}, host_id=host)
    assert [(b.host_id, b.detail["doing"]) for b in fleet_heartbeats(backend_db)] == [("h1", "c"), ("h2", "b")]
    assert latest_heartbeat(backend_db, host_id="h2").detail["doing"] == "b"
    assert latest_heartbeat(backend_db).detail["doing"] == "c"


def test_decisions_newest_first(backend_db):
    for at, config in ((1.0, "c-old"), (2.0, "c-new")):
        write_decision(backend_db, {"policy": "p", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                                    "config_id": config, "state": "verified", "decided_at": at,
                                    "details": {"n": 1}})
    found = latest_decision(backend_db, "p", "cpu", "2.13")
    assert found.config_id == "c-new" and found.details == {"n": 1}


def test_deployment_figures_are_the_same_numbers_of_the_same_types(backend_db):
    dep = register_deployment(backend_db, "serving", policy="p", config_id="c1")
    assert register_deployment(backend_db, "serving") == dep
    windows = [{"t_start": 100.0 + 10 * i, "t_end": 105.0 + 10 * i, "energy_j": 40.0 + i, "inferences": 100,
                "avg_power_w": 8.0, "peak_power_w": 9.0 + i, "energy_source": "estimate" if i < 2 else "rapl",
                "config_id": "c1", "other_processes": i % 2, "share": 0.5 if i % 2 else 1.0} for i in range(5)]
    assert insert_samples(backend_db, dep, windows) == 5 and len(read_samples(backend_db, dep)) == 5
    totals = sample_totals(backend_db, dep, max_avg_power_w=7.0, max_peak_power_w=11.5)
    assert (totals.windows, totals.energy_j, totals.inferences, totals.metered_s) == (5, 210.0, 500, 25.0)
    assert type(totals.inferences) is int and type(totals.energy_j) is float
    assert (totals.estimated_windows, totals.estimated_energy_j, totals.shared_windows) == (2, 81.0, 2)
    assert (totals.mean_share, totals.windows_above_avg_limit, totals.windows_above_peak_limit) == (0.5, 5, 2)
    assert totals.sources == ("estimate", "rapl") and totals.tokens is None
    [per_config] = config_totals(backend_db, dep)
    assert (per_config.windows, per_config.energy_j, per_config.inferences) == (5, 210.0, 500)
    # five windows starting 100 s .. 140 s, 45 s in all, in 4 spans of 11.25 s (the whole part of 0.89 is 0)
    spans = sample_timeline(backend_db, dep, 4)
    assert [(s.t_start, s.windows, s.energy_j) for s in spans] == [(100.0, 2, 81.0), (120.0, 1, 42.0),
                                                                   (130.0, 1, 43.0), (140.0, 1, 44.0)]
    progress = calls_progress(backend_db, dep, "c1", calls_needed=250)
    assert (progress.calls, progress.metered_s, progress.crossing) == (500, 25.0, (120.0, 125.0, 100, 200))


def test_runs_move_between_backends_either_way(backend_db, tmp_path):
    _references(backend_db)
    insert_run(backend_db, _run(extra={"policy": "mlp"}))
    insert_run(backend_db, _run(started_at=5.0, status="failed", reason="oom"))
    records = export_runs(backend_db)
    sqlite_db = open_db(tmp_path / "other.db")
    assert len(import_runs(sqlite_db, records)) == 2 and import_runs(sqlite_db, records) == []
    back = export_runs(sqlite_db)
    sqlite_db.close()
    with transaction(backend_db):
        backend_db.execute("DELETE FROM runs")
    assert len(import_runs(backend_db, back)) == 2
    assert [(r["status"], r["policy"]) for r in list_runs(backend_db)] == [("failed", None), ("ok", "mlp")]


def test_read_only_openings_read_and_refuse_writes(backend_db, backend_target):
    _references(backend_db)
    insert_run(backend_db, _run())
    reader = open_for_reading(backend_target)
    assert len(list_runs(reader)) == 1
    with pytest.raises(Exception) as refused:
        insert_run(reader, _run(started_at=9.0))
    assert "is read-only" in str(as_store_error(refused.value, backend_target))
    reader.close()


def test_two_connections_write_one_after_the_other(backend_db, backend_target):
    _references(backend_db)
    other = open_db(backend_target)
    order: list[str] = []
    with transaction(backend_db):
        insert_run(backend_db, _run())

        def second() -> None:
            with transaction(other):
                order.append("second")
                insert_run(other, _run(started_at=3.0))

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.5)
        order.append("first commits")
    thread.join(10)
    other.close()
    assert order == ["first commits", "second"] and len(list_runs(backend_db)) == 2


def test_postgresql_errors_name_the_database_without_its_password(postgres_server):
    wrong = postgres_server.url("postgres", password="not-the-password")
    with pytest.raises(StoreError, match="refused the login") as refused:
        open_db(wrong)
    assert "not-the-password" not in str(refused.value) and ":***@127.0.0.1" in str(refused.value)
    with pytest.raises(DatabaseMissing, match=r"jp_never_created does not exist \(.*\); create it"):
        open_db(postgres_server.url("jp_never_created"))
    empty = postgres_server.new_database()
    with pytest.raises(DatabaseCorrupt, match="is an empty database, not a joulepilot database"):
        open_for_reading(empty)
    import psycopg

    foreign = postgres_server.new_database()
    with psycopg.connect(foreign, autocommit=True) as conn:
        conn.execute("CREATE TABLE my_notes (note TEXT)")
    with pytest.raises(DatabaseCorrupt, match="its schema holds my_notes"):
        open_db(foreign)
    assert postgres_server.password not in str(refused.value)


def test_runs_export_and_import_commands_move_runs_between_a_file_and_postgresql(postgres_server, tmp_path):
    url = postgres_server.new_database()
    sweep = "tests/data/gpu_sweep_h200.json"
    runner = CliRunner(env={"JOULEPILOT_DB": url})  # a URL with a password: never on the command line
    imported = runner.invoke(main, ["runs", "import", sweep])
    assert imported.exit_code == 0, imported.output
    assert imported.output.endswith("56 run(s) imported, 0 already present\n")
    exported = runner.invoke(main, ["runs", "export", str(tmp_path / "out.json")])
    assert exported.exit_code == 0, exported.output
    into_file = runner.invoke(main, ["runs", "import", str(tmp_path / "out.json"), "--db", str(tmp_path / "jp.db")])
    assert into_file.output.endswith("56 run(s) imported, 0 already present\n")
    listed = runner.invoke(main, ["runs", "--json", "--limit", "0"])
    assert len(json.loads(listed.output)) == 56
    status = runner.invoke(main, ["status", "--json"])
    assert json.loads(status.output)["db"] == url.replace(postgres_server.password, "***")
    refused = runner.invoke(main, ["runs"], env={"JOULEPILOT_DB": postgres_server.url("jp", password="wrong")})
    assert refused.exit_code == 1 and "refused the login" in refused.output and "wrong" not in refused.output


def test_hosts_that_open_a_new_database_at_once_create_its_schema_once(backend_target):
    # A fleet's daemons started together each migrate the empty database; each step runs once, under the write
    # lock, whoever waited for it sees the step done (PostgreSQL: a table created since it began).
    from joulepilot.store import open_db

    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            open_db(backend_target).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    database = open_db(backend_target)
    try:
        assert schema_version(database) == SCHEMA_VERSION
    finally:
        database.close()


def test_a_driver_error_the_store_did_not_map_is_mapped_at_the_boundary():
    # The daemon and the CLI tell an unreachable server (wait it out, keep runs aside) from a bug by
    # `as_store_error`: a psycopg error raised outside the store's own calls is mapped too, its password hidden.
    psycopg = pytest.importorskip("psycopg")
    from joulepilot.store import StoreUnreachable, as_store_error

    url = "postgresql://fleet:s3cret@127.0.0.1:1/joulepilot"
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(url, connect_timeout=2)
    problem = as_store_error(caught.value, url)
    assert isinstance(problem, StoreUnreachable) and "s3cret" not in str(problem) and "fleet:***@" in str(problem)
