"""The judge: the one place where runs become a decision.

The resolver (`policies.resolve`: `policy explain`, `policy lock`, the daemon's decision), the guided
search (`controller.search`: what to measure next and when to stop) and everything that reports a decision
ask this module; nothing else computes an objective, checks a limit or ranks configurations. The rules:

* **A run** (`Run`): one stored (or replayed) measurement of one configuration. A run counts once it
  succeeded; a run bench flagged "repeat this run" counts only once its configuration has a clean run
  (`noise.counted`).
* **The objective** of one run (`run_objective`): `energy` is J per call plus the compile energy amortised
  over `expected_inferences` calls (divided by the batch size when the grid spans several: J per sample);
  `latency` is p95 latency per call; `edp` their product. For a generation policy (`task = "generate"`)
  `energy` is J per generated token (prefill and decode of the whole batch) plus the compile energy amortised
  over `expected_tokens` tokens, at any batch size (a token is a token); `latency` is the median time per
  output token (TPOT p50); `edp` their product. A run whose compile energy was not metered gets
  it estimated as its compile seconds x its average power, and the configuration's verdict says so
  (`compile_estimated`): counting an unmetered compile as free would favour every compiled configuration
  over eager, which compiles nothing. For the same reason a run that compiled nothing of its own (a further
  window of a worker process, or a repeat that started from the configuration's saved artifacts) is amortised
  with its configuration's compile (`with_process_compile`), and only cold compiles make its compile time.
* **Energy sources** (`policies.sources`): configurations are compared on runs of one source only.
* **Limits** (`check_limits`): average power on the upper end of its median's interval (with 4 or more runs never
  above the order-statistic bound at the same confidence, `noise.distribution_free_high`: at 4 or 5 runs, the
  highest of them), peak power on the
  highest instant power seen, the others on the median of the counted runs, each less `[limits] margin_pct`
  (not the accuracy limit). A figure a limit needs that no run measured fails the limit. A generation's
  `max_tpot_ms` holds the p95 time per output token (every step of every call of the latency pass: a tail
  over hundreds of samples), `max_ttft_ms` the median time to first token (the latency pass makes a few calls,
  each one first token, so a p95 of them would be their maximum), and `max_rel_error` the logits' error
  against eager fp32 over the first steps. Whether the greedy tokens match eager in the configuration's own
  precision (`tokens_match`, and the leading steps that do) limits nothing: the greedy path of a model turns
  at near-ties of its logits, which any change in the order of floating-point sums (a fused kernel) can flip,
  so it is shown beside the decision, and the error limit is what a policy holds a configuration to.
* **Ranking** (`judge`): the lowest median objective within every limit is the *best*; every configuration
  whose interval overlaps it *ties* with it, and the tie-break (`noise.break_tie`: lower average power,
  cheaper compile, simpler mode, each only where it differs by more than its own noise) chooses among
  them. `[search] tolerance_pct` (default 2) is the regret a policy accepts, and says how each rival of the
  chosen one stands (`Standing`):
    - `beaten`: the chosen one is better by more than the noise (the intervals do not overlap);
    - `within tolerance`: even at the unfavourable ends of both intervals the chosen one is at most
      `tolerance_pct` worse: a tie settled by the tie-break, which more runs could not make matter;
    - `close call`: the intervals overlap and the chosen one could still be worse by more than the
      tolerance: more runs may change the answer, so the search and the daemon measure again, while more
      runs can still settle it (`settleable`): once both sides have measured intervals (`noise.MIN_REPEATS`
      runs each), a close call whose intervals, narrowed to `max_repeats` runs each (as the square root of the
      runs and their t-quantile's fall), would still leave more than the tolerance is beyond what the cap of
      runs can settle: the lower median stands without more runs (the reason says so).
* **The infeasible pick**: when nothing meets every limit, the lowest-power configuration that meets the
  limits other than power (by the upper end of its average power's interval) is applied, state
  `infeasible`, with the shortfall; never the highest-power fallback.
* **Verified** (`noise.confirmation`): the chosen configuration rests on at least `[search] min_repeats`
  counted runs, and either two of them started their own worker process, or no rival could change the
  answer (every rival `beaten` by more than the tolerance: its interval starts more than the tolerance
  above the chosen one's end), so that a second process cannot change the decision. Else `provisional`.
* **Repeats** (`repeats`): the chosen configuration until it is verified, both sides of each settleable close call,
  and the configurations that may yet be within the limits and better (average power straddling the
  envelope, a figure a limit needs that their runs did not measure, or resting on flagged runs), up to
  `noise.MAX_REPEATS` runs of one configuration; with nothing within the limits, those that may yet be
  before the infeasible pick.

Pure Python: no SQL, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from joulepilot.compiler.budget import COMPILE_OVERRUN
from joulepilot.store.jsonvalues import json_column

from .noise import (
    DEFAULT_CONFIDENCE,
    MAX_REPEATS,
    MIN_REPEATS,
    Confirmation,
    Interval,
    RepeatAdvice,
    TieEntry,
    assumed_spread_rel,
    break_tie,
    confirmation,
    counted,
    distribution_free_high,
    fresh_process_of,
    median,
    median_interval,
    repeat_advice,
    t_quantile,
    typical_rel_std,
)
from .schema import DEFAULT_TOLERANCE_PCT, Limits
from .sources import (
    UNCOMPARED,
    estimate_note,
    group_by_source,
    not_compared_text,
    own_sources,
    pick_source,
    ranked_sources,
    source_key,
    uncompared_summary,
)

STATES = ("verified", "provisional", "infeasible", "fallback")
# limit -> (the figure it is checked on, its unit, the figure in words)
LIMITS = {
    "max_avg_power_w": ("avg_power_w", "W", "average power"),
    "max_peak_power_w": ("peak_power_w", "W", "peak power"),
    "max_p95_latency_ms": ("latency_ms_p95", "ms", "p95 latency"),
    "max_compile_s": ("compile_s", "s", "compile time"),
    "max_rel_error": ("max_rel_error", "", "relative error"),
    "max_tpot_ms": ("tpot_ms_p95", "ms", "p95 time per output token"),
    "max_ttft_ms": ("ttft_ms_p50", "ms", "median time to first token"),
}
POWER_LIMITS = ("max_avg_power_w", "max_peak_power_w")

# How a rival stands against the chosen configuration (see the module docstring).
BEATEN = "beaten"
WITHIN_TOLERANCE = "within tolerance"
CLOSE_CALL = "close call"


def fmt(value: float, unit: str = "") -> str:
    """A figure as every decision text writes it: four significant digits and its unit."""
    return f"{value:.4g}{(' ' + unit) if unit else ''}"


def objective_unit(objective: str, per_sample: bool, generates: bool = False) -> str:
    """The unit of an objective value: 'J' per call, 'J/sample', 'J/token', 'ms', 'J x ms', 'J/sample x ms' or
    'J/token x ms'."""
    energy = "J/token" if generates else "J/sample" if per_sample else "J"
    return {"energy": energy, "latency": "ms", "edp": f"{energy} x ms"}[objective]


def objective_text(objective: str, per_sample: bool = False, generates: bool = False) -> str:
    if generates:
        return {"energy": "amortised J/token", "latency": "TPOT p50 (ms per output token)",
                "edp": "energy-delay product (J/token x TPOT ms)"}[objective]
    energy = "J/sample" if per_sample else "J/inference"
    return {"energy": f"amortised {energy}", "latency": "p95 latency (ms)",
            "edp": f"energy-delay product ({'J/sample' if per_sample else 'J'} x ms)"}[objective]


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True)
class Run:
    """One run of one configuration, as the judge counts it: what a stored run, a replayed one or a
    measurement the search just made says."""

    ok: bool
    energy_j_per_inference: float | None = None
    avg_power_w: float | None = None
    peak_power_w: float | None = None
    latency_ms_p95: float | None = None
    compile_s: float | None = None
    compile_energy_j: float | None = None
    max_rel_error: float | None = None
    energy_source: str | None = None
    # a generation's (None for a forward pass): J per generated token, first token and time per output token,
    # and whether the greedy tokens match eager in the configuration's precision (the leading steps that do)
    energy_j_per_token: float | None = None
    ttft_ms_p50: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p95: float | None = None
    tokens_match: bool | None = None
    tokens_match_steps: int | None = None
    fresh_process: bool = True  # it started its worker process (not a further window of one)
    warm_started: bool = False  # its process started from the configuration's saved artifacts: it compiled nothing
    flagged: str | None = None  # bench's "repeat this run" window warning
    run_id: int | None = None
    wall_s: float = 0.0  # what measuring it took
    reason: str | None = None  # why it failed

    @classmethod
    def from_row(cls, run: Any, *, fresh_process: bool | None = None) -> Run:
        """From a stored run (a `store.RunRow`, a runs row as `list_runs` gives it, or an export's `run`);
        `fresh_process` defaults to what the run records (`extra.window_in_process` above 1: a further
        window of one worker process)."""
        def get(key: str) -> Any:
            return run.get(key) if isinstance(run, Mapping) else getattr(run, key, None)

        extra = json_column(get("extra"), {})
        extra = extra if isinstance(extra, dict) else {}
        started, finished = _number(get("started_at")), _number(get("finished_at"))
        warning = extra.get("window_warning")
        generated = extra.get("generation") if isinstance(extra.get("generation"), dict) else {}
        match, steps = get("tokens_match"), generated.get("tokens_match_steps")
        return cls(ok=get("status") == "ok", energy_j_per_inference=_number(get("energy_j_per_inference")),
                   avg_power_w=_number(get("avg_power_w")), peak_power_w=_number(get("peak_power_w")),
                   latency_ms_p95=_number(get("latency_ms_p95")), compile_s=_number(get("compile_s")),
                   compile_energy_j=_number(get("compile_energy_j")), max_rel_error=_number(get("max_rel_error")),
                   energy_source=get("energy_source"),
                   energy_j_per_token=_number(get("energy_j_per_token")), ttft_ms_p50=_number(get("ttft_ms_p50")),
                   tpot_ms_p50=_number(get("tpot_ms_p50")), tpot_ms_p95=_number(get("tpot_ms_p95")),
                   tokens_match=None if match is None else bool(match),
                   tokens_match_steps=steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
                   fresh_process=fresh_process_of(extra) if fresh_process is None else fresh_process,
                   warm_started="warm_start_from" in extra,
                   flagged=str(warning) if warning else None, run_id=get("id"),
                   wall_s=max(0.0, finished - started) if started is not None and finished is not None else 0.0,
                   reason=get("reason"))

    @property
    def compile_overran(self) -> bool:
        """It failed because its compile took longer than the worker's budget allows."""
        return not self.ok and str(self.reason or "").startswith(COMPILE_OVERRUN)


@dataclass(frozen=True)
class Rules:
    """What a policy asks of the judge: its `[objective]`, `[limits]` and the `[search]` settings that
    decide how sure a decision must be. `expected_inferences` is what compile energy is amortised over: calls
    for a forward pass, generated tokens (`expected_tokens`) for a generation (`generates`)."""

    objective: str = "energy"
    expected_inferences: int = 1_000_000
    limits: Limits = field(default_factory=Limits)
    min_repeats: int = MIN_REPEATS
    max_repeats: int = MAX_REPEATS
    tolerance_pct: float = DEFAULT_TOLERANCE_PCT
    confidence: float = DEFAULT_CONFIDENCE
    per_sample: bool = False  # the grid spans several batch sizes: energy per sample
    generates: bool = False  # a generation policy: energy per generated token, latency per output token

    @classmethod
    def of(cls, policy: Any) -> Rules:
        from .batches import per_sample

        generates = bool(getattr(policy, "generates", False))
        count = policy.objective.expected_tokens if generates else policy.objective.expected_inferences
        return cls(objective=policy.objective.minimize, expected_inferences=int(count), limits=policy.limits,
                   min_repeats=policy.search.min_repeats, tolerance_pct=policy.search.tolerance_pct,
                   per_sample=per_sample(policy) and not generates, generates=generates)

    @property
    def tolerance(self) -> float:
        return self.tolerance_pct / 100.0

    @property
    def unit(self) -> str:
        return objective_unit(self.objective, self.per_sample, self.generates)

    @property
    def energy_figure(self) -> str:
        """The run figure the energy objective rests on: J per call, or J per generated token."""
        return "energy_j_per_token" if self.generates else "energy_j_per_inference"

    @property
    def latency_figure(self) -> str:
        """The run figure the latency objective rests on: p95 latency per call, or TPOT p50."""
        return "tpot_ms_p50" if self.generates else "latency_ms_p95"

    @property
    def count_unit(self) -> str:
        """What compile energy is amortised over: 'inferences' or 'tokens'."""
        return "tokens" if self.generates else "inferences"

    def limit_text(self, limit: str, value: float) -> str:
        """'250 W', or '237.5 W (250 W less the 5% margin)'."""
        bound, unit = self.limits.bound(limit, value), LIMITS[limit][1]
        if bound == value:
            return fmt(value, unit)
        return f"{fmt(bound, unit)} ({fmt(value, unit)} less the {self.limits.margin_pct:g}% margin)"


def compile_energy(run: Run) -> tuple[float, bool]:
    """(the compile call's joules, whether they are estimated): metered when the run has them, else its
    compile seconds x its average power (0 for a run that records neither)."""
    if run.compile_energy_j is not None:
        return run.compile_energy_j, False
    return (run.compile_s or 0.0) * (run.avg_power_w or 0.0), bool(run.compile_s)


def with_process_compile(runs: Sequence[Run]) -> list[Run]:
    """The runs of one configuration, each that compiled nothing of its own (a further window of a worker
    process, or a process that started from the configuration's saved artifacts: neither stores compile
    figures) given the configuration's compile energy: the median of its runs that compiled. Amortised without
    it, a configuration measured in three windows of one process would have two runs of three that compiled
    for free, and its median objective would leave the compile out."""
    compiled = [run for run in runs if run.compile_energy_j is not None or run.compile_s is not None]
    if not compiled:
        return list(runs)
    joules = median([compile_energy(run)[0] for run in compiled])
    return [replace(run, compile_energy_j=joules) if (not run.fresh_process or run.warm_started)
            and run.compile_energy_j is None and run.compile_s is None else run for run in runs]


def amortised_j(run: Run, rules: Rules) -> float | None:
    """The run's J per call (per generated token, for a generation) with the compile energy amortised over
    `rules.expected_inferences` calls (tokens); None without energy."""
    energy = getattr(run, rules.energy_figure)
    if energy is None:
        return None
    return energy + compile_energy(run)[0] / rules.expected_inferences


def score(objective: str, energy: float | None, latency_ms: float | None) -> float | None:
    """The objective from its figures (energy already per call or per sample, amortised)."""
    if objective == "energy":
        return energy
    if latency_ms is None or energy is None and objective == "edp":
        return None
    return latency_ms if objective == "latency" else energy * latency_ms  # type: ignore[operator]


def run_objective(run: Run, config: Mapping[str, Any], rules: Rules) -> float | None:
    """The objective of one ok run of `config` (see the module docstring); None when it lacks a figure."""
    if not run.ok:
        return None
    energy = amortised_j(run, rules)
    if energy is not None and rules.per_sample:
        energy /= max(1, int(config.get("batch_size") or 1))
    return score(rules.objective, energy, getattr(run, rules.latency_figure))


@dataclass
class Verdict:
    """One configuration as the judge sees it: its runs, the figures of those that count, its limits."""

    config: dict[str, Any]
    runs: list[Run]  # every run given, ok or failed, of any source
    source: str | None = None  # the energy source its figures rest on (None: no ok run)
    counted: list[Run] = field(default_factory=list)  # its runs of that source that count
    clean: bool = True  # False: every ok run of it was flagged, so its figures rest on flagged runs
    objective: Interval | None = None
    avg_power_w: Interval | None = None
    compile_s: Interval | None = None
    peak_power_w: float | None = None  # the highest instant power seen
    latency_ms_p95: float | None = None  # medians, from here on
    max_rel_error: float | None = None
    tpot_ms_p50: float | None = None  # a generation's
    tpot_ms_p95: float | None = None
    ttft_ms_p50: float | None = None
    # a generation's greedy tokens against eager in the configuration's precision, over its counted runs: whether
    # every run matched for every new token, and the fewest leading steps that matched (None: not measured)
    tokens_match: bool | None = None
    tokens_match_steps: int | None = None
    amortised_j: float | None = None  # J per call (per token, for a generation), compile amortised
    compile_estimated: bool = False  # some counted run's compile energy was estimated (see `compile_energy`)
    violations: list[str] = field(default_factory=list)  # the limits it breaks or cannot be verified on
    power_straddles: bool = False  # median average power within the envelope, its upper bound over it
    not_compared: str | None = None  # why, when its runs are all of another source than the one ranked
    status: str = "unmeasured"  # chosen | tied | kept | rejected | flagged | failed | uncompared | unmeasured

    @property
    def config_id(self) -> str:
        return str(self.config["id"])

    @property
    def label(self) -> str:
        return str(self.config.get("label") or self.config_id)

    @property
    def mode(self) -> str:
        return str(self.config.get("mode") or "")

    @property
    def measured(self) -> bool:
        return self.objective is not None

    @property
    def compared(self) -> bool:
        return self.not_compared is None

    @property
    def feasible(self) -> bool:
        return self.measured and self.clean and self.compared and not self.violations

    @property
    def only_power(self) -> bool:
        """Measured cleanly, and rejected by power limits alone."""
        return (self.measured and self.clean and bool(self.violations)
                and all(v.split(":")[0] in POWER_LIMITS for v in self.violations))

    @property
    def runs_text(self) -> str:
        n = len(self.counted)
        return f"{n} run{'s' if n != 1 else ''}"

    def sort_key(self) -> tuple:
        """Lowest median objective first, then the cheaper compile, then the label."""
        median_ = self.objective.median if self.objective else math.inf
        return (median_, self.compile_s.median if self.compile_s else 0.0, self.label)

    def tie_entry(self) -> TieEntry:
        assert self.objective is not None
        return TieEntry(self.config_id, self.objective, self.avg_power_w, self.compile_s, self.mode)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self) | {"config_id": self.config_id, "label": self.label}
        for name in ("objective", "avg_power_w", "compile_s"):
            value = getattr(self, name)
            out[name] = value.to_dict() if value else None
        return out


@dataclass(frozen=True)
class Standing:
    """How one rival stands against the chosen configuration (BEATEN, WITHIN_TOLERANCE or CLOSE_CALL), and
    the figures that say so: the chosen one's median below the rival's (`diff_rel`, negative when above)
    and the uncertainty of that difference (`plus_minus_rel`), relative to the rival's median."""

    rival: Verdict
    kind: str
    diff_rel: float
    plus_minus_rel: float
    separated: bool  # the rival's interval starts more than the tolerance above the chosen one's end
    facing_rel: tuple[float, float] = (0.0, 0.0)  # the chosen one's and the rival's facing half-intervals


def standing(chosen: Verdict, rival: Verdict, tolerance: float) -> Standing:
    """`rival` against `chosen`: the difference of their medians relative to the rival's, with its
    uncertainty (the facing halves of the two intervals, combined as independent errors)."""
    a, b = chosen.objective, rival.objective
    assert a is not None and b is not None
    base = abs(b.median) or 1.0
    diff = (b.median - a.median) / base
    facing = (a.high - a.median, b.median - b.low) if diff >= 0 else (a.median - a.low, b.high - b.median)
    facing_rel = (facing[0] / base, facing[1] / base)
    plus_minus = math.hypot(*facing_rel)
    if diff >= 0 and not a.overlaps(b):
        kind = BEATEN
    elif plus_minus - diff <= tolerance:  # the chosen one is worse by at most this much
        kind = WITHIN_TOLERANCE
    else:
        kind = CLOSE_CALL
    return Standing(rival, kind, diff, plus_minus, separated=diff - plus_minus > tolerance, facing_rel=facing_rel)


@dataclass
class Judgement:
    """The decision the runs support: its state, the chosen configuration (None for `fallback`, and while
    the only candidates within the limits rest on flagged runs), every configuration's verdict, and why."""

    rules: Rules
    verdicts: dict[str, Verdict]  # in the order given
    ranked_source: str | None = None
    state: str = "fallback"
    chosen: Verdict | None = None
    best: Verdict | None = None  # lowest median within every limit
    feasible: list[Verdict] = field(default_factory=list)  # within every limit, `sort_key` order
    ties: list[Verdict] = field(default_factory=list)  # best and every one whose interval overlaps it
    standings: list[Standing] = field(default_factory=list)  # the chosen one against each other feasible one
    criterion: str = ""  # what chose among the ties ('' when the chosen one is the best outright)
    confirmation: Confirmation | None = None
    flagged_better: list[Verdict] = field(default_factory=list)  # rest on flagged runs, would beat the chosen
    reason: str = ""
    confidence: str = ""

    @property
    def close_calls(self) -> list[Standing]:
        return [s for s in self.standings if s.kind == CLOSE_CALL]

    @property
    def open_close_calls(self) -> list[Standing]:
        """The close calls that more runs can still settle (`settleable`): those worth measuring again."""
        return [s for s in self.close_calls if self.chosen is not None and settleable(s, self.chosen, self.rules)]

    @property
    def contenders(self) -> list[Verdict]:
        """The ties, the chosen one first."""
        return sorted(self.ties, key=lambda v: v is not self.chosen)

    def measured(self) -> list[Verdict]:
        return [v for v in self.verdicts.values() if v.measured]


# -- judging -----------------------------------------------------------------------------------------
def _summarise(configs: Mapping[str, Mapping[str, Any]], runs_by_config: Mapping[str, Sequence[Run]],
               rules: Rules) -> dict[str, Verdict]:
    """Each configuration judged on the ok runs given (of one energy source), with the typical spread of the
    clean repeats among them."""
    out: dict[str, Verdict] = {}
    objectives: dict[str, list[float]] = {}
    powers: dict[str, list[float]] = {}
    for config_id, ok in runs_by_config.items():
        config = configs[config_id]
        kept = [ok[i] for i in counted(ok)]
        clean = bool(kept)
        runs = kept if clean else list(ok)
        verdict = out[config_id] = Verdict(dict(config), [], counted=runs, clean=clean)
        verdict.compile_estimated = any(compile_energy(r)[1] for r in runs
                                        if getattr(r, rules.energy_figure) is not None)
        runs = with_process_compile(runs)
        values = [(run_objective(r, config, rules), r) for r in runs]
        objectives[config_id] = [v for v, _ in values if v is not None]
        powers[config_id] = [r.avg_power_w for r in runs if r.avg_power_w is not None]
        energies = [amortised_j(r, rules) for r in runs]
        energies = [e for e in energies if e is not None]
        verdict.amortised_j = median(energies) if energies else None
        peaks = [r.peak_power_w for r in runs if r.peak_power_w is not None]
        verdict.peak_power_w = max(peaks) if peaks else None
        matches = [r.tokens_match for r in runs if r.tokens_match is not None]
        verdict.tokens_match = all(matches) if matches else None
        steps = [r.tokens_match_steps for r in runs if r.tokens_match_steps is not None]
        verdict.tokens_match_steps = min(steps) if steps else None
        for name in ("latency_ms_p95", "max_rel_error", "tpot_ms_p50", "tpot_ms_p95", "ttft_ms_p50"):
            figures = [getattr(r, name) for r in runs if getattr(r, name) is not None]
            setattr(verdict, name, median(figures) if figures else None)
        compiles = [r.compile_s for r in runs if r.compile_s is not None]
        verdict.compile_s = median_interval(compiles, confidence=rules.confidence) if compiles else None
    for values, target in ((objectives, "objective"), (powers, "avg_power_w")):
        found = intervals({cid: values[cid] for cid in out}, {cid for cid, v in out.items() if v.clean},
                          confidence=rules.confidence)
        for config_id, interval in found.items():
            setattr(out[config_id], target, interval)
    for config_id, verdict in out.items():
        power = verdict.avg_power_w
        bound = distribution_free_high(powers[config_id], confidence=rules.confidence) if power else None
        if power is not None and bound is not None and bound < power.high:
            # Enough runs for a bound that assumes no distribution: the envelope is not held against a power
            # above every one of them because other configurations' runs spread more.
            which = "its highest run" if bound == max(powers[config_id]) else "an order statistic of its runs"
            verdict.avg_power_w = replace(power, high=bound, method=f"{power.method}, at most {which}")
    return out


def intervals(values_per_config: Mapping[str, Sequence[float]], typical_of: Collection[str] | None = None, *,
              confidence: float = DEFAULT_CONFIDENCE) -> dict[str, Interval]:
    """config id -> the median of its values with an interval for it, each configuration's spread moderated
    by the typical spread of the others with repeats (`policies.noise`; of those in `typical_of` only,
    when given: runs that do not count yet do not shape it); configurations with no value are left out."""
    typical = typical_rel_std([v for cid, v in values_per_config.items() if typical_of is None or cid in typical_of])
    spread = assumed_spread_rel(typical, confidence=confidence)
    return {cid: median_interval(values, confidence=confidence, spread_rel=spread, prior_rel_std=typical)
            for cid, values in values_per_config.items() if values}


def counted_rows(rows: Sequence[Any]) -> list[Any]:
    """The stored runs of one configuration (`store.RunRow`s) that count: every ok one once a clean one
    exists (`noise.counted`), else every ok one, each flagged "repeat this run"."""
    ok = [row for row in rows if row.ok]
    kept = counted([Run.from_row(row) for row in ok])
    return [ok[i] for i in kept] if kept else ok


def check_limits(verdict: Verdict, rules: Rules) -> list[str]:
    """The limits `verdict` breaks, or cannot be verified on, as reasons ('max_avg_power_w: measured ...')."""
    out = []
    runs = verdict.runs_text
    for limit, value in rules.limits.items():
        figure, unit, _ = LIMITS[limit]
        bound = rules.limits.bound(limit, value)
        power = verdict.avg_power_w
        if limit == "max_avg_power_w":
            measured = power.high if power else None
            what = f"{figure} upper bound (median {fmt(power.median, unit)}, {runs})" if power else figure
        elif limit == "max_peak_power_w":
            measured, what = verdict.peak_power_w, f"{figure} highest of {runs}"
        elif limit == "max_compile_s":
            measured, what = (verdict.compile_s.median if verdict.compile_s else None), f"{figure} median of {runs}"
        else:
            measured, what = getattr(verdict, figure), f"{figure} median of {runs}"
        if measured is None:
            out.append(f"{limit}: {figure} was not measured, so the limit {rules.limit_text(limit, value)} cannot "
                       f"be verified")
        elif measured > bound:
            out.append(f"{limit}: measured {what} {fmt(measured, unit)} > limit {rules.limit_text(limit, value)}")
            if limit == "max_avg_power_w" and power is not None and power.median <= bound:
                verdict.power_straddles = True
    return out


def predicted_violations(predicted: Mapping[str, Sequence[float]], rules: Rules) -> tuple[list[str], list[str]]:
    """(the limits a prediction ({figure: (mean, std)}) says a configuration breaks, the limits a prediction
    cannot speak to): a prediction never grants a limit, it only proposes what to measure."""
    broken, notes = [], []
    for limit, value in rules.limits.items():
        figure, unit, _ = LIMITS[limit]
        if limit in ("max_peak_power_w", "max_rel_error") or figure not in predicted:
            notes.append(f"{limit} cannot be predicted; needs a measurement")
            continue
        mean, std = predicted[figure][0], predicted[figure][1]
        if mean > rules.limits.bound(limit, value):
            broken.append(f"{limit}: predicted {figure} {fmt(mean, unit)} ± {fmt(std, unit)} > limit "
                          f"{rules.limit_text(limit, value)}")
    return broken, notes


def judge(configs: Sequence[Mapping[str, Any]], runs: Mapping[str, Sequence[Run]], rules: Rules, *,
          exclude: Mapping[str, str] | Collection[str] = ()) -> Judgement:
    """The decision `runs` (config id -> its runs, in any order) support among `configs` (the grid's rows,
    measured or not) under `rules`. `exclude`: configurations rejected whatever their runs say (config id ->
    why; ids alone: they broke the power envelope in a deployment)."""
    rows = {str(c["id"]): c for c in configs}
    why_excluded = dict(exclude) if isinstance(exclude, Mapping) else \
        {cid: "broke the power envelope in a live deployment (envelope guard)" for cid in exclude}
    given = {cid: list(runs.get(cid, ())) for cid in rows}
    ok_by_config = {cid: [r for r in rs if r.ok] for cid, rs in given.items()}
    grouped = group_by_source({cid: rs for cid, rs in ok_by_config.items() if rs}, lambda r: r.energy_source)
    per_source = {source: _summarise(rows, group, rules) for source, group in grouped.items()}
    for summaries in per_source.values():
        for cid, verdict in summaries.items():
            verdict.violations = check_limits(verdict, rules) if verdict.measured else \
                [f"{rules.objective}: the objective's figures were not measured"]
            if cid in why_excluded:
                verdict.violations.append(why_excluded[cid])
    order = ranked_sources({source: len(group) for source, group in grouped.items()})
    ranked = pick_source(order, [lambda s: any(v.feasible for v in per_source[s].values()),
                                 lambda s: any(v.only_power for v in per_source[s].values())])
    own = own_sources(grouped, order)
    verdicts: dict[str, Verdict] = {}
    for cid, row in rows.items():
        source = ranked if cid in grouped.get(ranked or "", {}) else own.get(cid)
        if source is None:
            verdict = Verdict(dict(row), given[cid], status="failed" if given[cid] else "unmeasured")
            if cid in why_excluded:
                verdict.violations.append(why_excluded[cid])
        else:
            verdict = per_source[source][cid]
            verdict.runs, verdict.source = given[cid], source
            if source != ranked:
                verdict.not_compared = not_compared_text(source, str(ranked))
                verdict.status = UNCOMPARED
            elif verdict.violations:
                verdict.status = "rejected"
            else:
                verdict.status = "kept" if verdict.clean else "flagged"
        verdicts[cid] = verdict
    out = Judgement(rules, verdicts, ranked_source=ranked)
    _rank(out)
    _explain(out)
    return out


def _rank(out: Judgement) -> None:
    rules = out.rules
    compared = [v for v in out.verdicts.values() if v.compared and v.measured]
    out.feasible = sorted((v for v in compared if v.feasible), key=Verdict.sort_key)
    chosen_level = math.inf
    if out.feasible:
        best = out.best = out.feasible[0]
        assert best.objective is not None
        out.ties = [v for v in out.feasible if v is best or v.objective.overlaps(best.objective)]  # type: ignore[union-attr]
        # The tie-break chooses among the best and the ties that can be worse than it by at most the tolerance;
        # one that could be worse by more is a close call: more runs decide, and until then the best stands.
        settled = [v for v in out.ties if v is best or standing(v, best, rules.tolerance).kind != CLOSE_CALL]
        chosen = best
        if len(settled) > 1:
            winner, criterion = break_tie([v.tie_entry() for v in settled])
            chosen = next(v for v in settled if v.config_id == winner.key)
            out.criterion = criterion if chosen is not best else ""
        out.chosen = chosen
        out.standings = [standing(chosen, v, rules.tolerance) for v in out.feasible if v is not chosen]
        for v in out.ties:
            v.status = "tied"
        chosen.status = "chosen"
        assert chosen.objective is not None
        chosen_level = chosen.objective.median
        own = [r for r in chosen.runs if not r.ok or source_key(r.energy_source) == chosen.source]
        out.confirmation = confirmation(own, rules.min_repeats,
                                        separated=all(s.separated for s in out.standings))
        out.state = "verified" if out.confirmation.confirmed else "provisional"
    out.flagged_better = sorted((v for v in out.verdicts.values() if v.status == "flagged" and v.measured
                                 and v.compared and v.sort_key()[0] < chosen_level), key=Verdict.sort_key)
    if out.chosen is None and not out.flagged_better:
        pick = infeasible_pick(compared)
        if pick is not None:
            out.chosen, out.state = pick, "infeasible"
            pick.status = "chosen"
        else:
            out.state = "fallback"
    elif out.chosen is None:
        out.state = "provisional"


def infeasible_pick(verdicts: Sequence[Verdict]) -> Verdict | None:
    """The lowest-power configuration that meets every limit but the power ones (by the upper end of its
    average power's interval, then its peak, then its objective), or None."""
    pool = [v for v in verdicts if v.only_power and v.compared]
    if not pool:
        return None

    def power(v: Verdict) -> tuple:
        return (v.avg_power_w.high if v.avg_power_w else math.inf,
                v.peak_power_w if v.peak_power_w is not None else math.inf, v.sort_key())

    return min(pool, key=power)


# -- words -------------------------------------------------------------------------------------------
def tie_text(criterion: str, chosen: Verdict, other: Verdict) -> str:
    """'lower average power (300 W vs 400 W)', 'cheaper compile (12 s vs 40 s)', 'simpler mode (default vs
    max-autotune)' or 'lower median (...)': what the tie-break decided on, with both figures."""
    if criterion == "lower average power" and chosen.avg_power_w and other.avg_power_w:
        return f"{criterion} ({fmt(chosen.avg_power_w.median, 'W')} vs {fmt(other.avg_power_w.median, 'W')})"
    if criterion == "cheaper compile" and chosen.compile_s and other.compile_s:
        return f"{criterion} ({fmt(chosen.compile_s.median, 's')} vs {fmt(other.compile_s.median, 's')})"
    if criterion == "simpler mode":
        return f"{criterion} ({chosen.mode} vs {other.mode})"
    return "lower median (average power, compile and mode within the noise)"


def _pct(value: float) -> str:
    """A relative figure in percent: one decimal under 10% (2.9%), none above (21%)."""
    return f"{100 * value:.1f}%" if abs(value) < 0.1 else f"{value:.0%}"


def standing_text(s: Standing, chosen: Verdict, tolerance_pct: float) -> str:
    """The chosen configuration against one rival, in words."""
    rival = s.rival
    if s.kind == BEATEN:
        return f"{chosen.label} beats {rival.label} by {_pct(s.diff_rel)} +- {_pct(s.plus_minus_rel)}"
    lower = chosen.label if s.diff_rel >= 0 else rival.label
    figures = f"{lower} lower by {_pct(abs(s.diff_rel))} +- {_pct(s.plus_minus_rel)}"
    if s.kind == WITHIN_TOLERANCE and abs(s.diff_rel) + s.plus_minus_rel <= tolerance_pct / 100.0:
        head = (f"{chosen.label} and {rival.label} are within {tolerance_pct:g}% of each other "
                f"({_pct(abs(s.diff_rel))} +- {_pct(s.plus_minus_rel)})")
    elif s.kind == WITHIN_TOLERANCE:
        head = (f"{chosen.label} cannot be worse than {rival.label} by more than the {tolerance_pct:g}% tolerance "
                f"({figures})")
    else:
        head = (f"{chosen.label} and {rival.label} tie within the noise ({figures}), and could still differ by more "
                f"than the {tolerance_pct:g}% tolerance")
    if chosen.objective and rival.objective and chosen.objective.overlaps(rival.objective):
        winner, criterion = break_tie([chosen.tie_entry(), rival.tie_entry()])
        if winner.key == chosen.config_id:
            head += f"; chosen for {tie_text(criterion, chosen, rival)}"
        else:  # the rival would win the tie-break, but could be worse than the chosen one by over the tolerance
            head += (f"; {rival.label} has the {tie_text(criterion, rival, chosen)}, but could be worse by more than "
                     f"the {tolerance_pct:g}% tolerance")
    return head


def _explain(out: Judgement) -> None:
    rules = out.rules
    text = objective_text(rules.objective, rules.per_sample, rules.generates)
    chosen, ranked = out.chosen, out.ranked_source
    n_all = len(out.verdicts)
    uncompared: dict[str, list[str]] = {}
    for v in out.verdicts.values():
        if v.status == UNCOMPARED and v.source:
            uncompared.setdefault(v.source, []).append(v.label)
    parts: list[str] = []
    if out.state in ("verified", "provisional") and chosen is not None:
        best = out.best
        assert best is not None and best.objective is not None and chosen.objective is not None
        if chosen is best:
            parts.append(f"{chosen.label} is the measured configuration with the lowest median {text} "
                         f"({fmt(chosen.objective.median)}, {chosen.runs_text}) within every limit")
        else:
            parts.append(f"{chosen.label} ties with {best.label} (lowest median {text} {fmt(best.objective.median)})"
                         f" within the noise and wins the tie-break on {tie_text(out.criterion, chosen, best)}")
        settled = [s for s in out.standings if s.kind == WITHIN_TOLERANCE and s.rival in out.ties]
        live = out.open_close_calls
        beyond = [s for s in out.close_calls if s not in live]
        if live:
            parts.append(f"{', '.join(s.rival.label for s in live)} could still beat it by more than the "
                         f"{rules.tolerance_pct:g}% tolerance")
        if beyond:
            parts.append(f"{', '.join(s.rival.label for s in beyond)} could still beat it by more than the "
                         f"{rules.tolerance_pct:g}% tolerance, but the runs are too noisy for {rules.max_repeats} "
                         f"runs of each to tell (+-{_pct(max(s.plus_minus_rel for s in beyond))} now): the lower "
                         f"median stands and they are not measured again")
        if not live and not beyond and settled:
            parts.append(f"{', '.join(s.rival.label for s in settled)} cannot beat it by more than the "
                         f"{rules.tolerance_pct:g}% tolerance: a tie that more runs would not make matter")
        if chosen.compile_estimated and rules.objective != "latency":
            parts.append("its compile energy was not metered: estimated as compile seconds x average power")
        if chosen.tokens_match is False:
            parts.append(tokens_note(chosen))
        if estimate_note(ranked):
            parts.append(str(estimate_note(ranked)))
        parts.append(f"{len(out.feasible)} of {n_all} candidates measured within limits")
        if uncompared:
            parts.append(uncompared_summary(uncompared, str(ranked)))
        assert out.confirmation is not None
        if not out.confirmation.confirmed:
            parts.append(out.confirmation.shortfall())
        out.confidence = _confidence(out)
    elif out.state == "infeasible" and chosen is not None:
        out.confidence = shortfall(chosen, rules)
        parts.append(f"the power envelope cannot be met: no measured configuration is within it, so "
                     f"{chosen.label}, the lowest-power one that meets the other limits, is applied: "
                     f"{out.confidence}")
        if estimate_note(ranked):
            parts.append(str(estimate_note(ranked)))
        if uncompared:
            parts.append(uncompared_summary(uncompared, str(ranked)))
    else:
        if out.flagged_better:
            labels = ", ".join(v.label for v in out.flagged_better)
            parts.append(f"the only measured configurations within every limit ({labels}) rest on runs flagged "
                         f"\"repeat this run\", so the policy's fallback is applied until a clean run confirms them")
        if uncompared:
            parts.append(uncompared_summary(uncompared, str(ranked)))
    out.reason = "; ".join(parts)


def tokens_note(verdict: Verdict) -> str:
    """What a generation's greedy tokens say beside its error figure, for a configuration whose tokens do not all
    match eager's in its own precision (reported; it limits nothing, see the module docstring)."""
    precision = str(verdict.config.get("precision") or "fp32")
    steps = verdict.tokens_match_steps
    where = f"for the first {steps} step{'s' if steps != 1 else ''} only" if steps is not None else "not for every step"
    return (f"its greedy tokens match eager {precision}'s {where} (reported, not a limit: the accuracy limit is "
            f"max_rel_error on the logits)")


def _confidence(out: Judgement) -> str:
    chosen = out.chosen
    assert chosen is not None and chosen.objective is not None
    rivals = [s for s in out.standings]
    if not rivals:
        return f"{chosen.label} is the only measured configuration within every limit"
    # The rival that matters most: a close call first, then the nearest one.
    rival = min(rivals, key=lambda s: (s.kind != CLOSE_CALL, s.rival.sort_key()))
    assert rival.rival.objective is not None
    return (f"{standing_text(rival, chosen, out.rules.tolerance_pct)} (median of {chosen.objective.n} vs "
            f"{rival.rival.objective.n} runs)")


def shortfall(verdict: Verdict, rules: Rules) -> str:
    """'lowest measured average power 282 W (the upper bound of its 3 runs, whose median is 262 W) exceeds 250 W
    by 13%', per power limit the configuration breaks: the figure the envelope is checked on, and the median
    beside it (a deployment's own average power compares with the median)."""
    parts = []
    for limit, value in rules.limits.items():
        bound = rules.limits.bound(limit, value)
        if limit == "max_avg_power_w" and verdict.avg_power_w is not None:
            power = verdict.avg_power_w
            measured = power.high
            what = (f"average power {fmt(measured, 'W')} (the upper bound of its {verdict.runs_text}, whose median "
                    f"is {fmt(power.median, 'W')})")
        elif limit == "max_peak_power_w" and verdict.peak_power_w is not None:
            measured = verdict.peak_power_w
            what = f"peak power {fmt(measured, 'W')}"
        else:
            continue
        if measured > bound:
            parts.append(f"lowest measured {what} exceeds {rules.limit_text(limit, value)} by "
                         f"{_pct(measured / bound - 1)}")
    return "; ".join(parts)


# -- what to measure again ---------------------------------------------------------------------------
def _may_yet_fit(verdict: Verdict) -> bool:
    """Measured cleanly and compared, and kept out only by what more runs may change: its average power's
    interval straddling the envelope, or a figure a limit needs that its runs did not measure."""
    return (verdict.measured and verdict.clean and verdict.compared and bool(verdict.violations)
            and all("was not measured" in v or (v.startswith("max_avg_power_w") and verdict.power_straddles)
                    for v in verdict.violations))


# A precision whose measured relative error is this many times the limit or more is tried in another
# configuration only after the rest (one near the limit may yet meet it in another mode).
FAR_OVER = 2.0


def deferred(config: Mapping[str, Any], out: Judgement) -> str:
    """Why an unmeasured `config` waits until every other candidate was considered ('' when it does not):
    what this workload's runs showed of its precision (a run of it failed the numerical check by more than
    FAR_OVER times `max_rel_error`) or of its mode (a compile of it overran the worker's budget). The guided
    search measures it last, and the resolver does not propose it for measuring."""
    precision, mode = config.get("precision"), config.get("mode")
    limit = out.rules.limits.max_rel_error
    verdicts = list(out.verdicts.values())
    for verdict in verdicts:
        error = verdict.max_rel_error
        if (verdict.measured and verdict.config.get("precision") == precision and limit is not None
                and error is not None and error > FAR_OVER * limit):
            return (f"{precision} failed the numerical check in {verdict.label} (relative error {fmt(error)}, "
                    f"over {FAR_OVER:g}x the limit)")
    for verdict in verdicts:
        if verdict.config.get("mode") == mode and any(r.compile_overran for r in verdict.runs):
            return f"{mode}'s compile overran the budget in {verdict.label}"
    return ""



@dataclass(frozen=True)
class Wanted:
    """A configuration to measure again: the runs it still needs (`advice.more`, one new worker process
    taking that many windows) and why."""

    verdict: Verdict
    advice: RepeatAdvice
    close: bool  # a close call or a configuration that may yet be within the limits (not just confirming)

    @property
    def config_id(self) -> str:
        return self.verdict.config_id


def settleable(s: Standing, chosen: Verdict, rules: Rules) -> bool:
    """Whether more runs can still settle close call `s`: with `max_repeats` runs on each side, each interval
    narrowing as the square root of its runs and as its t-quantile falls with the runs (taken without the
    prior's degrees of freedom, the larger fall, so that a close call is given up only when even that leaves
    it open), the chosen one could no longer be worse than the rival by more than the tolerance. A side of
    fewer than MIN_REPEATS runs has an assumed interval, which more runs replace with a measured one: such a
    close call is always worth its runs."""
    a, b = chosen.objective, s.rival.objective
    assert a is not None and b is not None
    if a.n < MIN_REPEATS or b.n < MIN_REPEATS:
        return True
    quantile = (1 + rules.confidence) / 2

    def narrowed(n: int) -> float:
        cap = max(rules.max_repeats, n)
        return math.sqrt(n / cap) * t_quantile(quantile, cap - 1) / t_quantile(quantile, n - 1)

    at_cap = math.hypot(s.facing_rel[0] * narrowed(a.n), s.facing_rel[1] * narrowed(b.n))
    return at_cap - s.diff_rel <= rules.tolerance


def repeats(out: Judgement) -> list[Wanted]:
    """What the judgement asks to measure again, most pressing first (see the module docstring): none with
    `min_repeats = 1` (the policy said one run is enough). The cap of runs counts every run of a
    configuration, failed and flagged ones included; confirming counts the runs of the source ranked."""
    rules = out.rules
    if rules.min_repeats <= 1:
        return []
    chosen = out.chosen
    unverified = [v for v in out.verdicts.values() if v is not chosen and _may_yet_fit(v)]
    if out.state == "infeasible" and chosen is not None:
        bound = dict(rules.limits.items()).get("max_avg_power_w")
        limit = rules.limits.bound("max_avg_power_w", bound) if bound is not None else None
        flagged = [v for v in out.verdicts.values() if v.compared and not v.clean and v.measured and limit is not None
                   and any(r.avg_power_w is not None and r.avg_power_w <= limit for r in v.counted)]
        # Those that may yet be within every limit first: one that turns out so makes the infeasible pick moot.
        order = [(v, True) for v in sorted({v.config_id: v for v in [*unverified, *flagged]}.values(),
                                           key=Verdict.sort_key)] + [(chosen, False)]
    elif chosen is not None:
        # Only those that could beat the chosen one by more than the tolerance are worth another run.
        hopeful = [v for v in [*out.flagged_better, *unverified]
                   if v.objective is not None and standing(chosen, v, rules.tolerance).kind == CLOSE_CALL]
        live = out.open_close_calls
        close = bool(live)
        order = [(v, v is not chosen or close) for v in sorted(
            {v.config_id: v for v in [chosen, *[s.rival for s in live], *hopeful]}.values(),
            key=Verdict.sort_key)]
    else:
        order = [(v, True) for v in sorted({v.config_id: v for v in [*out.flagged_better, *unverified]}.values(),
                                           key=Verdict.sort_key)]
    wanted = []
    for verdict, close in order:
        if verdict is chosen and out.confirmation is not None and out.confirmation.confirmed and not close:
            continue
        separated = verdict is chosen and out.confirmation is not None and out.confirmation.separated
        advice = repeat_advice(verdict.runs, close_call=close, min_repeats=rules.min_repeats,
                               max_repeats=rules.max_repeats, separated=separated)
        if advice.more > 0:
            wanted.append(Wanted(verdict, advice, close))
    return wanted
