"""`joulepilot.compile(model, policy=...)`: a drop-in for torch.compile that applies the policy's decision.

The decision in force comes from `runtime.lookup` (lock files, then the store). A decision whose
state is not `verified` is applied as decided, and a benchmark request is left for the daemon (once
per process, without a warning). With no decision: the policy's [fallback] configuration, a warning
(once per policy, device kind and torch version per process) and a row in `requests` so the daemon
benchmarks the model.

The hook never raises because of joulepilot's own files: a lock file it cannot read (permissions,
not UTF-8, corrupt, of a newer format), a decision this joulepilot cannot apply (see `runtime.lookup`),
a store that is missing, read-only, corrupt, of a newer schema or locked, and a policy file that cannot
be found or parsed all end in one warning naming the file and the fix. An unusable policy runs the model
uncompiled in fp32 (there is no [fallback] to read). A deployment whose store cannot be used, or whose name is
outside the rule for names (`policies.schema.name_problem`), is served unmetered. The store is used with a short busy timeout (`lookup.SERVING_BUSY_TIMEOUT_MS`), so a store
another process holds locked costs about a second per use (the lookup, a benchmark request, registering
a deployment), never the store's 30 s. A locked store does not leave a deployment unmetered: it is attached
all the same, and its metering thread registers it once the lock is released (`attach(register_on_thread=True)`).

`torch_compile_kwargs` are merged over the decided ones: `options` entries override the decided
Inductor options one by one; `mode` replaces the decided mode and options; anything else (`fullgraph`,
`backend`, `dynamic`, ...) is passed through. When the decision is eager nothing is compiled and the
keyword arguments are ignored. The returned callable runs the model under `torch.no_grad()` in the
decided precision (autocast for bf16/fp16) and carries `.decision` (what was applied and why), `flush()` and
`close()`: a `MeteredModel` for a metered deployment, else a `ServedModel`, whose two do nothing.

A generation policy (`task = "generate"`) applies to a causal language model's `generate`: the model is prepared
in place by `compiler.generation.prepare_generation`, the one function the benchmark worker measured it with
(precision as the model's dtype, the decided KV cache, allocated for the policy's prompt_len + new_tokens, decode
steps compiled with the decided arguments, the prompt by the decided prefill setting), and the returned object
calls the model and has its `generate`; metered, each generate call counts its generated tokens. Such a policy
given a model without transformers' `generate` is an unusable policy (one warning; the model runs uncompiled in
fp32). A forward-pass policy given a causal LM compiles its forward calls as decided; its `generate` runs the
model's own, uncompiled (one warning at its first call: a generation is decided by a generation policy).

A decision made at another batch size than the policy's `batch_size` (`[search] batch_sizes`, the batch-size
lever) is applied as decided (mode, options, precision), but the batch size is the caller's: the hook never
changes it. It says so once (a warning), in `.decision.reason`, and in `.decision.details["batch_size"]`
({"decided": 8, "policy": 32}); the compile artifacts it loads are those measured at the decided batch size,
and a metered deployment is recorded under the workload at that batch size (`attach` keeps the policy's own,
where reports find the baselines, beside it).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

from joulepilot.compiler import (
    ArtifactsInfo,
    CompileConfig,
    ConfigError,
    apply_config,
    artifact_path_for,
    load_warm_start,
)
from joulepilot.compiler.generation import GenerationError, has_generate, prepare_generation
from joulepilot.compiler.inductor import inductor_options, torch_compile_kwargs
from joulepilot.compiler.provenance import device_name
from joulepilot.compiler.remote_cache import RemoteCacheError, configured_url, use_in_this_process
from joulepilot.compiler.warmstart import precompile_opted_in
from joulepilot.policies.batches import batch_note, config_workload_id
from joulepilot.policies.resolve import fallback_config
from joulepilot.policies.schema import Policy, name_problem
from joulepilot.store import DRIVER_ERRORS, StoreError, database_error, host_identity, is_busy, open_db
from joulepilot.store.daemon_state import add_host_request
from joulepilot.store.safeio import shorten

from .attach import attach
from .lookup import (
    SERVING_BUSY_TIMEOUT_MS,
    AppliedDecision,
    Lookup,
    cached_policy,
    current_device_kind,
    db_path,
    find_decision,
    torch_version_minor,
)
from .metered import Fallback, MeteredModel
from .served import ServedModel

log = logging.getLogger("joulepilot.hook")

_warned: set[tuple[str, ...]] = set()
_write_databases: dict[str, Any] = {}


def _write_database(db: Any) -> Any:
    """An open store to write a request or register a deployment in (created and migrated if needed), cached
    per path; it waits SERVING_BUSY_TIMEOUT_MS for another process's lock."""
    if db is not None and not isinstance(db, str | os.PathLike):
        return db
    path = db_path(db)
    key = os.path.realpath(path)
    if key not in _write_databases:
        _write_databases[key] = open_db(path, busy_timeout_ms=SERVING_BUSY_TIMEOUT_MS)
    return _write_databases[key]


def _store_problem(db: Any, exc: BaseException) -> str:
    """One line for an error met using the store, naming the file."""
    if isinstance(exc, DRIVER_ERRORS):
        where = db_path(db) if db is None or isinstance(db, str | os.PathLike) else "(the store passed as db=)"
        return str(database_error(where, exc, busy_timeout_ms=SERVING_BUSY_TIMEOUT_MS))
    return str(exc)


def _busy(exc: BaseException) -> bool:
    """Whether a store error only means another process holds the store locked."""
    return is_busy(exc) or (isinstance(exc, StoreError) and exc.__cause__ is not None and is_busy(exc.__cause__))


def _request_benchmark(policy: Policy, kind: str, torch_version: str, db: Any) -> None:
    """Leave a request for the daemon, unless an unhandled one for this policy and host is waiting."""
    host = host_identity()
    note = {"policy_path": policy.path, "batch_size": policy.batch_size, "seq_len": policy.seq_len,
            "image_size": policy.image_size, "device_kind": kind, "torch_version": torch_version,
            "hostname": host["hostname"]}
    try:
        add_host_request(_write_database(db), policy.name, workload=policy.workload, host=host, note=note)
    except Exception as exc:  # a read-only or locked store must not stop the model from running
        log.warning("could not record a benchmark request for %s: %s", policy.name, _store_problem(db, exc))


def _warn_once(key: tuple[str, ...], message: str) -> bool:
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(f"joulepilot: {message}", stacklevel=4)
    return True


def _fallback(policy: Policy, kind: str, torch_version: str, db: Any, found: Lookup) -> AppliedDecision:
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


def _unusable_policy(policy: Any, model: Any, device: str, exc: BaseException) -> ServedModel:
    """The model uncompiled in fp32, for a policy that cannot be found or read, or whose task the model cannot do,
    after one warning."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, RecursionError):
        text = f"{policy}: nested too deeply to be a policy file; flatten it"
    elif isinstance(exc, UnicodeDecodeError):
        text = f"{policy}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
    named = shorten(str(policy), 120)  # a name or path of any length, from the caller
    reason = f"policy {named!r} cannot be used ({shorten(text, 600)}); running the model uncompiled in fp32"
    _warn_once(("policy", named), reason)
    config = CompileConfig("eager", precision="fp32")
    return ServedModel(_keep_generate(apply_config(config, model, device), model),
                       AppliedDecision(named, current_device_kind(device), torch_version_minor(),
                                       config.to_row(), "fallback", "none", reason))


class TaskMismatch(ValueError):
    """A generation policy given a model that cannot generate."""


def _task_problem(policy: Policy, model: Any) -> TaskMismatch | None:
    if policy.generates and not has_generate(model):
        return TaskMismatch(f"{policy.path or policy.name}: task = \"generate\", but the model "
                            f"({type(model).__name__}) has no transformers generate() and generation_config; give a "
                            "causal language model, or a forward-pass policy (without task) for this model")
    return None


def _keep_generate(fn: Any, model: Any, warning: str | None = None) -> Any:
    """`fn` (the applied callable of a forward pass) with the model's own `generate`, uncompiled, when the model
    has one; `warning` is given once, at the first generate call."""
    if not has_generate(model):
        return fn
    original = model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        if warning is not None:
            _warn_once(("generate", warning), warning)
        return original(*args, **kwargs)

    fn.generate = generate
    return fn


def _apply_generation(policy: Policy, config: CompileConfig, model: Any, device: str,
                      user_kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(the model, prepared in place to generate under `config` (see the module docstring); the PreparedGeneration)."""
    kwargs = merge_compile_kwargs(config, device, user_kwargs) if user_kwargs and config.compiles else None
    prepared = prepare_generation(model, config, device, max_cache_len=policy.generation.cache_len,
                                  compile_kwargs=kwargs)
    return model, prepared


def _generation_fallback(policy: Policy, prepared: Any, config: CompileConfig) -> Fallback:
    """What the envelope guard swaps a generation deployment to: its decode steps uncompiled, the dynamic cache,
    in the precision the model has (`PreparedGeneration.run_eagerly`)."""
    eager = CompileConfig("eager", precision=config.precision, batch_size=config.batch_size)

    def build() -> Any:
        prepared.run_eagerly()
        return prepared.model

    return Fallback(eager.id, eager.label, build)


def _load_artifacts(applied: AppliedDecision, config: Any, device: str,
                    workload_id: str | None = None) -> ArtifactsInfo | None:
    """The decided configuration's saved artifacts loaded into this process's caches (None: none);
    `workload_id`: the workload they were measured under, when not the decision's (another batch size)."""
    workload_id = workload_id or applied.workload_id
    if not workload_id or not config.compiles:
        return None
    path = artifact_path_for(workload_id, config.id, device_name(device))
    try:
        if not path.is_file():
            return None
        return load_warm_start(path)
    except Exception as exc:  # unreadable, stale or foreign artifacts only cost a cold compile
        log.warning("could not load compile artifacts %s: %s", path, exc)
        return None


def _note_batch_size(policy: Policy, applied: AppliedDecision, config: CompileConfig) -> str | None:
    """For a configuration decided at another batch size than the policy's: say so (once, and in the decision's
    reason and details) and return the workload it was measured under; None otherwise."""
    note = batch_note(policy, applied.config)
    if not note:
        return None
    applied.details["batch_size"] = {"decided": config.batch_size, "policy": policy.batch_size}
    if note not in applied.reason:
        applied.reason = f"{applied.reason}; {note}" if applied.reason else note
    _warn_once(("batch", policy.path or policy.name, config.id),
               f"policy {policy.name!r} applies {config.label}: {note}; joulepilot.compile does not change your "
               "batch size")
    return config_workload_id(policy, config)


def merge_compile_kwargs(config: CompileConfig, device: str, user: dict[str, Any]) -> dict[str, Any]:
    """The decided torch.compile kwargs with the caller's on top (see the module docstring)."""
    kwargs = torch_compile_kwargs(config, device)
    user = dict(user)
    if "mode" in user:
        kwargs.pop("options", None)
        kwargs.pop("mode", None)
    if "options" in user:
        options = {} if "mode" in user else inductor_options(config, device)
        options.update(user.pop("options") or {})
        kwargs.pop("mode", None)  # torch refuses mode and options together; the mode is expanded above
        kwargs["options"] = options
    kwargs.update(user)
    return kwargs


def _apply(config: CompileConfig, model: Any, device: str, user_kwargs: dict[str, Any], *,
           precompile: bool = False) -> Callable[..., Any]:
    if not user_kwargs or not config.compiles:
        if user_kwargs:
            log.debug("decision is eager; torch.compile arguments %s ignored", sorted(user_kwargs))
        return apply_config(config, model, device, precompile=precompile)
    return apply_config(config, model, device, compile_kwargs=merge_compile_kwargs(config, device, user_kwargs),
                        precompile=precompile)


def _use_fleet_cache() -> None:
    """With `JOULEPILOT_REDIS_URL` set, compile from (and into) the fleet's remote caches, as the daemon's workers
    do (`compiler.remote_cache`); a bad URL or a server that does not answer is a warning, never an error here."""
    try:
        use_in_this_process(configured_url())
    except RemoteCacheError as exc:
        _warn_once(("fleet-cache", str(exc)), f"{exc}; compiling without the fleet's cache")
    except Exception as exc:  # noqa: BLE001 - a cache must not stop a model from being served
        _warn_once(("fleet-cache", type(exc).__name__), f"the fleet's compile cache could not be used ({exc}); "
                   "compiling without it")


def use_precompiled_frames(loaded: ArtifactsInfo | None, torch_compile_kwargs: dict[str, Any]) -> bool:
    """Whether to install Dynamo's precompiled frames at torch.compile: only when $JOULEPILOT_PRECOMPILE opts
    in (precompile is experimental and off by default) and the artifacts carry them; they were compiled with
    the decided arguments, so not when the caller gives torch.compile arguments of its own."""
    return bool(precompile_opted_in() and loaded is not None and loaded.precompile and not torch_compile_kwargs)


def _model_device(model: Any, device: Any) -> str:
    if device is not None:
        return str(device)
    try:
        return str(next(model.parameters()).device)
    except (AttributeError, StopIteration, TypeError):
        return "cpu"


def _with_decision(metered: MeteredModel, applied: AppliedDecision) -> MeteredModel:
    """The metered model with `.decision` its own (a generation's model is no wrapper of joulepilot's to carry it)."""
    metered.decision = applied  # type: ignore[attr-defined]
    return metered


def compile(  # noqa: A001 - the public name mirrors torch.compile on purpose
    model: Any,
    policy: str | os.PathLike | Policy,
    *,
    device: Any = None,
    db: Any = None,
    deployment: str | None = None,
    flush_on_sigterm: bool = False,
    **torch_compile_kwargs: Any,
) -> ServedModel | MeteredModel:
    """Compile `model` as the policy's decision for this device kind and torch version says.

    `policy`: a policy name (looked up as <name>.toml in $JOULEPILOT_POLICIES, <JOULEPILOT_HOME>/policies,
    the current directory) or a path. `device`: where the model runs (default: its parameters' device).
    `db`: the store (path or open Database; default $JOULEPILOT_DB / the home folder's joulepilot.db).
    `deployment`: meter this live deployment under that name (a `MeteredModel`; its samples are flushed
    by `.close()` and at a normal exit, and on SIGTERM too with `flush_on_sigterm=True`).
    Other keyword arguments go to torch.compile (see the module docstring). Returns a `MeteredModel` for a metered
    deployment, else a `ServedModel`; either is called as the model and has `.decision`, `flush()` and `close()`,
    whichever path was taken (a store that cannot be used, a policy that cannot be read, the fallback).
    """
    dev = _model_device(model, device)
    if deployment is not None and (problem := name_problem(deployment, "deployment")) is not None:
        _warn_once(("deployment-name", shorten(str(deployment))), f"{problem}; the model is served unmetered until "
                   "the deployment is given such a name")
        deployment = None
    try:
        pol = cached_policy(policy)
    except Exception as exc:  # a bad policy file (RecursionError included) must not take the process down
        return _unusable_policy(policy, model, dev, exc)
    mismatch = _task_problem(pol, model)
    if mismatch is not None:
        return _unusable_policy(policy, model, dev, mismatch)
    kind = current_device_kind(dev)
    torch_version = torch_version_minor()
    found = find_decision(pol, kind, torch_version, db)
    unmetered = found.store_unusable and not found.store_busy  # a locked store still meters (see _attach)
    if deployment is not None and unmetered:
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
            # A decision that is not verified (the fallback, or a measured choice on fewer runs than a
            # verified decision needs) still wants measurements: ask the daemon (quietly, once).
            key = ("request", pol.path or pol.name, kind, torch_version)
            if key not in _warned:
                _warned.add(key)
                _request_benchmark(pol, kind, torch_version, db)

    config = CompileConfig.from_row(applied.config)
    if config.padding != "none" and getattr(pol, "shapes", None) is not None:
        buckets = ", ".join(map(str, sorted(set(pol.shapes.run_sizes(config.padding)))))
        _warn_once(("padding", pol.path or pol.name, config.id),
                   f"{config.label} was measured with inputs padded to the {pol.shapes.dim} buckets {buckets}; "
                   "joulepilot.compile does not pad: pad your inputs to those sizes, or the model recompiles "
                   "for each new size")
    measured_under = _note_batch_size(pol, applied, config)
    if config.compiles:
        _use_fleet_cache()
    fallback = None
    if pol.generates:  # warm starts of a generation are not saved yet: it compiles at its first decode step
        try:
            compiled, prepared = _apply_generation(pol, config, model, dev, torch_compile_kwargs)
        except (GenerationError, ConfigError) as exc:
            return _unusable_policy(policy, model, dev, exc)
        fallback = _generation_fallback(pol, prepared, config)
        applied.details["artifacts_loaded"] = False
    else:
        loaded = _load_artifacts(applied, config, dev, measured_under)
        applied.details["artifacts_loaded"] = loaded is not None
        if loaded is not None:
            applied.details["artifacts"] = loaded.to_dict()
        precompile = use_precompiled_frames(loaded, torch_compile_kwargs)
        compiled = _keep_generate(
            _apply(config, model, dev, torch_compile_kwargs, precompile=precompile), model,
            f"policy {pol.name!r} decides the model's forward calls; its generate() runs uncompiled: decide a "
            "generation with a policy of task = \"generate\"")
        compiled.decision = applied  # type: ignore[attr-defined]
    log.info("joulepilot.compile: %s -> %s (%s, from %s)", pol.name, config.label, applied.state, applied.source)
    if deployment is None or unmetered:
        return ServedModel(compiled, applied)
    attach_kwargs = dict(policy=pol, decision=applied, device=dev, base_model=model,
                         workload_id=measured_under or applied.workload_id, config_id=applied.config_id,
                         device_kind=applied.device_kind, flush_on_sigterm=flush_on_sigterm, fallback=fallback)
    if not found.store_busy:
        try:
            # The hook's own connection (short busy timeout): the metering thread opens the file again for itself.
            return _with_decision(attach(compiled, deployment, db=_write_database(db), **attach_kwargs), applied)
        except (StoreError, *DRIVER_ERRORS, OSError) as exc:
            if not _busy(exc):  # serve unmetered rather than not at all
                _warn_once(("deployment", deployment),
                           f"deployment {deployment!r} is not metered: {_store_problem(db, exc)}")
                return ServedModel(compiled, applied)
            log.warning("deployment %r: %s; its metering thread registers it when the lock is released",
                        deployment, _store_problem(db, exc))
    # Locked by another process: waiting longer here would hold up serving, so the metering thread registers
    # the deployment (its first windows wait, buffered and in the side file, until it has).
    try:
        return _with_decision(attach(compiled, deployment, db=db, register_on_thread=True, **attach_kwargs), applied)
    except Exception as exc:  # noqa: BLE001 - no meter (or no thread) here: serve unmetered rather than not at all
        _warn_once(("deployment", deployment), f"deployment {deployment!r} is not metered: {exc}")
        return ServedModel(compiled, applied)
