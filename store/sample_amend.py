"""Amend a deployment's newest stored window in place (the live meter folds a short last window into it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlite_utils

from .db import transaction

AMENDABLE = ("t_end", "energy_j", "inferences", "avg_power_w", "peak_power_w", "other_processes", "share")


def amend_newest_sample(db: sqlite_utils.Database, deployment_id: int, t_start: float,
                        values: Mapping[str, Any]) -> bool:
    """Overwrite the AMENDABLE fields of the deployment's newest sample, if that sample starts at
    `t_start`; returns whether a row was changed (False: another writer appended since)."""
    with transaction(db):
        row = db.execute("SELECT id, t_start FROM deployment_samples WHERE deployment_id = ? "
                         "ORDER BY t_start DESC, id DESC LIMIT 1", [deployment_id]).fetchone()
        if row is None or row[1] != t_start:
            return False
        fields = [k for k in AMENDABLE if k in values]
        db.execute(f"UPDATE deployment_samples SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                   [values[k] for k in fields] + [row[0]])
    return True
