"""The decision in force for (policy, device kind, torch major.minor): lock files first, then the store.

  1. the lock files: `<stem>.lock.json` beside the policy and `<policy name>.lock.json` in the lock
     directory ($JOULEPILOT_LOCK_DIR, else <JOULEPILOT_HOME>/locks; the daemon writes there when the
     policy folder is read-only). The newest entry made for this exact policy content (same policy
     hash) wins;
  2. the store's newest decision that names a configuration (the database is opened read-only, once
     per process; a WAL database in a folder this user cannot write is opened immutable, for one lookup). After the envelope guard marked the newest decision `violated`, the newest earlier
     decision whose configuration did not break the envelope applies (`policies.applicable_decision`),
     with a note, until the daemon decides again. A decision made for other policy content is ignored.

A decision this joulepilot cannot apply (a lock entry or stored row naming an unknown mode or precision,
options that are not JSON or that the installed torch does not know, a lock file of a newer format) is
skipped and the next source tried: the other lock file, the store, else none (the hook's fallback). So is
a decision the policy does not allow (`policies.allowed`: a lock file or a stored row is data, never code):
a configuration outside the policy's [search] grid and [fallback], Inductor options other than the knobs
joulepilot searches (`cpp.cxx` would name a program to run), a decided_at in the future. So the
configuration of a decision returned here always parses (`CompileConfig.from_row`), is one the policy
allows, and applies.

The serving path (this lookup, and the hook's benchmark request and deployment registration) waits
SERVING_BUSY_TIMEOUT_MS for another process's lock on the store, not the store's 30 s: a store the daemon
holds locked costs `joulepilot.compile` about a second per use, and the note says the database is locked
(`Lookup.store_busy`: the hook still meters a deployment then, registering it from the metering thread).

Problems met on the way (a lock file or store that cannot be read, a decision skipped) are collected as
one-line notes naming the file and the fix; nothing here raises because of joulepilot's own files. This is the hot
path of `joulepilot.compile`: policies are cached per file and modification time, stores per path.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from joulepilot.policies.decide import applicable_decision
from joulepilot.policies.load import find_policy, load_policy
from joulepilot.policies.lock import default_lock_dir, find_locked
from joulepilot.policies.resolve import torch_minor
from joulepilot.policies.schema import Policy
from joulepilot.store import DRIVER_ERRORS, StoreError, database_error, default_db_path, is_busy, open_db
from joulepilot.store.db import opened_immutable

# How long the serving path waits for another process's lock on the store, per statement (the store's own
# default is 30 s): a serving process starts on a lock file or the fallback rather than stall on the daemon.
SERVING_BUSY_TIMEOUT_MS = 1_000

_policies: dict[str, tuple[int, Policy]] = {}
_read_databases: dict[str, Any] = {}


@dataclass
class AppliedDecision:
    """What `compile` applied: the configuration row, its state and where the decision came from."""

    policy: str
    device_kind: str
    torch_version: str
    config: dict[str, Any]
    state: str  # verified | provisional | infeasible | fallback (as decided), or 'fallback' when no decision exists
    source: str  # 'lock' | 'store' | 'none'
    reason: str
    policy_hash: str = ""
    id: int | None = None  # the decisions row, when the decision came from the store
    workload_id: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def config_id(self) -> str:
        return self.config["id"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Lookup:
    """A lookup's result and the problems met on the way (each a line naming a file and a fix)."""

    applied: AppliedDecision | None = None
    notes: list[str] = field(default_factory=list)
    store_unusable: bool = False
    store_busy: bool = False  # unusable only because another process held it locked (a deployment is still metered)


@functools.cache
def torch_version_minor() -> str:
    """The installed torch's major.minor (read once per process)."""
    return torch_minor()


def current_device_kind(device: Any = None) -> str:
    """'cpu', or the CUDA device's name (e.g. 'NVIDIA H200') for a cuda device; None means cuda:0 when
    CUDA is available, else cpu."""
    text = str(device) if device is not None else ""
    if not text:
        import torch

        text = "cuda" if torch.cuda.is_available() else "cpu"
    if not text.startswith("cuda"):
        return "cpu"
    import torch

    return torch.cuda.get_device_name(torch.device(text))


def cached_policy(name_or_path: str | os.PathLike | Policy) -> Policy:
    """The policy by name or path, parsed once per file and modification time (raises as load_policy)."""
    if isinstance(name_or_path, Policy):
        return name_or_path
    path = find_policy(name_or_path)
    key = os.path.realpath(path)
    mtime = path.stat().st_mtime_ns
    cached = _policies.get(key)
    if cached and cached[0] == mtime:
        return cached[1]
    policy = load_policy(path)
    _policies[key] = (mtime, policy)
    return policy


def db_path(db: Any) -> Path:
    """The store's file: `db` as given, else $JOULEPILOT_DB / the home folder's joulepilot.db."""
    return Path(db).expanduser() if db is not None else default_db_path()


def _locked_note(where: Any) -> str:
    return (f"database {where} is locked by another process (still locked after {SERVING_BUSY_TIMEOUT_MS / 1000:g} "
            "s), so the decision in it could not be read; retry when the lock is released, or lock the decision "
            "into a file (`joulepilot policy lock` on the policy), which the hook reads without the database")


def _read_database(db: Any) -> tuple[Any, StoreError | None, bool]:
    """(an open store to read, or None when there is no database file; the error when it cannot be opened;
    whether to close it after this lookup). Opened read-only and cached per path: reading needs no write access and no migration. An immutable connection (see `open_db`) is not cached: it would
    never see a later decision."""
    if db is not None and not isinstance(db, str | os.PathLike):
        return db, None, False
    path = db_path(db)
    key = os.path.realpath(path)
    if key in _read_databases:
        return _read_databases[key], None, False
    if not path.exists():
        return None, None, False
    try:
        database = open_db(path, read_only=True, busy_timeout_ms=SERVING_BUSY_TIMEOUT_MS)
    except StoreError as exc:
        return None, exc, False
    if opened_immutable(database):
        return database, None, True
    _read_databases[key] = database
    return database, None, False


def _torch_problem(config: dict[str, Any]) -> str | None:
    """Why the installed torch cannot apply a (parsed) configuration row's Inductor options, or None."""
    from joulepilot.compiler import CompileConfig, checked_config

    try:
        checked_config(CompileConfig.from_row(config))
    except (ValueError, TypeError, KeyError) as exc:  # ConfigError is a ValueError
        return f"names a configuration this torch cannot apply ({' '.join(str(exc).split())[:300]})"
    return None


def _from_lock(policy: Policy, kind: str, torch_version: str, found: Lookup) -> AppliedDecision | None:
    locked, problems = find_locked(policy.path, policy.name, kind, torch_version, policy_hash=policy.hash,
                                   lock_dir=default_lock_dir(), policy=policy,
                                   usable=lambda entry: _torch_problem(entry["config"]))
    found.notes.extend(f"ignoring lock file {p}" for p in problems)
    if locked is None:
        return None
    entry = locked.entry
    return AppliedDecision(policy.name, kind, torch_version, entry["config"], entry["state"], "lock",
                           entry.get("reason", ""), entry.get("policy_hash", ""), entry.get("decision_id"),
                           entry.get("workload_id"), {**entry, "lock_file": locked.path})


def _violation_note(policy: Policy, violated: dict[str, Any], replacement: dict[str, Any] | None) -> str:
    config = (replacement or {}).get("details", {}).get("config") or {}
    then = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(violated["decided_at"])))
    using = (f"applying the earlier decision {config.get('label', config.get('id'))} (decision "
             f"{replacement['id']})" if replacement else "applying the policy's fallback")
    return (f"the decision for policy {policy.name!r} broke its power envelope at {then} (configuration "
            f"{violated.get('config_id')}, decision {violated['id']}); {using} until the daemon decides again")


def _from_store(policy: Policy, kind: str, torch_version: str, db: Any, found: Lookup) -> AppliedDecision | None:
    where = db_path(db) if db is None or isinstance(db, str | os.PathLike) else "(the store passed as db=)"
    database, problem, temporary = _read_database(db)
    if problem is not None:
        found.store_busy = is_busy(problem.__cause__)
        found.notes.append(_locked_note(where) if found.store_busy else str(problem))
        found.store_unusable = True
        return None
    if database is None:
        return None
    try:
        applicable = applicable_decision(database, policy, kind, torch_version)
    except DRIVER_ERRORS as exc:  # a truncated or damaged file is often found only when read
        found.notes.append(_locked_note(where) if is_busy(exc) else str(database_error(where, exc)))
        found.store_unusable = True
        found.store_busy = is_busy(exc)
        return None
    finally:
        if temporary:
            database.close()
    for refused, refusal in applicable.refused:
        found.notes.append(f"decision {refused.id} for policy {policy.name!r} in database {where} {refusal.problem}; "
                           f"ignored: {refusal.fix}")
    row = applicable.row
    if applicable.violated is not None:
        found.notes.append(_violation_note(policy, applicable.violated,
                                           row if row and row["policy_hash"] == policy.hash else None))
    if row is None or row["policy_hash"] != policy.hash:
        return None
    details = row["details"]
    config = details.get("config")
    problem = _torch_problem(config)
    if problem:
        found.notes.append(f"decision {row['id']} for policy {policy.name!r} in database {where} {problem}; ignored: "
                           "upgrade joulepilot here if a newer version made it, or decide again with this one "
                           "(`joulepilot policy lock` on the policy, or the daemon)")
        return None
    workload_id = details.get("workload_id")
    return AppliedDecision(policy.name, kind, torch_version, config, row["state"], "store",
                           row["reason"] or "", row["policy_hash"], row["id"],
                           workload_id if isinstance(workload_id, str) else None,
                           {"measured": details.get("measured", {}), "proposed": details.get("proposed")})


def find_decision(policy: Policy, device_kind: str, torch_version: str, db: Any) -> Lookup:
    """The decision in force and the notes gathered finding it (see the module docstring)."""
    found = Lookup()
    found.applied = _from_lock(policy, device_kind, torch_version, found) or \
        _from_store(policy, device_kind, torch_version, db, found)
    return found


def lookup_decision(policy: str | os.PathLike | Policy, device_kind: str, torch_version: str,
                    db: Any = None) -> AppliedDecision | None:
    """The decision in force (lock files first, then the store), or None. This is the hot path."""
    return find_decision(cached_policy(policy), device_kind, torch_version, db).applied


