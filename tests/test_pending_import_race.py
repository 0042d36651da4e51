"""Side files imported by several processes at once (two `bench` starts, a bench start and a daemon pass, all
waiting on a write lock held by a third): each file is imported by exactly one of them, and a run is never
inserted twice, even from two copies of one side file. A claim left by an importer that died (or hangs) is
taken over later."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from daemon_factories import wait_for
from joulepilot.store import commit_run_or_set_aside, describe_import, import_pending_runs, open_db
from joulepilot.store import pending as pending_module
from pending_factories import finished_run, runs_in, send_later, side_files, side_record, write_lock_held


def _database_with_side_file(path: Path) -> Path:
    """A database whose last run waits in a side file (its commit found the write lock taken); the file."""
    db = open_db(path)
    with write_lock_held(path):
        outcome = commit_run_or_set_aside(db, **finished_run(), stop=lambda: True)
    db.close()
    assert outcome.run_id is None and outcome.pending_path.is_file()
    return outcome.pending_path


def _wait_until_all_wait_for_the_lock(began: list[threading.Event], workers: list[threading.Thread]) -> None:
    """Each importer is either waiting for the write lock or already done (it found nothing to import)."""
    wait_for(lambda: all(b.is_set() or not w.is_alive() for b, w in zip(began, workers, strict=True)), 60,
             "both importers to wait for the write lock", interval_s=0.02)


def _import_side_by_side(path: Path) -> list[list]:
    """Two importers, each with its own connection, start while another connection holds the write lock;
    the lock is released once both wait for it (or have finished). What each one imported."""
    dbs = [open_db(path) for _ in range(2)]
    began = [threading.Event() for _ in dbs]
    for db, flag in zip(dbs, began, strict=True):
        db.conn.set_trace_callback(lambda sql, flag=flag: flag.set() if sql.startswith("BEGIN IMMEDIATE") else None)
    results: list[list] = [[] for _ in dbs]

    def run(i: int) -> None:
        results[i] = import_pending_runs(dbs[i])

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(dbs))]
    with write_lock_held(path):
        for worker in workers:
            worker.start()
        _wait_until_all_wait_for_the_lock(began, workers)
    for worker in workers:
        worker.join(60)
    for db in dbs:
        db.close()
    return results


def test_two_importers_waiting_on_a_lock_import_a_side_file_once(tmp_path):
    path = tmp_path / "race.db"
    side = _database_with_side_file(path)
    pending_id = side_record(side)["pending_id"]
    results = _import_side_by_side(path)
    items = [item for result in results for item in result]
    assert [i.path for i in items if i.run_id is not None and not i.already_stored] == [side]
    assert [i for i in items if i.run_id is None] == []  # the other one did not see it, or saw it stored
    ((run_id, _, stored_pending_id),) = runs_in(path)
    assert stored_pending_id == pending_id and run_id in {i.run_id for i in items}
    assert side_files(path) == []


def test_two_copies_of_one_side_file_store_one_run(tmp_path):
    """Even when the same run reaches two importers (a copy restored from a backup, a claim taken over from an
    importer that was only slow), the check that it is not stored yet is inside the import's transaction."""
    path = tmp_path / "copies.db"
    side = _database_with_side_file(path)
    shutil.copy(side, side.with_name(side.name.replace("run-", "run-0-copy-")))
    results = _import_side_by_side(path)
    items = [item for result in results for item in result]
    assert len(runs_in(path)) == 1
    assert sorted(i.already_stored for i in items) == [False, True]
    assert len({i.run_id for i in items}) == 1
    assert side_files(path) == []


# An importer in its own process, as a `bench` start or a daemon pass is: it says "waiting" when it asks for the
# write lock, then prints what it imported.
_IMPORTER = """
import sys
from joulepilot.store import describe_import, import_pending_runs, open_db
db = open_db(sys.argv[1])
db.conn.set_trace_callback(lambda sql: sql.startswith("BEGIN IMMEDIATE") and print("waiting", flush=True))
for item in import_pending_runs(db):
    print(describe_import(item), flush=True)
"""


class _Importer:
    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _IMPORTER, str(path)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def waiting_or_done(self) -> bool:
        return "waiting" in self.lines or self.proc.poll() is not None

    def finish(self) -> list[str]:
        self.proc.wait(60)
        self._reader.join(10)
        assert self.proc.returncode in (0, -signal.SIGKILL), self.proc.stderr.read()
        return [line for line in self.lines if line != "waiting"]


def test_two_processes_starting_at_once_import_a_side_file_once(tmp_path):
    path = tmp_path / "procs.db"
    side = _database_with_side_file(path)
    with write_lock_held(path):
        importers = [_Importer(path) for _ in range(2)]
        wait_for(lambda: all(i.waiting_or_done() for i in importers), 60, "both importers to start", interval_s=0.02)
    said = [line for importer in importers for line in importer.finish()]
    ((run_id, _, _),) = runs_in(path)
    assert said == [f"imported run {run_id} kept in {side} after an earlier failed commit"]
    assert side_files(path) == []


def test_a_claim_left_by_a_killed_importer_is_taken_over(tmp_path):
    path = tmp_path / "killed.db"
    side = _database_with_side_file(path)
    with write_lock_held(path):
        importer = _Importer(path)
        wait_for(importer.waiting_or_done, 60, "the importer to claim the file and wait", interval_s=0.02)
        importer.proc.kill()  # SIGKILL: no chance to give the file back
        assert importer.finish() == []
    (claimed,) = side_files(path)
    assert claimed != side and claimed.name.startswith(side.name)  # still claimed by the dead process
    db = open_db(path)
    (item,) = import_pending_runs(db)
    db.close()
    assert item.path == side and item.run_id is not None and not item.already_stored
    assert [r[0] for r in runs_in(path)] == [item.run_id] and side_files(path) == []


def test_a_claim_of_a_live_importer_is_left_alone_until_it_is_old(tmp_path, monkeypatch):
    path = tmp_path / "stuck.db"
    side = _database_with_side_file(path)
    with write_lock_held(path):
        importer = _Importer(path)
        wait_for(importer.waiting_or_done, 60, "the importer to claim the file and wait", interval_s=0.02)
        importer.proc.send_signal(signal.SIGSTOP)  # alive, but stuck
    try:
        db = open_db(path)
        assert import_pending_runs(db) == []  # it is another live process's to import
        assert runs_in(path) == []
        monkeypatch.setattr(pending_module, "CLAIM_STALE_S", 0.5)
        time.sleep(1.5)
        (item,) = import_pending_runs(db)  # its claim is too old to be a working importer's
        db.close()
        assert item.path == side and item.run_id is not None
    finally:
        importer.proc.send_signal(signal.SIGCONT)
    said = importer.finish()  # it wakes up, finds the run stored, and stores nothing
    assert said == [f"pending run {side} was already stored as run {item.run_id}; side file removed"]
    assert [r[0] for r in runs_in(path)] == [item.run_id] and side_files(path) == []


def test_an_import_that_cannot_commit_gives_the_file_back(tmp_path):
    path = tmp_path / "busy.db"
    side = _database_with_side_file(path)
    db = open_db(path)
    db.execute("PRAGMA busy_timeout = 300")
    with write_lock_held(path):
        (item,) = import_pending_runs(db)
    assert item.run_id is None and "locked" in item.error
    assert describe_import(item).startswith(f"pending run {side} not imported yet (database is locked)")
    assert side_files(path) == [side]  # under its own name again, for the next start
    (item,) = import_pending_runs(db)
    assert item.run_id is not None and side_files(path) == []
    db.close()


def test_sigterm_while_an_import_waits_gives_the_file_back(tmp_path):
    path = tmp_path / "term.db"
    side = _database_with_side_file(path)
    db = open_db(path)

    def exit_like_bench(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_like_bench)
    try:
        with write_lock_held(path):
            sent = send_later(0.5, signal.SIGTERM)
            with pytest.raises(SystemExit):
                import_pending_runs(db)
            handled_s = time.monotonic() - sent.result()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handled_s < 10  # not the store's 30 s busy timeout
    assert runs_in(path) == [] and side_files(path) == [side]
    (item,) = import_pending_runs(db)
    assert item.run_id is not None and side_files(path) == []
    db.close()


def test_a_stop_request_ends_an_import_waiting_for_the_lock(tmp_path):
    path = tmp_path / "stop.db"
    side = _database_with_side_file(path)
    db = open_db(path)
    db.execute("PRAGMA busy_timeout = 10000")
    stop = threading.Event()
    with write_lock_held(path):
        timer = threading.Timer(0.3, stop.set)
        started = time.monotonic()
        timer.start()
        (item,) = import_pending_runs(db, stop=stop.is_set)
        waited_s = time.monotonic() - started
    assert item.run_id is None and "locked" in item.error and waited_s < 5  # not the 10 s busy timeout
    assert side_files(path) == [side]
    assert import_pending_runs(db, stop=stop.is_set) == []  # asked to stop: nothing more is tried
    (item,) = import_pending_runs(db)
    assert item.run_id is not None and side_files(path) == []
    db.close()


def _run_with_nan_extra() -> dict:
    """A finished run whose `extra` holds NaN, as a worker's result keys do (written with allow_nan)."""
    kwargs = finished_run()
    kwargs["run"]["extra"] = {"note": "measured", "cv": float("nan")}
    return kwargs


def test_a_stored_run_whose_extra_holds_nan_does_not_block_imports(tmp_path):
    path = tmp_path / "nan.db"
    db = open_db(path)
    assert commit_run_or_set_aside(db, **_run_with_nan_extra()).run_id is not None
    with write_lock_held(path):
        side = commit_run_or_set_aside(db, **finished_run(0.7), stop=lambda: True).pending_path
    [item] = import_pending_runs(db)
    assert item.error == "" and item.run_id is not None and not item.already_stored
    assert not side.exists()
    stored = db.execute("SELECT energy_j_per_inference FROM runs WHERE id = ?", [item.run_id]).fetchone()
    assert stored == (0.7,)


def test_a_run_whose_extra_holds_nan_is_recognised_as_already_stored(tmp_path):
    path = tmp_path / "nan-copy.db"
    db = open_db(path)
    with write_lock_held(path):
        side = commit_run_or_set_aside(db, **_run_with_nan_extra(), stop=lambda: True).pending_path
    copy = side.with_name(side.name.replace("run-", "run-0-copy-"))
    shutil.copy(side, copy)
    first, second = import_pending_runs(db)
    assert (first.already_stored, second.already_stored) == (False, True)
    assert first.run_id == second.run_id is not None
    assert db.execute("SELECT count(*) FROM runs").fetchone() == (1,)
    assert side_files(path) == []
