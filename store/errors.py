"""Errors raised by the store, and the one place where SQLite's and PostgreSQL's errors become them
(`database_error`): every message names the database file (or URL, without its password) and what to do. A
damaged file says so with the fix, a full disk says which disk, whichever command, the daemon, the exporter or
the hook met it."""

from __future__ import annotations

import os
import sqlite3

from .urls import redacted


class StoreError(RuntimeError):
    """The database cannot be opened, migrated, read or written; the message says what to do."""


class DatabaseMissing(StoreError):
    """A command that only reads was pointed at a database file that does not exist."""


class StoreUnreachable(StoreError):
    """The database server cannot be reached (down, restarting, or the network between): what is set aside now is
    stored once it answers again."""


class DatabaseCorrupt(StoreError):
    """The file is damaged (SQLite finds it malformed, or no database at all), or is a SQLite file that is not a
    joulepilot database."""


class DiskFull(StoreError):
    """The disk holding the database is full (SQLITE_FULL)."""


class SchemaTooNew(StoreError):
    """The database was written by a newer joulepilot."""


class ExportFormatError(StoreError):
    """A runs export file that cannot be read or imported; the message names the file, record and field."""


# What the database driver raises (`database_error` maps them): other parts catch them by this name.
DRIVER_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error,)

# Errors that carry no result code, matched on their message.
_CODES_BY_TEXT = (("locked", sqlite3.SQLITE_BUSY), ("busy", sqlite3.SQLITE_BUSY),
                  ("disk is full", sqlite3.SQLITE_FULL), ("readonly", sqlite3.SQLITE_READONLY),
                  ("read-only", sqlite3.SQLITE_READONLY), ("disk i/o", sqlite3.SQLITE_IOERR),
                  ("malformed", sqlite3.SQLITE_CORRUPT), ("not a database", sqlite3.SQLITE_NOTADB),
                  ("closed database", sqlite3.SQLITE_CANTOPEN))
# What SQLite answers a COMMIT or ROLLBACK after it rolled the transaction back itself (a full disk, an I/O error).
_ENDED_BY_SQLITE = "no transaction is active"


def original_error(exc: BaseException) -> BaseException:
    """The error to report for `exc`: itself, or, for a COMMIT or ROLLBACK that SQLite refused because it had ended
    the transaction itself, the error it ended it for (raised before, `__context__`)."""
    while isinstance(exc, sqlite3.Error) and _ENDED_BY_SQLITE in str(exc) \
            and isinstance(exc.__context__, sqlite3.Error):
        exc = exc.__context__
    return exc


def sqlite_code(exc: BaseException) -> int | None:
    """SQLite's primary result code for `exc` (sqlite3.SQLITE_FULL, ...), from its code, else its message (see
    `original_error`); None for an error that is not SQLite's or not known."""
    exc = original_error(exc)
    if not isinstance(exc, sqlite3.Error):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF != sqlite3.SQLITE_ERROR:
        return code & 0xFF
    text = str(exc).lower()
    return next((c for needle, c in _CODES_BY_TEXT if needle in text), code)


# PostgreSQL's SQLSTATEs that mean another transaction holds what this one waits for: lock_not_available,
# deadlock_detected, serialization_failure, query_canceled (a statement timeout).
_PG_BUSY = ("55P03", "40P01", "40001", "57014")


def is_busy(exc: BaseException) -> bool:
    """Whether a database error means another connection holds a lock (SQLITE_BUSY / SQLITE_LOCKED, or
    PostgreSQL's lock SQLSTATEs)."""
    if getattr(exc, "sqlstate", None) in _PG_BUSY:
        return True
    return sqlite_code(exc) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _postgres_error(target: str, exc: BaseException, busy_timeout_ms: int | None) -> StoreError:
    """The StoreError for an error psycopg raised (its SQLSTATE, or for a connection that failed, libpq's text)."""
    state = getattr(exc, "sqlstate", None) or ""
    text = " ".join(str(exc).split())
    lowered = text.lower()
    if state == "3D000" or (not state and "does not exist" in lowered and "database" in lowered):
        return DatabaseMissing(f"database {target} does not exist ({text}); create it (createdb, or CREATE DATABASE "
                               f"as its owner) or check --db / JOULEPILOT_DB")
    if state in ("28P01", "28000") or "authentication failed" in lowered or "no password supplied" in lowered:
        return StoreError(f"database {target} refused the login ({text}); check the user and password "
                          f"(the URL, PGPASSWORD or ~/.pgpass)")
    if state.startswith("08") or state in ("57P01", "57P02", "57P03") or not state:  # no connection, or shut down
        return StoreUnreachable(f"cannot reach database {target} ({text}); check that the server runs and the URL's "
                                f"host and port, or pass --db / set JOULEPILOT_DB")
    if state == "53100":
        return DiskFull(f"the disk of database {target} is full ({text}); free space on the server and retry")
    if state == "25006":
        return StoreError(f"database {target} is read-only here ({text}); this command needs to write: use a "
                          f"role and server that may write")
    if state == "42501":
        return StoreError(f"database {target}: permission denied ({text}); grant this role the right to create and "
                          f"write tables in the database's schema")
    if state in _PG_BUSY:
        waited = f"for {busy_timeout_ms / 1000:g} s" if busy_timeout_ms is not None else "past its lock timeout"
        return StoreError(f"database {target} stayed locked {waited} ({text}); another process holds a long "
                          f"write; retry")
    if state.startswith("XX"):
        return DatabaseCorrupt(f"database {target} reports damage ({text}); restore it from a backup, or point "
                               f"--db / JOULEPILOT_DB at another database")
    return StoreError(f"database {target}: {text}")


def _recovered_path(target: str | os.PathLike) -> str:
    stem, dot, suffix = os.fspath(target).rpartition(".")
    return f"{stem}-recovered.{suffix}" if dot and "/" not in suffix else f"{os.fspath(target)}-recovered"


def damaged_message(target: str | os.PathLike, detail: str) -> str:
    """The one line for a damaged database file: what SQLite found, and the three ways out."""
    return (f"the database {target} is damaged (SQLite: {detail}); restore it from a backup, or recover what it "
            f"holds with `sqlite3 {target} .recover | sqlite3 {_recovered_path(target)}` and put that file in its "
            f"place, or move it aside and let joulepilot create a new one")


def database_error(target: str | os.PathLike, exc: BaseException, *, busy_timeout_ms: int | None = None) -> StoreError:
    """The StoreError for an error SQLite raised on the database `target`, naming the file and the fix
    (`busy_timeout_ms`: how long the connection waited for a lock, when known)."""
    if not isinstance(exc, sqlite3.Error) and hasattr(exc, "sqlstate"):
        return _postgres_error(str(target), exc, busy_timeout_ms)
    exc = original_error(exc)
    text = str(exc)
    code = sqlite_code(exc)
    if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return DatabaseCorrupt(damaged_message(target, text))
    if code == sqlite3.SQLITE_FULL:
        return DiskFull(f"the disk holding {target} is full (SQLite: {text}); free space on it and retry")
    if code == sqlite3.SQLITE_IOERR:
        return StoreError(f"database {target}: {text} (a full disk, a file size limit or a failing disk); free "
                          f"space on its disk and retry")
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM):
        return StoreError(f"database {target} is read-only ({text}); this command needs to write: fix its "
                          f"permissions or pass --db with a writable file")
    if code == sqlite3.SQLITE_CANTOPEN:
        return StoreError(f"cannot open database {target} ({text}); the file and its folder must exist and be "
                          f"writable for this command (SQLite keeps -wal and -shm files beside the database)")
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        waited = f"for {busy_timeout_ms / 1000:g} s" if busy_timeout_ms is not None else "past its busy timeout"
        return StoreError(f"database {target} stayed locked {waited} ({text}); another process holds a long "
                          f"write; retry")
    return StoreError(f"database {target}: {text}")


def as_store_error(exc: BaseException, target: str | os.PathLike) -> StoreError | None:
    """`exc` as the store's error for the database `target` (a StoreError as it is, an error SQLite raised
    mapped by `database_error`), or None for anything else (a bug keeps its traceback)."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.ProgrammingError):
        return database_error(target, exc)
    if type(exc).__module__.startswith("psycopg") and hasattr(exc, "sqlstate"):  # one the store did not map itself
        return database_error(redacted(str(target)), exc)
    return None
