"""What an envelope-guard trip leaves behind: a warning, a `violations` row and a `violated` decision.

`trip_rows` works out the rows (pure, JSON-able), `warn_trip` warns, and `record_trip` does both and writes
the rows. A live deployment warns at once but writes with its windows, so a trip while the store is locked
is recorded when it is writable again (or kept in the deployment's side file meanwhile).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from joulepilot.store import Store
from joulepilot.store.deployment_writes import record_violation

from .guard import EnvelopeWarning, Trip, trip_message

log = logging.getLogger("joulepilot.guard")


def trip_rows(
    trip: Trip,
    *,
    deployment: str,
    policy: str | None,
    config_id: str | None,
    decision: Mapping[str, Any] | None,
    device_kind: str | None,
    torch_version: str | None,
    source: str,
    config_label: str | None = None,
    broke_decision: bool = True,
) -> dict[str, Any]:
    """{"message", "decision", "violation"}: the warning's text and the rows a trip writes (the keyword
    arguments of `mark_decision_violated` and `insert_violation`; None where nothing is written).

    The violation row names the decision that was broken (or, when the deployment had none, the new
    `violated` one) so `violated_config_ids` can find its device kind; the new decision row is what
    `joulepilot status` and the resolver see first. `broke_decision` False: `decision` did not choose what
    serves (a guard's fallback does), so the violation names the new row; `decision` still gives its policy hash,
    device kind and torch version. Without a policy there is nothing to mark.
    """
    message = trip_message(deployment, trip, config_label, source)
    rows: dict[str, Any] = {"message": message, "decision": None, "violation": None}
    if policy is None:
        return rows
    broken_id = (decision or {}).get("id") if broke_decision else None
    kind = device_kind or (decision or {}).get("device_kind")
    if kind:
        rows["decision"] = {
            "policy": policy,
            "policy_hash": (decision or {}).get("policy_hash") or "",
            "device_kind": kind,
            "torch_version": torch_version or (decision or {}).get("torch_version") or "",
            "config_id": config_id,
            "reason": message,
            "details": {"deployment": deployment, "window_powers_w": trip.window_powers_w,
                        "limit_w": trip.limit_w, "energy_source": source, "violated_decision_id": broken_id},
            "at": trip.at,
        }
    rows["violation"] = {
        "policy": policy, "deployment": deployment, "limit_name": "max_avg_power_w", "limit_value": trip.limit_w,
        "measured_value": trip.measured_w, "config_id": config_id, "decision_id": broken_id, "at": trip.at,
    }
    return rows


def warn_trip(message: str, *, stacklevel: int = 3) -> None:
    warnings.warn(message, EnvelopeWarning, stacklevel=stacklevel)
    log.warning(message)


def write_trip(db: Store, rows: Mapping[str, Any]) -> dict[str, Any]:
    """Write the rows of `trip_rows` (once: writing them again adds nothing); returns the ids written."""
    written: dict[str, Any] = {"message": rows["message"], "violation_id": None, "decision_id": None}
    if rows.get("violation") is not None:
        written["violation_id"], written["decision_id"], _ = record_violation(db, rows.get("decision"),
                                                                              rows["violation"])
    return written


def record_trip(db: Store, trip: Trip, **fields: Any) -> dict[str, Any]:
    """Write the violation and a `violated` decision (`fields` as `trip_rows` takes them), and warn; returns the
    ids written. Without a policy it only warns."""
    rows = trip_rows(trip, **fields)
    warn_trip(rows["message"])
    return write_trip(db, rows)
