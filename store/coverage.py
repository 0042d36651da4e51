"""What the stored runs cover: which device kinds and torch versions have measurements, and which
configurations were measured recently under one provenance."""

from __future__ import annotations

from typing import Any

import sqlite_utils


def ok_run_groups(db: sqlite_utils.Database) -> list[dict[str, Any]]:
    """Ok runs counted per workload, device, device name and torch version (raw values, as stored)."""
    cur = db.execute(
        "SELECT workload_id, device, device_name, torch_version, COUNT(*) AS runs FROM runs WHERE status = 'ok' "
        "GROUP BY workload_id, device, device_name, torch_version")
    names = [c[0] for c in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def recent_ok_runs(db: sqlite_utils.Database, workload_id: str, provenance_key: str, min_finished_at: float
                   ) -> list[dict[str, Any]]:
    """Ok runs of a workload under one provenance finished since `min_finished_at`, newest first
    (id, config_id, extra)."""
    cur = db.execute(
        "SELECT id, config_id, extra FROM runs WHERE workload_id = ? AND provenance_key = ? AND status = 'ok' "
        "AND COALESCE(finished_at, started_at) >= ? ORDER BY id DESC",
        [workload_id, provenance_key, min_finished_at])
    names = [c[0] for c in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
