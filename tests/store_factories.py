"""Databases as an older joulepilot left them, for the store's migration and refusal tests."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from joulepilot.store.connection import Store
from joulepilot.store.schema import MIGRATIONS


def database_at(path: Path, version: int, *, wal: bool = False, user_table: bool = False) -> Path:
    """A joulepilot database at schema `version` (its migrations up to there) with one run in it; `wal` in WAL
    mode, `user_table` with a table of the user's own beside joulepilot's."""
    conn = sqlite3.connect(path, isolation_level=None)
    if wal:
        conn.execute("PRAGMA journal_mode = WAL")
    for step in MIGRATIONS[:version]:
        step(Store(conn))
    conn.execute(f"PRAGMA user_version = {version}")
    conn.execute("INSERT INTO hosts VALUES ('h1', 'box', 'x86', 1.0)")
    conn.execute("INSERT INTO workloads (id, spec, batch_size, created_at) VALUES ('w1', 'mlp', 8, 1.0)")
    conn.execute("INSERT INTO configs (id, label, mode, fusion, options, precision, dynamic, batch_size)"
                 " VALUES ('c1', 'eager/fp32/b8', 'eager', 'default', '{}', 'fp32', 0, 8)")
    conn.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at,"
                 " energy_j_per_inference) VALUES ('w1', 'c1', 'h1', 'cpu', 'ok', 2.0, 0.25)")
    if user_table:
        conn.execute("CREATE TABLE my_notes (note TEXT)")
    conn.close()
    return path


def damage_pages(path: Path, table: str, *, keep_root: bool = True) -> list[int]:
    """Write garbage over the pages of `table` (its leaves; with `keep_root` False its root too) in a real database
    file, as a failing disk or a stray write would: the header and every other table stay whole, so SQLite opens
    the file and finds the damage only where it reads those pages (or when quick_check walks them). Returns the
    page numbers damaged (1-based)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        rows = conn.execute("SELECT pageno, path FROM dbstat WHERE name = ? ORDER BY pageno", [table]).fetchall()
    finally:
        conn.close()
    pages = [page for page, where in rows if not (keep_root and where == "/")]
    assert pages, f"{table} has no pages to damage besides its root: store more rows in it first"
    with open(path, "r+b") as fh:
        for page in pages:
            fh.seek((page - 1) * page_size)
            fh.write(bytes([0xAB]) * page_size)
    return pages
