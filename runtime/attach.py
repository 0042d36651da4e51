"""`attach(model, "name")`: start metering a deployment and return its `MeteredModel`.

Everything that happens once, before the first call: the store opened (its file reopened by the
metering thread), the host, its devices and the deployment registered, the decision being served
looked up when none is given, the envelope guard built from the policy, and the policy's `[fallback]`
prepared (built lazily, on the caller's thread, when the guard asks for it). With `register_on_thread` the
store is not touched here: the metering thread registers the deployment (`_register`) before it writes windows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

from joulepilot.compiler import CompileConfig, ShapeSet, apply_config
from joulepilot.compiler.workloads import workload_id as spec_workload_id
from joulepilot.policies.batches import batch_workload_id
from joulepilot.policies.schema import Policy, name_problem
from joulepilot.store import Store, default_db_path, open_db, upsert_devices, upsert_host
from joulepilot.store.catalog import config_row
from joulepilot.store.decisions import APPLICABLE_STATES, latest_decision
from joulepilot.store.deployments import register_deployment
from joulepilot.store.devicekind import device_kind as row_device_kind
from joulepilot.store.reports import config_labels

from .guard import EnvelopeGuard, guard_from_policy, setting
from .metered import DEFAULT_FLUSH_INTERVAL_S, DEFAULT_INTERVAL_S, Fallback, MeteredModel
from .metered import flush_on_sigterm as install_sigterm_flush


def as_mapping(obj: Any) -> dict[str, Any] | None:
    """A decision (row dict, dataclass or object with `to_dict`) as a plain dict."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return dict(obj)
    for method in ("to_dict", "to_row"):
        if callable(getattr(obj, method, None)):
            return dict(getattr(obj, method)())
    if is_dataclass(obj):
        return asdict(obj)
    return {k: getattr(obj, k) for k in dir(obj) if not k.startswith("_") and not callable(getattr(obj, k))}


def _policy_name(policy: Any) -> str | None:
    if policy is None:
        return None
    if isinstance(policy, str | os.PathLike):
        path = Path(policy)
        return path.name.removesuffix(".toml") if path.suffix == ".toml" else str(policy)
    return setting(policy, "name")


def _db_file(db: Store) -> str | None:
    path = db.file
    return str(path) if path is not None else None


def _path_of(db: str | os.PathLike | None) -> Path:
    """The store's file for a path, or the default store for None (absolute: the thread may run elsewhere)."""
    return (Path(db).expanduser() if db is not None else default_db_path()).absolute()


def _torch_device(model: Any, device: str | None) -> str:
    if device:
        if device == "cuda":
            import torch

            return f"cuda:{torch.cuda.current_device()}"
        return str(device)
    params = getattr(model, "parameters", None)
    if callable(params):
        try:
            return str(next(iter(params())).device)
        except (StopIteration, TypeError):
            pass
    return "cpu"


def _decided_config(decision: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The configuration row a decision applies (an AppliedDecision's `config`, a decisions row's details')."""
    details = (decision or {}).get("details") or {}
    for config in ((decision or {}).get("config"), details.get("config") if isinstance(details, Mapping) else None):
        if isinstance(config, Mapping):
            return config
    return {}


def _served_batch_size(db: Store | None, policy: Any, decision: Mapping[str, Any] | None,
                       config_id: str | None) -> int | None:
    """Samples per call the deployment serves: the batch size of the configuration served (the decided one; the
    batch-size lever may decide another than the policy's), else the policy's (`db` None: no store to look in)."""
    decided = _decided_config(decision)
    if config_id is None or decided.get("id") == config_id:
        config = decided
    else:  # without a store (registration not done yet): the policy's batch size
        config = (config_row(db, config_id) or {}) if db is not None else {}
    batch = config.get("batch_size") or setting(policy, "batch_size")
    return int(batch) if isinstance(batch, int | float) and not isinstance(batch, bool) else None


def _policy_workload_id(policy: Any, spec: str, batch: int) -> str:
    """The policy's workload at `batch`: for a `Policy`, the one rule of `policies.batches` (model options and a
    generation included); for a policy given as a plain mapping, from its spec and input shapes."""
    if isinstance(policy, Policy):
        return batch_workload_id(policy, batch)
    shapes = setting(policy, "shapes")
    return spec_workload_id(spec, batch, setting(policy, "seq_len"), setting(policy, "image_size"),
                            shapes if isinstance(shapes, ShapeSet) else None)


def _served_workload_id(policy: Any, batch: int | None) -> str | None:
    """The policy's workload at `batch` when that is not the policy's own batch size, else None."""
    spec, own = setting(policy, "workload"), setting(policy, "batch_size")
    if not isinstance(spec, str) or batch is None or own is None or int(own) == batch:
        return None
    return _policy_workload_id(policy, spec, batch)


def _workload_id(db: Store, policy: Any, decision: Mapping[str, Any] | None) -> str | None:
    """The decision's workload, else the policy's at its own batch size: where the policy's baselines are."""
    details = (decision or {}).get("details") or {}
    if isinstance(details, Mapping) and details.get("workload_id"):
        return str(details["workload_id"])
    if decision and decision.get("workload_id"):
        return str(decision["workload_id"])
    spec = setting(policy, "workload")
    batch = setting(policy, "batch_size")
    if not isinstance(spec, str) or batch is None:
        return None
    return _policy_workload_id(policy, spec, int(batch))


def _config_label(db: Store, config_id: str | None) -> str | None:
    if not config_id:
        return None
    return config_labels(db, [config_id]).get(config_id)


def _fallback_from_policy(policy: Any, base_model: Any, device: str, batch_size: int | None = None) -> Fallback | None:
    """The policy's `[fallback]` configuration applied to the uncompiled model, built lazily, at the batch size
    the deployment serves (`batch_size`, else the policy's): it takes the same calls."""
    if policy is None or base_model is None:
        return None
    spec = setting(policy, "fallback")
    if spec is None:
        spec = {"mode": "eager"}
    if not isinstance(spec, CompileConfig):
        values = dict(spec) if isinstance(spec, Mapping) else as_mapping(spec) or {}
        batch = batch_size or setting(policy, "batch_size")
        if batch is not None:
            values.setdefault("batch_size", int(batch))
        known = {"mode", "fusion", "options", "precision", "dynamic", "batch_size"}
        spec = CompileConfig(**{k: v for k, v in values.items() if k in known})
    cfg = spec
    return Fallback(cfg.id, cfg.label, lambda: apply_config(cfg, base_model, device))


@dataclass
class Registered:
    """What registering a deployment found and wrote: its id, the decision served, the batch size and label."""

    deployment_id: int
    decision_row: dict[str, Any] | None
    batch_size: int | None
    config_label: str | None


def _register(store: Store, deployment_name: str, *, policy: Any, policy_name: str | None,
              decision_row: dict[str, Any] | None, config_id: str | None, device_kind: str | None,
              torch_device: str, meter: Any, workload_id: str | None, interval_s: float) -> Registered:
    """Everything `attach` writes before the first window: the host, its devices and the deployment."""
    host_id = upsert_host(store)
    upsert_devices(store, host_id, [d.to_dict() for d in meter.devices])
    if decision_row is None and policy_name and device_kind:
        decision_row = latest_decision(store, policy_name, device_kind, states=APPLICABLE_STATES)
    # The deployment's workload is the one it serves, at the decided configuration's batch size (where that
    # configuration's runs are); its policy's own, where the baselines are, is kept beside it for reports.
    baseline_workload_id = _workload_id(store, policy, decision_row)
    served_batch = _served_batch_size(store, policy, decision_row, config_id)
    workload_id = workload_id or _served_workload_id(policy, served_batch) or baseline_workload_id
    limits = setting(policy, "limits")
    deployment_id = register_deployment(
        store, deployment_name, policy=policy_name, workload_id=workload_id, config_id=config_id,
        host_id=host_id, device=torch_device,
        details={"device_kind": device_kind, "energy_source": meter.primary_source,
                 "task": setting(policy, "task") or "forward",
                 "baseline_workload_id": baseline_workload_id, "batch_size": served_batch,
                 "limits": as_mapping(limits) if limits is not None else None, "interval_s": interval_s,
                 # per deployment, not per host: processes with different CUDA_VISIBLE_DEVICES share `gpu:0`
                 "gpus": [{"index": d.index, "uuid": d.uuid, "name": d.name} for d in meter.devices
                          if getattr(d, "kind", "") == "gpu"]},
    )
    return Registered(deployment_id, decision_row, served_batch, _config_label(store, config_id))


def attach(
    model_callable: Callable[..., Any],
    deployment_name: str,
    *,
    policy: Any = None,
    decision: Any = None,
    db: Store | str | os.PathLike | None = None,
    device: str | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    meter: Any = None,
    base_model: Any = None,
    fallback: Fallback | Callable[[], Fallback | None] | None = None,
    workload_id: str | None = None,
    config_id: str | None = None,
    device_kind: str | None = None,
    guard: EnvelopeGuard | None = None,
    flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
    flush_on_sigterm: bool = False,
    register_on_thread: bool = False,
) -> MeteredModel:
    """Meter `model_callable` as the deployment `deployment_name`; returns the callable wrapper.

    - `policy`: the policy object (or its name); its `[limits] max_avg_power_w` and `[guard]` table
      configure the envelope guard, its `[fallback]` the configuration to swap to.
    - `decision`: the decision being served (a decisions row or object); gives the configuration id,
      device kind and the decision a violation marks.
    - `base_model`: the uncompiled model, needed to build the fallback configuration.
    - `workload_id`: the workload served (default: the policy's at the decided configuration's batch size).
      The deployment's details keep the batch size served (`batch_size`) and the decision's workload, at the
      policy's own batch size, as `baseline_workload_id`: reports compare with the baselines measured there.
    - `meter`: an `EnergyMeter` to read (default: `EnergyMeter(device=device, sampler=False)`).
    - `flush_on_sigterm`: also flush on SIGTERM (see `runtime.metered.flush_on_sigterm`); samples are
      always flushed by `close()` and at a normal interpreter exit.
    - `register_on_thread`: touch no store here; the metering thread registers the deployment (retrying at each
      flush while the store refuses), and its windows wait, buffered and in the side file, until it has. For a
      store another process holds locked: serving starts at once and is metered all the same.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be positive, got {interval_s!r}")
    problem = name_problem(deployment_name, "deployment")
    if problem is not None:  # the name becomes a Prometheus label value, a log line and a report's title
        raise ValueError(problem)
    if isinstance(db, Store):
        store, db_path = db, _db_file(db)
    elif register_on_thread:
        store, db_path = None, str(_path_of(db))  # opened by the metering thread only
    else:
        store = open_db(db)
        db_path = _db_file(store)
    torch_device = _torch_device(model_callable, device)
    own_meter = meter is None
    if meter is None:
        from joulepilot.telemetry import EnergyMeter  # loaded when a deployment is metered, not to serve

        meter = EnergyMeter(device=torch_device, sampler=False)
    decision_row = as_mapping(decision)
    policy_name = _policy_name(policy) or (decision_row or {}).get("policy")
    config_id = config_id or (decision_row or {}).get("config_id") or \
        ((decision_row or {}).get("config") or {}).get("id")
    if device_kind is None:
        gpu_names = [d.name for d in meter.devices if getattr(d, "kind", "") == "gpu" and d.name]
        device_kind = (decision_row or {}).get("device_kind") or row_device_kind(
            {"device": torch_device, "device_name": gpu_names[0] if gpu_names else None})

    def register(on: Store) -> Registered:
        return _register(on, deployment_name, policy=policy, policy_name=policy_name, decision_row=decision_row,
                         config_id=config_id, device_kind=device_kind, torch_device=torch_device, meter=meter,
                         workload_id=workload_id, interval_s=interval_s)

    registered: Registered | None = None
    if not register_on_thread:
        try:
            registered = register(store)
        except BaseException:
            if own_meter:
                meter.close()
            raise
    if guard is None and policy is not None and not isinstance(policy, str | os.PathLike):
        guard = guard_from_policy(policy)
    if fallback is None and base_model is not None and policy is not None \
            and not isinstance(policy, str | os.PathLike):
        served_batch = registered.batch_size if registered is not None else \
            _served_batch_size(None, policy, decision_row, config_id)
        fallback = _fallback_from_policy(policy, base_model, torch_device, served_batch)
    model = MeteredModel(
        model_callable, deployment_name, deployment_id=registered.deployment_id if registered else None,
        generates=setting(policy, "task") == "generate" if policy is not None else False,
        db_path=db_path, shared_db=None if db_path else store, meter=meter, own_meter=own_meter,
        device=torch_device, interval_s=interval_s, flush_interval_s=flush_interval_s, config_id=config_id,
        config_label=registered.config_label if registered else None, policy_name=policy_name,
        decision=registered.decision_row if registered else decision_row, device_kind=device_kind, guard=guard,
        fallback=fallback, register=None if registered else register,
    )
    if store is not None and db_path and not isinstance(db, Store):
        store.close()
    if flush_on_sigterm:
        install_sigterm_flush()
    return model
