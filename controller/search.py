"""Guided search: which configuration of a grid to measure next, and when to stop.

A pure engine: the caller gives the grid (configs rows), a `measure(config, fresh_process)` callback that
returns one `policies.judge.Run`, and optionally a `predict(configs)` callback that returns the trade-off
model's {target: (mean, std)} per configuration (`TradeoffModel.predict_many`); the daemon
(`controller.guided`) and `benchmarks/search_replay.py` drive it the same way. What the runs say (the
objective, the limits, the ranking, ties and the tolerance, the infeasible pick, `verified`, what needs
measuring again) is the judge's (`policies.judge`), the very code the resolver decides with: the search's
ranking and the stored decision agree on the same runs.

How it searches (`strategy = "guided"`):

1. The baseline first: eager fp32 (default fusion, no variant) at the baseline batch size, when the grid
   has it, once: it compiles nothing (the cheapest run of the grid), reports and the tuning bill compare
   against it, and it removes the model's offset for this workload before anything compiles. Stock compile
   (default mode) fp32 is a candidate like any other, measured only when the search finds it worth it:
   nothing of a decision rests on it, and reports say where it was not measured (the bill then counts its
   payback against eager fp32, and says so).
2. The model's predictions for this workload are corrected by what was measured so far, and grow surer
   as configurations that share a precision, mode, fusion preset or batch size are measured
   (`search_forecast`: a Gaussian process over the model's errors).
3. Each unmeasured configuration gets an acquisition value: the expected improvement of the amortised
   objective (lognormal prediction) by more than the tolerance on what the search can already count on,
   times the predicted probability that it meets the limits, divided by the predicted seconds of measuring
   it (compile seconds plus the workload's measured overhead per run: a max-autotune compile costs several
   times a default one). What it can count on is the best measured configuration within every limit, or
   another candidate at least even odds to meet the limits, taken one spread above its prediction,
   whichever is lower. Before anything is measured within the limits or likely to be, it is the
   probability of meeting the limits per second, scaled by 1/objective.
4. What this workload's runs showed is used at once: a precision whose run failed the numerical check
   (`max_rel_error`) and a mode whose compile overran the worker's budget are tried in another
   configuration only after every other candidate.
5. A configuration is skipped, with its reason recorded, when it could not beat the best measured
   median by more than the tolerance (its expected improvement beyond that, times its probability of
   meeting the limits, is under `min_expected_gain` of the best), when it is predicted to break a limit
   (probability below `min_feasible_probability`), or, for the energy objective, when its expected
   saving over `expected_inferences` is less than the energy measuring it costs.
6. A first measurement asks for the windows a verified decision needs (`min_repeats`) in its one worker
   process, and takes each further window only while the judge, given the windows so far, still asks to
   measure the configuration again (`wants_more`; the daemon's worker asks its parent before each window,
   `compiler.window_gate`).
7. Then what the judge asks to measure again (`policies.judge.repeats`): the chosen configuration until it
   is verified, and both sides of a close call (two configurations that could still differ by more than
   the tolerance), each time one new worker process taking the windows still needed (`Step.windows`:
   each window is stored as a run of its own, the later ones marked as windows of the same process).
   A process whose numerical check is over `max_rel_error` takes no further window: the check is one per
   process, so they could only repeat a configuration the policy cannot apply.
8. It stops when nothing is left to measure or repeat, when `budget_s` seconds of measuring are spent,
   after `max_measurements` measurements (each window counts as one), or when a configuration's job failed as often as it may without
   storing a run (`blocked`); a measurement predicted to overrun the budget is not started.

A grid of `SMALL_GRID` (8) configurations or fewer is measured whole, each configuration once, cheapest
compile first, then confirmed as above. `strategy = "exhaustive"` does the same on any grid. With several
batch sizes in the grid the objective is per sample (J / batch size); latency limits apply per call.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

from joulepilot.compiler.budget import windows_taken
from joulepilot.policies.judge import (
    Judgement,
    Rules,
    Run,
    Verdict,
    deferred,
    fmt,
    judge,
    repeats,
)
from joulepilot.policies.noise import median
from joulepilot.store.jsonvalues import json_column

from .features import config_row
from .planner import compile_cost_rank
from .search_forecast import DEFAULT_OVERHEAD_S, Arm, Forecast, Forecaster, expected_improvement, prob_below
from .search_types import (
    STRATEGIES,
    Measurer,
    Predictor,
    SearchResult,
    SearchSettings,
    SearchStep,
    SkippedConfig,
    check_rules,
)

__all__ = ["STRATEGIES", "GuidedSearch", "SearchResult", "SearchSettings", "SearchStep", "SkippedConfig",
           "run_search"]

# An unmeasured candidate at least this likely to meet the limits is counted on to deliver its objective
# at one spread (log sd) above its prediction: measuring another is worth only what it may improve on that.
REACHABLE_MIN_P = 0.5
REACHABLE_SD = 1.0


def _is_baseline(config: Mapping[str, Any], batch_size: int) -> bool:
    """Eager fp32, default fusion, no variant, at `batch_size`: what the search measures first."""
    return (config.get("mode") == "eager" and config.get("precision") == "fp32" and config.get("fusion") == "default"
            and not bool(config.get("dynamic")) and (config.get("padding") or "none") == "none"
            and not config.get("regional")
            and json_column(config.get("options"), {}) in ({}, None)
            and int(config.get("batch_size") or 1) == batch_size)


def _cost_rank(config: Mapping[str, Any]) -> tuple:
    return (*compile_cost_rank(config), int(config.get("batch_size") or 1), str(config.get("label") or config["id"]))


class Step(NamedTuple):
    """One measurement the search asks for: a process measuring `arm` for `windows` windows in a row
    (the first counts as a fresh process when `fresh_process`, the others as further windows of it)."""

    arm: Arm
    fresh_process: bool
    kind: str  # baseline | guided | exhaustive | repeat
    why: str
    windows: int = 1


class GuidedSearch:
    """One search over one grid; `run()` measures until the stop rule holds and returns the result.

    `exclude`: config ids never measured and never chosen (config id -> why; ids alone: they broke the power
    envelope in a deployment); `blocked`: config id -> why it is measured no more (its job failed as often as
    it may): one with no run at all stops the search, since a job that fails without storing a run (the
    device cannot be metered, the workload cannot be built) fails for every configuration."""

    def __init__(self, candidates: Sequence[Any], measure: Measurer, predict: Predictor | None = None, *,
                 rules: Rules | None = None, settings: SearchSettings | None = None,
                 prior: Mapping[str, Sequence[Run]] | None = None, refresh_predictions: bool = False,
                 spent_s: float = 0.0, measurements: int = 0,
                 exclude: Mapping[str, str] | Collection[str] = (), blocked: Mapping[str, str] | None = None) -> None:
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
        self.settings = settings or SearchSettings()
        per_sample = len({int(a.config.get("batch_size") or 1) for a in self.arms.values()}) > 1
        self.rules = check_rules(rules or Rules())
        if self.rules.per_sample != per_sample and not self.rules.generates:  # J per token needs no batch
            self.rules = Rules(**{**self.rules.__dict__, "per_sample": per_sample})
        self.exclude = exclude
        self.blocked = dict(blocked or {})
        self.refresh_predictions = refresh_predictions
        self.unit = self.rules.unit
        self.forecaster = Forecaster(self.arms, self.rules)
        batch = self.settings.baseline_batch_size or int(rows[0].get("batch_size") or 1)
        self.baselines = [a for a in self.arms.values() if _is_baseline(a.config, batch) and self._measurable(a)]
        self.steps: list[SearchStep] = []
        # A search resumed from stored runs (controller.guided): what it had already spent of its budget.
        self.spent_s = float(spent_s)
        self.measurements_before = int(measurements)
        self.skip_reasons: dict[str, tuple[str, Forecast | None]] = {}
        self._predicted = False
        self._budget_blocked = False
        self._judged: tuple[int, Judgement] | None = None

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

    # -- what the runs say ------------------------------------------------------------------------------
    def judgement(self) -> Judgement:
        """The judge's decision on every run so far (recomputed only when a run was added)."""
        count = sum(len(a.runs) for a in self.arms.values())
        if self._judged is None or self._judged[0] != count:
            self._judged = (count, judge([a.config for a in self.arms.values()],
                                         {a.id: a.runs for a in self.arms.values()}, self.rules,
                                         exclude=self.exclude))
        return self._judged[1]

    # -- what to measure next ---------------------------------------------------------------------------
    def _remaining_s(self) -> float:
        return math.inf if self.settings.budget_s is None else self.settings.budget_s - self.spent_s

    def _measurable(self, arm: Arm) -> bool:
        return arm.id not in self.exclude and arm.id not in self.blocked

    def _unmeasured(self) -> list[Arm]:
        return [a for a in self.arms.values() if not a.runs and self._measurable(a)]

    def _explore(self, out: Judgement) -> tuple[Arm, str, int] | None:
        """The unmeasured arm with the highest acquisition value, recording why the others are skipped."""
        candidates = self._unmeasured()
        if not candidates:
            return None
        waits = {a.id: deferred(a.config, out) for a in candidates}
        if self.settings.strategy == "exhaustive" or len(self.arms) <= self.settings.small_grid:
            arm = min(candidates, key=lambda a: (bool(waits[a.id]), _cost_rank(a.config)))
            why = ("exhaustive: every configuration once" if self.settings.strategy == "exhaustive" else
                   f"a grid of {len(self.arms)} configurations is measured whole, each once")
            return arm, why + (f" ({waits[arm.id]}, so it comes last)" if waits[arm.id] else ""), \
                self._first_windows(fc_cost_s=None)
        self._refresh_raw()
        best = out.best
        kept: list[tuple[Arm, Forecast]] = []
        for arm in candidates:
            fc = self.forecaster.forecast(arm)
            reason = self._skip_reason(arm, fc, best)
            if reason:
                self.skip_reasons[arm.id] = (reason, fc)
            else:
                self.skip_reasons.pop(arm.id, None)
                kept.append((arm, fc))
        if not kept and (best is None or best.objective is None):
            probe = self._infeasibility_probe(candidates, out)
            if probe is not None:
                arm, fc = probe
                self.skip_reasons.pop(arm.id, None)
                return arm, (f"nothing measured is within the limits yet, and a prediction alone never makes a "
                             f"policy infeasible: {arm.label} is the likeliest to fit (predicted P(within limits) "
                             f"{fc.p_feasible:.0%}), about {fc.cost_s:.0f} s to measure"), 1
        scored = [(self._acquisition(fc, self._reachable(arm, kept, best)), arm, fc) for arm, fc in kept]
        scored.sort(key=lambda t: (bool(waits[t[1].id]), -t[0], _cost_rank(t[1].config)))
        for value, arm, fc in scored:
            if fc.cost_s > self._remaining_s():
                self._budget_blocked = True
                self.skip_reasons[arm.id] = (f"not measured: about {fc.cost_s:.0f} s to measure, more than the "
                                             f"{max(0.0, self._remaining_s()):.0f} s left of budget_s", fc)
                continue
            why = (f"acquisition {value:.3g}/s: predicted {fmt(fc.mean, self.unit)} +- {fmt(fc.std, self.unit)}, "
                   f"P(within limits) {fc.p_feasible:.0%}, about {fc.cost_s:.0f} s to measure")
            if waits[arm.id]:
                why += f" (after the others: {waits[arm.id]})"
            return arm, why, self._first_windows(fc.cost_s)
        return None

    def _infeasibility_probe(self, candidates: Sequence[Arm], out: Judgement) -> tuple[Arm, Forecast] | None:
        """While no measured configuration meets the limits and every one left is predicted not to, the one
        likeliest to meet them in a precision this workload has no run of yet: the precision moves power most,
        and predictions learnt on other models misjudge a new one's, so `infeasible` must rest on a measurement
        in every precision allowed. None when every precision has one, or nothing is left to try."""
        seen = {a.config.get("precision") for a in self.arms.values() if a.runs}
        pool = [(a, self.skip_reasons[a.id][1]) for a in candidates
                if a.id in self.skip_reasons and a.config.get("precision") not in seen and not deferred(a.config, out)]
        pool = [(a, fc) for a, fc in pool if fc is not None and fc.known]
        return max(pool, key=lambda t: (t[1].p_feasible, -t[1].mean)) if pool else None

    def _first_windows(self, fc_cost_s: float | None) -> int:
        """The windows a first measurement may take: as many as a verified decision needs (`min_repeats`), as the
        budget allows (each counted at a whole measurement's cost, an upper bound). Its worker takes each further
        window only while the judge still asks to measure the configuration again (`wants_more`), so a
        configuration its first window leaves out of the running costs no more than that window."""
        windows = self.rules.min_repeats
        if math.isfinite(self._remaining_s()):
            cost_s = fc_cost_s if fc_cost_s is not None else self.forecaster.overhead_s()
            windows = max(1, min(windows, int(self._remaining_s() // max(cost_s, 1.0))))
        return windows

    def wants_more(self, config_id: str, runs: Sequence[Run] = ()) -> bool:
        """Whether the judge, given `runs` of `config_id` on top of those the search holds, asks to measure it
        again (`policies.judge.repeats`): what a worker asks before each further window of a process. The
        daemon asks it from the worker's parent with the windows measured so far, `run` after each window it
        adds."""
        arm = self.arms.get(config_id)
        if arm is None or not self._measurable(arm):
            return False
        if runs:
            runs_by = {a.id: a.runs for a in self.arms.values()}
            runs_by[config_id] = [*arm.runs, *runs]
            out = judge([a.config for a in self.arms.values()], runs_by, self.rules, exclude=self.exclude)
        else:
            out = self.judgement()
        # Of an infeasible decision, only what may yet be within the limits: its pick outside them is confirmed
        # last, if nothing else fits.
        return any(item.config_id == config_id and item.advice.further_window
                   and (item.close or out.state != "infeasible") for item in repeats(out))

    def _skip_reason(self, arm: Arm, fc: Forecast, best: Verdict | None) -> str:
        s, rules = self.settings, self.rules
        if not fc.known:
            return ""  # no prediction at all: measure it rather than guess
        if fc.p_feasible < s.min_feasible_probability:
            return f"{fc.limiting} (P(within limits) {fc.p_feasible:.0%})"
        if best is None or best.objective is None:
            return ""
        level = best.objective.median
        gain = expected_improvement(*fc.log_objective, level * (1.0 - rules.tolerance)) * fc.p_feasible
        chance = prob_below(*fc.log_objective, level * (1.0 - rules.tolerance)) * fc.p_feasible
        if chance < s.min_beat_probability and gain < rules.tolerance * level:
            return (f"predicted {fmt(fc.mean, self.unit)} +- {fmt(fc.std, self.unit)}, measured best "
                    f"{fmt(level, self.unit)} ({best.label}): a {chance:.0%} chance to beat it by more than the "
                    f"{rules.tolerance_pct:g}% tolerance (less than {s.min_beat_probability:.0%})")
        if gain < s.min_expected_gain * level:
            return (f"predicted {fmt(fc.mean, self.unit)} +- {fmt(fc.std, self.unit)}, measured best "
                    f"{fmt(level, self.unit)} ({best.label}): expected gain beyond the {rules.tolerance_pct:g}% "
                    f"tolerance {gain / level:.2%} of it (less than {s.min_expected_gain:.0%})")
        if rules.objective == "energy" and fc.power_w:
            calls = rules.expected_inferences * (max(1, int(arm.config.get("batch_size") or 1))
                                                 if rules.per_sample else 1)
            saving_j = expected_improvement(*fc.log_objective, level) * fc.p_feasible * calls
            cost_j = fc.cost_s * fc.power_w
            if saving_j < cost_j:
                return (f"expected saving {fmt(saving_j / 1000, 'kJ')} over {rules.expected_inferences:,} "
                        f"{rules.count_unit} is less than measuring it costs (about {fc.cost_s:.0f} s, "
                        f"{fmt(cost_j / 1000, 'kJ')})")
        return ""

    def _reachable(self, arm: Arm, kept: Sequence[tuple[Arm, Forecast]], best: Verdict | None) -> float:
        """The objective the search can count on without measuring `arm`: the best measured median within
        every limit, or a candidate still to measure that is likely within the limits
        (`REACHABLE_MIN_P`), taken at one spread above its prediction; inf when there is neither."""
        level = best.objective.median if best is not None and best.objective is not None else math.inf
        for other, fc in kept:
            if other is not arm and fc.known and fc.p_feasible >= REACHABLE_MIN_P:
                level = min(level, fc.pessimistic(REACHABLE_SD))
        return level

    def _acquisition(self, fc: Forecast, reachable: float) -> float:
        """Expected improvement by more than the tolerance on `reachable`, x P(within limits), per second of
        measuring; while nothing is reachable, P(within limits) per second, scaled by 1 / predicted objective."""
        if not fc.known:
            return 0.0
        if not math.isfinite(reachable):
            return fc.p_feasible / (fc.cost_s * fc.mean)
        threshold = reachable * (1.0 - self.rules.tolerance)
        return expected_improvement(*fc.log_objective, threshold) * fc.p_feasible / fc.cost_s

    def _repeat(self, out: Judgement) -> tuple[Arm, int, str] | None:
        """What the judge asks to measure again that fits the budget: those short of the minimum of runs
        first, then the fewest runs first."""
        wanted = []
        for rank, item in enumerate(repeats(out)):
            arm = self.arms[item.config_id]
            if not self._measurable(arm):
                continue
            starts = [r.wall_s for r in arm.runs if r.fresh_process] or [r.wall_s for r in arm.runs]
            if starts and median(starts) > self._remaining_s():
                self._budget_blocked = True
                continue
            short = len(arm.counted_runs()) < self.rules.min_repeats
            wanted.append(((0, rank, 0) if short else (1, len(arm.runs), rank), arm, item.advice))
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
                return Step(arm, True, "baseline", "the baseline that reports compare against (it compiles nothing)")
        out = self.judgement()
        picked = self._explore(out)
        if picked is not None:
            kind = "exhaustive" if self.settings.strategy == "exhaustive" else "guided"
            arm, why, windows = picked
            if windows > 1:
                why += f" (up to {windows} windows in one process, while the judge asks for more)"
            return Step(arm, True, kind, why, windows)
        repeat = self._repeat(out)
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
        never = [self.arms[cid] for cid in self.blocked if cid in self.arms and not self.arms[cid].runs]
        if never:  # a job that fails without storing a run (the device cannot be metered, say) fails for all
            return None, f"{never[0].label} could not be measured: {self.blocked[never[0].id]} without storing a run"
        self._budget_blocked = False
        step = self._next()
        if step is not None:
            if s.max_measurements is not None:  # each window is a measurement: take no more than are left
                step = step._replace(windows=max(1, min(step.windows, s.max_measurements - self.measurements)))
            return step, ""
        if self._budget_blocked:
            return None, (f"budget_s: what is left to measure would not fit in the "
                          f"{max(0.0, self._remaining_s()):.0f} s left")
        return None, (f"nothing left that could beat the chosen configuration by more than the "
                      f"{self.rules.tolerance_pct:g}% tolerance")

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
                if not observation.ok or window + 1 >= windows_taken(step.windows, observation.max_rel_error,
                                                                     self.rules.limits.max_rel_error):
                    break  # a process that failed, or whose numerical check is over the limit, takes no more windows
                if observation.wall_s > self._remaining_s():
                    break  # another window, at what this one took, would overrun budget_s
                if not self.wants_more(step.arm.id):
                    break  # the judge asks no more of it: it is out of the running, or confirmed
        return self.result(stop)

    def result(self, stop: str) -> SearchResult:
        """What was measured and skipped, and the judge's decision, as the search stands (`stop`: why it
        ended)."""
        out = self.judgement()
        skipped = []
        for arm in self._unmeasured():
            why, fc = self.skip_reasons.get(arm.id) or (f"not measured: the search stopped ({stop})", None)
            skipped.append(SkippedConfig(arm.id, arm.label, why, (fc.mean, fc.std) if fc and fc.known else None,
                                         fc.p_feasible if fc else None))
        skipped += [SkippedConfig(cid, self.arms[cid].label, f"not measured: {why}")
                    for cid, why in self.blocked.items() if cid in self.arms and not self.arms[cid].runs]
        chosen = out.chosen
        return SearchResult(state=out.state, chosen_config_id=chosen.config_id if chosen else None,
                            chosen_label=chosen.label if chosen else None, reason=out.reason,
                            confidence=out.confidence, objective_unit=self.unit,
                            measured=[v for v in out.verdicts.values() if v.runs], skipped=skipped,
                            steps=list(self.steps), spent_s=self.spent_s, measurements=self.measurements,
                            stop_reason=stop)


def run_search(candidates: Sequence[Any], measure: Measurer, predict: Predictor | None = None, *,
               rules: Rules | None = None, settings: SearchSettings | None = None,
               prior: Mapping[str, Sequence[Run]] | None = None, refresh_predictions: bool = False) -> SearchResult:
    """Search `candidates` (configs rows or CompileConfigs) and decide; see the module docstring.

    `measure(config_row, fresh_process)` measures one configuration once and returns a `Run`;
    `predict(config_rows)` returns {target: (mean, std)} per row (the trade-off model's `predict_many`
    for this workload and device; None: search without a model); `rules`: what the judge holds the runs
    to (`policies.judge.Rules`); `prior` holds runs already stored, by config id (they count, but cost
    nothing); with `refresh_predictions` the predictor is asked again before every choice."""
    return GuidedSearch(candidates, measure, predict, rules=rules, settings=settings, prior=prior,
                        refresh_predictions=refresh_predictions).run()
