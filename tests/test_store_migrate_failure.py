"""A migration that fails (a full disk) reports the error SQLite gave, in one line naming the file and the fix,
and leaves the database at the schema version it had, whole; the next open on a disk with room finishes it."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from joulepilot.store import SCHEMA_VERSION, StoreError, list_runs, open_db, schema_version
from joulepilot.store import db as db_module
from joulepilot.store.db import joulepilot_tables
from joulepilot.store.schema import MIGRATIONS
from store_factories import database_at


def _file_state(path: Path) -> tuple[int, str, set[str]]:
    """The file's schema version, SQLite's integrity verdict and its tables, read without joulepilot."""
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                  if not r[0].startswith("sqlite")}
        return version, integrity, tables
    finally:
        conn.close()


def _full_disk_at_last_step(*, sqlite_ended_transaction: bool):
    """The last migration step as it fails on a full disk: its statements run, then the write fails, SQLite
    having rolled the transaction back itself (as it does when it cannot write its journal) or not."""
    real = MIGRATIONS[-1]

    def step(db) -> None:
        real(db)
        if sqlite_ended_transaction:
            db.execute("ROLLBACK")
        raise sqlite3.OperationalError("database or disk is full")

    return [*MIGRATIONS[:-1], step]


@pytest.mark.parametrize("sqlite_ended_transaction", [True, False], ids=["rolled-back-by-sqlite", "still-open"])
def test_a_failed_migration_step_reports_its_own_error_and_keeps_the_previous_version(
        tmp_path, monkeypatch, sqlite_ended_transaction):
    path = database_at(tmp_path / "old.db", SCHEMA_VERSION - 1, wal=True)
    joulepilot_tables(SCHEMA_VERSION - 1)  # the check of the file's tables replays the real migrations, not these
    monkeypatch.setattr(db_module, "MIGRATIONS",
                        _full_disk_at_last_step(sqlite_ended_transaction=sqlite_ended_transaction))
    with pytest.raises(StoreError) as err:
        open_db(path)
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and "database or disk is full" in message and "free space" in message
    assert "cannot rollback" not in message

    version, integrity, tables = _file_state(path)
    assert (version, integrity) == (SCHEMA_VERSION - 1, "ok")
    assert tables == joulepilot_tables(SCHEMA_VERSION - 1)
    monkeypatch.undo()
    db = open_db(path)  # room again: the migration completes and the old run is there
    assert schema_version(db) == SCHEMA_VERSION
    assert [r["energy_j_per_inference"] for r in list_runs(db)] == [0.25]
    db.close()


# A child process whose files may not grow past a limit: SQLite's writes fail as on a full disk.
_CAPPED_OPEN = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
from joulepilot.store import StoreError, open_db
try:
    open_db(sys.argv[1])
except StoreError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_new_database_on_a_disk_that_fills_up_reports_the_write_error(tmp_path):
    path = tmp_path / "new.db"
    # Room for the empty file, its WAL switch and part of the first schema, not for all of it.
    # Coverage's data file would hit the same limit at exit: a process that cannot write files is not measured.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_PROCESS_")}
    proc = subprocess.run([sys.executable, "-c", _CAPPED_OPEN, str(path), "60000"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 3, proc.stderr
    message = proc.stdout.strip()
    assert "\n" not in message and "Traceback" not in proc.stderr
    assert message.startswith(f"database {path}: ") and message.endswith("; free space on its disk and retry")
    assert "cannot rollback" not in message
    assert "disk I/O error" in message or "disk is full" in message

    version, integrity, tables = _file_state(path)
    assert integrity == "ok"
    assert tables == (joulepilot_tables(version) if version else set())  # each version whole, none half-made
    db = open_db(path)
    assert schema_version(db) == SCHEMA_VERSION
    db.close()
