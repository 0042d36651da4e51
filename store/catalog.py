"""What can be measured: workload and configuration rows, read by id.

Workload and configuration rows stay plain dicts of their columns (JSON columns as stored): the
trade-off features and `CompileConfig.from_row` read them by column name.
"""

from __future__ import annotations

from typing import Any

from .connection import Store


def _first(db: Store, sql: str, args: list[Any]) -> dict[str, Any] | None:
    rows = list(db.query(sql, args))
    return rows[0] if rows else None


def workload_row(db: Store, workload_id: str | None) -> dict[str, Any] | None:
    """The workloads row with this id, or None."""
    return _first(db, "SELECT * FROM workloads WHERE id = ?", [workload_id]) if workload_id else None


def workload_rows(db: Store) -> dict[str, dict[str, Any]]:
    """Every workloads row, by id."""
    return {row["id"]: row for row in db.query("SELECT * FROM workloads")}


def config_row(db: Store, config_id: str | None) -> dict[str, Any] | None:
    """The configs row with this id, or None."""
    return _first(db, "SELECT * FROM configs WHERE id = ?", [config_id]) if config_id else None
