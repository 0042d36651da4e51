"""Deployment metering against a store that refuses writes: the metering thread lives on, a trip is recorded
once the store is writable again, and what cannot be written at exit waits in a side file that the next
attach imports, exactly once.

The store is locked the way another writer locks it: a separate process holding `BEGIN EXCLUSIVE`.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
from joulepilot.compiler import CompileConfig, bench
from joulepilot.policies.schema import validate
from joulepilot.runtime import EnvelopeWarning, attach, metered
from joulepilot.store import db as store_db
from joulepilot.store import open_db
from joulepilot.store.deployment_side_files import deployment_side_file, set_aside_deployment
from joulepilot.store.deployments import get_deployment, list_violations, read_samples

LOCK_HOLDER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    sys.stdin.read()  # held until the test closes our stdin
    conn.execute("ROLLBACK")
""")


@contextmanager
def write_lock_held(db_path: Path):
    """Another process holds the database's write lock for as long as the block runs."""
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def busy_work(x: int) -> int:
    """A stand-in model: some CPU time per call, so the estimate meter reads power while it serves."""
    return sum(range(x))


def serve(dep, seconds: float) -> None:
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        dep(2000)


def side_files(db_path: Path) -> list[Path]:
    return sorted(db_path.with_name(db_path.name + ".pending").glob("deployment-*.json"))


def tight_policy():
    """A policy whose envelope any served window breaks: the guard trips on the first window with calls."""
    return validate({"name": "tight", "workload": "mlp", "batch_size": 8,
                     "limits": {"max_avg_power_w": 0.001}, "guard": {"windows": 1, "action": "warn"}}, "tight.toml")


def test_a_trip_while_the_store_is_locked_is_recorded_once_it_is_writable(tmp_path, monkeypatch):
    # The store's own wait for a lock, and the meter's, shortened so that a lock of a second or two outlasts them.
    monkeypatch.setattr(store_db, "BUSY_TIMEOUT_MS", 300)
    monkeypatch.setattr(metered, "STORE_WAIT_S", 0.3, raising=False)
    db_path = tmp_path / "jp.db"
    dep = attach(busy_work, "locked-trip", policy=tight_policy(), db=db_path, device="cpu", interval_s=0.2,
                 flush_interval_s=0.4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EnvelopeWarning)
        with write_lock_held(db_path):
            serve(dep, 2.0)  # the guard trips and every flush is refused
            assert dep._thread.is_alive(), "metering stopped on a store error"
            assert len(dep.trips) == 1  # the trip counts at once, whether or not the store takes it
        released_at = time.time()
        serve(dep, 2.0)
        assert dep._thread.is_alive()
        db = open_db(db_path)
        dep_id = get_deployment(db, "locked-trip")["id"]
        # Written while serving, after the lock went: the windows taken under the lock and those after it.
        stored = read_samples(db, dep_id)
        assert any(s["t_start"] >= released_at for s in stored)
        assert [v["deployment"] for v in list_violations(db)] == ["locked-trip"]
        dep.close()
    samples = read_samples(db, dep_id)
    assert sum(s["inferences"] for s in samples) == dep.inferences  # close() flushed the rest, nothing twice
    # No window lost or doubled under the lock: none overlaps the one before, and none starts a window's length
    # (0.2 s) after it. A gap of a few ms is the metering thread preempted between its monotonic and wall-clock
    # reads on a loaded machine (a whole-suite run saw 5.5 ms), which the stamps show as a small forward step.
    for a, b in zip(samples, samples[1:], strict=False):
        assert -1e-3 <= b["t_start"] - a["t_end"] < 0.1, (a, b)
    [violation] = list_violations(db, deployment="locked-trip")
    assert violation["limit_value"] == 0.001 and violation["measured_value"] > 0.001
    violated = db.execute("SELECT COUNT(*) FROM decisions WHERE state = 'violated' AND policy = 'tight'").fetchone()
    assert violated[0] == 1
    assert dep.trips[0]["violation_id"] == violation["id"]
    assert side_files(db_path) == []  # everything reached the store: no side file is left


EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    from joulepilot.runtime import attach, metered

    EXIT_WAIT_S = getattr(metered, "EXIT_WAIT_S", 5.0)  # (5 s where the module names no bound)

    def busy_work(x):
        return sum(range(x))

    dep = attach(busy_work, "exiting", db=sys.argv[1], device="cpu", interval_s=0.2, flush_interval_s=3600)
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:
        dep(2000)
    print(dep.inferences, EXIT_WAIT_S, flush=True)
    sys.stdin.readline()  # the test locks the store, then lets us exit
""")


def test_a_locked_store_at_exit_keeps_the_samples_in_a_side_file_for_the_next_attach(tmp_path, caplog):
    db_path = tmp_path / "jp.db"
    script = tmp_path / "serve.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(db_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    served_text, exit_wait_text = proc.stdout.readline().split()
    served, exit_wait_s = int(served_text), float(exit_wait_text)
    with write_lock_held(db_path):
        started = time.monotonic()
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        try:
            _, err = proc.communicate(timeout=exit_wait_s + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"the process was still exiting {exit_wait_s + 10:.0f} s later, stuck on the locked store")
        exit_s = time.monotonic() - started
    assert proc.returncode == 0
    # bounded by the named constant (plus the interpreter's exit, seconds on a loaded machine), not by the
    # store's own 30 s busy timeout
    assert exit_s < exit_wait_s + 5.0
    db = open_db(db_path)
    dep_id = get_deployment(db, "exiting")["id"]
    assert read_samples(db, dep_id) == []  # the store took nothing...
    [side] = side_files(db_path)  # ...and the side file has it all
    assert str(side) in err  # the exit says where the samples wait
    kept = json.loads(side.read_text())
    assert kept["deployment"] == "exiting"
    assert sum(s["inferences"] for s in kept["samples"]) == served
    copy = tmp_path / "side-copy.json"
    shutil.copy(side, copy)

    with caplog.at_level(logging.WARNING, logger="joulepilot.deployment"):
        again = attach(busy_work, "exiting", db=db_path, device="cpu", interval_s=0.2)
        again.close()  # the thread imports first; close() waits for it
    samples = read_samples(db, dep_id)
    assert sum(s["inferences"] for s in samples) == served + again.inferences
    assert any(str(side) in r.getMessage() and "imported" in r.getMessage() for r in caplog.records)
    assert side_files(db_path) == []
    imported_rows = len(samples)

    # A kill between the import's commit and the file's removal leaves the file: importing it again adds nothing.
    shutil.copy(copy, side)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="joulepilot.deployment"):
        attach(busy_work, "exiting", db=db_path, device="cpu", interval_s=5.0).close()
    assert len(read_samples(db, dep_id)) == imported_rows + 1  # only the new deployment's own short window
    assert sum(s["inferences"] for s in read_samples(db, dep_id)) == served + again.inferences
    assert any("already stored" in r.getMessage() for r in caplog.records)
    assert side_files(db_path) == []


def test_metering_thread_lives_through_a_failing_meter(tmp_path):
    """A meter that raises for a while (a driver reset) costs those windows' readings, not the metering."""

    class FlakyMeter:
        devices: list = []
        primary_source = "estimate"

        def __init__(self) -> None:
            self.failing = False
            self.joules = 0.0

        def read_energy_j(self) -> dict[str, float]:
            if self.failing:
                raise OSError("counter unavailable")
            self.joules += 1.0
            return {"cpu": self.joules}

        def read_power_w(self) -> dict[str, float]:
            return {"cpu": 5.0}

    meter = FlakyMeter()
    dep = attach(busy_work, "flaky", db=tmp_path / "jp.db", device="cpu", interval_s=0.1, flush_interval_s=0.2,
                 meter=meter)
    meter.failing = True
    serve(dep, 0.6)
    meter.failing = False
    serve(dep, 0.6)
    assert dep._thread.is_alive()
    dep.close()
    db = open_db(tmp_path / "jp.db")
    samples = read_samples(db, get_deployment(db, "flaky")["id"])
    assert sum(s["inferences"] for s in samples) == dep.inferences  # the failed windows' calls fold into the next



def _left_behind(db_path: Path) -> tuple[Path, list[dict]]:
    """A side file as a serving process that ended while the store was locked leaves it: three 5-s windows."""
    t0 = time.time() - 60
    windows = [{"t_start": t0 + 5 * i, "t_end": t0 + 5 * (i + 1), "energy_j": 40.0, "inferences": 100,
                "avg_power_w": 8.0, "peak_power_w": 9.0, "energy_source": "estimate", "config_id": None,
                "other_processes": 0, "share": 1.0} for i in range(3)]
    side = set_aside_deployment(deployment_side_file(db_path, "4242-test"), deployment="gone", samples=windows,
                                error="database is locked")
    return side, windows


def _stored_windows(db_path: Path) -> list[tuple]:
    db = open_db(db_path)
    return [(s["t_start"], s["inferences"], s["energy_j"]) for s in read_samples(db, get_deployment(db, "gone")["id"])]


def test_bench_imports_the_windows_a_deployment_left_in_a_side_file(tmp_path, flow_worker):
    db_path = tmp_path / "jp.db"
    side, windows = _left_behind(db_path)
    notes: list[str] = []
    bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db_path, idle_s=0,
          notice=notes.append)
    assert any(n.startswith("imported 3 metered windows (300 calls) of deployment 'gone'") and str(side) in n
               for n in notes), notes
    assert not side.exists()
    assert _stored_windows(db_path) == [(w["t_start"], w["inferences"], w["energy_j"]) for w in windows]


def test_the_daemon_imports_the_windows_a_deployment_left_in_a_side_file(tmp_path):
    db_path = tmp_path / "jp.db"
    open_db(db_path).close()
    side, windows = _left_behind(db_path)
    policies = tmp_path / "policies"
    policies.mkdir()
    proc = subprocess.run([sys.executable, "-m", "joulepilot", "daemon", "--db", str(db_path), "--policies",
                           str(policies), "--once", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"imported 3 metered windows (300 calls) of deployment 'gone' kept in {side}" in proc.stderr
    assert not side.exists()
    assert _stored_windows(db_path) == [(w["t_start"], w["inferences"], w["energy_j"]) for w in windows]
