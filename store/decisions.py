"""Decisions: which configuration a policy uses on one device kind and torch version, and why.

Rows come back as `DecisionRow` (the `decisions` columns; `details`, stored as JSON, decoded: the
candidates, the applied configuration row, the measured figures). Decisions are history: a row is
never rewritten. The envelope guard appends `violated` rows, which carry no configuration to apply,
so a reader that wants something to apply asks for the states it can use (`APPLICABLE_STATES`).

"The latest decision" has one meaning everywhere: the newest `decided_at`, the higher id on a tie
(`NEWEST_FIRST`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .connection import Store
from .db import transaction
from .jsonvalues import json_object, strict_json_text
from .rows import StoredRow

DECISION_COLUMNS = ("policy", "policy_hash", "device_kind", "torch_version", "config_id", "state", "reason",
                    "decided_at", "details")
# States whose row names a configuration to apply (`violated` only records what broke the envelope).
# `infeasible`: nothing measured meets the power envelope, and the lowest-power configuration that
# meets the other limits is applied all the same.
APPLICABLE_STATES = ("verified", "provisional", "infeasible", "fallback")
NEWEST_FIRST = "decided_at DESC, id DESC"


@dataclass
class DecisionRow(StoredRow):
    """One `decisions` row; `details` decoded ({} when empty or malformed)."""

    id: int
    policy: str
    policy_hash: str
    device_kind: str
    torch_version: str
    config_id: str | None
    state: str
    reason: str | None
    decided_at: float
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_columns(cls, row: Mapping[str, Any]) -> DecisionRow:
        decoded = super().from_columns(row)
        decoded.details = json_object(decoded.details)
        return decoded


@dataclass
class DecisionSummary(DecisionRow):
    """A decision with the label and knobs of the configuration it names (None when it names none, or
    the configuration is not stored)."""

    config_label: str | None = None
    mode: str | None = None
    fusion: str | None = None
    precision: str | None = None


def write_decision(db: Store, record: Mapping[str, Any]) -> int:
    """Insert one decision row; returns its id."""
    row = {k: record.get(k) for k in DECISION_COLUMNS}
    if row["details"] is not None and not isinstance(row["details"], str):
        row["details"] = strict_json_text(row["details"], sort_keys=True, default=str)
    with transaction(db):
        return db.insert_id(f"INSERT INTO decisions ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                         list(row.values()))


def _rows(db: Store, sql: str, args: list[Any]) -> list[DecisionRow]:
    return [DecisionRow.from_columns(row) for row in db.query(sql, args)]


def latest_decision(
    db: Store,
    policy: str,
    device_kind: str,
    torch_version: str | None = None,
    *,
    states: Collection[str] | None = None,
    exclude_config_ids: Collection[str] = (),
    config_id: str | None = None,
) -> DecisionRow | None:
    """The newest decision for this policy and device kind, or None.

    `torch_version`: major.minor, or None for any. `states`: only rows in these states (None: any state,
    `violated` included; a caller that applies the row passes APPLICABLE_STATES). `exclude_config_ids`:
    skip rows whose configuration is one of these (configurations that broke the envelope).
    `config_id`: only rows that name this configuration.
    """
    rows = newest_decisions(db, policy, device_kind, torch_version, states=states,
                            exclude_config_ids=exclude_config_ids, config_id=config_id, limit=1)
    return rows[0] if rows else None


def newest_decisions(
    db: Store,
    policy: str,
    device_kind: str,
    torch_version: str | None = None,
    *,
    states: Collection[str] | None = None,
    exclude_config_ids: Collection[str] = (),
    config_id: str | None = None,
    limit: int = 1,
) -> list[DecisionRow]:
    """Up to `limit` decisions as `latest_decision` picks them, newest first: for a reader that passes over rows
    it refuses (policies.allowed)."""
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
    if config_id is not None:
        sql += " AND config_id = ?"
        args.append(config_id)
    return _rows(db, f"{sql} ORDER BY {NEWEST_FIRST} LIMIT ?", [*args, int(limit)])


def list_decisions(db: Store, policy: str | None = None, *, latest_only: bool = False,
                   limit: int | None = None) -> list[DecisionRow]:
    """Decisions newest first; `latest_only` keeps the one in force per (policy, device_kind, torch)."""
    sql = "SELECT * FROM decisions" + (" WHERE policy = ?" if policy else "") + f" ORDER BY {NEWEST_FIRST}"
    rows = _rows(db, sql, [policy] if policy else [])
    if latest_only:
        seen, kept = set(), []
        for row in rows:
            key = (row.policy, row.device_kind, row.torch_version)
            if key not in seen:
                seen.add(key)
                kept.append(row)
        rows = kept
    return rows[:limit] if limit else rows


LATEST_DECISIONS_SQL = f"""
SELECT d.*, c.label AS config_label, c.mode, c.fusion, c.precision
FROM decisions d
LEFT JOIN configs c ON c.id = d.config_id
WHERE d.id = (SELECT d2.id FROM decisions d2 WHERE d2.policy = d.policy AND d2.device_kind = d.device_kind
              ORDER BY {NEWEST_FIRST} LIMIT 1)
ORDER BY d.policy, d.device_kind
"""


def latest_decisions(db: Store) -> list[DecisionSummary]:
    """The latest decision of every (policy, device kind), any torch version and any state, with its
    configuration's label and knobs; by policy, then device kind."""
    return [DecisionSummary.from_columns(row) for row in db.query(LATEST_DECISIONS_SQL)]
