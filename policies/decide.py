"""Deciding, recording and applying: the one way a decision is made, and the one way it is read back.

`decide` is what the daemon, `joulepilot policy explain --record` and `joulepilot policy lock` call:
it leaves out the configurations that broke the policy's envelope in a deployment on this device
kind, resolves, stores the decision with the provenance it was made under and who made it, and
writes the lock file (beside the policy, or in the lock directory when that folder is read-only).

`applicable_decision` is what the hook and the daemon's lock-file upkeep read: the newest decision
that names a configuration to apply. After the envelope guard appends a `violated` row, that is the
newest earlier decision whose configuration did not break the envelope (None: apply the fallback),
until the daemon decides again.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlite_utils
from joulepilot.store.decisions import APPLICABLE_STATES, DecisionRow, latest_decision
from joulepilot.store.deployments import violated_config_ids

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


def violated_configs(db: sqlite_utils.Database, policy: str, device_kind: str) -> set[str]:
    """Configurations that broke `policy`'s envelope in a deployment on this device kind (any torch)."""
    return violated_config_ids(db, policy, device_kind)


def decide(
    db: sqlite_utils.Database,
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
    `search`: the guided search's summary (controller.guided), kept in the decision's details as `search`.
    `no_repeat`: config id -> why the daemon cannot measure it again (`resolve`'s `no_repeat`).
    Every decision carries its tuning bill (`policies.bill`): what measuring its workload cost, and its payback.
    """
    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    violated = violated_configs(db, policy.name, device_kind) | set(exclude)
    decision = resolve(policy, db, device_kind, model, torch_version=torch_version, exclude=violated,
                       no_repeat=no_repeat)
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
            outcome.lock_file = write_lock(policy.path, decision, lock_dir=lock_dir)
        except LockWriteError as exc:
            outcome.lock_error = str(exc)
    return outcome


def _record_with_search(db: sqlite_utils.Database, decision: Decision, search: dict[str, Any], *,
                        provenance_key: str | None, decided_by: str, reason: str) -> None:
    """`record_decision`, with the search summary in the details."""
    from joulepilot.store import transaction, upsert_config
    from joulepilot.store.decisions import write_decision

    record = decision_record(decision, provenance_key=provenance_key, decided_by=decided_by, stale_reason=reason,
                             search=search)
    with transaction(db):
        upsert_config(db, decision.config)
        decision.id = write_decision(db, record)


@dataclass
class Applicable:
    """The stored decision a caller can apply, and the violation that pushed the newest one aside."""

    row: DecisionRow | None  # the decision in an applicable state, or None
    violated: DecisionRow | None = None  # the newest decision, when it is `violated`
    excluded: set[str] = field(default_factory=set)  # configurations that broke the envelope


def applicable_decision(db: sqlite_utils.Database, policy: str, device_kind: str, torch_version: str) -> Applicable:
    """The decision to apply for (policy, device kind, torch major.minor); see the module docstring."""
    newest = latest_decision(db, policy, device_kind, torch_version)
    if newest is None or newest.state in APPLICABLE_STATES:
        return Applicable(newest)
    excluded = violated_configs(db, policy, device_kind)
    row = latest_decision(db, policy, device_kind, torch_version, states=APPLICABLE_STATES,
                          exclude_config_ids=excluded)
    return Applicable(row, violated=newest if newest.state == "violated" else None, excluded=excluded)


def sync_lock(db: sqlite_utils.Database, policy: Policy, device_kind: str, *, torch_version: str | None = None,
              lock_dir: str | os.PathLike | None = None) -> Path | None:
    """Make the policy's lock file hold its applicable stored decision (made for its current content), if
    it does not already: a lock write that failed earlier is retried this way. Returns the file written,
    or None when nothing needed writing. Raises LockWriteError when it cannot be written."""
    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    applicable = applicable_decision(db, policy.name, device_kind, torch_version)
    found = applicable.row
    if found is None or found.policy_hash != policy.hash:
        return None
    locked, _problems = find_locked(policy.path, policy.name, device_kind, torch_version,
                                    policy_hash=policy.hash, lock_dir=lock_dir)
    if locked is not None and locked.entry["config"]["id"] not in applicable.excluded \
            and float(locked.entry.get("decided_at") or 0) >= float(found.decided_at):
        return None
    return write_lock(policy.path, decision_from_record(found), lock_dir=lock_dir)
