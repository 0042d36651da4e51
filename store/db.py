"""Opening the database: location, WAL, busy timeout, migrations, and one transaction per write."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlite_utils

from .errors import StoreError
from .schema import MIGRATIONS, SCHEMA_VERSION

BUSY_TIMEOUT_MS = 30_000


def default_home() -> Path:
    """`JOULEPILOT_HOME`, else the platform's user data folder for joulepilot."""
    env = os.environ.get("JOULEPILOT_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("joulepilot", appauthor=False))


def default_db_path() -> Path:
    """`JOULEPILOT_DB`, else `joulepilot.db` under the home folder."""
    env = os.environ.get("JOULEPILOT_DB")
    if env:
        return Path(env).expanduser()
    return default_home() / "joulepilot.db"


def schema_version(db: sqlite_utils.Database) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def migrate(db: sqlite_utils.Database) -> int:
    """Bring the database to SCHEMA_VERSION; each step commits with its version number."""
    conn = db.conn
    current = schema_version(db)
    if current > SCHEMA_VERSION:
        raise StoreError(
            f"database schema version {current} is newer than this joulepilot understands "
            f"({SCHEMA_VERSION}); upgrade joulepilot or point --db at another file"
        )
    for version in range(current, SCHEMA_VERSION):
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated while we waited for the write lock.
            if conn.execute("PRAGMA user_version").fetchone()[0] != version:
                conn.execute("ROLLBACK")
                continue
            MIGRATIONS[version](conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return schema_version(db)


def open_db(path: str | os.PathLike | None = None, *, migrate_schema: bool = True) -> sqlite_utils.Database:
    """Open (creating if needed) the joulepilot database at `path` or the default location."""
    target = Path(path).expanduser() if path else default_db_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(target), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)
    except (OSError, sqlite3.Error) as exc:
        raise StoreError(f"cannot open database {target}: {exc}; pass --db or set JOULEPILOT_DB") from exc
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    db = sqlite_utils.Database(conn)
    if migrate_schema:
        migrate(db)
    return db


@contextmanager
def transaction(db: sqlite_utils.Database) -> Iterator[sqlite_utils.Database]:
    """One logical write: everything inside commits together or not at all."""
    conn = db.conn
    if conn.in_transaction:
        yield db  # nested: the outer transaction owns the commit
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    else:
        conn.execute("COMMIT")
