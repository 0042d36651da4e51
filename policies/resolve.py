"""Choosing a policy's configuration for one device kind and torch version.

The rules that turn runs into a decision (the objective, energy sources, limits, ranking, ties and the
tolerance, the infeasible pick, `verified`) are the judge's (`policies.judge`), which the guided search asks
too; the README's "How a decision is made" says the same for users. This module gathers what the judge
needs and what a decision shows besides:

* Candidates are every allowed configuration: search.modes x search.precisions x search.fusion x
  search.dynamic x search.padding x search.regional at the policy's batch size, and at each of
  `[search] batch_sizes` when the policy lists them (`policies.batches`; eager compiles nothing, so it
  ignores fusion, dynamic, padding and regional and appears once per precision and batch size). Padding
  is searched only when it changes something: a shape set whose sizes all sit on their buckets runs the
  same calls either way.
* A candidate's runs are those of the same workload (spec, its batch size and shape) on the same device
  kind under the same torch major.minor, ok or failed; its figures are the medians of the runs the judge
  counted (`Candidate.figures`).
* A candidate with no measurement may still be scored by the trade-off model's prediction. It can be
  *proposed* (to be measured next), never applied: when no measured configuration meets every limit but
  a predicted one looks feasible the state is `provisional` with the fallback applied; with nothing
  feasible at all it is `fallback`, the reason says why. So `provisional` names either configuration: the
  chosen measured one (not verified yet) or the fallback (nothing measured fits yet); the reason says which.
* A run that `bench` flagged "repeat this run" (`extra.window_warning`) counts only once its configuration
  has a clean run: until then such a candidate is `flagged`, never chosen, and the daemon repeats it (at
  most REPEAT_LIMIT flagged runs per configuration).
* For a policy with `[search] strategy = "exhaustive"` the decision lists what the daemon measures again
  (`Decision.confirm`, with `confirm_reason`): the judge's repeats (`policies.judge.repeats`), less those
  whose job failed as often as it may (`no_repeat`); when the chosen one is among those, the reason says
  so ("it is not measured again: cap of 5 runs reached"). A stored decision with contenders to confirm is
  stale for the daemon (`controller.planner.stale_reason`).
* No predictions for a device kind with no ok run at all (the trade-off model knows nothing of it).
  When nothing is measured for this device kind and torch version but the workload has runs on
  other pairs, the decision names them (`measured_elsewhere`).
* The break-even inference count against eager fp32 is compile_energy_j / (eager J/inference - candidate
  J/inference), eager's J scaled to the candidate's batch size when they differ; a candidate that saves
  nothing per call against eager never breaks even (`break_even_never`, with `break_even_inferences` None:
  no infinity is ever stored or written).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import math
import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from joulepilot.store import Store
from joulepilot.store.catalog import workload_row as stored_workload
from joulepilot.store.coverage import run_coverage
from joulepilot.store.decisions import APPLICABLE_STATES, DecisionRow, latest_decision
from joulepilot.store.jsonvalues import json_object, strict_json_text
from joulepilot.store.runs import RunRow, latest_per_config
from joulepilot.store.torchversion import torch_major_minor

from .batches import (
    batch_note,
    batch_workload_id,
    grid_batch_sizes,
    grid_runs,
    grid_workload_ids,
    workload_rows_by_batch,
)
from .judge import (
    Judgement,
    Rules,
    Run,
    Verdict,
    compile_energy,
    counted_rows,
    deferred,
    judge,
    objective_text,
    objective_unit,
    predicted_violations,
    repeats,
    score,
    tokens_note,
)
from .noise import Confirmation, median
from .schema import Policy
from .sources import UNCOMPARED, joined_sources, left_out_text, source_key

FIGURES = ("energy_j_per_inference", "energy_above_idle_j_per_inference", "latency_ms_p50", "latency_ms_p95",
           "throughput_per_s", "avg_power_w", "peak_power_w", "compile_s", "compile_energy_j", "max_rel_error",
           "energy_source", "window_s", "torch_version", "device", "compile_energy_gpu_j", "compile_energy_gpu_source",
           "compile_energy_cpu_j", "compile_energy_cpu_source", "energy_j_per_token", "ttft_ms_p50", "tpot_ms_p50",
           "tpot_ms_p95", "tokens_per_s", "tokens_match")
# Figures taken from the newest counted run rather than a median (the energy source names every counted
# run's meter instead: the median J/inference rests on all of them).
NEWEST_FIGURES = ("torch_version", "device", "compile_energy_gpu_source", "compile_energy_cpu_source")
# A configuration whose runs were flagged this many times is not repeated again (the host is noisy).
REPEAT_LIMIT = 2


def torch_minor(version: str | None = None) -> str:
    """'2.13' from '2.13.0+cpu'; the installed torch's when `version` is None (without importing torch)."""
    return torch_major_minor(importlib.metadata.version("torch") if version is None else version)


# A torch version as `torch.__version__` and pip spell it: major.minor, an optional patch, pre-release,
# post- and dev-release parts, and an optional local label (+cu130, +cpu, +git1a2b3c4).
_TORCH_VERSION = re.compile(r"\d{1,4}\.\d{1,4}(?:\.\d{1,6})?(?:(?:a|b|rc)\d{1,6}|\.post\d{1,6}|\.dev\d{1,14})*"
                            r"(?:\+[0-9A-Za-z]+(?:[._-][0-9A-Za-z]+)*)?")
TORCH_VERSION_FORMS = "a torch version such as 2.11, 2.11.0 or 2.11.0+cu130"


def given_torch_minor(text: str) -> str:
    """torch major.minor of a version a user typed ('2.11', '2.11.0+cu130'); ValueError, naming the forms
    accepted, for anything else (a decision stored under a version that cannot exist is never applied)."""
    if len(text) > 64 or not _TORCH_VERSION.fullmatch(text):
        raise ValueError(f"expected {TORCH_VERSION_FORMS}")
    return torch_minor(text)


@dataclass
class Candidate:
    config: dict[str, Any]  # configs row
    label: str
    source: str  # 'measured' | 'predicted' | 'none'
    status: str = "pending"  # chosen | kept | flagged | rejected | proposed | unverified | unknown | uncompared
    reasons: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)  # measured
    predicted: dict[str, list[float]] = field(default_factory=dict)  # target -> [mean, std]
    run_id: int | None = None
    score: float | None = None
    amortised_energy_j: float | None = None
    break_even_inferences: float | None = None
    break_even_never: bool = False  # it saves nothing per call against eager: it never breaks even
    flagged: str | None = None  # the run's "repeat this run" warning, when bench flagged it
    notes: list[str] = field(default_factory=list)  # marks that reject nothing (a recompile limit hit over a shape set)
    # Over the counted repeats (measured candidates): the median objective and its interval, the
    # interval's larger half-width in percent of the median, how the interval was made, and the runs.
    median: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    spread_pct: float | None = None
    interval: str | None = None
    repeats: int = 0
    run_ids: list[int] = field(default_factory=list)
    avg_power_w_high: float | None = None  # upper end of the average power's interval (the envelope's figure)

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
    break_even_never: bool = False  # the applied configuration saves nothing per call against eager
    eager_energy_j_per_inference: float | None = None
    eager_energy_j_per_token: float | None = None  # a generation's
    decided_at: float = field(default_factory=time.time)
    id: int | None = None
    repeat: list[str] = field(default_factory=list)  # config ids whose flagged runs should be measured again
    # The chosen configuration and every one whose objective interval overlaps the lowest median's (the
    # ties), config ids; and, for an exhaustive policy, those of them the daemon measures again (config_id,
    # label, `runs` still needed, `why`) with the reason it does (`confirm_reason`), see `_to_confirm`.
    contenders: list[str] = field(default_factory=list)
    confirm: list[dict[str, Any]] = field(default_factory=list)
    confirm_reason: str = ""
    # (device kind, torch) pairs with ok runs of this workload, when none is measured for this pair
    measured_elsewhere: list[dict[str, Any]] = field(default_factory=list)
    excluded_violated: list[str] = field(default_factory=list)  # config ids left out: they broke the envelope
    # The chosen configuration against the runner-up ("X beats Y by 21% +- 3% ..."), or, when `infeasible`,
    # the shortfall ("lowest measured average power 282 W ... exceeds 250 W by 13%").
    confidence: str = ""
    # The tuning bill (`policies.bill.tuning_bill`): what the search cost and when the saving pays it back;
    # None on a decision stored before it was recorded.
    bill: dict[str, Any] | None = None
    # The batch-size lever (`policies.batches`): the grid's batch sizes (the policy's own first), the workload
    # of each (their runs are what was searched), and the objective's unit ('J/sample' with several).
    batch_sizes: list[int] = field(default_factory=list)
    workload_ids: list[str] = field(default_factory=list)
    objective_unit: str = ""
    # The energy source of the runs the candidates were ranked on (`policies.sources`): candidates measured
    # only otherwise are listed as `uncompared`. None when nothing is measured (or stored before it was kept).
    ranked_source: str | None = None
    # A generation policy's (`task = "generate"`): its task, and the tokens compile energy is amortised over.
    task: str = "forward"
    expected_tokens: int | None = None

    @property
    def config_id(self) -> str:
        return self.config["id"]

    @property
    def label(self) -> str:
        return self.config.get("label", self.config_id)

    @property
    def generates(self) -> bool:
        return self.task == "generate"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        values = _with_break_even(data)
        fields = set(Candidate.__dataclass_fields__)
        values["candidates"] = [c if isinstance(c, Candidate) else
                                Candidate(**{k: v for k, v in _with_break_even(c).items() if k in fields})
                                for c in values.get("candidates", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


def _with_break_even(data: Mapping[str, Any]) -> dict[str, Any]:
    """A stored decision's or candidate's fields, with the break-even of one stored before
    `break_even_never` existed made explicit: its infinity (written as `Infinity`) means never."""
    values = dict(data)
    count = values.get("break_even_inferences")
    if isinstance(count, float) and not math.isfinite(count):
        values["break_even_inferences"] = None
        values["break_even_never"] = values.get("break_even_never") or count > 0
    return values


BREAK_EVEN_NEVER = "never: it saves no energy per call against eager fp32"


def break_even_text(break_even_inferences: float | None, never: bool, compiles: bool = True,
                    unit: str = "inferences") -> str | None:
    """How many calls (`unit` 'tokens': generated tokens, for a generation) pay a configuration's compile energy
    back against eager fp32, in words: '12,345 inferences', `BREAK_EVEN_NEVER`, 'none needed (eager compiles
    nothing)', or None when not known."""
    if not compiles:
        return "none needed (eager compiles nothing)"
    if never:
        return BREAK_EVEN_NEVER if unit == "inferences" else BREAK_EVEN_NEVER.replace("per call", "per token")
    if break_even_inferences is None or not math.isfinite(break_even_inferences):
        return None
    return f"{break_even_inferences:,.0f} {unit}"


def candidate_configs(policy: Policy) -> list[Any]:
    """Every allowed configuration, in a stable order, without duplicates; each at every batch size of the
    grid (`policies.batches.grid_batch_sizes`: the policy's own, and `[search] batch_sizes`)."""
    from joulepilot.compiler import CompileConfig
    from joulepilot.compiler.generation_workloads import generation_variants

    search = policy.search
    shapes = getattr(policy, "shapes", None)
    paddings = search.padding if shapes is not None and shapes.padding_changes_anything else ("none",)
    generates = getattr(policy, "generates", False)
    seen, configs = set(), []
    for mode, precision, fusion, dynamic, padding, regional, batch in itertools.product(
            search.modes, search.precisions, search.fusion, search.dynamic, paddings, search.regional_settings(),
            grid_batch_sizes(policy)):
        if mode == "eager":
            fusion, dynamic, padding, regional = "default", False, "none", ""
        cfg = CompileConfig(mode=mode, fusion=fusion, precision=precision, dynamic=dynamic, padding=padding,
                            batch_size=batch, regional=regional)
        for variant in generation_variants(cfg, search.caches, search.compile_prefill) if generates else [cfg]:
            if variant.id not in seen:
                seen.add(variant.id)
                configs.append(variant)
    return configs


def fallback_config(policy: Policy) -> Any:
    from joulepilot.compiler import CompileConfig
    from joulepilot.compiler.generation_workloads import generation_variants

    fb = policy.fallback
    config = CompileConfig(mode=fb.mode, fusion="default" if fb.mode == "eager" else fb.fusion,
                           precision=fb.precision, batch_size=policy.batch_size)
    # a generation's fallback has the cache its mode is planned with (a compiled one, the static cache)
    return generation_variants(config)[0] if getattr(policy, "generates", False) else config


def policy_workload_id(policy: Policy) -> str:
    """The policy's workload at its own batch size (a configuration at another batch size of the grid is
    measured under `policies.batches.config_workload_id`)."""
    return batch_workload_id(policy)


def run_flag(run: RunRow | Mapping[str, Any]) -> str | None:
    """The "repeat this run" warning bench stored on a run (`extra.window_warning`), or None. `run`: a
    RunRow, or a run dict as `list_runs` gives it."""
    extra = run.extra if isinstance(run, RunRow) else json_object(run.get("extra"))
    warning = extra.get("window_warning")
    return str(warning) if warning else None


def needs_repeat(flagged_runs: int) -> bool:
    """A configuration whose ok runs are all flagged is measured again, up to REPEAT_LIMIT flagged runs."""
    return 0 < flagged_runs < REPEAT_LIMIT


@dataclass
class _Scan:
    """What the runs of a policy's grid on one device kind and torch say, per configuration."""

    ok_by_config: dict[str, list[RunRow]]  # every ok run, newest first
    latest: dict[str, RunRow]  # the latest ok run, else the latest failed run
    flagged_counts: dict[str, int]  # how many ok runs were flagged "repeat this run"
    newest_failed: set[str]  # configurations whose newest run failed
    all_by_config: dict[str, list[RunRow]]  # every run, ok or failed, newest first (the repeat cap counts them all)


def _scan_runs(db: Store, policy: Policy, device_kind: str, torch_version: str) -> _Scan:
    """The runs of the policy's workload at each batch size of its grid, sorted per configuration."""
    runs = grid_runs(db, policy, device_kind, torch_version)  # newest first
    flagged: dict[str, int] = {}
    newest: dict[str, RunRow] = {}
    ok_by_config: dict[str, list[RunRow]] = {}
    all_by_config: dict[str, list[RunRow]] = {}
    for run in runs:
        newest.setdefault(run.config_id, run)
        all_by_config.setdefault(run.config_id, []).append(run)
        if run.ok:
            ok_by_config.setdefault(run.config_id, []).append(run)
            if run_flag(run):
                flagged[run.config_id] = flagged.get(run.config_id, 0) + 1
    newest_failed = {config_id for config_id, run in newest.items() if not run.ok}
    return _Scan(ok_by_config, latest_per_config(runs, failed_if_no_ok=True), flagged, newest_failed, all_by_config)


def _figures(runs: list[RunRow]) -> dict[str, Any]:
    """The figures of a configuration's counted runs: medians, the highest peak power, the energy sources
    of them all ('rapl+estimate'), and the newest run's torch version, device and the sources of its compile
    energy's parts."""
    out: dict[str, Any] = {}
    for key in FIGURES:
        values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
        if key == "energy_source":
            out[key] = joined_sources(values)
        elif key in NEWEST_FIGURES:
            out[key] = values[0] if values else None
        elif key == "peak_power_w":
            out[key] = max(values) if values else None
        elif key == "tokens_match":  # a generation's greedy tokens matched in every counted run
            out[key] = int(all(values)) if values else None
        else:
            out[key] = median(values) if values else None
    return out


def _set_break_even(cand: Candidate, compile_energy_j: float | None, energy_j: float | None,
                    eager_j: float | None, is_eager: bool) -> None:
    """The candidate's break-even against eager (see the module docstring): 0 for eager itself, None when
    a figure is missing, and `break_even_never` when it saves nothing per call."""
    cand.break_even_inferences, cand.break_even_never = None, False
    if is_eager:
        cand.break_even_inferences = 0.0
        return
    figures = (compile_energy_j, energy_j, eager_j)
    if any(v is None or not math.isfinite(v) for v in figures):
        return
    saving = eager_j - energy_j  # type: ignore[operator]
    if saving > 0:
        cand.break_even_inferences = compile_energy_j / saving  # type: ignore[operator]
    else:
        cand.break_even_never = True


def _key_figures(cand: Candidate | None) -> dict[str, Any]:
    if cand is None or cand.source != "measured":
        return {}
    keep = ("energy_j_per_inference", "latency_ms_p95", "avg_power_w", "peak_power_w", "compile_s",
            "compile_energy_j", "compile_energy_gpu_j", "compile_energy_gpu_source", "compile_energy_cpu_j",
            "compile_energy_cpu_source", "max_rel_error", "energy_source", "torch_version", "energy_j_per_token",
            "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p95", "tokens_per_s", "tokens_match")
    return ({k: cand.figures.get(k) for k in keep} | {"run_id": cand.run_id, "median": cand.median,
            "ci_low": cand.ci_low, "ci_high": cand.ci_high, "repeats": cand.repeats})


STATUS_OF_VERDICT = {"chosen": "chosen", "tied": "kept", "kept": "kept", "flagged": "flagged",
                     "rejected": "rejected", UNCOMPARED: UNCOMPARED}


def _measured_candidate(verdict: Verdict, rows: Mapping[int, RunRow], eager_j: float | None,
                        energy_figure: str = "energy_j_per_inference") -> Candidate:
    """A candidate from the judge's verdict on its runs: the figures of the runs it counted, its limits;
    `energy_figure`: what its break-even against eager (`eager_j`) compares (J per call, or per token)."""
    counted = [rows[r.run_id] for r in verdict.counted if r.run_id in rows]
    cand = Candidate(config=verdict.config, label=verdict.label, source="measured",
                     status=STATUS_OF_VERDICT.get(verdict.status, "rejected"), reasons=list(verdict.violations),
                     figures=_figures(counted), run_id=counted[0].id if counted else None,
                     run_ids=[r.id for r in counted if r.id is not None], repeats=len(counted),
                     amortised_energy_j=verdict.amortised_j)
    ci = verdict.objective
    if ci is not None:
        cand.score, cand.median, cand.ci_low, cand.ci_high = ci.median, ci.median, ci.low, ci.high
        cand.spread_pct, cand.interval = 100.0 * ci.half_width_rel, ci.method
    if verdict.avg_power_w is not None:
        cand.avg_power_w_high = verdict.avg_power_w.high
    if verdict.not_compared:
        cand.reasons.insert(0, verdict.not_compared)
    hit = next((r for r in counted if r.extra.get("recompile_limit_hit")), None)
    if hit is not None:
        cand.notes.append(f"run {hit.id}: {hit.extra.get('recompile_warning') or 'hit the recompile limit'}")
    if verdict.tokens_match is False:
        cand.notes.append(tokens_note(verdict))
    _set_break_even(cand, cand.figures.get("compile_energy_j"), cand.figures.get(energy_figure), eager_j,
                    verdict.mode == "eager")
    return cand


def _order(cand: Candidate) -> tuple:
    """The judge's order (`Verdict.sort_key`) for a candidate, measured or predicted."""
    return (cand.score if cand.score is not None else math.inf, cand.figures.get("compile_s") or 0.0, cand.label)


def resolve(policy: Policy, db: Store, device_name: str, model: Any = None, *,
            torch_version: str | None = None, exclude: Collection[str] = (),
            no_repeat: Mapping[str, str] | None = None, search_next: Sequence[str] | None = None) -> Decision:
    """The decision for `policy` on device kind `device_name` ('cpu' or the GPU's name) and torch
    major.minor `torch_version` (default: the installed torch). `model` is a fitted TradeoffModel or None.
    `exclude`: config ids that broke the power envelope in a live deployment; they are rejected.
    `no_repeat`: config id -> why it cannot be measured again (the daemon's job for it failed as often as
    it may); such a contender is left out of `confirm`.
    `search_next`: for a policy whose guided search planned on these runs, the config ids it measures next
    (none once it stopped): beside a configuration it may apply, the decision then proposes only what the
    search would measure, never an unmeasured candidate it skipped as unable to beat that one by more than the
    tolerance (without it, the unmeasured candidate predicted best is proposed when it is predicted better).
    This only computes; `policies.decide` is what records a decision and writes its lock file."""
    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    workload_id = policy_workload_id(policy)
    workload_row = stored_workload(db, workload_id)
    scan = _scan_runs(db, policy, device_name, torch_version)
    coverage = run_coverage(db, workload_id)
    fallback = fallback_config(policy)
    configs = candidate_configs(policy)
    rules = Rules.of(policy)
    ids = {c.id for c in configs}
    out = judge([c.to_row() for c in configs], {cid: [Run.from_row(r) for r in rows]
                                                 for cid, rows in scan.all_by_config.items() if cid in ids},
                rules, exclude=exclude)
    ranked = out.ranked_source
    rows = {r.id: r for runs in scan.all_by_config.values() for r in runs if r.id is not None}
    eager_id = fallback.replace(mode="eager", fusion="default", precision="fp32", dynamic=False).id

    figure = rules.energy_figure

    def eager_at(batch: int, source: str | None, figure: str = figure) -> float | None:
        """Eager fp32's median J per call at the policy's batch size over its counted runs of `source`, for as
        many samples as one call of `batch` (None when it has no such run); a generation's J per token, which
        no batch size scales."""
        same = [r for r in scan.ok_by_config.get(eager_id, []) if source_key(r.energy_source) == source]
        values = [getattr(r, figure) for r in counted_rows(same) if getattr(r, figure) is not None]
        scale = 1.0 if figure == "energy_j_per_token" else batch / policy.batch_size
        return median(values) * scale if values else None

    predictions: dict[str, dict[str, tuple[float, float]]] = {}
    unmeasured = [c for c in configs if not out.verdicts[c.id].measured and out.verdicts[c.id].source is None]
    workload_ids = list(grid_workload_ids(policy).values())
    device_known = any(device_name in run_coverage(db, wid).device_kinds for wid in workload_ids)
    rows_by_batch = workload_rows_by_batch(db, policy) if len(workload_ids) > 1 else \
        {policy.batch_size: workload_row}
    if model is not None and unmeasured and device_known:
        for batch, row in rows_by_batch.items():
            at_batch = [c for c in unmeasured if c.batch_size == batch]
            if row is None or not at_batch:
                continue
            for cfg, pred in zip(at_batch, model.predict_many(row, at_batch, device_name), strict=True):
                predictions[cfg.id] = pred

    candidates: list[Candidate] = []
    for cfg in configs:
        verdict = out.verdicts[cfg.id]
        run = scan.latest.get(cfg.id)
        if verdict.source is not None:
            cand = _measured_candidate(verdict, rows, eager_at(cfg.batch_size, verdict.source), figure)
            others = {source: n for source, n in _sources_of(scan.ok_by_config.get(cfg.id, [])).items()
                      if source != verdict.source}
            if others and verdict.compared:
                cand.notes.append(left_out_text(others, str(ranked)))
            if not verdict.clean:
                newest = rows[verdict.counted[0].run_id]  # type: ignore[index]
                cand.flagged = run_flag(newest)
                times = scan.flagged_counts.get(cfg.id, 1)
                cand.reasons.append(f"run {newest.id} was flagged by bench, \"repeat this run\" ({cand.flagged})"
                                    + ("" if needs_repeat(times) else
                                       f"; flagged in {times} runs, so it is not repeated again: look for "
                                       f"contention on the host and bench it by hand"))
        elif cfg.id in predictions:
            failed = [f"last benchmark failed: {run.reason or 'no reason recorded'}"] if run is not None else []
            cand = _predicted_candidate(cfg, predictions[cfg.id], rules, eager_at(cfg.batch_size, ranked),
                                        failed + verdict.violations)
        else:
            cand = Candidate(config=cfg.to_row(), label=cfg.label, source="none", status="unknown")
            if run is not None:
                cand.reasons.append(f"benchmark failed: {run.reason or 'no reason recorded'}")
                cand.status, cand.source, cand.run_id = "rejected", "measured", run.id
            else:
                why = ("no trade-off model" if model is None else "workload never described"
                       if rows_by_batch.get(cfg.batch_size) is None else f"no run at all on {device_name}")
                cand.reasons.append(f"not measured on {device_name} with torch {torch_version}, and no "
                                    f"prediction ({why})")
            if verdict.violations:
                cand.reasons.extend(verdict.violations)
                cand.status = "rejected"
        candidates.append(cand)

    by_id = {c.config_id: c for c in candidates}
    chosen = by_id[out.chosen.config_id] if out.chosen is not None else None
    feasible_chosen = chosen if out.state in ("verified", "provisional") else None
    waits = {c.config_id: deferred(c.config, out) for c in candidates if c.status == "unverified"}
    for cand in candidates:
        if waits.get(cand.config_id):
            cand.reasons.append(f"not proposed for measuring: {waits[cand.config_id]}")
    hopeful = sorted((c for c in candidates if c.status == "unverified" and c.score is not None
                      and math.isfinite(c.score) and not waits[c.config_id]), key=_order)
    proposed = hopeful[0] if hopeful and (feasible_chosen is None or _order(hopeful[0]) < _order(feasible_chosen)) \
        else None
    if search_next is not None and (feasible_chosen is not None or out.state == "infeasible"):
        proposed = next((c for c in hopeful if c.config_id in search_next), None)

    def to_measure(why: str) -> str:  # the clause naming `proposed`: the search's pick, or the model's
        assert proposed is not None
        return f"; the guided search measures {proposed.label} next" if search_next is not None else \
            f"; {proposed.label} {why}"
    # Flagged runs within every limit that would beat the chosen one: measure them again. A repeat that failed
    # is not tried again, nor one whose newest run was metered otherwise than the runs ranked.
    worth_repeating = [by_id[v.config_id] for v in out.flagged_better]
    repeat = [c for c in worth_repeating if needs_repeat(scan.flagged_counts.get(c.config_id, 1))
              and c.config_id not in scan.newest_failed
              and source_key(scan.ok_by_config[c.config_id][0].energy_source) == ranked]

    confirm: list[dict[str, Any]] = []
    confirm_reason = ""
    confidence = out.confidence
    elsewhere = [] if any(c.source == "measured" for c in candidates) else \
        [p for p in coverage.workload_pairs if (p["device_kind"], p["torch_version"]) != (device_name, torch_version)]
    if feasible_chosen is not None:
        state, applied, reason = out.state, feasible_chosen.config, out.reason
        if policy.search.strategy == "exhaustive":  # the guided search repeats its contenders itself
            confirm, not_again = _to_confirm(out, no_repeat)
            assert out.confirmation is not None
            confirm_reason = _confirm_reason(feasible_chosen, out.confirmation, confirm)
            if not out.confirmation.confirmed and feasible_chosen.config_id in not_again:
                reason += f"; it is not measured again: {not_again[feasible_chosen.config_id]}"
    elif out.state == "infeasible" and chosen is not None:
        state, applied, reason = "infeasible", chosen.config, out.reason
        if proposed is not None:
            reason += to_measure("is predicted to fit and should be measured")
    elif worth_repeating:
        state, applied = "provisional", fallback.to_row()
        reason = out.reason
    elif proposed is not None:
        state, applied = "provisional", fallback.to_row()
        reason = _joined(f"no measured configuration meets every limit; {proposed.label} is predicted to "
                         f"({objective_text(rules.objective, rules.per_sample, rules.generates)} "
                         f"{proposed.score:.4g}) but is "
                         f"unmeasured, so the fallback {fallback.label} is applied until it is benchmarked", out.reason)
    else:
        state, applied = "fallback", fallback.to_row()
        reason = _joined(f"no configuration is feasible, so the fallback {fallback.label} is applied: " +
                         _rejection_summary(candidates, device_name, torch_version, workload_row is None, policy),
                         out.reason)
    if elsewhere:
        reason += "; " + _elsewhere_text(policy, device_name, torch_version, elsewhere)
    if proposed is not None:
        proposed.status = "proposed"
        if feasible_chosen is not None:
            reason += to_measure("is predicted better and should be measured")
    if feasible_chosen is not None and worth_repeating:
        reason += (f"; {worth_repeating[0].label} measured better, but its run was flagged \"repeat this run\" "
                   f"so it cannot be verified" + (" until it is measured again" if repeat else ""))
    if batch_note(policy, applied):
        reason += "; " + batch_note(policy, applied)

    applied_cand = by_id.get(applied["id"])
    if applied_cand is None:  # a fallback outside the grid: its figures from its own runs
        fallback_runs = {applied["id"]: scan.all_by_config.get(applied["id"], [])}
        side = judge([applied], {cid: [Run.from_row(r) for r in rs] for cid, rs in fallback_runs.items()}, rules)
        verdict = side.verdicts[applied["id"]]
        if verdict.source is not None:
            applied_batch = int(applied.get("batch_size") or policy.batch_size)
            applied_cand = _measured_candidate(verdict, rows, eager_at(applied_batch, verdict.source), figure)
    return Decision(
        policy=policy.name, policy_hash=policy.hash, device_kind=device_name, torch_version=torch_version,
        workload=policy.workload, workload_id=workload_id, config=applied, state=state, reason=reason,
        objective=rules.objective, expected_inferences=policy.objective.expected_inferences,
        task=policy.task, expected_tokens=policy.objective.expected_tokens,
        proposed=proposed.config if proposed else None, candidates=candidates,
        measured=_key_figures(applied_cand),
        break_even_inferences=applied_cand.break_even_inferences if applied_cand else None,
        break_even_never=applied_cand.break_even_never if applied_cand else False,
        eager_energy_j_per_inference=eager_at(policy.batch_size, ranked, "energy_j_per_inference"),
        eager_energy_j_per_token=eager_at(policy.batch_size, ranked, "energy_j_per_token") if rules.generates else None,
        ranked_source=ranked,
        repeat=[c.config_id for c in repeat], contenders=[v.config_id for v in out.contenders], confirm=confirm,
        confirm_reason=confirm_reason, measured_elsewhere=elsewhere,
        excluded_violated=sorted(set(exclude)), confidence=confidence,
        batch_sizes=list(grid_batch_sizes(policy)), workload_ids=workload_ids,
        objective_unit=objective_unit(rules.objective, rules.per_sample, rules.generates),
    )


def _joined(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _sources_of(runs: list[RunRow]) -> dict[str, int]:
    out: dict[str, int] = {}
    for run in runs:
        out[source_key(run.energy_source)] = out.get(source_key(run.energy_source), 0) + 1
    return out


def _predicted_candidate(cfg: Any, pred: Mapping[str, tuple[float, float]], rules: Rules, eager_j: float | None,
                         reasons: list[str]) -> Candidate:
    """An unmeasured candidate scored by the trade-off model's prediction (never applied, only proposed);
    `reasons`: why it is rejected whatever the prediction says (its benchmark failed, it broke the envelope)."""
    cand = Candidate(config=cfg.to_row(), label=cfg.label, source="predicted", reasons=list(reasons))
    cand.predicted = {k: [m, s] for k, (m, s) in pred.items()}
    energy = pred.get(rules.energy_figure, (math.nan, 0))[0]
    compile_s = pred.get("compile_s", (0.0, 0))[0] if cfg.compiles else 0.0
    power = pred.get("avg_power_w", (0.0, 0))[0]
    latency = pred.get(rules.latency_figure, (None, 0))[0]
    # Compile energy (GPU + CPU) as the model predicts it; a model that could not learn it (no run metered
    # both parts) leaves it estimated as the judge estimates an unmetered compile.
    if not cfg.compiles:
        compile_j = 0.0
    elif "compile_energy_j" in pred:
        compile_j = pred["compile_energy_j"][0]
    else:
        compile_j = compile_energy(Run(ok=True, compile_s=compile_s, avg_power_w=power))[0]
    cand.amortised_energy_j = energy + compile_j / rules.expected_inferences
    cand.score = score(rules.objective, cand.amortised_energy_j / (cfg.batch_size if rules.per_sample else 1),
                       latency)
    _set_break_even(cand, compile_j, energy, eager_j, not cfg.compiles)
    broken, notes = predicted_violations(pred, rules)
    cand.reasons.extend(broken)
    if cand.reasons:
        cand.status = "rejected"
    else:
        cand.status = "unverified"
        cand.reasons.append("not measured: prediction only" + ("; " + "; ".join(notes) if notes else ""))
    return cand


def _to_confirm(out: Judgement, no_repeat: Mapping[str, str] | None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(what the daemon measures again for an exhaustive policy, the judge's repeats less the flagged runs
    (`Decision.repeat` has those) and those whose job failed as often as it may: each one's config id,
    label, the runs it still needs and why; config id -> why a contender that is not confirmed is not
    measured again)."""
    wanted: list[dict[str, Any]] = []
    not_again: dict[str, str] = {}
    asked = {w.config_id: w for w in repeats(out)}
    for verdict in out.contenders:
        if verdict.config_id not in asked and verdict is out.chosen and out.confirmation \
                and not out.confirmation.confirmed:
            not_again[verdict.config_id] = f"cap of {out.rules.max_repeats} runs reached"
    for item in asked.values():
        if item.verdict.status == "flagged":
            continue
        if no_repeat and item.config_id in no_repeat:
            not_again[item.config_id] = no_repeat[item.config_id]
            continue
        wanted.append({"config_id": item.config_id, "label": item.verdict.label, "runs": item.advice.more,
                       "why": item.advice.why})
    return wanted, not_again


def _confirm_reason(chosen: Candidate, status: Confirmation, confirm: list[dict[str, Any]]) -> str:
    """Why a decision's contenders are measured again, as the daemon says it ('' when none is): 'its choice
    rests on 1 of the 3 runs a verified decision needs'."""
    if not confirm:
        return ""
    if status.runs < status.min_repeats:
        return f"its choice rests on {status.runs} of the {status.min_repeats} runs a verified decision needs"
    if status.fresh < status.fresh_needed:
        return (f"its choice rests on {status.fresh} of the {status.fresh_needed} worker processes a verified "
                f"decision needs")
    if any(item["config_id"] == chosen.config_id for item in confirm):
        return "its choice is a close call that more runs may still decide otherwise"
    return "configurations that may rival its choice rest on too few runs to tell"


def _elsewhere_text(policy: Policy, device: str, torch_version: str, elsewhere: list[dict[str, Any]]) -> str:
    pairs = ", ".join(f"{p['device_kind']} / torch {p['torch_version']} ({p['runs']} ok runs)" for p in elsewhere)
    return (f"nothing of {policy.workload} (batch {policy.batch_size}) is measured on {device} with torch "
            f"{torch_version}, but it is on: {pairs}")


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
        "details": strict_json_text(_decision_details(decision) | more_details, sort_keys=True, default=str),
    }


def decision_from_record(row: DecisionRow) -> Decision:
    """The Decision a stored decisions row holds."""
    data = dict(row.details)
    data.update({k: getattr(row, k) for k in ("policy", "policy_hash", "device_kind", "torch_version", "state",
                                              "reason", "decided_at")})
    data["id"] = row.id
    return Decision.from_dict(data)


def record_decision(db: Store, decision: Decision, *, provenance_key: str | None = None,
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


def stored_decision(db: Store, policy: str, device_kind: str,
                    torch_version: str) -> Decision | None:
    """The newest stored decision that names a configuration (a `violated` row does not)."""
    row = latest_decision(db, policy, device_kind, torch_version, states=APPLICABLE_STATES)
    return decision_from_record(row) if row else None
