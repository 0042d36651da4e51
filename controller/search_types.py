"""What the guided search takes and gives: one run (`Observation`), settings, and the result's parts.

Also the objective of one run (`run_objective`), shared by the search and by anything that scores its
choices (the replay benchmark's oracle), so both judge a configuration by the same figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from joulepilot.policies.noise import (
    DEFAULT_CONFIDENCE,
    MAX_REPEATS,
    MIN_REPEATS,
    Interval,
    RunMark,
    TieEntry,
    fresh_process_of,
)
from joulepilot.policies.schema import OBJECTIVES
from joulepilot.store.jsonvalues import json_column

from .features import config_row

STRATEGIES = ("guided", "exhaustive")
STATES = ("verified", "provisional", "infeasible", "failed")
POWER_LIMITS = ("max_avg_power_w", "max_peak_power_w")
LIMIT_UNITS = {"max_avg_power_w": "W", "max_peak_power_w": "W", "max_p95_latency_ms": "ms",
               "max_compile_s": "s", "max_rel_error": ""}
LIMIT_FIGURES = {"max_avg_power_w": "average power", "max_peak_power_w": "peak power",
                 "max_p95_latency_ms": "p95 latency", "max_compile_s": "compile time",
                 "max_rel_error": "relative error"}

Prediction = Mapping[str, tuple[float, float]]
Predictor = Callable[[Sequence[Mapping[str, Any]]], Sequence[Prediction]]


@dataclass(frozen=True)
class Observation:
    """One measurement of one configuration (one stored run), with what the search needs of it."""

    ok: bool
    wall_s: float
    energy_j_per_inference: float | None = None
    avg_power_w: float | None = None
    peak_power_w: float | None = None
    latency_ms_p95: float | None = None
    compile_s: float | None = None
    compile_energy_j: float | None = None
    max_rel_error: float | None = None
    fresh_process: bool = True
    flagged: str | None = None  # bench's "repeat this run" window warning
    reason: str | None = None  # why it failed
    run_id: int | None = None
    energy_source: str | None = None  # what metered it: nvml | rapl | estimate (runs are compared within one)

    @classmethod
    def from_run(cls, run: Mapping[str, Any], *, fresh_process: bool | None = None) -> Observation:
        """From a runs row (store.list_runs, or an export's `run`); `fresh_process` defaults to what
        the run records (`extra.window_in_process` above 1: a further window of one worker process)."""
        started, finished = run.get("started_at"), run.get("finished_at")
        wall_s = float(finished) - float(started) if isinstance(started, int | float) and \
            isinstance(finished, int | float) else 0.0
        extra = json_column(run.get("extra"), {})
        warning = extra.get("window_warning") if isinstance(extra, dict) else None

        def num(key: str) -> float | None:
            value = run.get(key)
            return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
                and math.isfinite(value) else None

        energy = num("energy_j_per_inference")
        if fresh_process is None:
            fresh_process = fresh_process_of(extra if isinstance(extra, dict) else None)
        return cls(ok=run.get("status") == "ok" and energy is not None, wall_s=max(0.0, wall_s),
                   energy_j_per_inference=energy, avg_power_w=num("avg_power_w"), peak_power_w=num("peak_power_w"),
                   latency_ms_p95=num("latency_ms_p95"), compile_s=num("compile_s"),
                   compile_energy_j=num("compile_energy_j"), max_rel_error=num("max_rel_error"),
                   fresh_process=fresh_process, flagged=str(warning) if warning else None,
                   reason=run.get("reason"), run_id=run.get("id"), energy_source=run.get("energy_source"))

    def mark(self) -> RunMark:
        return RunMark(ok=self.ok, flagged=bool(self.flagged), fresh_process=self.fresh_process)


Measurer = Callable[[Mapping[str, Any], bool], Observation]


@dataclass(frozen=True)
class SearchSettings:
    """How to search: the policy's `[search]` and `[objective]` tables and `[limits] margin_pct`.

    `min_expected_gain`: a candidate is skipped when its expected improvement on the best measured median
    beyond that median's noise (lognormal prediction, times its probability of meeting the limits) is
    less than this share of the best; `min_feasible_probability`: skipped when less likely than
    this to meet the limits; `confidence`: of the intervals of medians (policies.noise)."""

    strategy: str = "guided"
    objective: str = "energy"
    expected_inferences: int = 1_000_000
    budget_s: float | None = None
    max_measurements: int | None = None
    margin_pct: float = 0.0
    min_repeats: int = MIN_REPEATS
    max_repeats: int = MAX_REPEATS
    confidence: float = DEFAULT_CONFIDENCE
    min_expected_gain: float = 0.01
    min_feasible_probability: float = 0.05
    baseline_batch_size: int | None = None  # default: the first candidate's

    def __post_init__(self) -> None:
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.objective not in OBJECTIVES:
            problems.append(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.expected_inferences < 1:
            problems.append(f"expected_inferences must be at least 1, got {self.expected_inferences!r}")
        if self.budget_s is not None and not self.budget_s > 0:
            problems.append(f"budget_s must be a positive number of seconds, got {self.budget_s!r}")
        if self.max_measurements is not None and self.max_measurements < 1:
            problems.append(f"max_measurements must be at least 1, got {self.max_measurements!r}")
        if not 0 <= self.margin_pct < 100:
            problems.append(f"margin_pct must be in [0, 100), got {self.margin_pct!r}")
        if not 1 <= self.min_repeats <= self.max_repeats:
            problems.append(f"need 1 <= min_repeats <= max_repeats, got {self.min_repeats} and {self.max_repeats}")
        if not 0 < self.confidence < 1:
            problems.append(f"confidence must be between 0 and 1, got {self.confidence!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class MeasuredConfig:
    """A measured configuration: its runs and the figures the decision uses (of its counted runs)."""

    config_id: str
    label: str
    config: dict[str, Any]
    runs: list[Observation]
    objective: Interval | None = None
    avg_power_w: Interval | None = None
    peak_power_w: float | None = None  # highest instant power seen
    latency_ms_p95: float | None = None  # median
    compile_s: float | None = None  # median
    compile_s_interval: Interval | None = None
    max_rel_error: float | None = None  # median of the runs that measured it
    violations: list[str] = field(default_factory=list)  # limits broken (or not verifiable)
    power_straddles: bool = False  # median average power within the envelope, upper bound over it
    status: str = "measured"  # chosen | tied | kept | rejected | failed | flagged | uncompared
    # The energy source of the runs its figures rest on (`policies.sources`); `not_compared` says why it is
    # not compared with the others when its runs are all of another source than the one the decision ranks.
    energy_source: str | None = None
    not_compared: str | None = None

    @property
    def ok(self) -> bool:
        return self.objective is not None

    @property
    def compared(self) -> bool:
        return self.not_compared is None

    @property
    def feasible(self) -> bool:
        return self.ok and self.compared and not self.violations

    def tie_entry(self) -> TieEntry:
        assert self.objective is not None
        return TieEntry(self.config_id, self.objective, self.avg_power_w, self.compile_s_interval,
                        str(self.config.get("mode")))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("objective", "avg_power_w", "compile_s_interval"):
            value = getattr(self, name)
            out[name] = value.to_dict() if value else None
        return out


@dataclass
class SkippedConfig:
    """A configuration the search did not measure, and why."""

    config_id: str
    label: str
    reason: str
    predicted_objective: tuple[float, float] | None = None  # (mean, std) in the objective's unit
    p_feasible: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SearchStep:
    """One measurement the search made, and why."""

    index: int
    config_id: str
    label: str
    kind: str  # baseline | guided | exhaustive | repeat
    fresh_process: bool
    why: str
    ok: bool
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SearchResult:
    """What the search measured and skipped, what it chose and how sure it is."""

    state: str  # STATES
    chosen_config_id: str | None
    chosen_label: str | None
    reason: str
    confidence: str
    objective_unit: str
    measured: list[MeasuredConfig]
    skipped: list[SkippedConfig]
    steps: list[SearchStep]
    spent_s: float
    measurements: int
    stop_reason: str

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("measured", "skipped", "steps")}
        out["measured"] = [m.to_dict() for m in self.measured]
        out["skipped"] = [s.to_dict() for s in self.skipped]
        out["steps"] = [s.to_dict() for s in self.steps]
        return out


def per_sample_objective(configs: Iterable[Any]) -> bool:
    """Whether the grid spans several batch sizes, so the objective is per sample."""
    return len({int(config_row(c).get("batch_size") or 1) for c in configs}) > 1


def run_objective(obs: Observation, config: Mapping[str, Any], *, objective: str, expected_inferences: int,
                  per_sample: bool) -> float | None:
    """The objective of one ok run: J per call (per sample when `per_sample`) plus its compile energy
    amortised over `expected_inferences` calls (compile seconds x average power when the run lacks
    it); p95 latency in ms per call; or their product. None when the run lacks a figure it needs."""
    if not obs.ok or obs.energy_j_per_inference is None:
        return None
    compile_j = obs.compile_energy_j
    if compile_j is None:
        compile_j = (obs.compile_s or 0.0) * (obs.avg_power_w or 0.0)
    energy = obs.energy_j_per_inference + compile_j / expected_inferences
    if per_sample:
        energy /= max(1, int(config.get("batch_size") or 1))
    if objective == "energy":
        return energy
    if obs.latency_ms_p95 is None:
        return None
    return obs.latency_ms_p95 if objective == "latency" else energy * obs.latency_ms_p95


def objective_unit(objective: str, per_sample: bool) -> str:
    if objective == "latency":
        return "ms"
    energy = "J/sample" if per_sample else "J"
    return energy if objective == "energy" else f"{energy} x ms"


def limit_value(limit: str, value: float, margin_pct: float) -> float:
    """The limit the search holds a configuration to: reduced by the margin, except the accuracy one."""
    return value if limit == "max_rel_error" else value * (1.0 - margin_pct / 100.0)


def fmt(value: float, unit: str = "") -> str:
    text = f"{value:.3g}"
    return f"{text} {unit}" if unit else text
