"""Typed writes and reads for live deployments: registration, metered samples and envelope violations."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .connection import Store
from .db import transaction
from .jsonvalues import json_column

SAMPLE_FIELDS = (
    "t_start",
    "t_end",
    "energy_j",
    "inferences",
    "avg_power_w",
    "peak_power_w",
    "energy_source",
    "config_id",
    "other_processes",
    "share",
    "tokens",  # a generation's generated tokens in the window (None: a deployment of forward calls)
)


def _has_column(db: Store, table: str, column: str) -> bool:
    return column in db.column_names(table)


def register_deployment(
    db: Store,
    name: str,
    *,
    policy: str | None = None,
    workload_id: str | None = None,
    config_id: str | None = None,
    host_id: str | None = None,
    device: str | None = None,
    details: Mapping[str, Any] | None = None,
) -> int:
    """Create the deployment `name`, or refresh its policy/config/device; returns its id.

    A name is one deployment for its whole life: restarting a service under the same name appends
    to the same series of samples. `details` (limits, device name) is kept only where the schema
    has a `deployments.details` column.
    """
    fields: dict[str, Any] = {
        "policy": policy,
        "workload_id": workload_id,
        "config_id": config_id,
        "host_id": host_id,
        "device": device,
    }
    if details is not None and _has_column(db, "deployments", "details"):
        fields["details"] = json.dumps(dict(details), sort_keys=True, default=str)
    with transaction(db):
        row = db.execute("SELECT id FROM deployments WHERE name = ?", [name]).fetchone()
        if row is None:
            cols = ["name", "created_at", *fields]
            return db.insert_id(
                f"INSERT INTO deployments ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                [name, time.time(), *fields.values()],
            )
        present = {k: v for k, v in fields.items() if v is not None}
        if present:
            assignments = ", ".join(f"{k} = ?" for k in present)
            db.execute(f"UPDATE deployments SET {assignments} WHERE id = ?", [*present.values(), row[0]])
        return int(row[0])


def set_deployment_config(db: Store, deployment_id: int, config_id: str | None) -> None:
    """Record the configuration now serving (after a fallback swap)."""
    with transaction(db):
        db.execute("UPDATE deployments SET config_id = ? WHERE id = ?", [config_id, deployment_id])


def get_deployment(db: Store, name: str) -> dict[str, Any] | None:
    rows = list(db.query("SELECT * FROM deployments WHERE name = ?", [name]))
    return _decode_details(rows[0]) if rows else None


def _decode_details(row: dict[str, Any]) -> dict[str, Any]:
    if isinstance(row.get("details"), str):
        row["details"] = json_column(row["details"], row["details"])
    return row


def list_deployments(db: Store) -> list[dict[str, Any]]:
    """Every deployment with the sums of its samples, by name."""
    sql = """
    SELECT d.*, COUNT(s.id) AS samples, MIN(s.t_start) AS first_t, MAX(s.t_end) AS last_t,
           COALESCE(SUM(s.energy_j), 0) AS energy_j, COALESCE(SUM(s.inferences), 0) AS inferences,
           SUM(s.tokens) AS tokens,
           MAX(s.peak_power_w) AS peak_power_w
    FROM deployments d LEFT JOIN deployment_samples s ON s.deployment_id = d.id
    GROUP BY d.id ORDER BY d.name
    """
    return [_decode_details(r) for r in db.query(sql)]


def insert_samples(db: Store, deployment_id: int, samples: Iterable[Mapping[str, Any]]) -> int:
    """Write a batch of samples in one transaction; returns how many were written."""
    rows = [
        tuple([deployment_id] + [s.get(k) if k != "other_processes" else int(s.get(k) or 0) for k in SAMPLE_FIELDS])
        for s in samples
    ]
    if not rows:
        return 0
    cols = ", ".join(("deployment_id",) + SAMPLE_FIELDS)
    marks = ", ".join("?" for _ in range(len(SAMPLE_FIELDS) + 1))
    with transaction(db):
        db.executemany(f"INSERT INTO deployment_samples ({cols}) VALUES ({marks})", rows)
    return len(rows)


def read_samples(
    db: Store, deployment_id: int, *, since: float | None = None
) -> list[dict[str, Any]]:
    """Samples in time order; `since` (epoch seconds) keeps windows that end after it."""
    sql = "SELECT * FROM deployment_samples WHERE deployment_id = ?"
    args: list[Any] = [deployment_id]
    if since is not None:
        sql += " AND t_end > ?"
        args.append(since)
    return list(db.query(sql + " ORDER BY t_start, id", args))


def insert_violation(
    db: Store,
    *,
    policy: str,
    deployment: str,
    limit_name: str,
    limit_value: float,
    measured_value: float,
    config_id: str | None = None,
    decision_id: int | None = None,
    at: float | None = None,
) -> int:
    with transaction(db):
        return db.insert_id(
            "INSERT INTO violations (decision_id, policy, deployment, config_id, limit_name, limit_value, "
            "measured_value, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [decision_id, policy, deployment, config_id, limit_name, limit_value, measured_value,
             at if at is not None else time.time()],
        )


def list_violations(
    db: Store, *, deployment: str | None = None, since: float | None = None
) -> list[dict[str, Any]]:
    clauses, args = [], []
    if deployment is not None:
        clauses.append("deployment = ?")
        args.append(deployment)
    if since is not None:
        clauses.append("at >= ?")
        args.append(since)
    where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
    return list(db.query(f"SELECT * FROM violations{where} ORDER BY at", args))


def violated_config_ids(
    db: Store, policy: str, device_kind: str, *, torch_version: str | None = None
) -> set[str]:
    """Configurations that broke `policy`'s envelope in a deployment on `device_kind`.

    Read by the resolver/daemon so the next decision leaves them out. Both records of a violation
    count: the `violations` row (through the decision it names) and the `violated` decision row.
    """
    version_clause = " AND d.torch_version = ?" if torch_version else ""
    version_args: Sequence[Any] = [torch_version] if torch_version else []
    ids = {
        r[0]
        for r in db.execute(
            "SELECT v.config_id FROM violations v JOIN decisions d ON d.id = v.decision_id "
            f"WHERE v.policy = ? AND d.device_kind = ? AND v.config_id IS NOT NULL{version_clause}",
            [policy, device_kind, *version_args],
        )
    }
    ids |= {
        r[0]
        for r in db.execute(
            "SELECT d.config_id FROM decisions d WHERE d.policy = ? AND d.device_kind = ? "
            f"AND d.state = 'violated' AND d.config_id IS NOT NULL{version_clause}",
            [policy, device_kind, *version_args],
        )
    }
    return ids


def mark_decision_violated(
    db: Store,
    *,
    policy: str,
    policy_hash: str,
    device_kind: str,
    torch_version: str,
    config_id: str | None,
    reason: str,
    details: Mapping[str, Any] | None = None,
    at: float | None = None,
) -> int:
    """Append a `violated` decision for the configuration; decisions are history, never rewritten."""
    from .decisions import write_decision

    return int(write_decision(db, {
        "policy": policy, "policy_hash": policy_hash, "device_kind": device_kind,
        "torch_version": torch_version, "config_id": config_id, "state": "violated", "reason": reason,
        "decided_at": at if at is not None else time.time(), "details": dict(details or {}),
    }))
