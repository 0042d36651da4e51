"""`joulepilot.compile(model, policy=...)`: a drop-in for torch.compile that applies the policy's decision.

Lookup order for the decision of (policy, device kind, torch major.minor):
  1. the lock file beside the policy (`<stem>.lock.json`), if its entry was made for this exact
     policy content (same policy hash);
  2. the store's latest decision (the database is opened once per process, without migrating it, and
     only read); a decision made for other policy content is ignored;
  A decision whose state is not `verified` is applied as decided, and a benchmark request is left
  for the daemon (once per process, without a warning).
  3. neither: the policy's [fallback] configuration, a warning (once per policy, device kind and torch
     version per process) and a row in `requests` so the daemon benchmarks the model.

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
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from joulepilot.policies.load import find_policy, load_policy
from joulepilot.policies.lock import read_lock
from joulepilot.policies.schema import Policy

log = logging.getLogger("joulepilot.hook")

_warned: set[tuple[str, str, str]] = set()
_policies: dict[str, tuple[int, Policy]] = {}
_databases: dict[str, Any] = {}


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


def _database(db: Any, *, create: bool = False) -> Any:
    """An open store (cached per path), or None when the file does not exist and `create` is False."""
    if db is not None and not isinstance(db, str | os.PathLike):
        return db
    from joulepilot.store import default_db_path, open_db

    path = Path(db).expanduser() if db is not None else default_db_path()
    key = str(path.resolve())
    if key in _databases:
        return _databases[key]
    if not path.exists() and not create:
        return None
    # Reading a decision needs no migration (the decisions table is in every schema version); the
    # first write (a request) migrates.
    database = open_db(path, migrate_schema=create)
    _databases[key] = database
    return database


def _from_lock(policy: Policy, kind: str, torch_version: str) -> AppliedDecision | None:
    if not policy.path:
        return None
    try:
        entry = read_lock(policy.path, kind, torch_version)
    except ValueError as exc:
        warnings.warn(f"joulepilot: ignoring lock file: {exc}", stacklevel=4)
        return None
    if entry is None:
        return None
    if entry.get("policy_hash") != policy.hash:
        log.info("lock entry for %s on %s/torch %s was made for other policy content; ignored",
                 policy.name, kind, torch_version)
        return None
    return AppliedDecision(policy.name, kind, torch_version, entry["config"], entry["state"], "lock",
                           entry.get("reason", ""), entry.get("policy_hash", ""), None, entry.get("workload_id"),
                           entry)


def _from_store(policy: Policy, kind: str, torch_version: str, db: Any) -> AppliedDecision | None:
    from joulepilot.store.decisions import latest_decision

    database = _database(db)
    if database is None:
        return None
    row = latest_decision(database, policy.name, kind, torch_version)
    if row is None or row["policy_hash"] != policy.hash:
        return None
    details = json.loads(row["details"] or "{}")
    return AppliedDecision(policy.name, kind, torch_version, details["config"], row["state"], "store",
                           row["reason"] or "", row["policy_hash"], row["id"], details.get("workload_id"),
                           {"measured": details.get("measured", {}), "proposed": details.get("proposed")})


def lookup_decision(policy: str | os.PathLike | Policy, device_kind: str, torch_version: str,
                    db: Any = None) -> AppliedDecision | None:
    """The decision in force (lock file first, then the store), or None. This is the hot path."""
    pol = _policy(policy)
    return _from_lock(pol, device_kind, torch_version) or _from_store(pol, device_kind, torch_version, db)


def _request_benchmark(policy: Policy, kind: str, torch_version: str, db: Any) -> None:
    """Leave a request for the daemon, unless an unhandled one for this policy and host is waiting."""
    from joulepilot.store import host_identity, transaction, upsert_host

    try:
        database = _database(db, create=True)
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


def _fallback(policy: Policy, kind: str, torch_version: str, db: Any) -> AppliedDecision:
    from joulepilot.policies.resolve import fallback_config

    config = fallback_config(policy)
    key = (policy.path or policy.name, kind, torch_version)
    reason = (f"no decision for policy {policy.name!r} on {kind} with torch {torch_version} (no lock entry, "
              f"nothing in the store); using the fallback {config.label} and asking the daemon to benchmark it")
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"joulepilot: {reason}", stacklevel=3)
        _request_benchmark(policy, kind, torch_version, db)
    return AppliedDecision(policy.name, kind, torch_version, config.to_row(), "fallback", "none", reason,
                           policy.hash)


def _load_artifacts(applied: AppliedDecision, config: Any, device: str) -> bool:
    if not applied.workload_id or not config.compiles:
        return False
    from joulepilot.compiler import artifact_path_for, load_artifacts
    from joulepilot.compiler.provenance import device_name

    path = artifact_path_for(applied.workload_id, config.id, device_name(device))
    if not path.is_file():
        return False
    try:
        return load_artifacts(path)
    except Exception as exc:  # stale or foreign artifacts only cost a cold compile
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
    pol = _policy(policy)
    dev = _model_device(model, device)
    kind = current_device_kind(dev)
    torch_version = torch_version_minor()
    applied = lookup_decision(pol, kind, torch_version, db) or _fallback(pol, kind, torch_version, db)
    if applied.source != "none" and applied.state != "verified":
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
    if deployment is not None:
        return _attach_deployment(compiled, deployment, pol, applied, db, model, dev)
    return compiled
