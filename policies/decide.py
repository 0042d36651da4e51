"""Deciding, recording and applying: the one way a decision is made, and the one way it is read back.

`decide` is what the daemon, `joulepilot policy explain --record` and `joulepilot policy lock` call:
it leaves out the configurations that broke the policy's envelope in a deployment on this device
kind, resolves, stores the decision with the provenance it was made under and who made it, and
writes the lock file (beside the policy, or in the lock directory when that folder is read-only).

`applicable_decision` is what the hook and the daemon's lock-file upkeep read: the newest decision
that names a configuration to apply. After the envelope guard appends a `violated` row, that is the
newest earlier decision whose configuration did not break the envelope (None: apply the fallback),
until the daemon decides again. A stored row is data, not code: one its policy would not allow, or dated in
the future (`policies.allowed.decision_refusal`), is passed over as if it were not there, and named.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joulepilot.store import Store
from joulepilot.store.decisions import APPLICABLE_STATES, DecisionRow, newest_decisions
from joulepilot.store.deployments import violated_config_ids

from .allowed import Refusal, decision_refusal, time_refusal
from .bill import tuning_bill
from .lock import LockWriteError, find_locked, write_lock
from .resolve import Decision, decision_from_record, decision_record, record_decision, resolve, torch_minor
from .schema import Policy


@dataclass
class Decided:
    """A decision and what became of it: stored (its id is on the decision) and locked, or why not."""

    decision: Decision
    lock_file: Path | None = None
    lock_error: str | None = None


def violated_configs(db: Store, policy: str, device_kind: str) -> set[str]:
    """Configurations that broke `policy`'s envelope in a deployment on this device kind (any torch)."""
    return violated_config_ids(db, policy, device_kind)


def decide(
    db: Store,
    policy: Policy,
    device_kind: str,
    model: Any = None,
    *,
    torch_version: str | None = None,
    provenance_key: str | None = None,
    decided_by: str = "cli",
    reason: str = "",
    lock_dir: str | os.PathLike | None = None,
    record: bool = True,
    lock: bool = True,
    exclude: Collection[str] = (),
    search: Mapping[str, Any] | None = None,
    no_repeat: Mapping[str, str] | None = None,
) -> Decided:
    """Resolve `policy` for `device_kind` and torch major.minor (default: the installed torch), leaving out
    every configuration that broke its envelope; store it (`record`) and write its lock file (`lock`).

    `provenance_key`: the software stack the decision was made under (the daemon's probe; None when
    deciding for another host's device or torch). `decided_by`: 'daemon', 'policy lock', ... `reason`:
    why it was (re)decided. A lock file that cannot be written anywhere does not raise: `lock_error`
    says why, and the stored decision stands (the daemon writes the file again on its next pass).
    `search`: the guided search's summary (controller.guided), kept in the decision's details as `search`; what
    it measures next is all the decision proposes for measuring (`resolve`'s `search_next`).
    `no_repeat`: config id -> why the daemon cannot measure it again (`resolve`'s `no_repeat`).
    Every decision carries its tuning bill (`policies.bill`): what measuring its workload cost, and its payback.
    """
    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    violated = violated_configs(db, policy.name, device_kind) | set(exclude)
    search_next = None if search is None else [n["config_id"] for n in search.get("next", [])
                                                if n.get("kind") == "guided"]
    decision = resolve(policy, db, device_kind, model, torch_version=torch_version, exclude=violated,
                       no_repeat=no_repeat, search_next=search_next)
    if search is not None and search.get("stop_reason") and decision.state == "fallback":
        decision.reason += f"; the guided search stopped: {search['stop_reason']}"
    decision.bill = tuning_bill(db, decision)
    outcome = Decided(decision)
    if record and search is None:
        record_decision(db, decision, provenance_key=provenance_key, decided_by=decided_by, reason=reason)
    elif record:
        _record_with_search(db, decision, dict(search), provenance_key=provenance_key, decided_by=decided_by,
                            reason=reason)
    if lock and (policy.path or lock_dir is not None):  # a policy built in memory has nowhere to lock to
        try:
            outcome.lock_file = write_lock(policy.path, decision, lock_dir=lock_dir, policy=policy)
        except LockWriteError as exc:
            outcome.lock_error = str(exc)
    return outcome


def _record_with_search(db: Store, decision: Decision, search: dict[str, Any], *,
                        provenance_key: str | None, decided_by: str, reason: str) -> None:
    """`record_decision`, with the search summary in the details."""
    from joulepilot.store import transaction, upsert_config
    from joulepilot.store.decisions import write_decision

    record = decision_record(decision, provenance_key=provenance_key, decided_by=decided_by, stale_reason=reason,
                             search=search)
    with transaction(db):
        upsert_config(db, decision.config)
        decision.id = write_decision(db, record)


# How many refused rows a reader passes over before it gives up on the store (the fallback then applies).
MAX_REFUSED_ROWS = 20


@dataclass
class Applicable:
    """The stored decision a caller can apply, and the violation that pushed the newest one aside."""

    row: DecisionRow | None  # the decision in an applicable state, or None
    violated: DecisionRow | None = None  # the newest decision, when it is `violated`
    excluded: set[str] = field(default_factory=set)  # configurations that broke the envelope
    refused: list[tuple[DecisionRow, Refusal]] = field(default_factory=list)  # rows passed over, newest first


def _row_refusal(policy: Policy, row: DecisionRow, now: float | None) -> Refusal | None:
    """Why a stored row must be passed over: for a row that names a configuration to apply and was made for the
    policy's current content, `decision_refusal`; for any other (never applied), its time alone."""
    if row.state in APPLICABLE_STATES and row.policy_hash == policy.hash:
        return decision_refusal(policy, row.details.get("config"), row.decided_at, now=now)
    return time_refusal(row.decided_at, now)


def _first_sound(policy: Policy, rows: list[DecisionRow], refused: list[tuple[DecisionRow, Refusal]],
                 now: float | None) -> DecisionRow | None:
    """The first of `rows` not refused; each refused one is added to `refused` (once)."""
    named = {row.id for row, _ in refused}
    for row in rows:
        refusal = _row_refusal(policy, row, now)
        if refusal is None:
            return row
        if row.id not in named:
            refused.append((row, refusal))
    return None


def newest_sound_decision(db: Store, policy: Policy, device_kind: str,
                          torch_version: str | None = None, *, now: float | None = None,
                          ) -> tuple[DecisionRow | None, list[tuple[DecisionRow, Refusal]]]:
    """The newest stored decision of any state (`violated` too) that is not refused, and the rows passed over;
    `torch_version` None: any torch. What the daemon asks when it checks whether a decision is stale."""
    refused: list[tuple[DecisionRow, Refusal]] = []
    rows = newest_decisions(db, policy.name, device_kind, torch_version, limit=MAX_REFUSED_ROWS)
    return _first_sound(policy, rows, refused, now), refused


def applicable_decision(db: Store, policy: Policy, device_kind: str, torch_version: str, *,
                        now: float | None = None) -> Applicable:
    """The decision to apply for (policy, device kind, torch major.minor); see the module docstring."""
    newest, refused = newest_sound_decision(db, policy, device_kind, torch_version, now=now)
    if newest is None or newest.state in APPLICABLE_STATES:
        return Applicable(newest, refused=refused)
    excluded = violated_configs(db, policy.name, device_kind)
    rows = newest_decisions(db, policy.name, device_kind, torch_version, states=APPLICABLE_STATES,
                            exclude_config_ids=excluded, limit=MAX_REFUSED_ROWS)
    row = _first_sound(policy, rows, refused, now)
    return Applicable(row, violated=newest if newest.state == "violated" else None, excluded=excluded,
                      refused=refused)


def sync_lock(db: Store, policy: Policy, device_kind: str, *, torch_version: str | None = None,
              lock_dir: str | os.PathLike | None = None) -> Path | None:
    """Make the policy's lock file hold its applicable stored decision (made for its current content), if
    it does not already: a lock write that failed earlier is retried this way, and an entry the hook would
    refuse is replaced. Returns the file written, or None when nothing needed writing. Raises LockWriteError
    when it cannot be written."""
    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    applicable = applicable_decision(db, policy, device_kind, torch_version)
    found = applicable.row
    if found is None or found.policy_hash != policy.hash:
        return None
    locked, _problems = find_locked(policy.path, policy.name, device_kind, torch_version,
                                    policy_hash=policy.hash, lock_dir=lock_dir, policy=policy)
    if locked is not None and locked.entry["config"]["id"] not in applicable.excluded \
            and float(locked.entry.get("decided_at") or 0) >= float(found.decided_at):
        return None
    return write_lock(policy.path, decision_from_record(found), lock_dir=lock_dir, policy=policy)
