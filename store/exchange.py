"""Export runs with their workload, configuration and host rows, and import them elsewhere.

The format is a list of records `{"run": {...}, "workload": {...}, "config": {...}, "host": {...}}`
whose dicts are rows of the matching tables. Importing keeps workload, config and host ids, gives runs
new ids, and skips a run already present (same workload, config, host, start time and device).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import sqlite_utils

from .db import transaction


def export_runs(db: sqlite_utils.Database, where: str | None = None, params: Iterable[Any] = ()) -> list[dict]:
    sql = "SELECT * FROM runs" + (f" WHERE {where}" if where else "") + " ORDER BY id"
    records = []
    for run in db.query(sql, list(params)):
        workload = db["workloads"].get(run["workload_id"])
        config = db["configs"].get(run["config_id"])
        host = db["hosts"].get(run["host_id"])
        records.append({"run": run, "workload": workload, "config": config, "host": host})
    return records


def import_runs(db: sqlite_utils.Database, records: Iterable[Mapping[str, Any]]) -> list[int]:
    """Insert exported records in one transaction; returns the new run ids (skipped ones omitted)."""
    new_ids: list[int] = []
    run_columns = set(db["runs"].columns_dict)
    with transaction(db):
        for rec in records:
            db["hosts"].insert(dict(rec["host"]), pk="id", ignore=True)
            db["workloads"].insert(dict(rec["workload"]), pk="id", ignore=True)
            db["configs"].insert(dict(rec["config"]), pk="id", ignore=True)
            run = {k: v for k, v in dict(rec["run"]).items() if k in run_columns and k != "id"}
            exists = db.execute(
                "SELECT 1 FROM runs WHERE workload_id = ? AND config_id = ? AND host_id = ? AND started_at = ?"
                " AND device = ?",
                [run["workload_id"], run["config_id"], run["host_id"], run["started_at"], run["device"]],
            ).fetchone()
            if exists:
                continue
            cols = ", ".join(run)
            cur = db.execute(f"INSERT INTO runs ({cols}) VALUES ({', '.join('?' for _ in run)})",
                             list(run.values()))
            new_ids.append(cur.lastrowid)
    return new_ids


def write_export(path: str | Path, records: list[dict]) -> None:
    Path(path).write_text(json.dumps(records, indent=1, sort_keys=True, default=str) + "\n")


def read_export(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text())
