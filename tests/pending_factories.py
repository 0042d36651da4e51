"""A finished run to commit, and another process's write lock on the database, for the side-file tests."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from joulepilot.compiler.config import CompileConfig

WORKLOAD = {"id": "pending-workload", "spec": "mlp", "batch_size": 4}
CONFIG = CompileConfig(mode="eager", batch_size=4).to_row()
SAMPLES = [(0.0, "cpu:0", 12.5), (0.1, "cpu:0", 13.0)]


def finished_run(energy_j: float = 0.5) -> dict[str, Any]:
    """The keyword arguments of `commit_run_or_set_aside` for one finished measurement."""
    from joulepilot.store import host_identity

    host = host_identity()
    run = {"workload_id": WORKLOAD["id"], "config_id": CONFIG["id"], "host_id": host["id"], "device": "cpu",
           "status": "ok", "started_at": time.time(), "finished_at": time.time(),
           "energy_j_per_inference": energy_j, "energy_source": "estimate", "extra": {"note": "measured"}}
    return {"run": run, "samples": SAMPLES, "host": host, "workload": WORKLOAD, "config": CONFIG}


def runs_in(path: Path) -> list[tuple[int, float, str | None]]:
    """(id, energy_j_per_inference, extra.pending_id) of every run in the file, read without joulepilot."""
    conn = sqlite3.connect(path, timeout=60)
    try:
        return conn.execute("SELECT id, energy_j_per_inference, json_extract(extra, '$.pending_id') FROM runs"
                            " ORDER BY id").fetchall()
    finally:
        conn.close()


def side_files(path: Path) -> list[Path]:
    """Every file in the database's side folder (claimed or not, temporary ones included)."""
    folder = path.with_name(path.name + ".pending")
    return sorted(folder.iterdir()) if folder.is_dir() else []


def side_record(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text())


@contextmanager
def write_lock_held(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holds the database's write lock (as a daemon's or another bench's long write does)
    until the block ends."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def send_later(after_s: float, sig: int) -> Future:
    """Send `sig` to this process `after_s` from now, from another thread; the future holds the monotonic time it
    was sent, so that a test times how long the signal took to be handled, not how late the thread ran."""
    sent: Future = Future()

    def send() -> None:
        time.sleep(after_s)
        sent.set_result(time.monotonic())
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()
    return sent


def release_later(conn: sqlite3.Connection, after_s: float) -> threading.Thread:
    """End the transaction holding the write lock `after_s` from now, from another thread."""
    def release() -> None:
        time.sleep(after_s)
        conn.execute("ROLLBACK")
        conn.execute("BEGIN")  # an empty read transaction, so that write_lock_held's ROLLBACK has one to end

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread
