"""What an envelope-guard trip leaves behind: a warning, a `violations` row and a `violated` decision."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import sqlite_utils
from joulepilot.store.deployments import insert_violation, mark_decision_violated

from .guard import EnvelopeWarning, Trip, trip_message

log = logging.getLogger("joulepilot.guard")


def record_trip(
    db: sqlite_utils.Database,
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
) -> dict[str, Any]:
    """Write the violation and a `violated` decision, and warn; returns the ids written.

    The violation row names the decision that was broken (or, when the deployment had none, the new
    `violated` one) so `violated_config_ids` can find its device kind; the new decision row is what
    `joulepilot status` and the resolver see first. Without a policy there is nothing to mark: it
    only warns.
    """
    message = trip_message(deployment, trip, config_label, source)
    warnings.warn(message, EnvelopeWarning, stacklevel=2)
    log.warning(message)
    written: dict[str, Any] = {"message": message, "violation_id": None, "decision_id": None}
    if policy is None:
        return written
    broken_id = (decision or {}).get("id")
    kind = device_kind or (decision or {}).get("device_kind")
    if kind:
        written["decision_id"] = mark_decision_violated(
            db,
            policy=policy,
            policy_hash=(decision or {}).get("policy_hash") or "",
            device_kind=kind,
            torch_version=torch_version or (decision or {}).get("torch_version") or "",
            config_id=config_id,
            reason=message,
            details={"deployment": deployment, "window_powers_w": trip.window_powers_w,
                     "limit_w": trip.limit_w, "energy_source": source, "violated_decision_id": broken_id},
            at=trip.at,
        )
    written["violation_id"] = insert_violation(
        db, policy=policy, deployment=deployment, limit_name="max_avg_power_w", limit_value=trip.limit_w,
        measured_value=trip.measured_w, config_id=config_id,
        decision_id=broken_id if broken_id is not None else written["decision_id"], at=trip.at,
    )
    return written
