"""Typed reads that energy reports need beyond a deployment's own samples and violations.

Each function answers one question a report asks (which GPU, which host, which configuration, which
decision, which baseline runs) so the report code never writes SQL.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlite_utils

from .jsonvalues import json_column

# The baselines a deployment is compared with, as filters on the `configs` row of a run.
BASELINE_FILTERS = {
    "eager_fp32": "c.mode = 'eager' AND c.precision = 'fp32'",
    "compile_default_fp32": ("c.mode = 'default' AND c.fusion = 'default' AND c.precision = 'fp32' "
                             "AND c.options IN ('{}', '') AND c.dynamic = 0"),
}


def _first(db: sqlite_utils.Database, sql: str, args: list[Any]) -> dict[str, Any] | None:
    rows = list(db.query(sql, args))
    return rows[0] if rows else None


def device_name(db: sqlite_utils.Database, host_id: str | None, meter_device: str) -> str | None:
    """The recorded name of a metered device (`gpu:0`, `cpu:0`) on a host, or None."""
    row = _first(db, "SELECT name FROM devices WHERE host_id = ? AND device = ?", [host_id, meter_device])
    return row["name"] if row else None


def hostname(db: sqlite_utils.Database, host_id: str | None) -> str | None:
    row = _first(db, "SELECT hostname FROM hosts WHERE id = ?", [host_id]) if host_id else None
    return row["hostname"] if row else None


def workload_row(db: sqlite_utils.Database, workload_id: str | None) -> dict[str, Any] | None:
    return _first(db, "SELECT * FROM workloads WHERE id = ?", [workload_id]) if workload_id else None


def config_row(db: sqlite_utils.Database, config_id: str | None) -> dict[str, Any] | None:
    return _first(db, "SELECT * FROM configs WHERE id = ?", [config_id]) if config_id else None


def config_labels(db: sqlite_utils.Database, config_ids: Iterable[str | None]) -> dict[str, str]:
    """{config id: label} for the ids that the store knows."""
    ids = sorted({c for c in config_ids if c})
    if not ids:
        return {}
    marks = ", ".join("?" for _ in ids)
    return {r["id"]: r["label"] for r in db.query(f"SELECT id, label FROM configs WHERE id IN ({marks})", ids)}


def newest_decision(db: sqlite_utils.Database, policy: str, device_kind: str,
                    config_id: str | None = None) -> dict[str, Any] | None:
    """The newest decision of `policy` on `device_kind`, for `config_id` when one was decided for it,
    else for any configuration; `details` decoded."""
    base = "SELECT * FROM decisions WHERE policy = ? AND device_kind = ?"
    order = " ORDER BY decided_at DESC, id DESC LIMIT 1"
    row = None
    if config_id:
        row = _first(db, base + " AND config_id = ?" + order, [policy, device_kind, config_id])
    row = row or _first(db, base + order, [policy, device_kind])
    if row is not None and isinstance(row.get("details"), str):
        row["details"] = json_column(row["details"], row["details"])
    return row


def baseline_runs(db: sqlite_utils.Database, workload_id: str, baseline: str) -> list[dict[str, Any]]:
    """Successful runs of `workload_id` under the baseline configuration `baseline` (a key of
    BASELINE_FILTERS) that measured energy per inference, oldest first, on every device."""
    where = BASELINE_FILTERS[baseline]
    return list(db.query(
        "SELECT r.id, r.config_id, r.device, r.device_name, r.energy_j_per_inference, r.energy_source "
        "FROM runs r JOIN configs c ON c.id = r.config_id "
        f"WHERE r.workload_id = ? AND r.status = 'ok' AND r.energy_j_per_inference IS NOT NULL AND {where} "
        "ORDER BY r.id", [workload_id]))
