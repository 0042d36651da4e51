"""Side files imported while the database refuses every write (another connection holds the write lock, the
file is read-only): the import waits once, not once per file, leaves every file under its own name, says so
in one line, and the next import takes them all exactly once. A file refused for its own contents stops
nothing."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from joulepilot.compiler import CompileConfig, bench
from joulepilot.controller.daemon import Daemon
from joulepilot.runtime import attach, metered
from joulepilot.store import Store, commit_run_or_set_aside, import_pending_runs, open_db
from joulepilot.store.deployment_side_files import (
    deployment_side_file,
    deployment_side_files,
    describe_deployment_imports,
    import_deployment_side_files,
    set_aside_deployment,
)
from joulepilot.store.deployments import get_deployment, read_samples
from joulepilot.store.refusals import store_refusal
from joulepilot.store.side_file_imports import SideFileImports, import_side_files
from pending_factories import finished_run, runs_in, side_files, side_record, write_lock_held

LOCKED = "the database is locked by another process"


@pytest.fixture
def lock_waits(monkeypatch) -> list[int]:
    """One entry each time a write starts to wait for the write lock: one per side file an import tries (the
    tests clear it once their side files are written, as the commits that left them, and any other write,
    waited too)."""
    waits: list[int] = []
    real_begin_write = Store.begin_write

    def counted(self, stop=None):
        waits.append(len(waits))
        return real_begin_write(self, stop)

    monkeypatch.setattr(Store, "begin_write", counted)
    return waits


def _run_side_files(path: Path, count: int) -> list[Path]:
    """`count` runs whose commits found the write lock taken, each kept in its side file (sorted by name)."""
    db = open_db(path)
    with write_lock_held(path):
        kept = [commit_run_or_set_aside(db, **finished_run(0.1 * (n + 1)), stop=lambda: True).pending_path
                for n in range(count)]
    db.close()
    assert all(p is not None and p.is_file() for p in kept)
    return sorted(kept)


def _window(t_start: float) -> dict:
    return {"t_start": t_start, "t_end": t_start + 5.0, "energy_j": 40.0, "inferences": 100, "avg_power_w": 8.0,
            "peak_power_w": 9.0, "energy_source": "estimate", "config_id": None, "other_processes": 0,
            "share": 1.0}


def _deployment_side_files(path: Path, names: list[str]) -> list[Path]:
    """A side file per deployment in `names`, each with one window, as serving processes refused leave them."""
    t0 = time.time() - 60
    return sorted(set_aside_deployment(deployment_side_file(path, f"{n}-refused"), deployment=name,
                                       samples=[_window(t0)], error="database is locked")
                  for n, name in enumerate(names))


def _notes(items: list) -> list[str]:
    """What a start reports of run side files (`SideFileImports.notes`, as bench and the daemon print it)."""
    return [line for line, _ in SideFileImports(items, []).notes()]


def _short_wait(path: Path) -> object:
    db = open_db(path)
    db.execute("PRAGMA busy_timeout = 300")
    return db


def test_run_side_files_on_a_locked_database_wait_once_and_are_imported_once_after(tmp_path, lock_waits):
    path = tmp_path / "jp.db"
    sides = _run_side_files(path, 4)
    lock_waits.clear()
    pending_ids = sorted(side_record(s)["pending_id"] for s in sides)
    db = _short_wait(path)
    with write_lock_held(path):
        items = import_pending_runs(db)
    assert len(lock_waits) == 1  # the first file waited the busy timeout; the others were not tried
    assert [i.path for i in items] == sides and all(i.run_id is None for i in items)
    assert [i.tried for i in items] == [True] + [False] * (len(sides) - 1)
    assert {i.refused.reason for i in items} == {LOCKED}
    assert side_files(path) == sides  # each under its own name (no claim left), for the next start
    assert _notes(items) == [f"{len(sides)} side files in {sides[0].parent} not imported: {LOCKED}; "
                                       "they are kept and retried at the next start"]

    lock_waits.clear()
    items = import_pending_runs(db)  # the lock is gone: the next start
    assert [i.path for i in items] == sides
    assert all(i.run_id is not None and not i.already_stored and i.refused is None for i in items)
    assert len(lock_waits) == len(sides)
    assert sorted(r[2] for r in runs_in(path)) == pending_ids  # each run stored once
    assert side_files(path) == [] and import_pending_runs(db) == []
    db.close()


def test_a_read_only_database_tries_one_run_side_file_of_many(tmp_path, lock_waits):
    path = tmp_path / "jp.db"
    sides = _run_side_files(path, 3)
    lock_waits.clear()
    read_only = open_db(path, read_only=True)
    items = import_pending_runs(read_only)
    read_only.close()
    assert len(lock_waits) == 1
    assert {i.refused.reason for i in items} == {"the database is read-only"} and "readonly" in items[0].error
    assert side_files(path) == sides and runs_in(path) == []
    [line] = _notes(items)
    assert line.startswith(f"{len(sides)} side files in {sides[0].parent} not imported: the database is read-only")
    db = open_db(path)
    assert all(i.run_id is not None for i in import_pending_runs(db))
    assert len(runs_in(path)) == len(sides) and side_files(path) == []
    db.close()


def test_a_side_file_refused_for_its_own_contents_does_not_stop_the_others(tmp_path, lock_waits):
    path = tmp_path / "jp.db"
    good = _run_side_files(path, 2)
    lock_waits.clear()
    broken = good[0].with_name("run-0-broken.json")
    broken.write_text('{"pending_id": "cut sho')  # a side file cut short
    record = side_record(good[0])
    mismatched = good[0].with_name("run-1-mismatched.json")
    mismatched.write_text(json.dumps({**record, "pending_id": "f" * 32,
                                      "run": {**record["run"], "not_a_run_column": 1}}))
    db = _short_wait(path)
    items = import_pending_runs(db)
    by_path = {i.path: i for i in items}
    assert "unreadable side file" in by_path[broken].error and by_path[broken].refused is None
    assert "not_a_run_column" in by_path[mismatched].error and by_path[mismatched].refused is None
    assert all(by_path[g].run_id is not None for g in good)
    assert len(lock_waits) == 3  # the mismatched file and both good ones were each tried
    assert side_files(path) == [broken, mismatched]  # kept, for whoever repairs them
    lines = _notes(items)
    assert len(lines) == len(items) and not any("side files" in line for line in lines)
    db.close()


def test_a_start_waits_once_for_run_and_deployment_side_files_together(tmp_path, lock_waits):
    path = tmp_path / "jp.db"
    runs = _run_side_files(path, 3)
    deployments = _deployment_side_files(path, ["svc-a", "svc-b"])
    lock_waits.clear()
    db = _short_wait(path)
    with write_lock_held(path):
        found = import_side_files(db)
    assert len(lock_waits) == 1
    assert [i.path for i in found.runs] == runs and [i.path for i in found.deployments] == deployments
    assert [i.tried for i in [*found.runs, *found.deployments]] == [True] + [False] * 4
    assert found.notes() == [(f"5 side files in {runs[0].parent} not imported: {LOCKED}; they are kept and "
                              "retried at the next start", True)]
    assert side_files(path) == sorted([*runs, *deployments])

    again = import_side_files(db)
    assert all(i.run_id is not None and not i.already_stored for i in again.runs)
    assert [(i.deployment, i.windows, i.error) for i in again.deployments] == [("svc-a", 1, ""), ("svc-b", 1, "")]
    assert [kept for _line, kept in again.notes()] == [False] * 5
    assert len(runs_in(path)) == 3 and side_files(path) == []
    for name in ("svc-a", "svc-b"):
        assert len(read_samples(db, get_deployment(db, name)["id"])) == 1
    assert import_side_files(db).notes() == []
    db.close()


def test_deployment_side_files_on_a_read_only_database_are_tried_once(tmp_path, lock_waits):
    path = tmp_path / "jp.db"
    open_db(path).close()
    sides = _deployment_side_files(path, ["svc-a", "svc-b", "svc-c"])
    read_only = open_db(path, read_only=True)
    lock_waits.clear()  # the writes that made the database and the side files
    items = import_deployment_side_files(read_only)
    assert len(lock_waits) == 1 and [i.tried for i in items] == [True, False, False]
    [line] = describe_deployment_imports(items)
    assert line.startswith(f"3 side files in {sides[0].parent} not imported: the database is read-only")
    assert deployment_side_files(read_only) == sides
    read_only.close()
    db = open_db(path)
    assert [i.windows for i in import_deployment_side_files(db)] == [1, 1, 1] and side_files(path) == []
    db.close()


def busy_work(x: int) -> int:
    return sum(range(x))


def test_an_attach_whose_import_found_the_store_locked_imports_later(tmp_path, monkeypatch, caplog, lock_waits):
    """The hook imports side files after a flush the store took; refused then, it imports them after a later
    one (here its last, at close) rather than leaving them for the next process."""
    monkeypatch.setattr(metered, "STORE_WAIT_S", 0.3)
    path = tmp_path / "jp.db"
    open_db(path).close()
    sides = _deployment_side_files(path, ["gone-a", "gone-b", "gone-c"])
    dep = attach(busy_work, "serving", db=path, device="cpu", interval_s=60.0, flush_interval_s=3600)
    lock_waits.clear()  # the registration's own write
    with caplog.at_level(logging.WARNING, logger="joulepilot.deployment"), write_lock_held(path):
        dep._import_side_files()  # as after a flush, the store locked meanwhile
    assert len(lock_waits) == 1 and side_files(path) == sides
    [said] = [r.getMessage() for r in caplog.records if "serving" in r.getMessage()]
    assert f"3 side files in {sides[0].parent} not imported: {LOCKED}" in said
    dep.close()
    db = open_db(path)
    for name in ("gone-a", "gone-b", "gone-c"):
        assert len(read_samples(db, get_deployment(db, name)["id"])) == 1
    assert side_files(path) == []
    db.close()


def test_bench_on_a_locked_database_says_in_one_line_what_it_left(tmp_path, flow_worker, lock_waits):
    path = tmp_path / "jp.db"
    runs = _run_side_files(path, 3)
    deployments = _deployment_side_files(path, ["svc"])
    lock_waits.clear()
    db = _short_wait(path)
    notes: list[str] = []
    with write_lock_held(path) as holder:
        def notice(line: str) -> None:
            notes.append(line)
            if "not imported" in line:  # the long writer ends once the import gave up: the sweep can store
                holder.execute("ROLLBACK")
                holder.execute("BEGIN")  # an empty read transaction, for write_lock_held's ROLLBACK

        (run,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db, idle_s=0,
                       notice=notice)
    assert [n for n in notes if "side file" in n or "pending run" in n] == [
        f"4 side files in {runs[0].parent} not imported: {LOCKED}; they are kept and retried at the next start"]
    assert run["run_id"] is not None and len(lock_waits) == 2  # the import's one wait, and the new run's commit
    assert side_files(path) == sorted([*runs, *deployments])
    imported = import_side_files(db)
    assert len(imported.runs) == 3 and all(i.run_id is not None for i in imported.runs)
    assert [i.windows for i in imported.deployments] == [1] and side_files(path) == []
    db.close()


def test_a_daemon_pass_on_a_locked_database_logs_one_line_for_its_side_files(tmp_path, caplog, lock_waits):
    path = tmp_path / "jp.db"
    runs = _run_side_files(path, 2)
    _deployment_side_files(path, ["svc-a", "svc-b"])
    lock_waits.clear()
    daemon = Daemon.__new__(Daemon)  # importing side files reads only its database and its stop flag
    daemon.db, daemon.stop_event = _short_wait(path), threading.Event()
    with caplog.at_level(logging.INFO, logger="joulepilot.daemon"), write_lock_held(path):
        daemon._import_pending()
    assert len(lock_waits) == 1
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"4 side files in {runs[0].parent} not imported: {LOCKED}; they are kept and retried at the "
                    "next start")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="joulepilot.daemon"):
        daemon._import_pending()  # the next pass
    assert [r.levelname for r in caplog.records] == ["INFO"] * 4 and side_files(path) == []
    daemon.db.close()


def _sqlite_error(*statements: str) -> sqlite3.Error:
    conn = sqlite3.connect(":memory:")
    try:
        for sql in statements:
            conn.execute(sql)
    except sqlite3.Error as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError(f"{statements} raised nothing")


def test_only_errors_of_the_whole_database_stop_an_import():
    full = _sqlite_error("CREATE TABLE t (x BLOB)", "PRAGMA max_page_count = 2",
                         "INSERT INTO t VALUES (zeroblob(100000))")
    assert store_refusal(full).reason == "the database or its disk is full"
    assert store_refusal(_sqlite_error("CREATE TABLE t (x UNIQUE)", "INSERT INTO t VALUES (1)",
                                       "INSERT INTO t VALUES (1)")) is None  # this row's own
    assert store_refusal(_sqlite_error("INSERT INTO missing VALUES (1)")) is None  # a schema mismatch
    assert store_refusal(ValueError("unknown run fields")) is None
