"""Reads for replaying recorded sweeps (`benchmarks/search_replay.py`): runs with their rows, oldest first."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from .connection import Store


def runs_with_rows(db: Store, run_ids: Collection[int] | None = None) -> list[dict[str, Any]]:
    """Runs (all statuses, oldest first), each as {"run", "workload", "config", "host"} rows as stored;
    only those in `run_ids` when it is given."""
    workloads = {row["id"]: row for row in db.query("SELECT * FROM workloads")}
    configs = {row["id"]: row for row in db.query("SELECT * FROM configs")}
    hosts = {row["id"]: row for row in db.query("SELECT * FROM hosts")}
    wanted = None if run_ids is None else set(run_ids)
    out = []
    for run in db.query("SELECT * FROM runs ORDER BY id"):
        if wanted is not None and run["id"] not in wanted:
            continue
        out.append({"run": run, "workload": workloads.get(run["workload_id"]),
                    "config": configs.get(run["config_id"]), "host": hosts.get(run["host_id"])})
    return out
