"""Errors for which the database refuses every write alike, whatever is written.

Importing side files one after another, such an error on one file (another process holds the write lock, the
disk is full, the file is read-only or damaged) means the next file would fail the same way after the same
wait: the importers stop at the first one and leave the rest for the next start. An error that belongs to one
file's contents (a constraint, a column the schema lacks) is not one of these.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from .errors import original_error, sqlite_code

# SQLite's primary result codes that say nothing about what was being written
_REASONS = {
    sqlite3.SQLITE_BUSY: "the database is locked by another process",
    sqlite3.SQLITE_LOCKED: "the database is locked by another process",
    sqlite3.SQLITE_PROTOCOL: "the database is locked by another process",
    sqlite3.SQLITE_FULL: "the database or its disk is full",
    sqlite3.SQLITE_READONLY: "the database is read-only",
    sqlite3.SQLITE_PERM: "the database is read-only",
    sqlite3.SQLITE_CANTOPEN: "the database cannot be opened for writing",
    sqlite3.SQLITE_IOERR: "the database's disk reports an I/O error",
    sqlite3.SQLITE_CORRUPT: "the database is damaged",
    sqlite3.SQLITE_NOTADB: "the database is damaged",
    sqlite3.SQLITE_NOMEM: "SQLite ran out of memory",
}


@dataclass(frozen=True)
class StoreRefusal:
    """Why the database refuses every side file now."""

    reason: str  # in words: "the database is locked by another process"
    error: str  # SQLite's own message


def store_refusal(exc: BaseException) -> StoreRefusal | None:
    """The refusal `exc` is, when any other write would meet it too; None for an error of this write's own."""
    reason = _REASONS.get(sqlite_code(exc))  # type: ignore[arg-type]
    return None if reason is None else StoreRefusal(reason, str(original_error(exc)))


def refused_line(count: int, folder: Path | None, refusal: StoreRefusal, retried: str) -> str:
    """One line for the `count` side files an import left because the database refused: `retried` says when
    they are tried again."""
    where = f" in {folder}" if folder is not None else ""
    files = f"{count} side file{'s' if count != 1 else ''}{where}"
    return f"{files} not imported: {refusal.reason}; they are kept and retried {retried}"
