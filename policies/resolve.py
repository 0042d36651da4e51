"""Choosing a policy's configuration for one device kind and torch version.

Rules (the README's "How a decision is made" says the same for users):

* Candidates are every allowed configuration: search.modes x search.precisions x search.fusion x
  search.dynamic x search.padding x search.regional at the policy's batch size, and at each of
  `[search] batch_sizes` when the policy lists them (`policies.batches`; eager compiles nothing, so it
  ignores fusion, dynamic, padding and regional and appears once per precision and batch size). Padding
  is searched only when it changes something: a shape set whose sizes all sit on their buckets runs the
  same calls either way.
* A candidate's figures come from its ok runs of the same workload (spec, its batch size and shape) on
  the same device kind under the same torch major.minor. Limits are checked against these
  measurements only. A measured figure that a limit needs but the run lacks rejects the candidate:
  a hard limit is never granted on a guess.
* Candidates are compared only on runs of one energy source (`policies.sources`): the most trustworthy
  source (nvml/rapl, then partly estimated, then estimate) with a candidate counted within every limit, else
  one with a candidate only the power limits reject, else the most trustworthy present
  (`Decision.ranked_source`). A configuration is judged on its runs of that source alone (its other runs are
  named in its notes and not counted: no median, interval, envelope check or break-even mixes meters);
  one with no run of it is listed as `uncompared`, its reason saying so, on its own source's figures. A
  decision that ranks estimates says so in its reason.
* A candidate with no measurement may still be scored by the trade-off model's prediction. It can be
  *proposed* (to be measured next), never applied:
    - best measured feasible candidate exists -> that config is applied; a predicted candidate that
      looks better is named in `proposed`. The state is `verified` when its runs confirm it
      (`policies.noise.confirmation`, the rule the guided search applies too: at least the policy's
      `[search] min_repeats` counted runs, default MIN_REPEATS = 3, at least two of them in a fresh
      worker process), else `provisional`, and the reason says how many of the runs it needs it has
      ("it has 1 of the 3 runs a verified decision needs");
    - none, but a predicted candidate looks feasible -> state `provisional`: the fallback is applied
      and the predicted candidate is `proposed`, until a measurement confirms or refutes it;
    - nothing feasible at all -> state `fallback`, the fallback applied, the reason says why.
  So `provisional` names either configuration: the chosen measured one (too few runs yet) or the
  fallback (nothing measured fits yet); the reason says which.
* Contenders (`Decision.contenders`): the lowest median within every limit and every candidate whose
  interval overlaps it, the chosen one among them. For a policy with `[search] strategy = "exhaustive"`
  the decision also lists those the daemon measures again (`Decision.confirm`, with `confirm_reason`),
  by the guided search's rule (`policies.noise.repeat_advice`): each until it is confirmed, a close call
  (the tie-break chose another than the lowest median) a little more, at most MAX_REPEATS runs of one
  configuration (failed and flagged runs included); nothing with `min_repeats = 1`. One that reached that cap, or whose repeat the daemon
  could not run again (`no_repeat`: its job failed as often as it may), is not listed, and when it is the
  chosen one the reason says so ("it is not measured again: cap of 5 runs reached"). A stored decision
  with contenders to confirm is stale for the daemon (`controller.planner.stale_reason`).
* A run that `bench` flagged "repeat this run" (`extra.window_warning`: its energy window ran much
  slower than its latency pass) counts only once its configuration has a clean run: until then such a
  candidate is `flagged`, never chosen, and the daemon repeats it (at most REPEAT_LIMIT flagged runs per
  configuration). Meanwhile the decision rests on another candidate, or is `provisional` with the
  fallback applied.
* No predictions for a device kind with no ok run at all (the trade-off model knows nothing of it).
  When nothing is measured for this device kind and torch version but the workload has runs on
  other pairs, the decision names them (`measured_elsewhere`).
* Energy objective: joules per forward call plus compile energy amortised over expected_inferences
  (compile_energy_j / expected_inferences); with several batch sizes in the grid that amortised figure is
  divided by the candidate's batch size (J per sample, as the guided search ranks them). `latency`: p95
  latency, per call. `edp`: amortised energy x p95. Limits are per call whatever the batch size.
  Ties go to the cheaper compile. The break-even inference count against eager fp32 is
  compile_energy_j / (eager J/inference - candidate J/inference), eager's J scaled to the candidate's
  batch size when they differ; a candidate that saves nothing per call against eager never breaks even
  (`break_even_never`, with `break_even_inferences` None: no infinity is ever stored or written).
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

import sqlite_utils
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
    per_sample,
    workload_rows_by_batch,
)
from .bill import joined_sources
from .noise import (
    TIE,
    Confirmation,
    Interval,
    RunMark,
    TieEntry,
    assumed_spread_rel,
    break_tie,
    compare,
    confirmation,
    counted,
    fresh_process_of,
    median,
    median_interval,
    repeat_advice,
    typical_rel_std,
)
from .schema import Policy
from .sources import (
    UNCOMPARED,
    estimate_note,
    group_by_source,
    left_out_text,
    not_compared_text,
    own_sources,
    pick_source,
    ranked_sources,
    source_key,
    uncompared_summary,
)

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
           "energy_source", "window_s", "torch_version", "device", "compile_energy_gpu_j", "compile_energy_gpu_source",
           "compile_energy_cpu_j", "compile_energy_cpu_source")
# Figures taken from the newest counted run rather than a median (the energy source names every counted
# run's meter instead: the median J/inference rests on all of them).
NEWEST_FIGURES = ("torch_version", "device", "compile_energy_gpu_source", "compile_energy_cpu_source")
STATES = ("verified", "provisional", "infeasible", "fallback")
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


def break_even_text(break_even_inferences: float | None, never: bool, compiles: bool = True) -> str | None:
    """How many calls pay a configuration's compile energy back against eager fp32, in words: '12,345
    inferences', `BREAK_EVEN_NEVER`, 'none needed (eager compiles nothing)', or None when not known."""
    if not compiles:
        return "none needed (eager compiles nothing)"
    if never:
        return BREAK_EVEN_NEVER
    if break_even_inferences is None or not math.isfinite(break_even_inferences):
        return None
    return f"{break_even_inferences:,.0f} inferences"


def candidate_configs(policy: Policy) -> list[Any]:
    """Every allowed configuration, in a stable order, without duplicates; each at every batch size of the
    grid (`policies.batches.grid_batch_sizes`: the policy's own, and `[search] batch_sizes`)."""
    from joulepilot.compiler import CompileConfig

    search = policy.search
    shapes = getattr(policy, "shapes", None)
    paddings = search.padding if shapes is not None and shapes.padding_changes_anything else ("none",)
    seen, configs = set(), []
    for mode, precision, fusion, dynamic, padding, regional, batch in itertools.product(
            search.modes, search.precisions, search.fusion, search.dynamic, paddings, search.regional_settings(),
            grid_batch_sizes(policy)):
        if mode == "eager":
            fusion, dynamic, padding, regional = "default", False, "none", ""
        cfg = CompileConfig(mode=mode, fusion=fusion, precision=precision, dynamic=dynamic, padding=padding,
                            batch_size=batch, regional=regional)
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
    """A configuration whose newest ok run is flagged is measured again, up to REPEAT_LIMIT flagged runs."""
    return 0 < flagged_runs < REPEAT_LIMIT


@dataclass
class _Scan:
    """What the runs of a policy's grid on one device kind and torch say, per configuration."""

    ok_by_config: dict[str, list[RunRow]]  # every ok run, newest first
    latest: dict[str, RunRow]  # the latest ok run, else the latest failed run
    flagged_counts: dict[str, int]  # how many ok runs were flagged "repeat this run"
    newest_failed: set[str]  # configurations whose newest run failed
    all_by_config: dict[str, list[RunRow]]  # every run, ok or failed, newest first (the repeat cap counts them all)


def _scan_runs(db: sqlite_utils.Database, policy: Policy, device_kind: str, torch_version: str) -> _Scan:
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


@dataclass
class _Repeats:
    """What a configuration's ok runs say together: the runs that count (every ok run, flagged ones
    included, once a clean one exists; all of them, flagged, while none is clean), their medians and
    intervals."""

    runs: list[RunRow]  # newest first
    clean: bool  # False: every run is flagged, so none counts yet
    objective: list[float]  # per run: the objective (amortised J, ms or J x ms)
    amortised_j: list[float]
    power_w: list[float]
    objective_ci: Interval | None = None
    power_ci: Interval | None = None
    compile_ci: Interval | None = None


def _repeats(policy: Policy, ok_runs: list[RunRow], samples_per_call: int = 1) -> _Repeats:
    """`samples_per_call`: what the objective's energy is divided by (the batch size when the objective is
    per sample, else 1); `amortised_j` stays per call."""
    runs, clean = counted_runs(ok_runs)
    objective, amortised = [], []
    for run in runs:
        if run.energy_j_per_inference is None:
            continue
        energy = run.energy_j_per_inference + (run.compile_energy_j or 0.0) / policy.objective.expected_inferences
        score = _score(policy.objective.minimize, energy / samples_per_call, run.latency_ms_p95)
        amortised.append(energy)
        if score is not None:
            objective.append(score)
    power = [r.avg_power_w for r in runs if r.avg_power_w is not None]
    return _Repeats(runs, clean, objective, amortised, power)


def run_mark(run: RunRow) -> RunMark:
    """What the repeat rules need of a stored run: ok, flagged "repeat this run", started its process."""
    return RunMark(ok=run.ok, flagged=run_flag(run) is not None, fresh_process=fresh_process_of(run.extra))


def counted_runs(ok_runs: Sequence[RunRow]) -> tuple[list[RunRow], bool]:
    """(the runs of one configuration that count, whether any is clean): every ok run once a clean one
    exists (`noise.counted`), else all of them, every one flagged "repeat this run"."""
    kept = counted([run_mark(run) for run in ok_runs])
    return ([ok_runs[i] for i in kept], True) if kept else ([r for r in ok_runs if r.ok], False)


def repeat_intervals(values_per_config: Mapping[str, Sequence[float]]) -> dict[str, Interval]:
    """config_id -> the median of its values and an interval for it, each configuration's spread moderated
    by the typical spread of the others with repeats (`policies.noise`); configurations with no value
    are left out."""
    typical = typical_rel_std(list(values_per_config.values()))
    spread = assumed_spread_rel(typical)
    return {cid: median_interval(values, spread_rel=spread, prior_rel_std=typical)
            for cid, values in values_per_config.items() if values}


def _intervals(all_repeats: Mapping[str, _Repeats]) -> None:
    """Each configuration's intervals (objective and average power); flagged-only ones do not shape the
    typical spread."""
    for figure, target in (("objective", "objective_ci"), ("power_w", "power_ci")):
        typical = typical_rel_std([getattr(r, figure) for r in all_repeats.values() if r.clean])
        spread = assumed_spread_rel(typical)
        for rep in all_repeats.values():
            values = getattr(rep, figure)
            if values:
                setattr(rep, target, median_interval(values, spread_rel=spread, prior_rel_std=typical))
    for rep in all_repeats.values():
        compiles = [r.compile_s for r in rep.runs if r.compile_s is not None]
        if compiles:
            rep.compile_ci = median_interval(compiles)


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
        else:
            out[key] = median(values) if values else None
    return out


def _fmt(value: float, unit: str) -> str:
    return f"{value:.4g}{(' ' + unit) if unit else ''}"


def _score(objective: str, energy_j: float, latency_ms: float | None) -> float | None:
    if objective == "energy":
        return energy_j
    if latency_ms is None:
        return None
    return latency_ms if objective == "latency" else energy_j * latency_ms


def _limit_text(policy: Policy, limit: str, value: float) -> str:
    bound, unit = policy.limits.bound(limit, value), LIMIT_FIGURES[limit][1]
    if bound == value:
        return _fmt(value, unit)
    return f"{_fmt(bound, unit)} ({_fmt(value, unit)} less the {policy.limits.margin_pct:g}% margin)"


def _check_measured(cand: Candidate, policy: Policy, rep: _Repeats) -> None:
    """Average power on the upper end of its median's interval, peak power on the highest peak seen, the
    others on their median over the counted runs; each limit less the policy's margin."""
    n = len(rep.runs)
    runs_text = f"{n} run{'s' if n != 1 else ''}"
    for limit, value in policy.limits.items():
        figure, unit = LIMIT_FIGURES[limit]
        bound = policy.limits.bound(limit, value)
        if limit == "max_avg_power_w":
            measured = rep.power_ci.high if rep.power_ci else None
            what = (f"{figure} upper bound (median {_fmt(rep.power_ci.median, unit)}, {runs_text})"
                    if rep.power_ci else figure)
        elif limit == "max_peak_power_w":
            measured = cand.figures.get(figure)
            what = f"{figure} highest of {runs_text}"
        else:
            measured = cand.figures.get(figure)
            what = f"{figure} median of {runs_text}"
        if measured is None:
            cand.reasons.append(f"{limit}: {figure} was not measured, so the limit {_limit_text(policy, limit, value)}"
                                f" cannot be verified")
        elif measured > bound:
            cand.reasons.append(f"{limit}: measured {what} {_fmt(measured, unit)} > limit "
                                f"{_limit_text(policy, limit, value)}")


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
        if mean > policy.limits.bound(limit, value):
            cand.reasons.append(f"{limit}: predicted {figure} {_fmt(mean, unit)} ± {_fmt(std, unit)} "
                                f"> limit {_limit_text(policy, limit, value)}")
    return notes


def _amortise(cand: Candidate, policy: Policy, energy_j: float, compile_energy_j: float | None,
              latency_ms: float | None, samples_per_call: int = 1) -> None:
    amortised = energy_j + (compile_energy_j or 0.0) / policy.objective.expected_inferences
    cand.amortised_energy_j = amortised
    cand.score = _score(policy.objective.minimize, amortised / samples_per_call, latency_ms)


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
    saving = eager_j - energy_j
    if saving > 0:
        cand.break_even_inferences = compile_energy_j / saving
    else:
        cand.break_even_never = True


def _key_figures(cand: Candidate | None) -> dict[str, Any]:
    if cand is None or cand.source != "measured":
        return {}
    keep = ("energy_j_per_inference", "latency_ms_p95", "avg_power_w", "peak_power_w", "compile_s",
            "compile_energy_j", "compile_energy_gpu_j", "compile_energy_gpu_source", "compile_energy_cpu_j",
            "compile_energy_cpu_source", "max_rel_error", "energy_source", "torch_version")
    return ({k: cand.figures.get(k) for k in keep} | {"run_id": cand.run_id, "median": cand.median,
            "ci_low": cand.ci_low, "ci_high": cand.ci_high, "repeats": cand.repeats})


def _set_measured(cand: Candidate, policy: Policy, rep: _Repeats, eager_j: float | None, compiles: bool) -> None:
    cand.source, cand.run_id = "measured", rep.runs[0].id
    cand.run_ids = [r.id for r in rep.runs]
    cand.repeats = len(rep.runs)
    cand.figures = _figures(rep.runs)
    ci = rep.objective_ci
    if ci is not None:
        cand.score, cand.median, cand.ci_low, cand.ci_high = ci.median, ci.median, ci.low, ci.high
        cand.spread_pct = 100.0 * ci.half_width_rel
        cand.interval = ci.method
    cand.amortised_energy_j = median(rep.amortised_j) if rep.amortised_j else None
    if rep.power_ci is not None:
        cand.avg_power_w_high = rep.power_ci.high
    _check_measured(cand, policy, rep)
    _set_break_even(cand, cand.figures.get("compile_energy_j"), cand.figures.get("energy_j_per_inference"), eager_j,
                    not compiles)


def _tie_entry(cand: Candidate, rep: _Repeats) -> TieEntry:
    assert rep.objective_ci is not None
    return TieEntry(cand.config_id, rep.objective_ci, rep.power_ci, rep.compile_ci, cand.config.get("mode", ""))


def _tie_text(criterion: str, chosen: Candidate, other: Candidate) -> str:
    if criterion == "lower average power":
        return (f"{criterion} ({_fmt(chosen.figures.get('avg_power_w') or 0.0, 'W')} vs "
                f"{_fmt(other.figures.get('avg_power_w') or 0.0, 'W')})")
    if criterion == "cheaper compile":
        return (f"{criterion} ({_fmt(chosen.figures.get('compile_s') or 0.0, 's')} vs "
                f"{_fmt(other.figures.get('compile_s') or 0.0, 's')})")
    if criterion == "simpler mode":
        return f"{criterion} ({chosen.config.get('mode')} vs {other.config.get('mode')})"
    return "lower median (average power, compile and mode within the noise)"


def _rank(feasible: list[Candidate], repeats: Mapping[str, _Repeats]
          ) -> tuple[Candidate, str, str, list[Candidate]]:
    """(the chosen candidate, the tie-break criterion or '' when it is the lowest median outright, the
    confidence sentence comparing it with the runner-up, the contenders: the lowest median and every
    candidate whose interval overlaps it, the chosen one among them). `feasible` is sorted by median
    objective."""
    best = feasible[0]
    best_ci = repeats[best.config_id].objective_ci
    ties = [c for c in feasible if c is best or repeats[c.config_id].objective_ci.overlaps(best_ci)]
    criterion = ""
    chosen = best
    if len(ties) > 1:
        winner, criterion = break_tie([_tie_entry(c, repeats[c.config_id]) for c in ties])
        chosen = next(c for c in ties if c.config_id == winner.key)
    rivals = [c for c in feasible if c is not chosen]
    if not rivals:
        return chosen, criterion, f"{chosen.label} is the only measured configuration within every limit", ties
    rival = rivals[0]
    chosen_ci, rival_ci = repeats[chosen.config_id].objective_ci, repeats[rival.config_id].objective_ci
    comparison = compare(chosen_ci, rival_ci)
    if comparison.verdict == TIE:
        _, pair_criterion = break_tie([_tie_entry(chosen, repeats[chosen.config_id]),
                                       _tie_entry(rival, repeats[rival.config_id])])
        text = (f"{chosen.label} ties {rival.label} within noise ({comparison.diff_rel:.0%} +- "
                f"{comparison.plus_minus_rel:.0%}); chosen for {_tie_text(pair_criterion, chosen, rival)}")
    else:
        text = comparison.text(chosen.label, rival.label)
    return chosen, criterion, f"{text} (median of {chosen_ci.n} vs {rival_ci.n} runs)", ties


def _to_confirm(policy: Policy, ties: Sequence[Candidate], chosen: Candidate, best: Candidate,
                all_by_config: Mapping[str, Sequence[RunRow]], no_repeat: Mapping[str, str] | None,
                source: str | None = None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """(the contenders to measure again, the chosen one first, then lowest median first: each one's config
    id, label, the runs it still needs and why; config id -> why a contender that is not confirmed is not
    measured again).

    The rule is the guided search's (`policies.noise.repeat_advice`): every contender until it rests on
    `[search] min_repeats` counted runs from two processes; a tie that more runs may still decide otherwise
    (the tie-break chose another than the lowest median) is a close call and gets more, and no
    configuration gets more than MAX_REPEATS runs, failed and flagged ones included. A policy that asks for
    one run (`min_repeats = 1`) has said one is enough: nothing is repeated, close calls included. With
    `source`, an ok run metered otherwise does not confirm (the cap still counts it)."""
    if policy.search.min_repeats <= 1:
        return [], {}
    close = {c.config_id for c in ties} if len(ties) > 1 and chosen is not best else set()
    wanted: list[dict[str, Any]] = []
    not_again: dict[str, str] = {}
    for cand in sorted(ties, key=lambda c: c is not chosen):  # stable: the others stay lowest median first
        every = list(all_by_config.get(cand.config_id, ()))
        marks = [run_mark(run) for run in every]
        advice = repeat_advice(marks, close_call=cand.config_id in close, min_repeats=policy.search.min_repeats)
        confirming = [run_mark(run) for run in every
                      if source is None or not run.ok or source_key(run.energy_source) == source]
        if advice.more <= 0:
            if not confirmation(confirming, policy.search.min_repeats).confirmed:
                not_again[cand.config_id] = advice.why
            continue
        if no_repeat and cand.config_id in no_repeat:
            not_again[cand.config_id] = no_repeat[cand.config_id]
            continue
        wanted.append({"config_id": cand.config_id, "label": cand.label, "runs": advice.more, "why": advice.why})
    return wanted, not_again


def _confirm_reason(chosen: Candidate, status: Confirmation, confirm: Sequence[Mapping[str, Any]]) -> str:
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
    return "configurations that tie with its choice rest on fewer runs than a verified decision needs"


POWER_LIMITS = ("max_avg_power_w", "max_peak_power_w")


def _only_power(cand: Candidate) -> bool:
    """A measured candidate rejected by power limits alone (nothing else in its reasons)."""
    return bool(cand.reasons) and all(r.split(":")[0] in POWER_LIMITS for r in cand.reasons)


def _infeasible_pick(candidates: list[Candidate], exclude: Collection[str]) -> Candidate | None:
    """The lowest-power measured configuration that meets every limit but the power ones, or None."""
    pool = [c for c in candidates if c.status == "rejected" and c.source == "measured" and c.repeats
            and c.config_id not in exclude and _only_power(c)]
    if not pool:
        return None

    def power(c: Candidate) -> tuple:
        avg = c.avg_power_w_high if c.avg_power_w_high is not None else c.figures.get("avg_power_w")
        return (avg if avg is not None else math.inf, c.figures.get("peak_power_w") or math.inf,
                c.score if c.score is not None else math.inf, c.label)

    return min(pool, key=power)


def _shortfall(cand: Candidate, policy: Policy) -> str:
    """'lowest measured 282 W exceeds 250 W by 13%', per power limit the candidate breaks."""
    parts = []
    for limit, value in policy.limits.items():
        bound = policy.limits.bound(limit, value)
        if limit == "max_avg_power_w":
            measured, what = cand.avg_power_w_high, f"average power (upper bound, {cand.repeats} runs)"
        elif limit == "max_peak_power_w":
            measured, what = cand.figures.get("peak_power_w"), "peak power"
        else:
            continue
        if measured is not None and measured > bound:
            parts.append(f"lowest measured {what} {_fmt(measured, 'W')} exceeds {_limit_text(policy, limit, value)} "
                         f"by {measured / bound - 1:.0%}")
    return "; ".join(parts)


def resolve(policy: Policy, db: sqlite_utils.Database, device_name: str, model: Any = None, *,
            torch_version: str | None = None, exclude: Collection[str] = (),
            no_repeat: Mapping[str, str] | None = None) -> Decision:
    """The decision for `policy` on device kind `device_name` ('cpu' or the GPU's name) and torch
    major.minor `torch_version` (default: the installed torch). `model` is a fitted TradeoffModel or None.
    `exclude`: config ids that broke the power envelope in a live deployment; they are rejected.
    `no_repeat`: config id -> why it cannot be measured again (the daemon's job for it failed as often as
    it may); such a contender is left out of `confirm`.
    This only computes; `policies.decide` is what records a decision and writes its lock file."""
    torch_version = torch_minor(torch_version) if torch_version else torch_minor()
    workload_id = policy_workload_id(policy)
    workload_row = stored_workload(db, workload_id)
    scan = _scan_runs(db, policy, device_name, torch_version)
    ok_by_config, runs, flagged_counts, newest_failed = scan.ok_by_config, scan.latest, scan.flagged_counts, \
        scan.newest_failed
    coverage = run_coverage(db, workload_id)
    fallback = fallback_config(policy)
    configs = candidate_configs(policy)
    # J per sample when the grid spans several batch sizes (the batch-size lever), else J per call as ever.
    by_sample = per_sample(policy)
    # Runs of different energy sources are never compared (`policies.sources`): each source's runs are
    # summarised apart, with the typical spread of that source's repeats.
    grouped = group_by_source(ok_by_config, lambda run: run.energy_source)
    repeats_by_source: dict[str, dict[str, _Repeats]] = {}
    for source, group in grouped.items():
        repeats_by_source[source] = {
            cid: _repeats(policy, ok, int(ok[0].batch_size or policy.batch_size) if by_sample else 1)
            for cid, ok in group.items()}
        _intervals(repeats_by_source[source])
    ranked_order = ranked_sources({source: len(group) for source, group in grouped.items()})
    own = own_sources(grouped, ranked_order)

    eager_id = fallback.replace(mode="eager", fusion="default", precision="fp32", dynamic=False).id

    def eager_j_of(source: str | None) -> float | None:
        """Eager fp32's J per call at the policy's batch size, over its runs of `source` (None without)."""
        eager_rep = repeats_by_source.get(source or "", {}).get(eager_id)
        return _figures(eager_rep.runs)["energy_j_per_inference"] if eager_rep else None

    def eager_at(batch: int, source: str | None) -> float | None:
        """Eager fp32's J per call (runs of `source`), for as many samples as one call of `batch`."""
        eager = eager_j_of(source)
        return None if eager is None else eager * batch / policy.batch_size

    def measured_candidate(cfg: Any, source: str) -> Candidate:
        """`cfg` judged on its runs of `source` alone."""
        rep = repeats_by_source[source][cfg.id]
        cand = Candidate(config=cfg.to_row(), label=cfg.label, source="none")
        _set_measured(cand, policy, rep, eager_at(cfg.batch_size, source), cfg.compiles)
        if cand.score is None:
            cand.reasons.append(f"{policy.objective.minimize}: the objective's figures were not measured")
        cand.status = "rejected" if cand.reasons else "kept"
        hit = next((r for r in rep.runs if r.extra.get("recompile_limit_hit")), None)
        if hit is not None:
            cand.notes.append(f"run {hit.id}: {hit.extra.get('recompile_warning') or 'hit the recompile limit'}")
        if not rep.clean:
            newest = rep.runs[0]
            cand.flagged = run_flag(newest)
            times = flagged_counts.get(cfg.id, 1)
            cand.reasons.append(f"run {newest.id} was flagged by bench, \"repeat this run\" ({cand.flagged})"
                                + ("" if needs_repeat(times) else
                                   f"; flagged in {times} runs, so it is not repeated again: look for "
                                   f"contention on the host and bench it by hand"))
            if cand.status == "kept":
                cand.status = "flagged"
        return cand

    trials = {source: [measured_candidate(cfg, source) for cfg in configs if cfg.id in repeats_by_source[source]]
              for source in ranked_order}
    # The source the decision ranks: the most trustworthy with a candidate counted within every limit, else
    # with one that only the power limits reject (the infeasible path), else the most trustworthy present.
    ranked = pick_source(ranked_order, [
        lambda source: any(c.status == "kept" and c.config_id not in exclude for c in trials[source]),
        lambda source: _infeasible_pick(trials[source], exclude) is not None])
    repeats = repeats_by_source.get(ranked or "", {})
    trial_of = {c.config_id: c for c in trials.get(ranked or "", [])}

    unmeasured = [c for c in configs if c.id not in ok_by_config]
    predictions: dict[str, dict[str, tuple[float, float]]] = {}
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
    uncompared: dict[str, list[str]] = {}
    for cfg in configs:
        run = runs.get(cfg.id)
        if cfg.id in trial_of:
            cand = trial_of[cfg.id]
            others = {source: len(group[cfg.id]) for source, group in grouped.items()
                      if source != ranked and cfg.id in group}
            if others:
                cand.notes.append(left_out_text(others, str(ranked)))
        elif cfg.id in own:  # measured, but only with another source than the one ranked: listed, not compared
            cand = next(c for c in trials[own[cfg.id]] if c.config_id == cfg.id)
            cand.reasons.insert(0, not_compared_text(own[cfg.id], str(ranked)))
            cand.status = UNCOMPARED
            uncompared.setdefault(own[cfg.id], []).append(cand.label)
        elif cfg.id in predictions:
            cand = Candidate(config=cfg.to_row(), label=cfg.label, source="predicted")
            pred = predictions[cfg.id]
            cand.predicted = {k: [m, s] for k, (m, s) in pred.items()}
            if run is not None:
                cand.reasons.append(f"last benchmark failed: {run.reason or 'no reason recorded'}")
            notes = _check_predicted(cand, policy)
            energy = pred.get("energy_j_per_inference", (math.nan, 0))[0]
            compile_s = pred.get("compile_s", (0.0, 0))[0] if cfg.compiles else 0.0
            power = pred.get("avg_power_w", (0.0, 0))[0]
            latency = pred.get("latency_ms_p95", (None, 0))[0]
            # Compile energy (GPU + CPU) as the model predicts it; a model that could not learn it (no run
            # metered both parts) leaves predicted compile seconds at predicted power.
            compile_j = (pred["compile_energy_j"][0] if "compile_energy_j" in pred else compile_s * power) \
                if cfg.compiles else 0.0
            _amortise(cand, policy, energy, compile_j, latency, cfg.batch_size if by_sample else 1)
            _set_break_even(cand, compile_j, energy, eager_at(cfg.batch_size, ranked), not cfg.compiles)
            if cand.reasons:
                cand.status = "rejected"
            else:
                cand.status = "unverified"
                cand.reasons.append("not measured: prediction only" + ("; " + "; ".join(notes) if notes else ""))
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
        if cfg.id in exclude:
            cand.reasons.append("broke the power envelope in a live deployment (envelope guard)")
            if cand.status != UNCOMPARED:
                cand.status = "rejected"
        candidates.append(cand)

    def order(c: Candidate) -> tuple:
        return (c.score if c.score is not None else math.inf, c.figures.get("compile_s") or 0.0, c.label)

    feasible = sorted((c for c in candidates if c.status == "kept"), key=order)
    hopeful = sorted((c for c in candidates if c.status == "unverified" and c.score is not None
                      and math.isfinite(c.score)), key=order)
    chosen, criterion, confidence, ties = _rank(feasible, repeats) if feasible else (None, "", "", [])
    proposed = hopeful[0] if hopeful and (chosen is None or order(hopeful[0]) < order(chosen)) else None
    # Flagged runs within every limit that would beat the chosen one: measure them again.
    worth_repeating = sorted((c for c in candidates if c.status == "flagged"
                              and (chosen is None or order(c) < order(chosen))), key=order)
    # A repeat that failed is not tried again: the flagged run stays what is known of it.
    # Nor one whose newest run was metered otherwise than the runs ranked: this host no longer meters it so.
    repeat = [c for c in worth_repeating if needs_repeat(flagged_counts.get(c.config_id, 1))
              and c.config_id not in newest_failed
              and source_key(ok_by_config[c.config_id][0].energy_source) == ranked]
    lowest_power = None if chosen is not None or worth_repeating else _infeasible_pick(candidates, exclude)

    confirm: list[dict[str, Any]] = []
    confirm_reason = ""
    objective = policy.objective.minimize
    objective_text = _objective_text(objective, by_sample)
    measured_any = any(c.source == "measured" for c in candidates)
    elsewhere = [] if measured_any else [p for p in coverage.workload_pairs
                                         if (p["device_kind"], p["torch_version"]) != (device_name, torch_version)]
    if chosen is not None:
        chosen.status = "chosen"
        # The best measured configuration is applied either way: on too few runs it is still a better bet
        # than the fallback, but the decision says it is not confirmed yet.
        status = confirmation([run_mark(run) for run in grouped[str(ranked)][chosen.config_id]],
                              policy.search.min_repeats)
        state, applied = ("verified" if status.confirmed else "provisional"), chosen.config
        reason = (f"{chosen.label} is the measured configuration with the lowest median "
                  f"{objective_text} ({chosen.score:.4g}, {chosen.repeats} "
                  f"run{'s' if chosen.repeats != 1 else ''}) within every limit")
        if criterion:
            reason = (f"{chosen.label} ties with {feasible[0].label} (lowest median {objective_text} "
                      f"{feasible[0].score:.4g}) within noise and wins the tie-break on "
                      f"{_tie_text(criterion, chosen, feasible[0])}")
        if estimate_note(ranked):
            reason += f"; {estimate_note(ranked)}"
        reason += f"; {len(feasible)} of {len(candidates)} candidates measured within limits"
        if uncompared:
            reason += f"; {uncompared_summary(uncompared, str(ranked))}"
        if not status.confirmed:
            reason += "; " + status.shortfall()
        if policy.search.strategy == "exhaustive":  # the guided search repeats its contenders itself
            # The repeat cap counts every run; confirming counts the runs of the source ranked.
            confirm, not_again = _to_confirm(policy, ties, chosen, feasible[0], scan.all_by_config, no_repeat,
                                             str(ranked))
            confirm_reason = _confirm_reason(chosen, status, confirm)
            if not status.confirmed and chosen.config_id in not_again:
                reason += f"; it is not measured again: {not_again[chosen.config_id]}"
    elif worth_repeating:
        state, applied = "provisional", fallback.to_row()
        labels = ", ".join(c.label for c in worth_repeating)
        reason = (f"the only measured configurations within every limit ({labels}) rest on runs flagged "
                  f"\"repeat this run\", so the fallback {fallback.label} is applied until a clean run "
                  f"confirms them")
    elif lowest_power is not None:
        lowest_power.status = "chosen"
        state, applied = "infeasible", lowest_power.config
        confidence = _shortfall(lowest_power, policy)
        reason = (f"the power envelope cannot be met: no measured configuration is within it, so "
                  f"{lowest_power.label}, the lowest-power one that meets the other limits, is applied: "
                  f"{confidence}")
        if estimate_note(ranked):
            reason += f"; {estimate_note(ranked)}"
        if proposed is not None:
            reason += f"; {proposed.label} is predicted to fit and should be measured"
    elif proposed is not None:
        state, applied = "provisional", fallback.to_row()
        reason = (f"no measured configuration meets every limit; {proposed.label} is predicted to "
                  f"({objective_text} {proposed.score:.4g}) but is unmeasured, so the fallback "
                  f"{fallback.label} is applied until it is benchmarked")
    else:
        state, applied = "fallback", fallback.to_row()
        reason = f"no configuration is feasible, so the fallback {fallback.label} is applied: " + \
            _rejection_summary(candidates, device_name, torch_version, workload_row is None, policy)
    if uncompared and chosen is None:
        reason += f"; {uncompared_summary(uncompared, str(ranked))}"
    if elsewhere:
        reason += "; " + _elsewhere_text(policy, device_name, torch_version, elsewhere)
    if proposed is not None:
        proposed.status = "proposed"
        if chosen is not None:
            reason += f"; {proposed.label} is predicted better and should be measured"
    if chosen is not None and worth_repeating:
        reason += (f"; {worth_repeating[0].label} measured better, but its run was flagged \"repeat this run\" "
                   f"so it cannot be verified" + (" until it is measured again" if repeat else ""))
    if batch_note(policy, applied):
        reason += "; " + batch_note(policy, applied)

    applied_cand = next((c for c in candidates if c.config_id == applied["id"]), None)
    # A fallback outside the grid: its figures from the runs ranked, else from its own most trustworthy source.
    applied_source = ranked if applied["id"] in repeats else own.get(applied["id"])
    if applied_cand is None and applied_source is not None:
        applied_cand = Candidate(config=applied, label=applied["label"], source="measured")
        applied_batch = int(applied.get("batch_size") or policy.batch_size)
        _set_measured(applied_cand, policy, repeats_by_source[applied_source][applied["id"]],
                      eager_at(applied_batch, applied_source), applied.get("mode") != "eager")
    return Decision(
        policy=policy.name, policy_hash=policy.hash, device_kind=device_name, torch_version=torch_version,
        workload=policy.workload, workload_id=workload_id, config=applied, state=state, reason=reason,
        objective=objective, expected_inferences=policy.objective.expected_inferences,
        proposed=proposed.config if proposed else None, candidates=candidates,
        measured=_key_figures(applied_cand),
        break_even_inferences=applied_cand.break_even_inferences if applied_cand else None,
        break_even_never=applied_cand.break_even_never if applied_cand else False,
        eager_energy_j_per_inference=eager_j_of(ranked), ranked_source=ranked,
        repeat=[c.config_id for c in repeat], contenders=[c.config_id for c in ties], confirm=confirm,
        confirm_reason=confirm_reason, measured_elsewhere=elsewhere,
        excluded_violated=sorted(set(exclude)), confidence=confidence,
        batch_sizes=list(grid_batch_sizes(policy)), workload_ids=workload_ids,
        objective_unit=_objective_unit(objective, by_sample),
    )


def _elsewhere_text(policy: Policy, device: str, torch_version: str, elsewhere: list[dict[str, Any]]) -> str:
    pairs = ", ".join(f"{p['device_kind']} / torch {p['torch_version']} ({p['runs']} ok runs)" for p in elsewhere)
    return (f"nothing of {policy.workload} (batch {policy.batch_size}) is measured on {device} with torch "
            f"{torch_version}, but it is on: {pairs}")


def _objective_text(objective: str, per_sample: bool = False) -> str:
    energy = "J/sample" if per_sample else "J/inference"
    return {"energy": f"amortised {energy}", "latency": "p95 latency (ms)",
            "edp": f"energy-delay product ({'J/sample' if per_sample else 'J'} x ms)"}[objective]


def _objective_unit(objective: str, per_sample: bool) -> str:
    """The unit of a candidate's score: 'J' per call, 'J/sample', 'ms', 'J x ms' or 'J/sample x ms'."""
    energy = "J/sample" if per_sample else "J"
    return {"energy": energy, "latency": "ms", "edp": f"{energy} x ms"}[objective]


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
