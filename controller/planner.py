"""Which policies need a new decision, and which configurations must be measured for them.

A decision is stale when there is none for this device kind, the policy file changed, the software
under it changed (torch / triton / driver / joulepilot: the runs' provenance key), the deployment
guard marked it violated, a hook asked for it, it is older than the configured age, a run it could
rest on was flagged "repeat this run", or (an exhaustive policy's) contenders are still to be measured
again (`Decision.confirm`). Planning lists the policy's allowed configurations cheapest compile first,
and leaves out those measured ok under the same provenance within the age limit (a flagged run does not
count until it was repeated) and those a deployment found over the envelope.

Once an exhaustive policy's sweep is done, `plan_repeats` names the contenders to measure again: the
chosen configuration and those that tie with it, each until it is confirmed (`policies.resolve`'s
`confirm`), one job each, a fresh worker process that takes the windows it still needs. A contender
whose job failed `max_attempts` times is not queued again (`repeat_blocked`), so a repeat that keeps
failing ends with the decision `provisional`, saying why, rather than in a loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from joulepilot.policies.noise import mode_rank
from joulepilot.store import Store
from joulepilot.store.daemon_state import failed_out_jobs
from joulepilot.store.decisions import DecisionRow
from joulepilot.store.runs import recent_ok_runs

# Cheapest compile first: a sweep that is paused or cut short has measured the cheap options. Modes go in
# order of simplicity (`policies.noise.MODE_SIMPLICITY`), which is that of their compile cost too.
PRECISION_ORDER = ("fp32", "tf32", "bf16", "fp16")


def compile_cost_rank(config: Any) -> tuple:
    """Sort key, cheapest compile first: mode, fusion preset, precision, then static before dynamic,
    unpadded before padded, and a regional variant right after its whole-model configuration (the comparison
    it exists for); configuration objects or rows."""
    def knob(name: str, default: Any = None) -> Any:
        if isinstance(config, Mapping):
            return config.get(name, default)
        return getattr(config, name, default)

    mode, precision, fusion = knob("mode"), knob("precision"), knob("fusion")
    prec_rank = PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else len(PRECISION_ORDER)
    return (mode_rank(mode), fusion != "default", fusion, prec_rank, bool(knob("dynamic", False)),
            (knob("padding", "none") or "none") != "none", bool(knob("regional", "")))


def ordered_candidates(policy: Any) -> list[Any]:
    """The policy's allowed configurations (CompileConfig), cheapest compile first; with `[search]
    batch_sizes`, each at every batch size of the grid (the policy's own first among equals)."""
    from joulepilot.policies.resolve import candidate_configs

    return sorted(candidate_configs(policy), key=compile_cost_rank)


def stale_reason(
    decision: DecisionRow | None, *, policy_hash: str, provenance_key: str, max_age_s: float,
    now: float | None = None,
) -> str | None:
    """Why the decision (the newest of any state: a `violated` one makes the policy stale) must be remade,
    or None when it is current."""
    now = time.time() if now is None else now
    if decision is None:
        return "no decision yet"
    if decision.state == "violated":
        return "a deployment broke the envelope with the decided configuration"
    if decision.policy_hash != policy_hash:
        return "the policy file changed"
    recorded = decision.details.get("provenance_key")
    if recorded != provenance_key:
        return "torch, triton or joulepilot changed since the decision" if recorded else \
            "the decision was not made under this host's current provenance"
    if now - float(decision.decided_at) > max_age_s:
        return f"the decision is older than {max_age_s / 86400:g} days"
    if decision.details.get("repeat"):
        return "runs it could rest on were flagged \"repeat this run\""
    if decision.details.get("confirm"):
        return str(decision.details.get("confirm_reason") or "its contenders are still to be measured again")
    return None


def fresh_ok_config_ids(db: Store, workload_id: str | Iterable[str], provenance_key: str,
                        min_finished_at: float) -> set[str]:
    """Configurations with an ok run of this workload (or of these, one per batch size of a grid) under this
    provenance, recent enough to trust.

    Its runs count as the judge counts them (`policies.noise.counted`: flagged "repeat this run" ones once a clean
    one exists); a configuration none of whose runs count is not fresh (it is measured again) until REPEAT_LIMIT
    of its runs were flagged."""
    from joulepilot.policies.judge import Run
    from joulepilot.policies.noise import counted
    from joulepilot.policies.resolve import needs_repeat

    ids = [workload_id] if isinstance(workload_id, str) else list(workload_id)
    by_config: dict[str, list[Run]] = {}
    for row in (row for wid in ids for row in recent_ok_runs(db, wid, provenance_key, min_finished_at)):
        by_config.setdefault(row.config_id, []).append(Run.from_row(row))
    return {config_id for config_id, runs in by_config.items() if counted(runs) or not needs_repeat(len(runs))}


def measured_config(row: Mapping[str, Any], policy: Any) -> Any:
    """The CompileConfig a daemon job measures for `policy`: the stored configuration as it is, at its own
    batch size (a configuration of the batch-size lever is at another batch size than the policy's on
    purpose); only a row that names no batch size takes the policy's."""
    from joulepilot.compiler import CompileConfig

    if not row.get("batch_size") and getattr(policy, "batch_size", None):
        row = {**row, "batch_size": policy.batch_size}
    return CompileConfig.from_row(row)


@dataclass
class Plan:
    policy: str
    workload_id: str
    reason: str
    to_measure: list[Any] = field(default_factory=list)  # CompileConfig, cheapest first
    already_measured: list[str] = field(default_factory=list)  # labels
    excluded_violated: list[str] = field(default_factory=list)  # labels

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "workload_id": self.workload_id, "reason": self.reason,
                "to_measure": [c.label for c in self.to_measure], "already_measured": self.already_measured,
                "excluded_violated": self.excluded_violated}


def plan_policy(
    db: Store, policy: Any, *, reason: str, provenance_key: str, max_age_s: float,
    violated: Iterable[str] = (), now: float | None = None,
) -> Plan:
    from joulepilot.policies.batches import grid_workload_ids
    from joulepilot.policies.resolve import policy_workload_id

    now = time.time() if now is None else now
    workload_id = policy_workload_id(policy)
    fresh = fresh_ok_config_ids(db, grid_workload_ids(policy).values(), provenance_key, now - max_age_s)
    violated = set(violated)
    plan = Plan(policy=policy.name, workload_id=workload_id, reason=reason)
    for cfg in ordered_candidates(policy):
        if cfg.id in violated:
            plan.excluded_violated.append(cfg.label)
        elif cfg.id in fresh:
            plan.already_measured.append(cfg.label)
        else:
            plan.to_measure.append(cfg)
    return plan


@dataclass
class Repeat:
    """A contender to measure again: one job, in a worker process of its own that takes `windows` energy
    windows (the runs it still needs; each is stored as a run)."""

    config: Any  # CompileConfig
    windows: int
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.label, "config_id": self.config.id, "windows": self.windows, "why": self.why}


@dataclass
class RepeatPlan:
    policy: str
    reason: str  # why the contenders are measured again ('' when none is)
    repeats: list[Repeat] = field(default_factory=list)


def repeat_blocked(db: Store, policy: Any, provenance_key: str, max_attempts: int) -> dict[str, str]:
    """config_id -> why it is not measured again: its job (of any batch size of the grid, under this
    provenance) failed `max_attempts` times, so the queue takes it no more."""
    from joulepilot.policies.batches import grid_workload_ids

    failed = failed_out_jobs(db, grid_workload_ids(policy).values(), provenance_key, max_attempts)
    return {config_id: f"its job failed {attempts} times" for config_id, attempts in failed.items()}


def plan_repeats(db: Store, policy: Any, device_kind: str, *, provenance_key: str,
                 max_attempts: int, violated: Iterable[str] = ()) -> RepeatPlan:
    """The contenders of an exhaustive policy to measure again, as the decision made now would list them
    (`Decision.confirm`; the trade-off model plays no part in which measured configuration is chosen)."""
    from joulepilot.policies.resolve import resolve

    decision = resolve(policy, db, device_kind, None, exclude=set(violated),
                       no_repeat=repeat_blocked(db, policy, provenance_key, max_attempts))
    by_id = {c.config_id: c for c in decision.candidates}
    plan = RepeatPlan(policy=policy.name, reason=decision.confirm_reason)
    for item in decision.confirm:
        plan.repeats.append(Repeat(measured_config(by_id[item["config_id"]].config, policy), int(item["runs"]),
                                   str(item["why"])))
    return plan
