"""What the guided search takes and gives: its settings, and the result's parts.

A run is the judge's `Run` and a measured configuration its `Verdict` (`policies.judge`): the search judges
by the resolver's rules because it asks the same module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from joulepilot.policies.judge import Rules, Run, Verdict
from joulepilot.policies.schema import OBJECTIVES

STRATEGIES = ("guided", "exhaustive")
# A grid this small is measured whole (each configuration once, cheapest first), then confirmed: the model
# cannot save much on it, and a guess it gets wrong would cost more than the runs it saves.
SMALL_GRID = 8

Prediction = Mapping[str, tuple[float, float]]
Predictor = Callable[[Sequence[Mapping[str, Any]]], Sequence[Prediction]]
Measurer = Callable[[Mapping[str, Any], bool], Run]


@dataclass(frozen=True)
class SearchSettings:
    """How to search: the policy's `[search]` table besides what the judge reads (`policies.judge.Rules`).

    `min_expected_gain`: a candidate is skipped when its expected improvement by more than the tolerance on
    the best measured median (lognormal prediction, times its probability of meeting the limits) is less
    than this share of the best; `min_feasible_probability`: skipped when less likely than this to meet the
    limits; `small_grid`: a grid of at most this many configurations is measured whole, each once."""

    strategy: str = "guided"
    budget_s: float | None = None
    max_measurements: int | None = None
    min_expected_gain: float = 0.01
    min_feasible_probability: float = 0.05
    baseline_batch_size: int | None = None  # default: the first candidate's
    small_grid: int = SMALL_GRID
    min_beat_probability: float = 0.1

    def __post_init__(self) -> None:
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.budget_s is not None and not self.budget_s > 0:
            problems.append(f"budget_s must be a positive number of seconds, got {self.budget_s!r}")
        if self.max_measurements is not None and self.max_measurements < 1:
            problems.append(f"max_measurements must be at least 1, got {self.max_measurements!r}")
        if problems:
            raise ValueError("; ".join(problems))


def check_rules(rules: Rules) -> Rules:
    """`rules` as the search takes them; ValueError naming every bad value at once."""
    problems = []
    if rules.objective not in OBJECTIVES:
        problems.append(f"objective must be one of {', '.join(OBJECTIVES)}, got {rules.objective!r}")
    if rules.expected_inferences < 1:
        problems.append(f"expected_inferences must be at least 1, got {rules.expected_inferences!r}")
    if not 0 <= rules.limits.margin_pct < 100:
        problems.append(f"margin_pct must be in [0, 100), got {rules.limits.margin_pct!r}")
    if not 1 <= rules.min_repeats <= rules.max_repeats:
        problems.append(f"need 1 <= min_repeats <= max_repeats, got {rules.min_repeats} and {rules.max_repeats}")
    if not 0 < rules.confidence < 1:
        problems.append(f"confidence must be between 0 and 1, got {rules.confidence!r}")
    if not rules.tolerance_pct >= 0:
        problems.append(f"tolerance_pct must be at least 0, got {rules.tolerance_pct!r}")
    if problems:
        raise ValueError("; ".join(problems))
    return rules


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
    """What the search measured and skipped, what it chose and how sure it is (the judge's decision)."""

    state: str  # policies.judge.STATES
    chosen_config_id: str | None
    chosen_label: str | None
    reason: str
    confidence: str
    objective_unit: str
    measured: list[Verdict]
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
