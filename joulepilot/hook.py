"""`joulepilot.compile(model, policy=...)`: a drop-in for torch.compile that applies the policy's decision.

Lookup order for the decision of (policy, device kind, torch major.minor):
  1. the lock files: `<stem>.lock.json` beside the policy and `<policy name>.lock.json` in the lock
     directory ($JOULEPILOT_LOCK_DIR, else <JOULEPILOT_HOME>/locks; the daemon writes there when the
     policy folder is read-only). The newest entry made for this exact policy content (same policy
     hash) wins;
  2. the store's newest decision that names a configuration (the database is opened read-only, once
     per process). After the envelope guard marked the newest decision `violated`, the newest earlier
     decision whose configuration did not break the envelope applies, with one warning, until the
     daemon decides again. A decision made for other policy content is ignored.
  A decision whose state is not `verified` is applied as decided, and a benchmark request is left
  for the daemon (once per process, without a warning).
  3. neither: the policy's [fallback] configuration, a warning (once per policy, device kind and torch
     version per process) and a row in `requests` so the daemon benchmarks the model.

The hook never raises because of joulepilot's own files: a lock file it cannot read (permissions,
not UTF-8, corrupt), a store that is missing, read-only, corrupt or of a newer schema, and a policy
file that cannot be found or parsed all end in one warning naming the file and the fix. An unusable
policy runs the model uncompiled in fp32 (there is no [fallback] to read).

`torch_compile_kwargs` are merged over the decided ones: `options` entries override the decided
Inductor options one by one; `mode` replaces the decided mode and options; anything else (`fullgraph`,
`backend`, `dynamic`, ...) is passed through. When the decision is eager nothing is compiled and the
keyword arguments are ignored. The returned callable runs the model under `torch.no_grad()` in the
decided precision (autocast for bf16/fp16) and carries `.decision` (what was applied and why).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import socket
import sqlite3
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from joulepilot.policies.decide import applicable_decision
from joulepilot.policies.load import find_policy, load_policy
from joulepilot.policies.lock import default_lock_dir, find_locked
from joulepilot.policies.schema import Policy

log = logging.getLogger("joulepilot.hook")

_warned: set[tuple[str, ...]] = set()
_policies: dict[str, tuple[int, Policy]] = {}
_read_databases: dict[str, Any] = {}
_write_databases: dict[str, Any] = {}


@dataclass
class AppliedDecision:
    """What `compile` applied: the configuration row, its state and where the decision came from."""

    policy: str
    device_kind: str
    torch_version: str
    config: dict[str, Any]
    state: str  # verified | provisional | fallback (as decided), or 'fallback' when no decision exists
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
class _Lookup:
    """A lookup's result and the problems met on the way (each a line naming a file and a fix)."""

    applied: AppliedDecision | None = None
    notes: list[str] = field(default_factory=list)
    store_unusable: bool = False


@functools.cache
def torch_version_minor() -> str:
    """The installed torch's major.minor (read once per process)."""
    from joulepilot.policies.resolve import torch_minor

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


def _policy(name_or_path: str | os.PathLike | Policy) -> Policy:
    if isinstance(name_or_path, Policy):
        return name_or_path
    path = find_policy(name_or_path)
    key = str(path.resolve())
    mtime = path.stat().st_mtime_ns
    cached = _policies.get(key)
    if cached and cached[0] == mtime:
        return cached[1]
    policy = load_policy(path)
    _policies[key] = (mtime, policy)
    return policy


def _db_path(db: Any) -> Path:
    from joulepilot.store import default_db_path

    return Path(db).expanduser() if db is not None else default_db_path()


def _read_database(db: Any) -> tuple[Any, str | None]:
    """(an open store to read, or None when there is no database file; a problem line when it cannot
    be opened). Opened read-only and cached per path: reading needs no write access and no migration."""
    if db is not None and not isinstance(db, str | os.PathLike):
        return db, None
    from joulepilot.store import StoreError, open_db

    path = _db_path(db)
    key = str(path.resolve())
    if key in _read_databases:
        return _read_databases[key], None
    if not path.exists():
        return None, None
    try:
        database = open_db(path, read_only=True)
    except StoreError as exc:
        return None, str(exc)
    _read_databases[key] = database
    return database, None


def _write_database(db: Any) -> Any:
    """An open store to write a request to (created and migrated if needed), cached per path."""
    if db is not None and not isinstance(db, str | os.PathLike):
        return db
    from joulepilot.store import open_db

    path = _db_path(db)
    key = str(path.resolve())
    if key not in _write_databases:
        _write_databases[key] = open_db(path)
    return _write_databases[key]


def _from_lock(policy: Policy, kind: str, torch_version: str, found: _Lookup) -> AppliedDecision | None:
    locked, problems = find_locked(policy.path, policy.name, kind, torch_version, policy_hash=policy.hash,
                                   lock_dir=default_lock_dir())
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


def _from_store(policy: Policy, kind: str, torch_version: str, db: Any, found: _Lookup) -> AppliedDecision | None:
    from joulepilot.store import database_error

    database, problem = _read_database(db)
    if problem is not None:
        found.notes.append(problem)
        found.store_unusable = True
        return None
    if database is None:
        return None
    try:
        applicable = applicable_decision(database, policy.name, kind, torch_version)
    except sqlite3.Error as exc:  # a truncated or damaged file is often found only when read
        where = _db_path(db) if db is None or isinstance(db, str | os.PathLike) else "(the store passed as db=)"
        found.notes.append(str(database_error(where, exc)))
        found.store_unusable = True
        return None
    row = applicable.row
    if applicable.violated is not None:
        found.notes.append(_violation_note(policy, applicable.violated,
                                           row if row and row["policy_hash"] == policy.hash else None))
    if row is None or row["policy_hash"] != policy.hash:
        return None
    details = row["details"]
    config = details.get("config")
    if not isinstance(config, dict) or not config.get("id"):
        found.notes.append(f"decision {row['id']} in the store names no configuration; ignored "
                           f"(`joulepilot policy lock` or the daemon will decide again)")
        return None
    return AppliedDecision(policy.name, kind, torch_version, config, row["state"], "store",
                           row["reason"] or "", row["policy_hash"], row["id"], details.get("workload_id"),
                           {"measured": details.get("measured", {}), "proposed": details.get("proposed")})


def _lookup(policy: Policy, device_kind: str, torch_version: str, db: Any) -> _Lookup:
    found = _Lookup()
    found.applied = _from_lock(policy, device_kind, torch_version, found) or \
        _from_store(policy, device_kind, torch_version, db, found)
    return found


def lookup_decision(policy: str | os.PathLike | Policy, device_kind: str, torch_version: str,
                    db: Any = None) -> AppliedDecision | None:
    """The decision in force (lock files first, then the store), or None. This is the hot path."""
    return _lookup(_policy(policy), device_kind, torch_version, db).applied


def _request_benchmark(policy: Policy, kind: str, torch_version: str, db: Any) -> None:
    """Leave a request for the daemon, unless an unhandled one for this policy and host is waiting."""
    from joulepilot.store import host_identity, transaction, upsert_host

    try:
        database = _write_database(db)
        host = host_identity()
        with transaction(database):
            upsert_host(database, host)
            waiting = database.execute(
                "SELECT 1 FROM requests WHERE policy = ? AND host_id = ? AND handled_at IS NULL",
                [policy.name, host["id"]]).fetchone()
            if waiting is None:
                note = {"policy_path": policy.path, "batch_size": policy.batch_size, "seq_len": policy.seq_len,
                        "image_size": policy.image_size, "device_kind": kind, "torch_version": torch_version,
                        "hostname": socket.gethostname()}
                database.execute(
                    "INSERT INTO requests (policy, workload, host_id, requested_at, note) VALUES (?, ?, ?, ?, ?)",
                    [policy.name, policy.workload, host["id"], time.time(), json.dumps(note, sort_keys=True)])
    except Exception as exc:  # a read-only or locked store must not stop the model from running
        log.warning("could not record a benchmark request for %s: %s", policy.name, exc)


def _warn_once(key: tuple[str, ...], message: str) -> bool:
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(f"joulepilot: {message}", stacklevel=4)
    return True


def _fallback(policy: Policy, kind: str, torch_version: str, db: Any, found: _Lookup) -> AppliedDecision:
    from joulepilot.policies.resolve import fallback_config

    config = fallback_config(policy)
    if found.notes:
        reason = (f"no usable decision for policy {policy.name!r} on {kind} with torch {torch_version}: "
                  f"{'; '.join(found.notes)}; using the fallback {config.label}")
    else:
        reason = (f"no decision for policy {policy.name!r} on {kind} with torch {torch_version} (no lock entry, "
                  f"nothing in the store); using the fallback {config.label} and asking the daemon to benchmark it")
    if _warn_once((policy.path or policy.name, kind, torch_version), reason) and not found.store_unusable:
        _request_benchmark(policy, kind, torch_version, db)
    return AppliedDecision(policy.name, kind, torch_version, config.to_row(), "fallback", "none", reason,
                           policy.hash, details={"problems": list(found.notes)})


def _unusable_policy(policy: Any, model: Any, device: str, exc: BaseException) -> Callable[..., Any]:
    """The model uncompiled in fp32, for a policy that cannot be found or read, after one warning."""
    from joulepilot.compiler import CompileConfig

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, RecursionError):
        text = f"{policy}: nested too deeply to be a policy file; flatten it"
    elif isinstance(exc, UnicodeDecodeError):
        text = f"{policy}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
    reason = f"policy {str(policy)!r} cannot be used ({text[:300]}); running the model uncompiled in fp32"
    _warn_once(("policy", str(policy)), reason)
    config = CompileConfig("eager", precision="fp32")
    compiled = config.apply(model, device)
    compiled.decision = AppliedDecision(str(policy), current_device_kind(device), torch_version_minor(),  # type: ignore[attr-defined]
                                        config.to_row(), "fallback", "none", reason)
    return compiled


def _load_artifacts(applied: AppliedDecision, config: Any, device: str) -> bool:
    if not applied.workload_id or not config.compiles:
        return False
    from joulepilot.compiler import artifact_path_for, load_artifacts
    from joulepilot.compiler.provenance import device_name

    path = artifact_path_for(applied.workload_id, config.id, device_name(device))
    try:
        if not path.is_file():
            return False
        return load_artifacts(path)
    except Exception as exc:  # unreadable, stale or foreign artifacts only cost a cold compile
        log.warning("could not load compile artifacts %s: %s", path, exc)
        return False


def merge_compile_kwargs(config: Any, device: str, user: dict[str, Any]) -> dict[str, Any]:
    """The decided torch.compile kwargs with the caller's on top (see the module docstring)."""
    kwargs = config.torch_compile_kwargs(device)
    user = dict(user)
    if "mode" in user:
        kwargs.pop("options", None)
        kwargs.pop("mode", None)
    if "options" in user:
        options = {} if "mode" in user else config.inductor_options(device)
        options.update(user.pop("options") or {})
        kwargs.pop("mode", None)  # torch refuses mode and options together; the mode is expanded above
        kwargs["options"] = options
    kwargs.update(user)
    return kwargs


def _apply(config: Any, model: Any, device: str, user_kwargs: dict[str, Any]) -> Callable[..., Any]:
    if not user_kwargs or not config.compiles:
        if user_kwargs:
            log.debug("decision is eager; torch.compile arguments %s ignored", sorted(user_kwargs))
        return config.apply(model, device)
    return config.apply(model, device, compile_kwargs=merge_compile_kwargs(config, device, user_kwargs))


def _model_device(model: Any, device: Any) -> str:
    if device is not None:
        return str(device)
    try:
        return str(next(model.parameters()).device)
    except (AttributeError, StopIteration, TypeError):
        return "cpu"


def _attach_deployment(compiled: Callable[..., Any], deployment: str, policy: Policy, applied: AppliedDecision,
                       db: Any, model: Any, device: str) -> Callable[..., Any]:
    try:
        from joulepilot.controller import deployment as deployment_module
    except ImportError as exc:
        raise NotImplementedError("joulepilot.compile(deployment=...) needs joulepilot.controller.deployment, "
                                  f"which is not available in this installation ({exc})") from exc
    attach = getattr(deployment_module, "attach", None)
    if attach is None:
        raise NotImplementedError("joulepilot.controller.deployment has no attach(); deployment metering is "
                                  "not available in this installation")
    offered = {"policy": policy, "decision": applied, "db": db, "device": device, "base_model": model,
               "workload_id": applied.workload_id, "config_id": applied.config_id,
               "device_kind": applied.device_kind}
    params = inspect.signature(attach).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return attach(compiled, deployment, **{k: v for k, v in offered.items() if takes_any or k in params})


def compile(  # noqa: A001 - the public name mirrors torch.compile on purpose
    model: Any,
    policy: str | os.PathLike | Policy,
    *,
    device: Any = None,
    db: Any = None,
    deployment: str | None = None,
    **torch_compile_kwargs: Any,
) -> Callable[..., Any]:
    """Compile `model` as the policy's decision for this device kind and torch version says.

    `policy`: a policy name (looked up as <name>.toml in $JOULEPILOT_POLICIES, <JOULEPILOT_HOME>/policies,
    the current directory) or a path. `device`: where the model runs (default: its parameters' device).
    `db`: the store (path or open Database; default $JOULEPILOT_DB / the home folder's joulepilot.db).
    `deployment`: meter this live deployment under that name. Returns a callable with `.decision`.
    """
    dev = _model_device(model, device)
    try:
        pol = _policy(policy)
    except Exception as exc:  # a bad policy file (RecursionError included) must not take the process down
        return _unusable_policy(policy, model, dev, exc)
    kind = current_device_kind(dev)
    torch_version = torch_version_minor()
    found = _lookup(pol, kind, torch_version, db)
    if deployment is not None and found.store_unusable:
        found.notes.append(f"deployment {deployment!r} is not metered")
    applied = found.applied
    if applied is None:
        applied = _fallback(pol, kind, torch_version, db, found)
    else:
        if found.notes:
            _warn_once(("notes", pol.path or pol.name, kind, torch_version),
                       f"{'; '.join(found.notes)}; applying {applied.config.get('label', applied.config_id)} "
                       f"from the {applied.source}")
        if applied.state != "verified":
            # A decided fallback/provisional still wants measurements: ask the daemon (quietly, once).
            key = ("request", pol.path or pol.name, kind, torch_version)
            if key not in _warned:
                _warned.add(key)
                _request_benchmark(pol, kind, torch_version, db)

    from joulepilot.compiler import CompileConfig

    config = CompileConfig.from_row(applied.config)
    applied.details["artifacts_loaded"] = _load_artifacts(applied, config, dev)
    compiled = _apply(config, model, dev, torch_compile_kwargs)
    compiled.decision = applied  # type: ignore[attr-defined]
    log.info("joulepilot.compile: %s -> %s (%s, from %s)", pol.name, config.label, applied.state, applied.source)
    if deployment is None or found.store_unusable:
        return compiled
    from joulepilot.store import StoreError

    try:
        return _attach_deployment(compiled, deployment, pol, applied, db, model, dev)
    except (StoreError, sqlite3.Error, OSError) as exc:  # serve unmetered rather than not at all
        _warn_once(("deployment", deployment), f"deployment {deployment!r} is not metered: {exc}")
        return compiled
