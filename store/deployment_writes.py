"""Writes of a live deployment's windows and violations that may be retried: each lands once, however often.

A deployment's windows never overlap, so a window is known by its deployment and its start stamp. Storing a
window whose start is stored already adds nothing, or, when it ends later (the same window with a short last
window folded into it at close), extends the stored row to it. A violation is known by its deployment, limit
and time; storing it again adds neither it nor its `violated` decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .connection import Store
from .db import transaction
from .deployments import insert_samples, insert_violation, mark_decision_violated

# What a longer copy of a stored window (its folded tail) may change in the row already written.
AMENDABLE = ("t_end", "energy_j", "inferences", "avg_power_w", "peak_power_w", "other_processes", "share", "tokens")


class SamplesStored(NamedTuple):
    inserted: int  # new windows
    extended: int  # stored windows that grew to a longer copy of themselves
    already: int  # windows stored before, left as they were
    calls: int  # the calls the store counts now that it did not before

    @property
    def written(self) -> int:
        return self.inserted + self.extended


def store_samples(db: Store, deployment_id: int, samples: Iterable[Mapping[str, Any]]
                  ) -> SamplesStored:
    """Write the windows not stored yet, and extend those stored shorter, in one transaction."""
    new: list[Mapping[str, Any]] = []
    extended = already = calls = 0
    with transaction(db):
        for sample in samples:
            row = db.execute("SELECT id, t_end, inferences FROM deployment_samples WHERE deployment_id = ? "
                             "AND t_start = ? ORDER BY id LIMIT 1", [deployment_id, sample["t_start"]]).fetchone()
            if row is None:
                new.append(sample)
                calls += int(sample.get("inferences") or 0)
            elif sample["t_end"] > row[1]:
                fields = [k for k in AMENDABLE if k in sample]
                db.execute(f"UPDATE deployment_samples SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                           [sample[k] for k in fields] + [row[0]])
                extended += 1
                calls += max(0, int(sample.get("inferences") or 0) - int(row[2] or 0))
            else:
                already += 1
        inserted = insert_samples(db, deployment_id, new)
    return SamplesStored(inserted, extended, already, calls)


def record_violation(db: Store, decision: Mapping[str, Any] | None,
                     violation: Mapping[str, Any]) -> tuple[int, int | None, bool]:
    """Store an envelope violation and, when given, the `violated` decision it comes with (the keyword
    arguments of `mark_decision_violated` and `insert_violation`), both or neither. A violation without a
    `decision_id` cites the new decision. Returns (violation id, decision id, whether it was new)."""
    with transaction(db):
        row = db.execute("SELECT id, decision_id FROM violations WHERE deployment = ? AND limit_name = ? AND at = ? "
                         "ORDER BY id LIMIT 1",
                         [violation["deployment"], violation["limit_name"], violation["at"]]).fetchone()
        if row is not None:
            return int(row[0]), row[1], False
        decision_id = mark_decision_violated(db, **decision) if decision is not None else None
        values = dict(violation)
        if values.get("decision_id") is None:
            values["decision_id"] = decision_id
        return insert_violation(db, **values), decision_id, True
