"""Decisions: which configuration a policy uses on one device kind and torch version, and why.

Rows are plain dicts shaped like the `decisions` table; `details` is JSON (the candidates, the
applied configuration row, the measured figures). Decisions are history: a row is never rewritten.
The envelope guard appends `violated` rows, which carry no configuration to apply, so a reader that
wants something to apply asks for the states it can use (`APPLICABLE_STATES`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import sqlite_utils

from .db import transaction
from .jsonvalues import json_column

DECISION_COLUMNS = ("policy", "policy_hash", "device_kind", "torch_version", "config_id", "state", "reason",
                    "decided_at", "details")
# States whose row names a configuration to apply (`violated` only records what broke the envelope).
APPLICABLE_STATES = ("verified", "provisional", "fallback")


def write_decision(db: sqlite_utils.Database, record: Mapping[str, Any]) -> int:
    """Insert one decision row; returns its id."""
    row = {k: record.get(k) for k in DECISION_COLUMNS}
    if row["details"] is not None and not isinstance(row["details"], str):
        row["details"] = json.dumps(row["details"], sort_keys=True, default=str)
    with transaction(db):
        cur = db.execute(f"INSERT INTO decisions ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                         list(row.values()))
    return cur.lastrowid


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    details = json_column(row.get("details"), {})
    row["details"] = details if isinstance(details, dict) else {}
    return row


def latest_decision(
    db: sqlite_utils.Database,
    policy: str,
    device_kind: str,
    torch_version: str | None = None,
    *,
    states: Collection[str] | None = None,
    exclude_config_ids: Collection[str] = (),
) -> dict[str, Any] | None:
    """The newest decisions row for this policy and device kind, or None; `details` comes decoded (a dict).

    `torch_version`: major.minor, or None for any. `states`: only rows in these states (None: any state,
    `violated` included; a caller that applies the row passes APPLICABLE_STATES). `exclude_config_ids`:
    skip rows whose configuration is one of these (configurations that broke the envelope).
    """
    sql, args = "SELECT * FROM decisions WHERE policy = ? AND device_kind = ?", [policy, device_kind]
    if torch_version is not None:
        sql += " AND torch_version = ?"
        args.append(torch_version)
    if states is not None:
        wanted = list(states)
        sql += f" AND state IN ({', '.join('?' for _ in wanted)})"
        args.extend(wanted)
    excluded = list(exclude_config_ids)
    if excluded:
        sql += f" AND (config_id IS NULL OR config_id NOT IN ({', '.join('?' for _ in excluded)}))"
        args.extend(excluded)
    cur = db.execute(sql + " ORDER BY decided_at DESC, id DESC LIMIT 1", args)
    row = cur.fetchone()
    if row is None:
        return None
    return _decoded(dict(zip([c[0] for c in cur.description], row, strict=True)))


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
