"""Decisions: which configuration a policy uses on one device kind and torch version, and why.

Rows are plain dicts shaped like the `decisions` table; `details` is JSON (the candidates, the
applied configuration row, the measured figures). The newest row per (policy, device_kind,
torch_version) is the one in force.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import sqlite_utils

from .db import transaction

DECISION_COLUMNS = ("policy", "policy_hash", "device_kind", "torch_version", "config_id", "state", "reason",
                    "decided_at", "details")


def write_decision(db: sqlite_utils.Database, record: Mapping[str, Any]) -> int:
    """Insert one decision row; returns its id."""
    row = {k: record.get(k) for k in DECISION_COLUMNS}
    if row["details"] is not None and not isinstance(row["details"], str):
        row["details"] = json.dumps(row["details"], sort_keys=True, default=str)
    with transaction(db):
        cur = db.execute(f"INSERT INTO decisions ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                         list(row.values()))
    return cur.lastrowid


_LATEST_SQL = (
    "SELECT * FROM decisions WHERE policy = ? AND device_kind = ? AND torch_version = ? "
    "ORDER BY decided_at DESC, id DESC LIMIT 1"
)


def latest_decision(db: sqlite_utils.Database, policy: str, device_kind: str,
                    torch_version: str) -> dict[str, Any] | None:
    """The decision in force for this policy, device kind and torch major.minor, or None."""
    cur = db.execute(_LATEST_SQL, [policy, device_kind, torch_version])
    row = cur.fetchone()
    if row is None:
        return None
    return dict(zip([c[0] for c in cur.description], row, strict=True))


def list_decisions(db: sqlite_utils.Database, policy: str | None = None, *, latest_only: bool = False,
                   limit: int | None = None) -> list[dict[str, Any]]:
    """Decisions newest first; `latest_only` keeps the one in force per (policy, device_kind, torch)."""
    sql = "SELECT * FROM decisions" + (" WHERE policy = ?" if policy else "") + " ORDER BY decided_at DESC, id DESC"
    rows = list(db.query(sql, [policy] if policy else []))
    if latest_only:
        seen, kept = set(), []
        for row in rows:
            key = (row["policy"], row["device_kind"], row["torch_version"])
            if key not in seen:
                seen.add(key)
                kept.append(row)
        rows = kept
    return rows[:limit] if limit else rows
