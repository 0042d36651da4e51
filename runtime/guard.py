"""The envelope guard: trips when a deployment's measured average power stays above its policy's limit.

Pure bookkeeping over the sampled windows: average powers in (`EnvelopeGuard.feed`), a `Trip` out.
It reads no clock of its own when given the window's time, and touches no database: what a trip does
to the store (a `violations` row and a `violated` decision) is `runtime.trips.record_trip`, so the
logic can be replayed on a recorded power trace.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
    # a generation's: the energy of the offending windows and the tokens generated in them (None: not counted)
    energy_j: float | None = None
    tokens: int | None = None

    @property
    def j_per_token(self) -> float | None:
        return self.energy_j / self.tokens if self.energy_j is not None and self.tokens else None

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
        self._streak_energy: list[tuple[float | None, int | None]] = []  # a generation's (energy J, tokens)
        self.tripped: Trip | None = None

    def feed(self, avg_power_w: float | None, *, inferences: int | None = None, at: float | None = None,
             energy_j: float | None = None, tokens: int | None = None) -> Trip | None:
        """One window; `energy_j` and `tokens` (a generation's) let the trip say the J per token of its windows."""
        if self.tripped is not None:
            return None
        if avg_power_w is None or inferences == 0 or avg_power_w <= self.limit_w:
            self.reset_streak()
            return None
        self._streak.append(float(avg_power_w))
        self._streak_energy.append((energy_j, tokens))
        if len(self._streak) < self.windows:
            return None
        counted = tokens is not None and all(e is not None and t is not None for e, t in self._streak_energy)
        self.tripped = Trip(self.limit_w, list(self._streak), at if at is not None else time.time(),
                            energy_j=sum(e for e, _ in self._streak_energy) if counted else None,  # type: ignore[misc]
                            tokens=sum(t for _, t in self._streak_energy) if counted else None)  # type: ignore[misc]
        self.reset_streak()
        return self.tripped

    def reset_streak(self) -> None:
        self._streak.clear()
        self._streak_energy.clear()

    def reset(self) -> None:
        self.reset_streak()
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
    """The warning a trip gives; its figures are worded as what `source` made them (an estimate is never
    called measured)."""
    powers = ", ".join(f"{p:.1f}" for p in trip.window_powers_w)
    parts = set(source.split("+")) if source else set()
    if parts == {"estimate"}:
        figure = f"estimated average {trip.measured_w:.1f} W (ESTIMATE, not measured)"
    elif "estimate" in parts:
        figure = f"average {trip.measured_w:.1f} W ({source}: PARTLY ESTIMATE)"
    else:
        figure = f"measured average {trip.measured_w:.1f} W ({source or 'source unknown'})"
    per_token = trip.j_per_token
    return (
        f"deployment {deployment!r} broke its power envelope: {figure} "
        f"over {len(trip.window_powers_w)} consecutive windows [{powers}] W, "
        f"limit max_avg_power_w = {trip.limit_w:.1f} W"
        + (f", configuration {config_label}" if config_label else "")
        + (f"; {per_token:.4g} J per generated token in those windows ({trip.tokens} tokens)"
           if per_token is not None else "")
    )
