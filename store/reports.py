"""Typed reads that energy reports need beyond a deployment's own samples and violations.

Each function answers one question a report asks (which GPU, which host, which configurations, which
baseline runs) so the report code never writes SQL; workload and configuration rows come from
`catalog`, decisions from `decisions.latest_decision`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .connection import Store

# The baselines a deployment is compared with, as filters on the `configs` row of a run.
# A generation's baselines are eager and the stock compile with the dynamic cache and the prompt uncompiled (what
# `generate` and `torch.compile(model)` give); a forward pass's configurations all have those settings.
BASELINE_FILTERS = {
    "eager_fp32": "c.mode = 'eager' AND c.precision = 'fp32' AND c.cache = 'dynamic'",
    "compile_default_fp32": ("c.mode = 'default' AND c.fusion = 'default' AND c.precision = 'fp32' "
                             "AND c.options IN ('{}', '') AND c.dynamic = 0 AND c.padding = 'none' "
                             "AND c.regional = '' AND c.cache = 'dynamic' AND c.compile_prefill = 0"),
}


def _first(db: Store, sql: str, args: list[Any]) -> dict[str, Any] | None:
    rows = list(db.query(sql, args))
    return rows[0] if rows else None


def device_name(db: Store, host_id: str | None, meter_device: str) -> str | None:
    """The recorded name of a metered device (`gpu:0`, `cpu:0`) on a host, or None."""
    row = _first(db, "SELECT name FROM devices WHERE host_id = ? AND device = ?", [host_id, meter_device])
    return row["name"] if row else None


def hostname(db: Store, host_id: str | None) -> str | None:
    row = _first(db, "SELECT hostname FROM hosts WHERE id = ?", [host_id]) if host_id else None
    return row["hostname"] if row else None


def config_labels(db: Store, config_ids: Iterable[str | None]) -> dict[str, str]:
    """{config id: label} for the ids that the store knows."""
    ids = sorted({c for c in config_ids if c})
    if not ids:
        return {}
    marks = ", ".join("?" for _ in ids)
    return {r["id"]: r["label"] for r in db.query(f"SELECT id, label FROM configs WHERE id IN ({marks})", ids)}


def baseline_runs(db: Store, workload_id: str, baseline: str) -> list[dict[str, Any]]:
    """Successful runs of `workload_id` under the baseline configuration `baseline` (a key of
    BASELINE_FILTERS) that measured energy per inference, oldest first, on every device; each with its
    configuration's `batch_size` (samples per call)."""
    where = BASELINE_FILTERS[baseline]
    return list(db.query(
        "SELECT r.id, r.config_id, r.device, r.device_name, r.energy_j_per_inference, r.energy_j_per_token, "
        "r.energy_source, c.batch_size "
        "FROM runs r JOIN configs c ON c.id = r.config_id "
        f"WHERE r.workload_id = ? AND r.status = 'ok' AND r.energy_j_per_inference IS NOT NULL AND {where} "
        "ORDER BY r.id", [workload_id]))
