"""The open database that the other parts hold: `Store`, the store's own handle on one connection.

Other parts pass a Store to the store's typed functions and never talk SQL to it; inside store/ it runs
statements (`execute`, `query` yielding dicts), inserts (`insert_id`), transactions (`begin_write`, `begin_read`,
`commit`; `db.transaction` is the one way in for writes), and tells which SQL dialect it speaks. This class is
SQLite's (sqlite3); `postgres.PostgresStore` is PostgreSQL's.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_SLICE_MS = 200  # the longest a signal waits to be handled while a write waits for the lock


def _waits_for_lock(exc: sqlite3.Error) -> bool:
    """Whether SQLite refused because another connection holds the lock (worth waiting for)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    text = str(exc).lower()
    return "locked" in text or "busy" in text


@dataclass(frozen=True)
class Column:
    """One column of a table as the database declares it."""

    name: str
    type: str  # the declared type, upper case: 'TEXT', 'INTEGER', 'REAL'
    notnull: bool
    default_value: Any  # the DEFAULT expression as declared (text), or None


class Store:
    """One open joulepilot database (see the module docstring); close it with `close()`."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection, *, immutable: bool = False) -> None:
        self.conn = conn
        # Opened with `immutable=1` (a WAL database in a folder this user cannot write): it sees the file as it
        # was, never a later commit, so it is kept for one read, not longer.
        self.immutable = immutable
        # Makes one connection's transactions take turns between this process's threads.
        self.write_lock = threading.RLock()

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> sqlite3.Cursor:
        return self.conn.execute(sql) if params is None else self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        self.conn.executemany(sql, rows)

    def query(self, sql: str, params: Sequence[Any] | None = None) -> Iterator[dict[str, Any]]:
        """The rows of a SELECT, each as a dict of column name -> value."""
        cur = self.execute(sql, params)
        names = [c[0] for c in cur.description]
        for row in cur:
            yield dict(zip(names, row, strict=True))

    def insert_id(self, sql: str, params: Sequence[Any]) -> int | None:
        """Run one INSERT of a table with an integer `id`; the new row's id (None when nothing was inserted)."""
        cur = self.execute(sql, params)
        return cur.lastrowid if cur.rowcount == 1 else None

    def ddl(self, statement: str) -> str:
        """A migration's statement as this database takes it (the migrations are written in SQLite's types)."""
        return statement

    def whole_part(self, expression: str) -> str:
        """SQL for the whole part of a number that is not negative (SQLite's CAST truncates; others round)."""
        return f"CAST({expression} AS INTEGER)"

    def columns(self, table: str) -> list[Column]:
        return [Column(name, (kind or "").upper(), bool(notnull), default)
                for _cid, name, kind, notnull, default, _pk in self.execute(f"PRAGMA table_info([{table}])")]

    def column_names(self, table: str) -> set[str]:
        return {c.name for c in self.columns(table)}

    def table_names(self) -> list[str]:
        return [row[0] for row in self.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]

    def schema_names(self) -> list[str]:
        """The names of what the schema holds, tables first (SQLite's own left out)."""
        return [row[0] for row in self.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite%'"
                                               " ORDER BY type != 'table', name")]

    def schema_version(self) -> int:
        return self.execute("PRAGMA user_version").fetchone()[0]

    def set_schema_version(self, version: int) -> None:
        """Record the schema version, inside the migration step's transaction."""
        self.execute(f"PRAGMA user_version = {int(version)}")

    @property
    def file(self) -> Path | None:
        """The main database file (None for an in-memory database)."""
        for _seq, name, file in self.execute("PRAGMA database_list").fetchall():
            if name == "main":
                return Path(file) if file else None
        return None

    @property
    def target(self) -> str:
        """What messages name the database by: its file here, a URL without its password on PostgreSQL."""
        return str(self.file or "(in memory)")

    @property
    def side_path(self) -> Path | None:
        """The path whose siblings hold this database's side files (`<path>.pending/`): the file itself here."""
        return self.file

    def set_lock_wait_ms(self, ms: int) -> None:
        """How long each statement waits for a lock another connection holds (0: fail at once)."""
        self.execute(f"PRAGMA busy_timeout = {max(0, int(ms))}")

    @property
    def in_transaction(self) -> bool:
        return self.conn.in_transaction

    def begin_write(self, stop: Callable[[], bool] | None = None) -> None:
        """BEGIN IMMEDIATE, waiting for another process's write lock as long as the connection's busy timeout
        allows, slice by slice: SQLite waits in C code, where Python cannot run a signal handler, so between slices
        Python handles signals, and `stop()` returning True ends the wait (raising SQLite's 'database is locked')."""
        conn = self.conn
        total_ms = int(conn.execute("PRAGMA busy_timeout").fetchone()[0])
        deadline = time.monotonic() + total_ms / 1000
        conn.execute(f"PRAGMA busy_timeout = {min(LOCK_SLICE_MS, total_ms)}")
        try:
            while True:
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as exc:
                    if not _waits_for_lock(exc) or time.monotonic() >= deadline or (stop is not None and stop()):
                        raise
        finally:
            conn.execute(f"PRAGMA busy_timeout = {total_ms}")

    def begin_read(self) -> None:
        """A read transaction: every read until `commit` sees one committed state."""
        self.conn.execute("BEGIN")

    def commit(self) -> None:
        self.conn.execute("COMMIT")

    def rollback_quietly(self) -> None:
        """Undo the open transaction without hiding why it failed: SQLite may already have rolled it back itself
        (a full disk, an I/O error at COMMIT), and a ROLLBACK that fails in turn is not the error to report
        (closing the connection rolls back what is left)."""
        if not self.conn.in_transaction:
            return
        try:
            self.conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    def close(self) -> None:
        self.conn.close()
