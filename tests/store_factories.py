"""Databases as an older joulepilot left them, for the store's migration and refusal tests."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from joulepilot.store.schema import MIGRATIONS


def database_at(path: Path, version: int, *, wal: bool = False, user_table: bool = False) -> Path:
    """A joulepilot database at schema `version` (its migrations up to there) with one run in it; `wal` in WAL
    mode, `user_table` with a table of the user's own beside joulepilot's."""
    conn = sqlite3.connect(path, isolation_level=None)
    if wal:
        conn.execute("PRAGMA journal_mode = WAL")
    for step in MIGRATIONS[:version]:
        step(conn)
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
