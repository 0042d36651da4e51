"""A finished run is not lost when its commit is interrupted: a signal, Ctrl-C or any error during the commit
first writes the run to its side file, then goes on; the wait for another process's write lock is taken in
short slices, so a signal is handled within a fraction of a second instead of after SQLite's whole busy
timeout; and a side file written for a run whose commit did go through is never imported a second time."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from daemon_factories import wait_for
from joulepilot.store import commit_run_or_set_aside, import_pending_runs, open_db
from pending_factories import (
    SAMPLES,
    finished_run,
    release_later,
    runs_in,
    send_later,
    side_files,
    side_record,
    write_lock_held,
)

REPO = Path(__file__).resolve().parent.parent


def _exit_like_bench(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # what `bench` does with SIGTERM


SIGNALS = {"SIGTERM": (signal.SIGTERM, _exit_like_bench, SystemExit),
           "SIGINT": (signal.SIGINT, signal.default_int_handler, KeyboardInterrupt)}


def _assert_kept_whole(path: Path, energy_j: float = 0.5) -> str:
    """The one side file holds the run and its samples; returns its pending_id."""
    (file,) = side_files(path)
    assert file.name.startswith("run-") and file.suffix == ".json"
    record = side_record(file)
    assert record["run"]["energy_j_per_inference"] == energy_j and record["run"]["status"] == "ok"
    assert [tuple(s) for s in record["samples"]] == SAMPLES
    return record["pending_id"]


def _assert_imported_once(db, path: Path, pending_id: str) -> None:
    (item,) = import_pending_runs(db)
    assert item.run_id is not None, item.error
    assert [(r[0], r[2]) for r in runs_in(path)] == [(item.run_id, pending_id)]
    assert side_files(path) == []


@pytest.mark.parametrize("which", SIGNALS)
def test_a_signal_while_the_commit_waits_for_the_lock_sets_the_run_aside_at_once(tmp_path, which):
    path = tmp_path / "locked.db"
    db = open_db(path)
    db.execute("PRAGMA busy_timeout = 10000")  # SQLite alone would wait this long before Python sees the signal
    sig, handler, raised = SIGNALS[which]
    previous = signal.signal(sig, handler)
    try:
        with write_lock_held(path):
            sent = send_later(0.5, sig)
            with pytest.raises(raised):
                commit_run_or_set_aside(db, **finished_run())
            handled_s = time.monotonic() - sent.result()
    finally:
        signal.signal(sig, previous)
    # well within SQLite's 10 s wait (the slices are 0.1 s; a busy machine may take seconds to run this thread)
    assert handled_s < 5, f"the signal was handled {handled_s:.1f} s after it came"
    assert runs_in(path) == []
    pending_id = _assert_kept_whole(path)
    _assert_imported_once(db, path, pending_id)
    db.close()


@pytest.mark.parametrize("raised", [KeyboardInterrupt(), SystemExit(143), RuntimeError("a bug")],
                         ids=lambda e: type(e).__name__)
def test_anything_raised_inside_the_commit_sets_the_run_aside_before_it_propagates(tmp_path, monkeypatch, raised):
    from joulepilot.store import commit as commit_module

    real_insert = commit_module.insert_run

    def insert_then_raise(*args, **kwargs):
        real_insert(*args, **kwargs)  # the run's rows are written, the transaction is not committed yet
        raise raised

    path = tmp_path / "interrupted.db"
    db = open_db(path)
    monkeypatch.setattr(commit_module, "insert_run", insert_then_raise)
    with pytest.raises(type(raised)):
        commit_run_or_set_aside(db, **finished_run())
    monkeypatch.undo()
    assert runs_in(path) == []  # rolled back
    pending_id = _assert_kept_whole(path)
    _assert_imported_once(db, path, pending_id)
    db.close()


def test_a_second_interrupt_while_the_run_is_set_aside_still_keeps_it(tmp_path, monkeypatch):
    from joulepilot.store import commit as commit_module
    from joulepilot.store import pending as pending_module

    def interrupted_insert(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C during the commit ...

    real_write = pending_module.write_file_atomic
    calls: list[Path] = []

    def write_interrupted_once(target, data):
        calls.append(Path(target))
        if len(calls) == 1:
            raise KeyboardInterrupt  # ... and again while the side file is written
        return real_write(target, data)

    path = tmp_path / "twice.db"
    db = open_db(path)
    monkeypatch.setattr(commit_module, "insert_run", interrupted_insert)
    monkeypatch.setattr(pending_module, "write_file_atomic", write_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        commit_run_or_set_aside(db, **finished_run())
    monkeypatch.undo()
    assert len(calls) == 2
    _assert_kept_whole(path)
    db.close()


def test_a_run_committed_just_before_an_interrupt_is_not_imported_again(tmp_path, monkeypatch):
    from joulepilot.store import pending as pending_module

    real_outcome = pending_module.StoreOutcome

    def interrupted_once_stored(run_id, *args, **kwargs):
        if run_id is not None:
            raise KeyboardInterrupt  # after COMMIT, before the caller learns the run's id
        return real_outcome(run_id, *args, **kwargs)

    path = tmp_path / "committed.db"
    db = open_db(path)
    monkeypatch.setattr(pending_module, "StoreOutcome", interrupted_once_stored)
    with pytest.raises(KeyboardInterrupt):
        commit_run_or_set_aside(db, **finished_run())
    monkeypatch.undo()
    pending_id = _assert_kept_whole(path)
    ((run_id, _, stored_pending_id),) = runs_in(path)
    assert stored_pending_id == pending_id
    (item,) = import_pending_runs(db)
    assert item.already_stored and item.run_id == run_id
    assert len(runs_in(path)) == 1 and side_files(path) == []
    db.close()


def test_the_sliced_wait_still_waits_the_whole_busy_timeout(tmp_path):
    path = tmp_path / "busy.db"
    db = open_db(path)
    db.execute("PRAGMA busy_timeout = 3000")
    with write_lock_held(path) as holder:
        releaser = release_later(holder, 1.0)
        started = time.monotonic()
        outcome = commit_run_or_set_aside(db, **finished_run())
        waited_s = time.monotonic() - started
        releaser.join()
    assert outcome.run_id is not None and 0.9 < waited_s  # stored: the wait did not end at the first slice
    assert [r[0] for r in runs_in(path)] == [outcome.run_id] and side_files(path) == []
    assert db.execute("PRAGMA busy_timeout").fetchone()[0] == 3000  # the connection's own timeout is back

    db.execute("PRAGMA busy_timeout = 1000")
    with write_lock_held(path):
        started = time.monotonic()
        outcome = commit_run_or_set_aside(db, **finished_run(0.25))
        waited_s = time.monotonic() - started
    assert outcome.run_id is None and "locked" in outcome.error and 0.9 < waited_s < 10  # once, not per slice
    _assert_kept_whole(path, 0.25)
    db.close()


def test_a_stop_request_ends_the_wait_and_sets_the_run_aside(tmp_path):
    path = tmp_path / "stopping.db"
    db = open_db(path)
    db.execute("PRAGMA busy_timeout = 10000")
    stop = threading.Event()
    with write_lock_held(path):
        timer = threading.Timer(0.3, stop.set)
        started = time.monotonic()
        timer.start()
        outcome = commit_run_or_set_aside(db, **finished_run(), stop=stop.is_set)
        waited_s = time.monotonic() - started
    assert outcome.run_id is None and "locked" in outcome.error and waited_s < 5  # not SQLite's 10 s
    assert outcome.pending_path == _side_file_only(path)
    db.close()


def _side_file_only(path: Path) -> Path:
    (file,) = side_files(path)
    return file


def test_sigterm_to_bench_while_its_run_waits_for_a_locked_database(tmp_path, own_tmpdir, flow_worker):
    path = tmp_path / "bench.db"
    open_db(path).close()
    args = ["bench", "mlp", "--batch-size", "4", "--modes", "eager", "--device", "cpu", "--min-seconds", "0.3",
            "--no-warm-start", "--db", str(path)]
    stderr_path = tmp_path / "bench.stderr"
    job_scratch = os.path.join(str(own_tmpdir), "joulepilot-run-*", "phases.tsv")  # the job's; not the zygote's
    with write_lock_held(path), open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "joulepilot", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=stderr)
        try:
            wait_for(lambda: glob.glob(job_scratch), 120, "the worker to start", interval_s=0.05)
            wait_for(lambda: not glob.glob(job_scratch), 120, "the measurement to finish", interval_s=0.05)
            time.sleep(1.0)  # bench now waits for the write lock to commit the run
            assert proc.poll() is None, stderr_path.read_text()
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"bench did not exit within 60 s of SIGTERM; stderr:\n{stderr_path.read_text()}")
            exited_s = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = stderr_path.read_text()
    # the store's busy timeout is 30 s: a bench that waited it out would exit later than this
    assert exited_s < 15, f"bench exited {exited_s:.1f} s after SIGTERM; stderr:\n{text}"
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert runs_in(path) == []
    (file,) = side_files(path)
    record = side_record(file)
    assert record["run"]["status"] == "ok" and record["run"]["energy_j_per_inference"] > 0
    assert str(file) in text and "Traceback" not in text

    db = open_db(path)  # the next start imports it
    (item,) = import_pending_runs(db)
    assert [(r[0], r[2]) for r in runs_in(path)] == [(item.run_id, record["pending_id"])]
    db.close()
