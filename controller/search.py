"""Guided search: which configuration of a grid to measure next, when to stop, and which one to choose.

A pure engine: the caller gives the grid (configs rows), a `measure(config, fresh_process)` callback that
returns one `Observation`, and optionally a `predict(configs)` callback that returns the trade-off model's
{target: (mean, std)} per configuration (`TradeoffModel.predict_many`); the daemon, `bench` and
`benchmarks/search_replay.py` all drive it the same way.

How it searches (`strategy = "guided"`):

1. Baselines first: eager fp32 and stock compile (default mode, default fusion) fp32, at the baseline
   batch size, when the grid has them: reports need them, and they calibrate the model for this workload.
2. The model's predictions for this workload are corrected by what was measured so far, and grow surer
   as configurations that share a precision, mode, fusion preset or batch size are measured
   (`search_forecast`: a Gaussian process over the model's errors): the forest is fitted once per
   search, and this correction is what is updated after every measurement (milliseconds, whatever the
   size of the store).
3. Each unmeasured configuration gets an acquisition value: the expected improvement of the amortised
   objective (lognormal prediction) on what the search can already count on, times the predicted
   probability that it meets the limits (with `margin_pct`), divided by the predicted seconds to measure
   it (compile seconds plus the workload's measured overhead per run). What it can count on is the best
   measured configuration within every limit, or another candidate at least even odds to meet the
   limits, taken one spread above its prediction, whichever is lower: a cheap candidate is not measured
   first only because it beats the baselines when another is likely to beat it. Before anything is
   measured within the limits or likely to be, it is the probability of meeting the limits per second,
   scaled by 1/objective.
4. A configuration is skipped, with its reason recorded, when its expected improvement on the best
   measured median beyond that median's noise (lognormal prediction, times its probability of meeting
   the limits) is under `min_expected_gain` (1%) of that median, when it is predicted to break a limit
   (probability below `min_feasible_probability`), or, for the energy objective, when its expected
   saving over `expected_inferences` is less than the energy measuring it costs (so max-autotune is
   measured only when it is predicted to be worth its compile time).
5. Contenders are measured again (`policies.noise.repeat_advice`): the best measured configuration
   within the limits and every one whose interval overlaps it, at least `min_repeats` times in at
   least two processes. A repeat starts a new worker process and takes the windows still needed in it
   (`Step.windows`: each window is stored as a run of its own, the later ones marked as windows of the
   same process), so confirming a contender costs one more compile, not two. Close calls get another
   process of two windows, up to `max_repeats` runs: an average power whose interval straddles the
   envelope, and a tie that more runs may still decide otherwise (the tie-break chose another than the
   lowest median; a tie whose lowest median also wins the tie-break is repeated to the minimum only).
6. It stops when nothing is left to measure or repeat, when `budget_s` seconds of measuring are spent,
   or after `max_measurements` measurements; a measurement predicted to overrun the budget is not
   started.

`strategy = "exhaustive"` measures every configuration once, cheapest compile first, then repeats the
contenders the same way.

The decision (`decide`): among configurations whose counted runs meet every limit (average power by
the upper end of its interval, peak power by the highest instant power seen, the others by their
median; a figure a limit needs that no run measured fails it), the lowest median objective wins, and
every configuration whose interval overlaps it ties; a tie goes to lower average power, then the
cheaper compile, then the simpler mode, each only where it differs by more than its own noise
(`policies.noise.break_tie`). The state is `verified` when the choice rests on at least `min_repeats`
counted runs, two of them in fresh processes, else `provisional` (`policies.noise.confirmation`, the
rule the resolver applies too). When nothing fits, the lowest-power
configuration that meets the other limits is chosen with state `infeasible` and the shortfall; `failed`
when nothing was measured successfully. With several batch sizes in the grid the objective is per
sample (J / batch size); latency limits apply per call. Runs of different energy sources are never compared
(`policies.sources`, the resolver's rule): every figure above is over a configuration's runs of the one
source the decision ranks (the most trustworthy with a configuration within every limit, else with one only
the power limits reject), and a configuration measured only with another is summarised on its own source's
runs, `not_compared`, and never chosen, tied or repeated as a contender. A decision that ranks estimates says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from joulepilot.policies.noise import (
    TIE,
    assumed_spread_rel,
    break_tie,
    compare,
    confirmation,
    counted,
    median,
    median_interval,
    mode_rank,
    repeat_advice,
    typical_rel_std,
)
from joulepilot.policies.schema import Limits
from joulepilot.policies.sources import (
    estimate_note,
    group_by_source,
    not_compared_text,
    own_sources,
    pick_source,
    ranked_sources,
    source_key,
    uncompared_summary,
)
from joulepilot.store.jsonvalues import json_column

from .features import config_row
from .search_forecast import DEFAULT_OVERHEAD_S, Arm, Forecast, Forecaster, expected_improvement
from .search_types import (
    LIMIT_UNITS,
    POWER_LIMITS,
    STATES,
    STRATEGIES,
    MeasuredConfig,
    Measurer,
    Observation,
    Predictor,
    SearchResult,
    SearchSettings,
    SearchStep,
    SkippedConfig,
    fmt,
    limit_value,
    objective_unit,
    per_sample_objective,
    run_objective,
)

__all__ = ["STATES", "STRATEGIES", "GuidedSearch", "MeasuredConfig", "Observation", "SearchResult",
           "SearchSettings", "SearchStep", "SkippedConfig", "run_objective", "run_search"]

# An unmeasured candidate at least this likely to meet the limits is counted on to deliver its objective
# at one spread (log sd) above its prediction: measuring another is worth only what it may improve on that.
REACHABLE_MIN_P = 0.5
REACHABLE_SD = 1.0

Decision = tuple[str, MeasuredConfig | None, str, str, list[MeasuredConfig]]


def _is_baseline(config: Mapping[str, Any], batch_size: int) -> bool:
    return (config.get("precision") == "fp32" and config.get("fusion") == "default"
            and not bool(config.get("dynamic")) and (config.get("padding") or "none") == "none"
            and not config.get("regional")
            and json_column(config.get("options"), {}) in ({}, None)
            and int(config.get("batch_size") or 1) == batch_size and config.get("mode") in ("eager", "default"))


def _cost_rank(config: Mapping[str, Any]) -> tuple:
    precision_order = ("fp32", "tf32", "bf16", "fp16")
    precision = config.get("precision")
    return (mode_rank(str(config.get("mode"))), config.get("fusion") != "default",
            precision_order.index(precision) if precision in precision_order else len(precision_order),
            int(config.get("batch_size") or 1), str(config.get("label") or config.get("id")))


class Step(NamedTuple):
    """One measurement the search asks for: a process measuring `arm` for `windows` windows in a row
    (the first counts as a fresh process when `fresh_process`, the others as further windows of it)."""

    arm: Arm
    fresh_process: bool
    kind: str  # baseline | guided | exhaustive | repeat
    why: str
    windows: int = 1


class GuidedSearch:
    """One search over one grid; `run()` measures until the stop rule holds and returns the result."""

    def __init__(self, candidates: Sequence[Any], measure: Measurer, predict: Predictor | None = None, *,
                 limits: Limits | None = None, settings: SearchSettings | None = None,
                 prior: Mapping[str, Sequence[Observation]] | None = None,
                 refresh_predictions: bool = False, spent_s: float = 0.0, measurements: int = 0) -> None:
        rows = [config_row(c) for c in candidates]
        if not rows:
            raise ValueError("the search needs at least one candidate configuration")
        self.arms: dict[str, Arm] = {}
        for row in rows:
            self.arms.setdefault(str(row["id"]), Arm(row))
        for config_id, observations in (prior or {}).items():
            if config_id in self.arms:
                self.arms[config_id].runs.extend(observations)
        self.measure = measure
        self.predict = predict
        self.limits = limits or Limits()
        self.settings = settings or SearchSettings()
        self.refresh_predictions = refresh_predictions
        self.per_sample = per_sample_objective(rows)
        self.unit = objective_unit(self.settings.objective, self.per_sample)
        self.forecaster = Forecaster(self.arms, self.limits, self.settings, self.per_sample)
        batch = self.settings.baseline_batch_size or int(rows[0].get("batch_size") or 1)
        self.baselines = [a for a in sorted(self.arms.values(), key=lambda a: mode_rank(a.config["mode"]))
                          if _is_baseline(a.config, batch)]
        self.steps: list[SearchStep] = []
        # A search resumed from stored runs (controller.guided): what it had already spent of its budget.
        self.spent_s = float(spent_s)
        self.measurements_before = int(measurements)
        self.skip_reasons: dict[str, tuple[str, Forecast | None]] = {}
        self._predicted = False
        self._budget_blocked = False

    # -- predictions -----------------------------------------------------------------------------------
    def _refresh_raw(self) -> None:
        if self.predict is None or (self._predicted and not self.refresh_predictions):
            return
        arms = list(self.arms.values())
        for arm, pred in zip(arms, self.predict([a.config for a in arms]), strict=True):
            arm.raw = {t: (float(m), float(s)) for t, (m, s) in dict(pred).items()
                       if isinstance(m, int | float) and math.isfinite(m) and m > 0
                       and isinstance(s, int | float) and math.isfinite(s) and s >= 0}
        self.forecaster.reset()
        self._predicted = True

    # -- measured summaries ----------------------------------------------------------------------------
    def summaries(self) -> dict[str, MeasuredConfig]:
        """Every arm with at least one run, summarised with the noise of this workload's repeats.

        Runs of different energy sources are never compared (`policies.sources`): each source's runs are
        summarised apart, and an arm is judged on its runs of the source the decision ranks (the most
        trustworthy with an arm within every limit, else with one only the power limits reject, else the most
        trustworthy present); an arm measured only otherwise keeps its own source's figures, marked
        `not_compared`."""
        ok_by_arm = {arm.id: arm.ok_runs() for arm in self.arms.values() if arm.ok_runs()}
        grouped = group_by_source(ok_by_arm, lambda run: run.energy_source)
        per_source = {source: self._summaries_of(group) for source, group in grouped.items()}
        order = ranked_sources({source: len(group) for source, group in grouped.items()})
        ranked = pick_source(order, [
            lambda source: any(m.feasible for m in per_source[source].values()),
            lambda source: any(m.ok and m.violations and all(v.split(":")[0] in POWER_LIMITS for v in m.violations)
                               for m in per_source[source].values())])
        own = own_sources(grouped, order)
        out: dict[str, MeasuredConfig] = {}
        for arm in self.arms.values():
            if not arm.runs:
                continue
            source = ranked if arm.id in grouped.get(ranked or "", {}) else own.get(arm.id)
            if source is None:  # failed runs only
                out[arm.id] = self._summaries_of({arm.id: []})[arm.id]
                continue
            summary = per_source[source][arm.id]
            summary.energy_source = source
            if source != ranked:
                summary.not_compared = not_compared_text(source, str(ranked))
            out[arm.id] = summary
        return out

    def _summaries_of(self, runs_by_arm: Mapping[str, Sequence[Observation]]) -> dict[str, MeasuredConfig]:
        """The arms named, each judged on the ok runs given (of one energy source), with the typical spread of
        their repeats."""
        s = self.settings
        objectives: dict[str, list[float]] = {}
        powers: dict[str, list[float]] = {}
        counted_by_arm: dict[str, list[Observation]] = {}
        for arm_id, given in runs_by_arm.items():
            arm = self.arms[arm_id]
            runs = counted_by_arm[arm_id] = [given[i] for i in counted([r.mark() for r in given])]
            values = (run_objective(r, arm.config, objective=s.objective, expected_inferences=s.expected_inferences,
                                    per_sample=self.per_sample) for r in runs)
            objectives[arm_id] = [v for v in values if v is not None]
            powers[arm_id] = [r.avg_power_w for r in runs if r.avg_power_w is not None]
        typical_obj = typical_rel_std(list(objectives.values()))
        typical_pow = typical_rel_std(list(powers.values()))
        spread_obj = assumed_spread_rel(typical_obj, confidence=s.confidence)
        spread_pow = assumed_spread_rel(typical_pow, confidence=s.confidence)
        out: dict[str, MeasuredConfig] = {}
        for arm_id in runs_by_arm:
            arm = self.arms[arm_id]
            runs = counted_by_arm[arm_id]
            summary = MeasuredConfig(arm.id, arm.label, arm.config, list(arm.runs))
            out[arm.id] = summary
            if objectives[arm.id]:
                summary.objective = median_interval(objectives[arm.id], confidence=s.confidence,
                                                    spread_rel=spread_obj, prior_rel_std=typical_obj)
            if not summary.ok:
                summary.status = "flagged" if arm.ok_runs() else "failed"
                continue
            if powers[arm.id]:
                summary.avg_power_w = median_interval(powers[arm.id], confidence=s.confidence,
                                                      spread_rel=spread_pow, prior_rel_std=typical_pow)
            peaks = [r.peak_power_w for r in runs if r.peak_power_w is not None]
            summary.peak_power_w = max(peaks) if peaks else None
            latencies = [r.latency_ms_p95 for r in runs if r.latency_ms_p95 is not None]
            summary.latency_ms_p95 = median(latencies) if latencies else None
            errors = [r.max_rel_error for r in runs if r.max_rel_error is not None]
            summary.max_rel_error = median(errors) if errors else None
            compiles = [r.compile_s for r in runs if r.compile_s is not None]
            if compiles:
                summary.compile_s = median(compiles)
                summary.compile_s_interval = median_interval(compiles, confidence=s.confidence)
            self._check_limits(summary)
        return out

    def _check_limits(self, summary: MeasuredConfig) -> None:
        figures = {
            "max_avg_power_w": (summary.avg_power_w.high if summary.avg_power_w else None,
                                "average power (upper bound)"),
            "max_peak_power_w": (summary.peak_power_w, "peak power (highest seen)"),
            "max_p95_latency_ms": (summary.latency_ms_p95, "p95 latency (median)"),
            "max_compile_s": (summary.compile_s, "compile seconds (median)"),
            "max_rel_error": (summary.max_rel_error, "relative error (median)"),
        }
        for limit, value in self.limits.items():
            bound = limit_value(limit, value, self.settings.margin_pct)
            measured, what = figures[limit]
            unit = LIMIT_UNITS[limit]
            if measured is None:
                summary.violations.append(f"{limit}: {what} was not measured, so {fmt(bound, unit)} cannot be "
                                          f"verified")
            elif measured > bound:
                summary.violations.append(f"{limit}: {what} {fmt(measured, unit)} > {fmt(bound, unit)}")
                if limit == "max_avg_power_w" and summary.avg_power_w and summary.avg_power_w.median <= bound:
                    summary.power_straddles = True

    # -- the decision -----------------------------------------------------------------------------------
    def decide(self, summaries: Mapping[str, MeasuredConfig]) -> Decision:
        """(state, chosen, reason, confidence, ties): see the module docstring."""
        ok = [m for m in summaries.values() if m.ok and m.compared]
        if not ok:
            return "failed", None, "no configuration was measured successfully", "", []
        ranked = ok[0].energy_source
        feasible = sorted((m for m in ok if m.feasible), key=lambda m: (m.objective.median, m.label))
        if not feasible:
            return self._infeasible(ok, summaries)
        best = feasible[0]
        ties = [m for m in feasible if m is best or m.objective.overlaps(best.objective)]
        winner, criterion = break_tie([m.tie_entry() for m in ties])
        chosen = next(m for m in ties if m.config_id == winner.key)
        # Runs metered otherwise than those ranked do not confirm it (failed runs stay: they count nothing).
        status = confirmation([r.mark() for r in self.arms[chosen.config_id].runs
                               if not r.ok or source_key(r.energy_source) == ranked], self.settings.min_repeats)
        state = "verified" if status.confirmed else "provisional"
        if chosen is best:
            reason = (f"{chosen.label} has the lowest median {self._objective_text()} "
                      f"({fmt(chosen.objective.median, self.unit)}) within every limit")
        else:
            reason = (f"{chosen.label} ties with {best.label} (lowest median, {fmt(best.objective.median, self.unit)})"
                      f" and wins the tie-break on {self._tie_text(criterion, chosen, best)}")
        if estimate_note(ranked):
            reason += f"; {estimate_note(ranked)}"
        reason += f"; {len(feasible)} of {len(ok)} measured configurations within every limit"
        reason += self._uncompared_text(summaries, ranked)
        if state == "provisional":
            reason += "; " + status.shortfall()
        return state, chosen, reason, self._confidence(chosen, feasible), ties

    def _objective_text(self) -> str:
        return {"energy": "amortised energy", "latency": "p95 latency", "edp": "energy-delay product"}[
            self.settings.objective]

    @staticmethod
    def _tie_text(criterion: str, chosen: MeasuredConfig, other: MeasuredConfig) -> str:
        if criterion == "lower average power" and chosen.avg_power_w and other.avg_power_w:
            return f"{criterion} ({fmt(chosen.avg_power_w.median, 'W')} vs {fmt(other.avg_power_w.median, 'W')})"
        if criterion == "cheaper compile":
            return f"{criterion} ({fmt(chosen.compile_s or 0.0, 's')} vs {fmt(other.compile_s or 0.0, 's')})"
        if criterion == "simpler mode":
            return f"{criterion} ({chosen.config['mode']} vs {other.config['mode']})"
        return "lower median (average power, compile and mode within the noise)"

    def _confidence(self, chosen: MeasuredConfig, feasible: list[MeasuredConfig]) -> str:
        rivals = [m for m in feasible if m is not chosen]
        if not rivals:
            return f"{chosen.label} is the only measured configuration within every limit"
        rival = rivals[0]
        comparison = compare(chosen.objective, rival.objective)
        text = comparison.text(chosen.label, rival.label)
        if comparison.verdict == TIE:
            _, criterion = break_tie([chosen.tie_entry(), rival.tie_entry()])
            text += f"; {chosen.label} wins the tie-break on {self._tie_text(criterion, chosen, rival)}"
        return f"{text} ({self._objective_text()}, medians of {chosen.objective.n} and {rival.objective.n} runs)"

    def _infeasible(self, ok: list[MeasuredConfig], summaries: Mapping[str, MeasuredConfig]) -> Decision:
        def other_limits_met(m: MeasuredConfig) -> bool:
            return all(v.split(":")[0] in POWER_LIMITS for v in m.violations)

        pool = [m for m in ok if other_limits_met(m)] or ok
        chosen = min(pool, key=lambda m: (m.avg_power_w.median if m.avg_power_w else math.inf, m.objective.median))
        shortfalls = []
        for limit, value in self.limits.items():
            bound = limit_value(limit, value, self.settings.margin_pct)
            power = chosen.avg_power_w
            if limit == "max_avg_power_w" and power and power.high > bound:
                shortfalls.append(f"lowest measured average power {fmt(power.high, 'W')} (upper bound of {power.n} "
                                  f"run{'s' if power.n > 1 else ''}) exceeds {fmt(bound, 'W')} by "
                                  f"{power.high / bound - 1:.0%}")
            elif limit == "max_peak_power_w" and chosen.peak_power_w and chosen.peak_power_w > bound:
                shortfalls.append(f"its peak power {fmt(chosen.peak_power_w, 'W')} exceeds {fmt(bound, 'W')} by "
                                  f"{chosen.peak_power_w / bound - 1:.0%}")
        others = [v for v in chosen.violations if v.split(":")[0] not in POWER_LIMITS]
        reason = (f"no measured configuration meets every limit; {chosen.label} is the lowest-power one"
                  + (" that meets the other limits" if not others else "") + ": " + "; ".join(shortfalls + others))
        if estimate_note(chosen.energy_source):
            reason += f"; {estimate_note(chosen.energy_source)}"
        reason += self._uncompared_text(summaries, chosen.energy_source)
        return "infeasible", chosen, reason, "; ".join(shortfalls + others), []

    @staticmethod
    def _uncompared_text(summaries: Mapping[str, MeasuredConfig], ranked: str | None) -> str:
        """'; 1 candidate measured only with estimate (...) is not compared: ...', or '' when every measured
        configuration was compared."""
        labels: dict[str, list[str]] = {}
        for m in summaries.values():
            if not m.compared and m.energy_source:
                labels.setdefault(m.energy_source, []).append(m.label)
        return f"; {uncompared_summary(labels, str(ranked))}" if labels else ""

    # -- what to measure next ---------------------------------------------------------------------------
    def _remaining_s(self) -> float:
        return math.inf if self.settings.budget_s is None else self.settings.budget_s - self.spent_s

    def _unmeasured(self) -> list[Arm]:
        return [a for a in self.arms.values() if not a.runs]

    def _explore(self, summaries: Mapping[str, MeasuredConfig]) -> tuple[Arm, str] | None:
        """The unmeasured arm with the highest acquisition value, recording why the others are skipped."""
        candidates = self._unmeasured()
        if not candidates:
            return None
        if self.settings.strategy == "exhaustive":
            return min(candidates, key=lambda a: _cost_rank(a.config)), "exhaustive: every configuration once"
        self._refresh_raw()
        feasible = [m for m in summaries.values() if m.feasible]
        best = min(feasible, key=lambda m: m.objective.median) if feasible else None
        kept: list[tuple[Arm, Forecast]] = []
        for arm in candidates:
            fc = self.forecaster.forecast(arm)
            reason = self._skip_reason(arm, fc, best)
            if reason:
                self.skip_reasons[arm.id] = (reason, fc)
            else:
                self.skip_reasons.pop(arm.id, None)
                kept.append((arm, fc))
        scored = [(self._acquisition(fc, self._reachable(arm, kept, best)), arm, fc) for arm, fc in kept]
        scored.sort(key=lambda t: (-t[0], _cost_rank(t[1].config)))
        for value, arm, fc in scored:
            if fc.cost_s > self._remaining_s():
                self._budget_blocked = True
                self.skip_reasons[arm.id] = (f"not measured: about {fc.cost_s:.0f} s to measure, more than the "
                                             f"{max(0.0, self._remaining_s()):.0f} s left of budget_s", fc)
                continue
            why = (f"acquisition {value:.3g}/s: predicted {fmt(fc.mean, self.unit)} +- {fmt(fc.std, self.unit)}, "
                   f"P(within limits) {fc.p_feasible:.0%}, about {fc.cost_s:.0f} s to measure")
            return arm, why
        return None

    def _skip_reason(self, arm: Arm, fc: Forecast, best: MeasuredConfig | None) -> str:
        s = self.settings
        if not fc.known:
            return ""  # no prediction at all: measure it rather than guess
        if fc.p_feasible < s.min_feasible_probability:
            return f"{fc.limiting} (P(within limits) {fc.p_feasible:.0%})"
        if best is None:
            return ""
        noise = best.objective.median - best.objective.low
        gain = expected_improvement(*fc.log_objective, best.objective.median - noise) * fc.p_feasible
        if gain < s.min_expected_gain * best.objective.median:
            return (f"predicted {fmt(fc.mean, self.unit)} +- {fmt(fc.std, self.unit)}, measured best "
                    f"{fmt(best.objective.median, self.unit)} ({best.label}): expected gain beyond the noise "
                    f"{gain / best.objective.median:.1%} of it (less than {s.min_expected_gain:.0%})")
        if s.objective == "energy" and fc.power_w:
            calls = s.expected_inferences * (max(1, int(arm.config.get("batch_size") or 1)) if self.per_sample else 1)
            saving_j = expected_improvement(*fc.log_objective, best.objective.median) * fc.p_feasible * calls
            cost_j = fc.cost_s * fc.power_w
            if saving_j < cost_j:
                return (f"expected saving {fmt(saving_j / 1000, 'kJ')} over {s.expected_inferences:,} inferences is "
                        f"less than measuring it costs (about {fc.cost_s:.0f} s, {fmt(cost_j / 1000, 'kJ')})")
        return ""

    @staticmethod
    def _reachable(arm: Arm, kept: Sequence[tuple[Arm, Forecast]], best: MeasuredConfig | None) -> float:
        """The objective the search can count on without measuring `arm`: the best measured median within
        every limit, or a candidate still to measure that is likely within the limits
        (`REACHABLE_MIN_P`), taken at one spread above its prediction; inf when there is neither."""
        level = best.objective.median if best is not None else math.inf
        for other, fc in kept:
            if other is not arm and fc.known and fc.p_feasible >= REACHABLE_MIN_P:
                level = min(level, fc.pessimistic(REACHABLE_SD))
        return level

    @staticmethod
    def _acquisition(fc: Forecast, reachable: float) -> float:
        """Expected improvement on `reachable` x P(within limits) per second of measuring; while nothing
        is reachable, P(within limits) per second, scaled by 1 / predicted objective."""
        if not fc.known:
            return 0.0
        if not math.isfinite(reachable):
            return fc.p_feasible / (fc.cost_s * fc.mean)
        return expected_improvement(*fc.log_objective, reachable) * fc.p_feasible / fc.cost_s

    def _contenders(self, summaries: Mapping[str, MeasuredConfig]) -> tuple[list[MeasuredConfig], set[str]]:
        """(contenders in the order to repeat them, lowest median first; ids of the close calls among them).
        With nothing within the limits, those that may yet be come before the infeasible fallback."""
        state, chosen, _, _, ties = self.decide(summaries)
        if chosen is None:
            return [], set()
        if state == "infeasible":
            straddling = [m for m in summaries.values() if m.power_straddles and m is not chosen and m.compared
                          and all(v.startswith("max_avg_power_w") for v in m.violations)]
            # Resting only on flagged runs, yet under the power limit: a clean run may make it feasible.
            bound = dict(self.limits.items()).get("max_avg_power_w")
            flagged = [m for m in summaries.values() if not m.ok and m.status == "flagged" and m.compared
                       and bound is not None
                       and any(r.avg_power_w is not None and r.avg_power_w <= limit_value(
                           "max_avg_power_w", bound, self.settings.margin_pct) for r in self.arms[m.config_id].ok_runs())]
            # Those that may yet be within every limit come first, lowest median first: one that turns
            # out feasible makes confirming the infeasible fallback moot.
            hopeful = sorted(straddling + flagged, key=self._level)
            return [*hopeful, chosen], {m.config_id for m in hopeful}
        best = min(ties, key=lambda m: m.objective.median)
        level = {m.config_id: m.objective.median for m in ties}
        # As good as the best, but over the envelope only within the noise, lacking a figure a limit
        # needs, or resting only on flagged runs: more runs may make them feasible.
        hopeful = set()
        for m in summaries.values():
            if m.config_id in level:
                continue
            if m.ok and m.compared and m.objective.low <= best.objective.high and all(
                    (v.startswith("max_avg_power_w") and m.power_straddles) or "was not measured" in v
                    for v in m.violations):
                hopeful.add(m.config_id)
                level[m.config_id] = m.objective.median
            elif not m.ok and m.status == "flagged" and m.compared and self._level(m) <= best.objective.high:
                hopeful.add(m.config_id)
                level[m.config_id] = self._level(m)
        # A tie is a close call only while more runs may change the decision: when the tie-break chose
        # another than the lowest median. Ties with the lowest median chosen are repeated to the minimum.
        close = {m.config_id for m in ties} if len(ties) > 1 and chosen is not best else set()
        ordered = sorted(level, key=lambda cid: (level[cid], cid))
        return [summaries[cid] for cid in ordered], close | hopeful

    def _level(self, m: MeasuredConfig) -> float:
        """A measured configuration's median objective, over its ok runs when none counts yet (flagged)."""
        if m.objective is not None:
            return m.objective.median
        values = [run_objective(r, m.config, objective=self.settings.objective,
                                expected_inferences=self.settings.expected_inferences,
                                per_sample=self.per_sample) for r in self.arms[m.config_id].ok_runs()]
        known = [v for v in values if v is not None]
        return median(known) if known else math.inf

    def _repeat(self, summaries: Mapping[str, MeasuredConfig]) -> tuple[Arm, int, str] | None:
        """The contender that most needs another run, and whether that run must start a fresh process.

        Contenders short of the minimum come first, lowest median first (confirming the best may end
        the others' contention, and one that may beat it should not wait), then close calls, fewest runs
        first."""
        contenders, close = self._contenders(summaries)
        wanted = []
        for rank, summary in enumerate(contenders):
            arm = self.arms[summary.config_id]
            advice = repeat_advice([r.mark() for r in arm.runs], close_call=summary.config_id in close,
                                   min_repeats=self.settings.min_repeats, max_repeats=self.settings.max_repeats)
            if advice.more <= 0:
                continue
            if median([r.wall_s for r in arm.runs if r.fresh_process] or [r.wall_s for r in arm.runs]) \
                    > self._remaining_s():
                self._budget_blocked = True
                continue
            below_minimum = len(arm.counted_runs()) < self.settings.min_repeats
            wanted.append(((0, rank, 0) if below_minimum else (1, len(arm.runs), rank), arm, advice))
        if not wanted:
            return None
        _, arm, advice = min(wanted, key=lambda w: w[0])
        windows = advice.more
        return arm, windows, f"repeat: {advice.why}" + (f" ({windows} windows in one process)" if windows > 1 else "")

    def _next(self) -> Step | None:
        for arm in self.baselines:
            if not arm.runs:
                if DEFAULT_OVERHEAD_S > self._remaining_s():
                    self._budget_blocked = True
                    break
                return Step(arm, True, "baseline", "baseline that reports compare against")
        summaries = self.summaries()
        picked = self._explore(summaries)
        if picked is not None:
            kind = "exhaustive" if self.settings.strategy == "exhaustive" else "guided"
            return Step(picked[0], True, kind, picked[1])
        repeat = self._repeat(summaries)
        if repeat is not None:
            return Step(repeat[0], True, "repeat", repeat[2], repeat[1])
        return None

    @property
    def measurements(self) -> int:
        return self.measurements_before + len(self.steps)

    def advance(self) -> tuple[Step | None, str]:
        """The next measurement (a Step) without making it, or (None, why it stops)."""
        s = self.settings
        if s.budget_s is not None and self.spent_s >= s.budget_s:
            return None, f"budget_s spent ({self.spent_s:.0f} of {s.budget_s:g} s)"
        if s.max_measurements is not None and self.measurements >= s.max_measurements:
            return None, f"max_measurements reached ({self.measurements})"
        self._budget_blocked = False
        step = self._next()
        if step is not None:
            return step, ""
        if self._budget_blocked:
            return None, (f"budget_s: what is left to measure would not fit in the "
                          f"{max(0.0, self._remaining_s()):.0f} s left")
        return None, "nothing left that could beat the best measured configuration by more than the noise"

    def run(self) -> SearchResult:
        while True:
            step, stop = self.advance()
            if step is None:
                break
            for window in range(step.windows):
                fresh = step.fresh_process and window == 0
                observation = self.measure(step.arm.config, fresh)
                step.arm.runs.append(observation)
                self.spent_s += observation.wall_s
                self.steps.append(SearchStep(len(self.steps) + 1, step.arm.id, step.arm.label, step.kind, fresh,
                                             step.why if window == 0 else f"window {window + 1} of {step.windows} "
                                             "in the same process", observation.ok, observation.wall_s))
                if not observation.ok:
                    break  # a process that failed takes no more windows
        return self.result(stop)

    def result(self, stop: str) -> SearchResult:
        """What was measured and skipped, and the decision, as the search stands (`stop`: why it ended)."""
        summaries = self.summaries()
        state, chosen, reason, confidence, ties = self.decide(summaries)
        for m in summaries.values():
            if m.ok:
                m.status = "uncompared" if not m.compared else "rejected" if m.violations else "kept"
        for m in ties:
            m.status = "tied"
        if chosen is not None:
            chosen.status = "chosen"
        skipped = []
        for arm in self._unmeasured():
            why, fc = self.skip_reasons.get(arm.id) or (f"not measured: the search stopped ({stop})", None)
            skipped.append(SkippedConfig(arm.id, arm.label, why, (fc.mean, fc.std) if fc and fc.known else None,
                                         fc.p_feasible if fc else None))
        return SearchResult(state=state, chosen_config_id=chosen.config_id if chosen else None,
                            chosen_label=chosen.label if chosen else None, reason=reason, confidence=confidence,
                            objective_unit=self.unit, measured=list(summaries.values()), skipped=skipped,
                            steps=list(self.steps), spent_s=self.spent_s, measurements=self.measurements,
                            stop_reason=stop)


def run_search(candidates: Sequence[Any], measure: Measurer, predict: Predictor | None = None, *,
               limits: Limits | None = None, settings: SearchSettings | None = None,
               prior: Mapping[str, Sequence[Observation]] | None = None,
               refresh_predictions: bool = False) -> SearchResult:
    """Search `candidates` (configs rows or CompileConfigs) and decide; see the module docstring.

    `measure(config_row, fresh_process)` measures one configuration once and returns an Observation;
    `predict(config_rows)` returns {target: (mean, std)} per row (the trade-off model's `predict_many`
    for this workload and device; None: search without a model); `prior` holds runs already stored, by
    config id (they count, but cost nothing); with `refresh_predictions` the predictor is asked again
    before every choice (e.g. when it refits)."""
    return GuidedSearch(candidates, measure, predict, limits=limits, settings=settings, prior=prior,
                        refresh_predictions=refresh_predictions).run()
