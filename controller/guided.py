"""The daemon's guided search, one measurement at a time, resumed from the store.

`plan_guided` rebuilds the search (`controller.search`) from the runs already stored for a policy's
workload on one device kind and asks it what to measure next: the state of a search is the runs in the
store, never memory, so a daemon killed at any point continues where it stopped. The daemon measures
what it is given (every job runs in a fresh worker process), stores the run, and asks again, until the
plan has nothing left to measure; then it decides, keeping `GuidedPlan.summary()` in the decision.

Which runs count: those of the policy's workload (at each batch size of its grid, `policies.batches`: with
`[search] batch_sizes` the grid spans several, and the engine ranks by J per sample) on this device kind
under this torch major.minor
(under this host's provenance and within the decision age limit, when given), every one of them, ok
or failed, repeats included. The budget (`[search] budget_s`, `max_measurements`) counts the runs the
daemon made for this policy (`extra.policy`); runs made otherwise (`joulepilot bench`) count as
measurements but cost the policy nothing.

On a host with several GPUs a guided policy still has one measurement in flight (the daemon queues its next
one only when it has no open job), while other policies' jobs run beside it: each pick rests on every result
before it, so two picks made without each other's result could be the same configuration, or spend what the
stop rule would have saved after the first; the search therefore measures and decides as on one GPU.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from joulepilot.compiler.window_gate import Gate
from joulepilot.policies.batches import grid_workload_ids, workload_rows_by_batch
from joulepilot.policies.judge import Rules, Run
from joulepilot.policies.schema import Policy
from joulepilot.store import Store
from joulepilot.store.runs import RunRow, workload_runs

from .planner import ordered_candidates
from .search import GuidedSearch, SearchSettings, SkippedConfig

IN_PROGRESS = "the search is still under way"


@dataclass
class NextMeasurement:
    """One configuration the search wants measured now, and why."""

    config: Any  # CompileConfig
    kind: str  # baseline | guided | repeat
    fresh_process: bool
    why: str
    runs: int  # runs of it the search already counts
    windows: int = 1  # energy windows to take in the one worker process, each stored as a run

    def to_dict(self) -> dict[str, Any]:
        return {"config_id": self.config.id, "label": self.config.label, "kind": self.kind,
                "fresh_process": self.fresh_process, "why": self.why, "runs": self.runs, "windows": self.windows}


@dataclass
class GuidedPlan:
    """Where a policy's guided search stands: what to measure next (empty once it stops), what it
    skipped and why, and what it measured."""

    policy: str
    workload_id: str
    device_kind: str
    next: list[NextMeasurement] = field(default_factory=list)
    skipped: list[SkippedConfig] = field(default_factory=list)
    measured: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str | None = None  # None while there is something to measure
    spent_s: float = 0.0
    measurements: int = 0
    budget_s: float | None = None
    max_measurements: int | None = None
    excluded_violated: list[str] = field(default_factory=list)  # labels
    objective_unit: str = ""
    # The judge's decision on the runs so far (verified | provisional | infeasible | fallback) and the
    # configuration it chose (None for none), which the resolver reaches on the same runs.
    state: str | None = None
    chosen: str | None = None

    @property
    def done(self) -> bool:
        return not self.next

    def summary(self) -> dict[str, Any]:
        """What a decision keeps of the search (`details.search`), and `policy explain --json` shows."""
        return {"strategy": "guided", "stop_reason": self.stop_reason, "measured": self.measured,
                "skipped": [s.to_dict() for s in self.skipped], "next": [n.to_dict() for n in self.next],
                "spent_s": round(self.spent_s, 1), "measurements": self.measurements, "budget_s": self.budget_s,
                "max_measurements": self.max_measurements, "excluded_violated": self.excluded_violated,
                "objective_unit": self.objective_unit}


def search_settings(policy: Policy) -> SearchSettings:
    """The engine's settings from the policy's `[search]` (what the judge reads is `Rules.of(policy)`)."""
    return SearchSettings(strategy="guided", budget_s=policy.search.budget_s,
                          max_measurements=policy.search.max_measurements, baseline_batch_size=policy.batch_size)


def counted_runs(db: Store, workload_id: str | Collection[str], device_kind: str,
                 torch_version: str, *, provenance_key: str | None = None,
                 min_finished_at: float | None = None) -> list[RunRow]:
    """The runs a search rests on, oldest first (see the module docstring); `workload_id`: one, or the
    workloads of every batch size of the grid."""
    ids = [workload_id] if isinstance(workload_id, str) else list(workload_id)
    runs = sorted((run for wid in ids for run in workload_runs(db, wid, device_kind, torch_version)),
                  key=lambda r: -int(r.id or 0))
    kept = [r for r in runs
            if (provenance_key is None or r.provenance_key == provenance_key)
            and (min_finished_at is None or float(r.finished_at or r.started_at) >= min_finished_at)]
    return kept[::-1]


def _stored_runs(db: Store, policy: Policy, grid: Sequence[Any], device_kind: str, torch_version: str, *,
                 provenance_key: str | None, min_finished_at: float | None) -> tuple[dict[str, list[Run]], float, int]:
    """The runs of `grid` a search rests on, by config id, and the seconds and measurements its policy spent."""
    runs = counted_runs(db, list(grid_workload_ids(policy).values()), device_kind, torch_version,
                        provenance_key=provenance_key, min_finished_at=min_finished_at)
    ids = {c.id for c in grid}
    prior: dict[str, list[Run]] = {}
    spent_s, made = 0.0, 0
    for run in runs:
        if run.config_id not in ids:
            continue
        # A further window of a worker process is not a fresh process (`extra.window_in_process`), as the
        # resolver counts it: both ask the judge, so both reach the same state on the same runs.
        observation = Run.from_row(run)
        prior.setdefault(run.config_id, []).append(observation)
        if run.extra.get("policy") == policy.name:
            spent_s += observation.wall_s
            made += 1
    return prior, spent_s, made


def window_gate(db: Store, policy: Policy, device_kind: str, config_id: str, *, torch_version: str | None = None,
                provenance_key: str | None = None, max_age_s: float | None = None,
                violated: Collection[str] = (), now: float | None = None) -> Gate:
    """The gate a guided policy's worker asks before each further window of `config_id` (`compiler.window_gate`):
    whether the judge, given the stored runs (read here, once) and the windows measured so far, still asks to
    measure it again (`GuidedSearch.wants_more`, as the replayed search decides). It reads no store."""
    from joulepilot.policies.resolve import torch_minor

    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    now = time.time() if now is None else now
    grid = ordered_candidates(policy)
    prior, _, _ = _stored_runs(db, policy, grid, device_kind, torch_version, provenance_key=provenance_key,
                               min_finished_at=None if max_age_s is None else now - max_age_s)
    search = GuidedSearch(grid, _never_measure, None, rules=Rules.of(policy), settings=search_settings(policy),
                          prior=prior, exclude=set(violated))

    def gate(rows: Sequence[Mapping[str, Any]]) -> bool:
        return search.wants_more(config_id, [Run.from_row(row) for row in rows])

    return gate


def _never_measure(config: Mapping[str, Any], fresh_process: bool) -> Run:
    raise RuntimeError("plan_guided only plans; the daemon measures")


def plan_guided(db: Store, policy: Policy, device_kind: str, model: Any = None, *,
                torch_version: str | None = None, provenance_key: str | None = None,
                max_age_s: float | None = None, violated: Collection[str] = (),
                blocked: Mapping[str, str] | None = None, now: float | None = None) -> GuidedPlan:
    """The next measurement of `policy`'s guided search on `device_kind`, from the stored runs.

    `model`: a fitted TradeoffModel (fitted once per pass) or None; `violated`: config ids a deployment
    found over the envelope (never measured again, never chosen); `blocked`: config id -> why it cannot be
    measured (its job failed as often as it may without storing a run: `controller.planner.repeat_blocked`);
    `provenance_key` / `max_age_s`: count only runs under this provenance and this recent (the daemon's
    freshness rule)."""
    from joulepilot.policies.resolve import policy_workload_id, torch_minor

    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    now = time.time() if now is None else now
    workload_id = policy_workload_id(policy)
    violated = set(violated)
    grid = ordered_candidates(policy)
    plan = GuidedPlan(policy=policy.name, workload_id=workload_id, device_kind=device_kind,
                      budget_s=policy.search.budget_s, max_measurements=policy.search.max_measurements,
                      excluded_violated=[c.label for c in grid if c.id in violated])
    if all(c.id in violated for c in grid):
        plan.stop_reason = "every allowed configuration broke the power envelope in a deployment"
        return plan
    prior, spent_s, made = _stored_runs(db, policy, grid, device_kind, torch_version, provenance_key=provenance_key,
                                        min_finished_at=None if max_age_s is None else now - max_age_s)
    predict = None
    workloads = workload_rows_by_batch(db, policy)  # the model predicts each batch size with its own row
    if model is not None and all(row is not None for row in workloads.values()):
        def predict(rows: Any) -> Any:
            out: list[Any] = [None] * len(rows)
            for batch, workload in workloads.items():
                at = [i for i, row in enumerate(rows) if int(row.get("batch_size") or policy.batch_size) == batch]
                if at:
                    for i, pred in zip(at, model.predict_many(workload, [rows[i] for i in at], device_kind),
                                       strict=True):
                        out[i] = pred
            return [pred if pred is not None else {} for pred in out]

    search = GuidedSearch(grid, _never_measure, predict, rules=Rules.of(policy), settings=search_settings(policy),
                          prior=prior, spent_s=spent_s, measurements=made, exclude=violated, blocked=blocked)
    step, stop = search.advance()
    result = search.result(stop or IN_PROGRESS)
    by_id = {c.id: c for c in grid}
    if step is not None:
        plan.next.append(NextMeasurement(by_id[step.arm.id], step.kind, step.fresh_process, step.why,
                                         len(step.arm.runs), step.windows))
        plan.skipped = [s for s in result.skipped if s.config_id in search.skip_reasons]
    else:
        plan.stop_reason = stop
        plan.skipped = result.skipped
    plan.measured = [{"config_id": m.config_id, "label": m.label, "runs": len(m.runs),
                      "ok_runs": sum(1 for r in m.runs if r.ok), "status": m.status,
                      "objective": m.objective.median if m.objective else None,
                      "energy_source": m.source} for m in result.measured]
    plan.spent_s, plan.measurements, plan.objective_unit = spent_s, made, result.objective_unit
    plan.state = result.state
    plan.chosen = result.chosen_config_id
    return plan
