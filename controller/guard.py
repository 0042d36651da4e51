"""The envelope guard: trips when a deployment's measured average power stays above its policy's limit.

The guard itself is pure bookkeeping over the sampled windows (`EnvelopeGuard.feed`); what a trip
does to the store (a `violations` row and a `violated` decision) lives in `record_trip`, so the
logic can be replayed on a recorded power trace without a database.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlite_utils
from joulepilot.store.deployments import insert_violation, mark_decision_violated

log = logging.getLogger("joulepilot.guard")

ACTIONS = ("warn", "fallback")
DEFAULT_WINDOWS = 3


class EnvelopeWarning(UserWarning):
    """A deployment's measured power broke its policy's envelope."""


@dataclass
class Trip:
    """The evidence for one trip: the consecutive windows that were all above the limit."""

    limit_w: float
    window_powers_w: list[float]
    at: float = field(default_factory=time.time)

    @property
    def measured_w(self) -> float:
        """Mean of the offending windows' average power."""
        return sum(self.window_powers_w) / len(self.window_powers_w)


class EnvelopeGuard:
    """Feed one average power per metered window; `feed` returns a Trip on the window that trips.

    A trip needs `windows` consecutive windows above `limit_w`: one spike shorter than that never
    trips. A window in which the deployment served nothing breaks the streak, since no configuration
    can be blamed for power drawn while it was idle. After a trip the guard stays latched (no new
    trips) until `reset()`, which the deployment calls when it swaps configuration.
    """

    def __init__(self, limit_w: float, windows: int = DEFAULT_WINDOWS, action: str = "warn") -> None:
        if limit_w is None or limit_w <= 0:
            raise ValueError(f"guard limit_w must be a positive number of watts, got {limit_w!r}")
        if windows < 1:
            raise ValueError(f"guard windows must be at least 1, got {windows!r}")
        if action not in ACTIONS:
            raise ValueError(f"guard action must be one of {ACTIONS}, got {action!r}")
        self.limit_w = float(limit_w)
        self.windows = int(windows)
        self.action = action
        self._streak: list[float] = []
        self.tripped: Trip | None = None

    def feed(self, avg_power_w: float | None, *, inferences: int | None = None,
             at: float | None = None) -> Trip | None:
        if self.tripped is not None:
            return None
        if avg_power_w is None or inferences == 0 or avg_power_w <= self.limit_w:
            self._streak.clear()
            return None
        self._streak.append(float(avg_power_w))
        if len(self._streak) < self.windows:
            return None
        self.tripped = Trip(self.limit_w, list(self._streak), at if at is not None else time.time())
        self._streak.clear()
        return self.tripped

    def reset(self) -> None:
        self._streak.clear()
        self.tripped = None


def setting(obj: Any, *path: str, default: Any = None) -> Any:
    """Read `obj.a.b` or `obj["a"]["b"]` (policies may be dataclasses or plain dicts)."""
    current = obj
    for key in path:
        if current is None:
            return default
        if isinstance(current, Mapping):
            current = current.get(key)
        else:
            current = getattr(current, key, None)
    return default if current is None else current


def guard_from_policy(policy: Any) -> EnvelopeGuard | None:
    """The guard a policy asks for: `[limits] max_avg_power_w` and the optional `[guard]` table.

    ```toml
    [guard]
    windows = 3          # consecutive metered windows above the limit before it trips
    action = "fallback"  # "warn" (default) or "fallback": swap to the policy's fallback configuration
    ```
    No average-power limit means no guard.
    """
    limit_w = setting(policy, "limits", "max_avg_power_w")
    if limit_w is None:
        return None
    windows = setting(policy, "guard", "windows", default=DEFAULT_WINDOWS)
    action = setting(policy, "guard", "action", default="warn")
    return EnvelopeGuard(float(limit_w), windows=int(windows), action=str(action))


def trip_message(deployment: str, trip: Trip, config_label: str | None, source: str) -> str:
    powers = ", ".join(f"{p:.1f}" for p in trip.window_powers_w)
    return (
        f"deployment {deployment!r} broke its power envelope: measured average {trip.measured_w:.1f} W "
        f"({source}) over {len(trip.window_powers_w)} consecutive windows [{powers}] W, "
        f"limit max_avg_power_w = {trip.limit_w:.1f} W"
        + (f", configuration {config_label}" if config_label else "")
    )


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
