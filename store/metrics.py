"""Typed reads behind the Prometheus exporter: one consistent snapshot of what a scrape shows.

Everything here only reads, so it works on a connection from `open_db(path, read_only=True)`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .connection import Store
from .db import schema_version
from .decisions import DecisionRow
from .devicekind import device_kind
from .errors import StoreError
from .jsonvalues import json_object
from .schema import SCHEMA_VERSION
from .torchversion import torch_major_minor


class SchemaTooOld(StoreError):
    """A read-only reader met a database that no writer has migrated to this version yet."""


def require_current_schema(db: Store, path: str | os.PathLike) -> None:
    """Refuse a database older than this joulepilot: a read-only reader cannot migrate it."""
    version = schema_version(db)
    if version < SCHEMA_VERSION:
        raise SchemaTooOld(f"database {path} has schema version {version}, older than this joulepilot's "
                           f"({SCHEMA_VERSION}); start the daemon (it migrates the database) and scrape again")


@contextmanager
def read_snapshot(db: Store) -> Iterator[Store]:
    """All reads inside see the same committed state (one WAL read transaction)."""
    if db.in_transaction:
        yield db
        return
    db.begin_read()
    try:
        yield db
    finally:
        db.rollback_quietly()


def decision_workload_id(db: Store, decision: DecisionRow) -> str | None:
    """The workload a decision is about: recorded in its details, else the daemon's jobs for the policy."""
    recorded = decision.details.get("workload_id")
    if recorded:
        return str(recorded)
    row = db.execute("SELECT workload_id FROM jobs WHERE policy = ? ORDER BY id DESC LIMIT 1",
                     [decision.policy]).fetchone()
    if row:
        return row[0]
    row = db.execute("SELECT workload_id FROM deployments WHERE policy = ? AND workload_id IS NOT NULL "
                     "ORDER BY id DESC LIMIT 1", [decision.policy]).fetchone()
    return row[0] if row else None


# The figures a policy's gauges show, as a decision records them in `details.measured` (J per generated token: a
# generation policy's).
POLICY_FIGURES = ("energy_j_per_inference", "avg_power_w", "peak_power_w", "latency_ms_p95", "energy_j_per_token")


@dataclass
class DecidedFigures:
    """What the exporter shows for a decision's configuration, and where the figures come from.

    `basis`: 'decision' (the figures the decision recorded: medians over the runs it counted, the highest
    peak) or 'run' (one stored run, for a decision that recorded none); `run_id` names that run, or the
    newest run the decision counted.
    """

    energy_source: str | None
    energy_j_per_inference: float | None
    avg_power_w: float | None
    peak_power_w: float | None
    latency_ms_p95: float | None
    energy_j_per_token: float | None
    basis: str
    run_id: int | None = None


def decided_figures(db: Store, decision: DecisionRow) -> DecidedFigures | None:
    """The measured figures of the decided configuration on the decision's device kind and torch (None: none).

    A decision made by the resolver records the figures it was made from (`details.measured`), and those
    are returned: runs stored later, on any device, change nothing until the policy is decided again.
    A decision that recorded none (its configuration was unmeasured when decided, or it was written before
    the figures were kept) gets the newest ok run of its configuration on its own device kind and torch
    major.minor, a run under the decision's provenance first; never a run of another device.
    """
    if not decision.config_id:
        return None
    measured = decision.details.get("measured")
    if isinstance(measured, dict) and any(measured.get(k) is not None for k in POLICY_FIGURES):
        run_id = measured.get("run_id")
        return DecidedFigures(energy_source=measured.get("energy_source"),
                              **{k: _number(measured.get(k)) for k in POLICY_FIGURES},
                              basis="decision", run_id=int(run_id) if isinstance(run_id, int) else None)
    run = _own_device_run(db, decision)
    if run is None:
        return None
    return DecidedFigures(energy_source=run.get("energy_source"), **{k: run.get(k) for k in POLICY_FIGURES},
                          basis="run", run_id=int(run["id"]))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _own_device_run(db: Store, decision: DecisionRow) -> dict[str, Any] | None:
    """The newest ok run of the decided configuration and workload on the decision's device kind and torch
    major.minor; one under the decision's provenance key (when it recorded one) before any other."""
    workload_ids = [str(w) for w in decision.details.get("workload_ids") or [] if w]
    if not workload_ids:
        one = decision_workload_id(db, decision)
        workload_ids = [one] if one else []
    sql = "SELECT * FROM runs WHERE config_id = ? AND status = 'ok'"
    args: list[Any] = [decision.config_id]
    if workload_ids:
        sql += f" AND workload_id IN ({', '.join('?' for _ in workload_ids)})"
        args.extend(workload_ids)
    wanted_torch = torch_major_minor(decision.torch_version)
    runs = [run for run in db.query(sql + " ORDER BY id DESC", args)
            if device_kind(run) == decision.device_kind and torch_major_minor(run.get("torch_version")) == wanted_torch]
    provenance = decision.details.get("provenance_key")
    if provenance:
        same_stack = [run for run in runs if run.get("provenance_key") == provenance]
        runs = same_stack or runs
    return runs[0] if runs else None


def deployment_totals(db: Store) -> list[dict[str, Any]]:
    """Per deployment: its row (details decoded), energy by source, inferences, and its latest sample.

    Keys: id, name, policy, device, host_id, details (dict), energy_by_source ({source: joules}),
    inferences, tokens (a generation's generated tokens; None for a deployment of forward calls), last_sample
    (avg_power_w, peak_power_w, energy_source) or None.
    """
    deployments: dict[int, dict[str, Any]] = {}
    for row in db.query("SELECT * FROM deployments ORDER BY name"):
        row["details"] = json_object(row.get("details"))
        row.update(energy_by_source={}, inferences=0, tokens=None, last_sample=None)
        deployments[row["id"]] = row
    for dep_id, source, energy_j, inferences, tokens in db.execute(
            "SELECT deployment_id, energy_source, SUM(energy_j), SUM(inferences), SUM(tokens) FROM deployment_samples "
            "GROUP BY deployment_id, energy_source").fetchall():
        dep = deployments.get(dep_id)
        if dep is not None:
            dep["energy_by_source"][source] = float(energy_j or 0.0)
            dep["inferences"] += int(inferences or 0)
            if tokens is not None:
                dep["tokens"] = (dep["tokens"] or 0) + int(tokens)
    for row in db.query(
            "SELECT s.deployment_id, s.avg_power_w, s.peak_power_w, s.energy_source FROM deployment_samples s "
            "JOIN (SELECT deployment_id, MAX(id) AS id FROM deployment_samples GROUP BY deployment_id) last "
            "ON last.id = s.id"):
        dep = deployments.get(row.pop("deployment_id"))
        if dep is not None:
            dep["last_sample"] = row
    return list(deployments.values())


def recorded_gpu(db: Store, host_id: str | None, device_id: str) -> dict[str, Any] | None:
    """The devices row for `device_id` ('gpu:N') on a host: name, uuid, ... (None when not recorded)."""
    if not host_id:
        return None
    rows = list(db.query("SELECT * FROM devices WHERE id = ?", [f"{host_id}/{device_id}"]))
    return rows[0] if rows else None


def violation_counts(db: Store) -> list[dict[str, Any]]:
    """How many envelope violations each (policy, deployment) has recorded."""
    return list(db.query("SELECT policy, deployment, COUNT(*) AS n FROM violations "
                         "GROUP BY policy, deployment ORDER BY policy, deployment"))
