"""Choosing a policy's configuration for one device kind and torch version.

Rules (the README's "How a decision is made" says the same for users):

* Candidates are every allowed configuration: search.modes x search.precisions x search.fusion x
  search.dynamic at the policy's batch size (eager ignores fusion, so it appears once per precision).
* A candidate's figures come from its latest ok run of the same workload (spec, batch and shape) on
  the same device kind under the same torch major.minor. Limits are checked against these
  measurements only. A measured figure that a limit needs but the run lacks rejects the candidate:
  a hard limit is never granted on a guess.
* A candidate with no measurement may still be scored by the trade-off model's prediction. It can be
  *proposed* (to be measured next), never applied:
    - best measured feasible candidate exists  -> state `verified`, that config applied; a predicted
      candidate that looks better is named in `proposed`;
    - none, but a predicted candidate looks feasible -> state `provisional`: the fallback is applied
      and the predicted candidate is `proposed`, until a measurement confirms or refutes it;
    - nothing feasible at all -> state `fallback`, the fallback applied, the reason says why.
* A run that `bench` flagged "repeat this run" (`extra.window_warning`: its energy window ran much
  slower than its latency pass) never makes a decision `verified`: such a candidate is `flagged`, and
  the daemon repeats it (at most REPEAT_LIMIT flagged runs per configuration). Until a clean run
  exists the decision is verified on another candidate, or `provisional` with the fallback applied.
* No predictions for a device kind with no ok run at all (the trade-off model knows nothing of it).
  When nothing is measured for this device kind and torch version but the workload has runs on
  other pairs, the decision names them (`measured_elsewhere`).
* Energy objective: joules per forward call plus compile energy amortised over expected_inferences
  (compile_energy_j / expected_inferences). `latency`: p95 latency. `edp`: amortised energy x p95.
  Ties go to the cheaper compile. The break-even inference count against eager fp32 is
  compile_energy_j / (eager J/inference - candidate J/inference).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlite_utils
from joulepilot.store.catalog import workload_row as stored_workload
from joulepilot.store.coverage import run_coverage
from joulepilot.store.decisions import APPLICABLE_STATES, DecisionRow, latest_decision
from joulepilot.store.jsonvalues import json_object
from joulepilot.store.runs import RunRow, latest_per_config, workload_runs
from joulepilot.store.torchversion import torch_major_minor

from .schema import Policy

LIMIT_FIGURES = {
    "max_avg_power_w": ("avg_power_w", "W"),
    "max_peak_power_w": ("peak_power_w", "W"),
    "max_p95_latency_ms": ("latency_ms_p95", "ms"),
    "max_compile_s": ("compile_s", "s"),
    "max_rel_error": ("max_rel_error", ""),
}
# Limits a prediction can speak to (the trade-off model has no accuracy or peak-power target).
PREDICTED_LIMITS = {"max_avg_power_w": "avg_power_w", "max_p95_latency_ms": "latency_ms_p95",
                    "max_compile_s": "compile_s"}
FIGURES = ("energy_j_per_inference", "energy_above_idle_j_per_inference", "latency_ms_p50", "latency_ms_p95",
           "throughput_per_s", "avg_power_w", "peak_power_w", "compile_s", "compile_energy_j", "max_rel_error",
           "energy_source", "window_s", "torch_version")
STATES = ("verified", "provisional", "fallback")
# A configuration whose runs were flagged this many times is not repeated again (the host is noisy).
REPEAT_LIMIT = 2


def torch_minor(version: str | None = None) -> str:
    """'2.13' from '2.13.0+cpu'; the installed torch's when `version` is None (without importing torch)."""
    return torch_major_minor(importlib.metadata.version("torch") if version is None else version)


@dataclass
class Candidate:
    config: dict[str, Any]  # configs row
    label: str
    source: str  # 'measured' | 'predicted' | 'none'
    status: str = "pending"  # chosen | kept | flagged | rejected | proposed | unverified | unknown
    reasons: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)  # measured
    predicted: dict[str, list[float]] = field(default_factory=dict)  # target -> [mean, std]
    run_id: int | None = None
    score: float | None = None
    amortised_energy_j: float | None = None
    break_even_inferences: float | None = None
    flagged: str | None = None  # the run's "repeat this run" warning, when bench flagged it

    @property
    def config_id(self) -> str:
        return self.config["id"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Decision:
    policy: str
    policy_hash: str
    device_kind: str
    torch_version: str
    workload: str
    workload_id: str
    config: dict[str, Any]  # the configuration to apply (configs row)
    state: str
    reason: str
    objective: str
    expected_inferences: int
    proposed: dict[str, Any] | None = None  # prediction-only config worth measuring next
    candidates: list[Candidate] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)  # key figures of the applied config, if measured
    break_even_inferences: float | None = None
    eager_energy_j_per_inference: float | None = None
    decided_at: float = field(default_factory=time.time)
    id: int | None = None
    repeat: list[str] = field(default_factory=list)  # config ids whose flagged runs should be measured again
    # (device kind, torch) pairs with ok runs of this workload, when none is measured for this pair
    measured_elsewhere: list[dict[str, Any]] = field(default_factory=list)
    excluded_violated: list[str] = field(default_factory=list)  # config ids left out: they broke the envelope

    @property
    def config_id(self) -> str:
        return self.config["id"]

    @property
    def label(self) -> str:
        return self.config.get("label", self.config_id)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        values = dict(data)
        values["candidates"] = [c if isinstance(c, Candidate) else Candidate(**c)
                                for c in values.get("candidates", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


def candidate_configs(policy: Policy) -> list[Any]:
    """Every allowed configuration, in a stable order, without duplicates."""
    from joulepilot.compiler import CompileConfig

    seen, configs = set(), []
    for mode in policy.search.modes:
        for precision in policy.search.precisions:
            for fusion in policy.search.fusion:
                for dynamic in policy.search.dynamic:
                    fusion_used = "default" if mode == "eager" else fusion
                    cfg = CompileConfig(mode=mode, fusion=fusion_used, precision=precision, dynamic=dynamic,
                                        batch_size=policy.batch_size)
                    if cfg.id not in seen:
                        seen.add(cfg.id)
                        configs.append(cfg)
    return configs


def fallback_config(policy: Policy) -> Any:
    from joulepilot.compiler import CompileConfig

    fb = policy.fallback
    return CompileConfig(mode=fb.mode, fusion="default" if fb.mode == "eager" else fb.fusion,
                         precision=fb.precision, batch_size=policy.batch_size)


def policy_workload_id(policy: Policy) -> str:
    from joulepilot.compiler import workload_id

    return workload_id(policy.workload, policy.batch_size, policy.seq_len, policy.image_size)


def run_flag(run: RunRow | Mapping[str, Any]) -> str | None:
    """The "repeat this run" warning bench stored on a run (`extra.window_warning`), or None. `run`: a
    RunRow, or a run dict as `list_runs` gives it."""
    extra = run.extra if isinstance(run, RunRow) else json_object(run.get("extra"))
    warning = extra.get("window_warning")
    return str(warning) if warning else None


def needs_repeat(flagged_runs: int) -> bool:
    """A configuration whose newest ok run is flagged is measured again, up to REPEAT_LIMIT flagged runs."""
    return 0 < flagged_runs < REPEAT_LIMIT


def _scan_runs(db: sqlite_utils.Database, workload_id: str, device_kind: str, torch_version: str
               ) -> tuple[dict[str, RunRow], dict[str, int], set[str]]:
    """(config_id -> latest ok run, else latest failed run; config_id -> how many ok runs were flagged;
    configurations whose newest run failed)."""
    runs = workload_runs(db, workload_id, device_kind, torch_version)  # newest first
    flagged: dict[str, int] = {}
    newest: dict[str, RunRow] = {}
    for run in runs:
        newest.setdefault(run.config_id, run)
        if run.ok and run_flag(run):
            flagged[run.config_id] = flagged.get(run.config_id, 0) + 1
    newest_failed = {config_id for config_id, run in newest.items() if not run.ok}
    return latest_per_config(runs, failed_if_no_ok=True), flagged, newest_failed


def _figures(run: RunRow) -> dict[str, Any]:
    return {k: getattr(run, k) for k in FIGURES}


def _fmt(value: float, unit: str) -> str:
    return f"{value:.4g}{(' ' + unit) if unit else ''}"


def _score(objective: str, energy_j: float, latency_ms: float | None) -> float | None:
    if objective == "energy":
        return energy_j
    if latency_ms is None:
        return None
    return latency_ms if objective == "latency" else energy_j * latency_ms


def _check_measured(cand: Candidate, policy: Policy) -> None:
    for limit, value in policy.limits.items():
        figure, unit = LIMIT_FIGURES[limit]
        measured = cand.figures.get(figure)
        if measured is None:
            cand.reasons.append(f"{limit}: {figure} was not measured, so the limit {_fmt(value, unit)} "
                                f"cannot be verified")
        elif measured > value:
            cand.reasons.append(f"{limit}: measured {figure} {_fmt(measured, unit)} > limit {_fmt(value, unit)}")


def _check_predicted(cand: Candidate, policy: Policy) -> list[str]:
    """Reasons a prediction says the candidate breaks a limit; unverifiable limits are noted, not failed."""
    notes = []
    for limit, value in policy.limits.items():
        figure = PREDICTED_LIMITS.get(limit)
        unit = LIMIT_FIGURES[limit][1]
        if figure is None or figure not in cand.predicted:
            notes.append(f"{limit} cannot be predicted; needs a measurement")
            continue
        mean, std = cand.predicted[figure]
        if mean > value:
            cand.reasons.append(f"{limit}: predicted {figure} {_fmt(mean, unit)} ± {_fmt(std, unit)} "
                                f"> limit {_fmt(value, unit)}")
    return notes


def _amortise(cand: Candidate, policy: Policy, energy_j: float, compile_energy_j: float | None,
              latency_ms: float | None) -> None:
    amortised = energy_j + (compile_energy_j or 0.0) / policy.objective.expected_inferences
    cand.amortised_energy_j = amortised
    cand.score = _score(policy.objective.minimize, amortised, latency_ms)


def _break_even(compile_energy_j: float | None, energy_j: float, eager_j: float | None,
                is_eager: bool) -> float | None:
    if is_eager or eager_j is None or compile_energy_j is None:
        return 0.0 if is_eager else None
    saving = eager_j - energy_j
    return compile_energy_j / saving if saving > 0 else math.inf


def _key_figures(cand: Candidate | None) -> dict[str, Any]:
    if cand is None or cand.source != "measured":
        return {}
    keep = ("energy_j_per_inference", "latency_ms_p95", "avg_power_w", "peak_power_w", "compile_s",
            "compile_energy_j", "max_rel_error", "energy_source", "torch_version")
    return {k: cand.figures.get(k) for k in keep} | {"run_id": cand.run_id}


def resolve(policy: Policy, db: sqlite_utils.Database, device_name: str, model: Any = None, *,
            torch_version: str | None = None, exclude: Collection[str] = ()) -> Decision:
    """The decision for `policy` on device kind `device_name` ('cpu' or the GPU's name) and torch
    major.minor `torch_version` (default: the installed torch). `model` is a fitted TradeoffModel or None.
    `exclude`: config ids that broke the power envelope in a live deployment; they are rejected.
    This only computes; `policies.decide` is what records a decision and writes its lock file."""
    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    workload_id = policy_workload_id(policy)
    workload_row = stored_workload(db, workload_id)
    runs, flagged_counts, newest_failed = _scan_runs(db, workload_id, device_name, torch_version)
    coverage = run_coverage(db, workload_id)
    fallback = fallback_config(policy)

    eager_run = runs.get(fallback.replace(mode="eager", fusion="default", precision="fp32", dynamic=False).id)
    eager_j = eager_run.energy_j_per_inference if eager_run and eager_run.ok else None

    configs = candidate_configs(policy)
    unmeasured = [c for c in configs if c.id not in runs or not runs[c.id].ok]
    predictions: dict[str, dict[str, tuple[float, float]]] = {}
    device_known = device_name in coverage.device_kinds
    if model is not None and workload_row is not None and unmeasured and device_known:
        for cfg, pred in zip(unmeasured, model.predict_many(workload_row, unmeasured, device_name), strict=True):
            predictions[cfg.id] = pred

    candidates: list[Candidate] = []
    for cfg in configs:
        run = runs.get(cfg.id)
        cand = Candidate(config=cfg.to_row(), label=cfg.label, source="none")
        candidates.append(cand)
        if run is not None and run.ok:
            cand.source, cand.run_id = "measured", run.id
            cand.figures = _figures(run)
            _check_measured(cand, policy)
            _amortise(cand, policy, run.energy_j_per_inference, run.compile_energy_j, run.latency_ms_p95)
            cand.break_even_inferences = _break_even(run.compile_energy_j, run.energy_j_per_inference,
                                                     eager_j, not cfg.compiles)
            cand.status = "rejected" if cand.reasons else "kept"
            cand.flagged = run_flag(run)
            if cand.flagged:
                times = flagged_counts.get(cfg.id, 1)
                cand.reasons.append(f"run {run.id} was flagged by bench, \"repeat this run\" ({cand.flagged})"
                                    + ("" if needs_repeat(times) else
                                       f"; flagged in {times} runs, so it is not repeated again: look for "
                                       f"contention on the host and bench it by hand"))
                if cand.status == "kept":
                    cand.status = "flagged"
        elif cfg.id in predictions:
            pred = predictions[cfg.id]
            cand.source = "predicted"
            cand.predicted = {k: [m, s] for k, (m, s) in pred.items()}
            if run is not None:
                cand.reasons.append(f"last benchmark failed: {run.reason or 'no reason recorded'}")
            notes = _check_predicted(cand, policy)
            energy = pred.get("energy_j_per_inference", (math.nan, 0))[0]
            compile_s = pred.get("compile_s", (0.0, 0))[0] if cfg.compiles else 0.0
            power = pred.get("avg_power_w", (0.0, 0))[0]
            latency = pred.get("latency_ms_p95", (None, 0))[0]
            # Compile energy is not a target of its own: predicted compile seconds at predicted power.
            _amortise(cand, policy, energy, compile_s * power, latency)
            cand.break_even_inferences = _break_even(compile_s * power, energy, eager_j, not cfg.compiles)
            if cand.reasons:
                cand.status = "rejected"
            else:
                cand.status = "unverified"
                cand.reasons.append("not measured: prediction only" + ("; " + "; ".join(notes) if notes else ""))
        else:
            cand.status = "unknown"
            if run is not None:
                cand.reasons.append(f"benchmark failed: {run.reason or 'no reason recorded'}")
                cand.status, cand.source, cand.run_id = "rejected", "measured", run.id
            else:
                why = ("no trade-off model" if model is None else "workload never described"
                       if workload_row is None else f"no run at all on {device_name}")
                cand.reasons.append(f"not measured on {device_name} with torch {torch_version}, and no "
                                    f"prediction ({why})")
        if cfg.id in exclude:
            cand.reasons.append("broke the power envelope in a live deployment (envelope guard)")
            cand.status = "rejected"

    def order(c: Candidate) -> tuple:
        return (c.score if c.score is not None else math.inf, c.figures.get("compile_s") or 0.0, c.label)

    feasible = sorted((c for c in candidates if c.status == "kept"), key=order)
    hopeful = sorted((c for c in candidates if c.status == "unverified" and c.score is not None
                      and math.isfinite(c.score)), key=order)
    chosen = feasible[0] if feasible else None
    proposed = hopeful[0] if hopeful and (chosen is None or order(hopeful[0]) < order(chosen)) else None
    # Flagged runs within every limit that would beat the chosen one: measure them again.
    worth_repeating = sorted((c for c in candidates if c.status == "flagged"
                              and (chosen is None or order(c) < order(chosen))), key=order)
    # A repeat that failed is not tried again: the flagged run stays what is known of it.
    repeat = [c for c in worth_repeating if needs_repeat(flagged_counts.get(c.config_id, 1))
              and c.config_id not in newest_failed]

    objective = policy.objective.minimize
    measured_any = any(c.source == "measured" for c in candidates)
    elsewhere = [] if measured_any else [p for p in coverage.workload_pairs
                                         if (p["device_kind"], p["torch_version"]) != (device_name, torch_version)]
    if chosen is not None:
        chosen.status = "chosen"
        state, applied = "verified", chosen.config
        reason = (f"{chosen.label} is the measured configuration with the lowest {_objective_text(objective)} "
                  f"({chosen.score:.4g}) within every limit; {len(feasible)} of {len(candidates)} candidates "
                  f"measured within limits")
    elif worth_repeating or proposed is not None:
        state, applied = "provisional", fallback.to_row()
        if worth_repeating:
            labels = ", ".join(c.label for c in worth_repeating)
            reason = (f"the only measured configurations within every limit ({labels}) rest on runs flagged "
                      f"\"repeat this run\", so the fallback {fallback.label} is applied until a clean run "
                      f"confirms them")
        else:
            assert proposed is not None
            reason = (f"no measured configuration meets every limit; {proposed.label} is predicted to "
                      f"({_objective_text(objective)} {proposed.score:.4g}) but is unmeasured, so the fallback "
                      f"{fallback.label} is applied until it is benchmarked")
    else:
        state, applied = "fallback", fallback.to_row()
        reason = f"no configuration is feasible, so the fallback {fallback.label} is applied: " + \
            _rejection_summary(candidates, device_name, torch_version, workload_row is None, policy)
    if elsewhere:
        reason += "; " + _elsewhere_text(policy, device_name, torch_version, elsewhere)
    if proposed is not None:
        proposed.status = "proposed"
        if chosen is not None:
            reason += f"; {proposed.label} is predicted better and should be measured"
    if chosen is not None and worth_repeating:
        reason += (f"; {worth_repeating[0].label} measured better, but its run was flagged \"repeat this run\" "
                   f"so it cannot be verified" + (" until it is measured again" if repeat else ""))

    applied_cand = next((c for c in candidates if c.config_id == applied["id"]), None)
    applied_run = runs.get(applied["id"])
    if applied_cand is None and applied_run is not None and applied_run.ok:
        applied_cand = Candidate(config=applied, label=applied["label"], source="measured",
                                 figures=_figures(applied_run), run_id=applied_run.id)
    return Decision(
        policy=policy.name, policy_hash=policy.hash, device_kind=device_name, torch_version=torch_version,
        workload=policy.workload, workload_id=workload_id, config=applied, state=state, reason=reason,
        objective=objective, expected_inferences=policy.objective.expected_inferences,
        proposed=proposed.config if proposed else None, candidates=candidates,
        measured=_key_figures(applied_cand),
        break_even_inferences=applied_cand.break_even_inferences if applied_cand else None,
        eager_energy_j_per_inference=eager_j,
        repeat=[c.config_id for c in repeat], measured_elsewhere=elsewhere,
        excluded_violated=sorted(set(exclude)),
    )


def _elsewhere_text(policy: Policy, device: str, torch_version: str, elsewhere: list[dict[str, Any]]) -> str:
    pairs = ", ".join(f"{p['device_kind']} / torch {p['torch_version']} ({p['runs']} ok runs)" for p in elsewhere)
    return (f"nothing of {policy.workload} (batch {policy.batch_size}) is measured on {device} with torch "
            f"{torch_version}, but it is on: {pairs}")


def _objective_text(objective: str) -> str:
    return {"energy": "amortised J/inference", "latency": "p95 latency (ms)",
            "edp": "energy-delay product (J x ms)"}[objective]


def _rejection_summary(candidates: list[Candidate], device: str, torch_version: str, no_workload: bool,
                       policy: Policy) -> str:
    if no_workload and all(c.source == "none" for c in candidates):
        return (f"workload {policy.workload} (batch {policy.batch_size}) has never been benchmarked in this "
                f"store; run `joulepilot bench {policy.workload} --batch-size {policy.batch_size}`")
    counts: dict[str, int] = {}
    for c in candidates:
        for r in c.reasons:
            key = r.split(":")[0] if c.status == "rejected" else ("unmeasured" if c.source == "none" else r.split(":")[0])
            counts[key] = counts.get(key, 0) + 1
    parts = [f"{n} x {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return f"{len(candidates)} candidates on {device} / torch {torch_version}: " + ", ".join(parts)


def _decision_details(decision: Decision) -> dict[str, Any]:
    """What a decisions row keeps in `details`: everything but the row's own columns."""
    details = decision.to_dict()
    for key in ("policy", "policy_hash", "device_kind", "torch_version", "state", "reason", "decided_at", "id"):
        details.pop(key, None)
    return details


def decision_record(decision: Decision, **more_details: Any) -> dict[str, Any]:
    """The decisions-table row for a Decision (details carry everything else, and `more_details`, as JSON)."""
    return {
        "policy": decision.policy, "policy_hash": decision.policy_hash, "device_kind": decision.device_kind,
        "torch_version": decision.torch_version, "config_id": decision.config_id, "state": decision.state,
        "reason": decision.reason, "decided_at": decision.decided_at,
        "details": json.dumps(_decision_details(decision) | more_details, sort_keys=True, default=str,
                              allow_nan=True),
    }


def decision_from_record(row: DecisionRow) -> Decision:
    """The Decision a stored decisions row holds."""
    data = dict(row.details)
    data.update({k: getattr(row, k) for k in ("policy", "policy_hash", "device_kind", "torch_version", "state",
                                              "reason", "decided_at")})
    data["id"] = row.id
    return Decision.from_dict(data)


def record_decision(db: sqlite_utils.Database, decision: Decision, *, provenance_key: str | None = None,
                    decided_by: str | None = None, reason: str = "") -> int:
    """Store the decision (and its configuration row) and return its id. `provenance_key`, `decided_by`
    and `reason` (why it was re-decided) go into its details."""
    from joulepilot.store import transaction, upsert_config
    from joulepilot.store.decisions import write_decision

    record = decision_record(decision, provenance_key=provenance_key, decided_by=decided_by, stale_reason=reason)
    with transaction(db):
        upsert_config(db, decision.config)
        decision.id = write_decision(db, record)
    return decision.id


def stored_decision(db: sqlite_utils.Database, policy: str, device_kind: str,
                    torch_version: str) -> Decision | None:
    """The newest stored decision that names a configuration (a `violated` row does not)."""
    row = latest_decision(db, policy, device_kind, torch_version, states=APPLICABLE_STATES)
    return decision_from_record(row) if row else None
