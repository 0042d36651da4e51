"""The guided search's view of a configuration it has not measured: objective, limits, cost.

The trade-off model predicts each target from other workloads; what was measured of *this* workload
corrects it. Each measured configuration's log ratio measured / predicted is its residual, and the
residuals are modelled as a Gaussian process over the grid whose covariance adds what configurations
share (`residual_kernel`): one offset for the whole workload (about 1.1 in log energy across the
committed workloads: FLOPs do not translate into joules alike on every model and device), then an error
per precision, mode, fusion preset, batch size and variant that the model makes alike for every
configuration that has it, and what is left to each configuration (`RESIDUAL_SD_LOG`). A forecast is
the raw prediction plus the posterior mean of its residual, with the posterior spread: the first
measurement removes most of the offset, one measured configuration of a precision tells how far off the
model is for the others of that precision, and so on. Without a model (no raw prediction), a target is
guessed from measured neighbours weighted by `similarity`, with spread `SPREAD_NO_MODEL_LOG`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from joulepilot.policies.judge import LIMITS, Rules, Run, fmt
from joulepilot.policies.noise import counted, median
from joulepilot.store.jsonvalues import json_column

# The trade-off model's log error on an unseen workload, split by what configurations share (standard
# deviations in log space; fitted by maximum likelihood to the residuals of the committed GPU sweeps, each
# workload predicted by a model fitted on the others, and rounded): one offset for the whole workload, an
# error shared by the configurations of one precision, of one mode, of one fusion preset (with the same
# options), of one batch size and of one variant (dynamic shapes, padding, regional), and one of each
# configuration's own. Precision dominates energy and latency (the model misjudges how much bf16, fp16 or
# tf32 saves on a given model and device), compile time hardly depends on it. The committed sweeps hold
# one batch size and no variants per workload, so those two are a guess (about one mode's worth).
RESIDUAL_SD_LOG = {
    "energy_j_per_inference": {"offset": 1.1, "precision": 0.28, "mode": 0.09, "fusion": 0.03, "batch": 0.10,
                               "variant": 0.10, "config": 0.09},
    "latency_ms_p95": {"offset": 1.2, "precision": 0.23, "mode": 0.12, "fusion": 0.03, "batch": 0.10,
                       "variant": 0.10, "config": 0.16},
    "avg_power_w": {"offset": 0.15, "precision": 0.16, "mode": 0.10, "fusion": 0.03, "batch": 0.10,
                    "variant": 0.10, "config": 0.14},
    "compile_s": {"offset": 0.5, "precision": 0.03, "mode": 0.14, "fusion": 0.13, "batch": 0.05,
                  "variant": 0.15, "config": 0.15},
    "compile_energy_j": {"offset": 0.5, "precision": 0.03, "mode": 0.14, "fusion": 0.13, "batch": 0.05,
                         "variant": 0.15, "config": 0.15},
}
# Eager compiles nothing: its near-zero compile figures say nothing about compiled configurations.
COMPILE_TARGETS = ("compile_s", "compile_energy_j")
MEASUREMENT_SD_LOG = 0.05  # one run's noise in log space (repeats of one configuration differ by about 5%)
SPREAD_NO_MODEL_LOG = 0.5  # a guess from measured neighbours alone
PRECISION_SIMILARITY = 0.1
# Numerical error is set mostly by precision: configurations of one precision differ by about 10%
# (fusion and mode reorder the arithmetic), so a measured one predicts the others within this log spread.
REL_ERROR_SPREAD_LOG = 0.12
DEFAULT_OVERHEAD_S = 20.0  # seconds a measurement takes besides compiling, until one was measured
DEFAULT_PEAK_RATIO = 1.15  # peak / average power, until one was measured
PEAK_RATIO_SPREAD_LOG = 0.08
COMPILE_PAD_S = 0.05  # added before logs of compile seconds, so eager's ~0 s stays finite


@dataclass
class Arm:
    """One configuration of the grid: its row, its runs so far and the model's raw prediction."""

    config: dict[str, Any]
    runs: list[Run] = field(default_factory=list)
    raw: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return str(self.config["id"])

    @property
    def label(self) -> str:
        return str(self.config.get("label") or self.id)

    @property
    def compiles(self) -> bool:
        return self.config.get("mode") != "eager"

    def counted_runs(self) -> list[Run]:
        return [self.runs[i] for i in counted(self.runs)]

    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.ok]


@dataclass
class Forecast:
    """An unmeasured configuration: its objective (log mean, log sd), probability of meeting the limits,
    the limit least likely met (text), seconds to measure it and predicted average power."""

    log_objective: tuple[float, float]
    p_feasible: float
    limiting: str
    cost_s: float
    power_w: float | None

    @property
    def known(self) -> bool:
        return math.isfinite(self.log_objective[1])

    @property
    def mean(self) -> float:
        return math.exp(self.log_objective[0])

    @property
    def std(self) -> float:
        return self.mean * self.log_objective[1]

    def pessimistic(self, k: float) -> float:
        return math.exp(self.log_objective[0] + k * self.log_objective[1])


def similarity(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """How much a measurement of configuration b says about a, in (0, 1]."""
    weight = 1.0
    if a.get("precision") != b.get("precision"):
        weight *= PRECISION_SIMILARITY
    if a.get("mode") != b.get("mode"):
        weight *= 0.25 if "eager" in (a.get("mode"), b.get("mode")) else 0.5
    if a.get("fusion") != b.get("fusion") or a.get("options") != b.get("options"):
        weight *= 0.6
    batch_a, batch_b = int(a.get("batch_size") or 1), int(b.get("batch_size") or 1)
    if batch_a != batch_b:
        weight *= 0.5 ** abs(math.log2(batch_a / batch_b))
    if bool(a.get("dynamic")) != bool(b.get("dynamic")):
        weight *= 0.6
    if (a.get("padding") or "none") != (b.get("padding") or "none"):
        weight *= 0.6
    if (a.get("regional") or "") != (b.get("regional") or ""):
        weight *= 0.6
    return weight


def _properties(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a configuration may share with others, by the names of `RESIDUAL_SD_LOG`."""
    return {"precision": config.get("precision"), "mode": config.get("mode"),
            "fusion": (config.get("fusion"), json_column(config.get("options"), {}) or {}),
            "batch": int(config.get("batch_size") or 1),
            "variant": (bool(config.get("dynamic")), config.get("padding") or "none", config.get("regional") or "")}


def residual_kernel(target: str, a: Mapping[str, Any], b: Mapping[str, Any], same: bool) -> float:
    """Prior covariance of the model's log errors on configurations a and b of one workload (`same`:
    they are one configuration): the workload's offset, plus each property they share."""
    sd = RESIDUAL_SD_LOG.get(target, RESIDUAL_SD_LOG["energy_j_per_inference"])
    props_b = _properties(b)
    total = sd["offset"] ** 2 + (sd["config"] ** 2 if same else 0.0)
    for name, value in _properties(a).items():
        if value == props_b[name]:
            total += sd[name] ** 2
    return total


def norm_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def prob_below(log_mean: float, log_sd: float, bound: float) -> float:
    """P(X <= bound) for log X ~ Normal(log_mean, log_sd)."""
    if bound <= 0:
        return 0.0
    if log_sd <= 0:
        return 1.0 if log_mean <= math.log(bound) else 0.0
    return norm_cdf((math.log(bound) - log_mean) / log_sd)


def expected_improvement(log_mean: float, log_sd: float, best: float) -> float:
    """E[max(best - X, 0)] for log X ~ Normal(log_mean, log_sd): the lognormal expected improvement."""
    if best <= 0:
        return 0.0
    if log_sd <= 0:
        return max(0.0, best - math.exp(log_mean))
    d = (math.log(best) - log_mean) / log_sd
    return best * norm_cdf(d) - math.exp(log_mean + log_sd ** 2 / 2.0) * norm_cdf(d - log_sd)


class Forecaster:
    """Forecasts for the unmeasured arms of one search, from the model's raw predictions and the runs."""

    def __init__(self, arms: Mapping[str, Arm], rules: Rules) -> None:
        self.arms = arms
        self.rules = rules
        self._solved: dict[tuple, tuple[list[Arm], Any, Any]] = {}

    def reset(self) -> None:
        """Forget the solved residual systems (after the raw predictions changed)."""
        self._solved.clear()

    @staticmethod
    def _padded(target: str, value: float) -> float:
        return value + COMPILE_PAD_S if target == "compile_s" else value

    def measured_figure(self, arm: Arm, target: str) -> float | None:
        values = [self._padded(target, getattr(r, target)) for r in arm.counted_runs()
                  if getattr(r, target) is not None]
        values = [v for v in values if v > 0]
        return median(values) if values else None

    def calibrated(self, arm: Arm, target: str) -> tuple[float, float] | None:
        """(log mean, log sd) of `target` for `arm`, corrected by the measured arms; None: no idea."""
        if target in arm.raw:
            return self._posterior(arm, target)
        neighbours: list[tuple[float, float]] = []  # (weight, log measured), for a guess without a model
        for other in self.arms.values():
            if other is arm:
                continue
            measured = self.measured_figure(other, target)
            if measured is not None:
                neighbours.append((similarity(arm.config, other.config), math.log(measured)))
        if not neighbours:
            return None
        total = sum(w for w, _ in neighbours)
        return sum(w * v for w, v in neighbours) / total, SPREAD_NO_MODEL_LOG

    def _residuals(self, target: str) -> tuple[list[Arm], Any, Any]:
        """The measured arms with a raw prediction of `target`, the Cholesky factor of their covariance
        (noise included) and that covariance's inverse times their residuals; cached per set of runs."""
        key = (target, tuple((a.id, len(a.runs)) for a in self.arms.values() if a.runs))
        cached = self._solved.get(key)
        if cached is not None:
            return cached
        measured, residuals, noise = [], [], []
        for other in self.arms.values():
            if target not in other.raw or (target in COMPILE_TARGETS and not other.compiles):
                continue
            value = self.measured_figure(other, target)
            if value is None:
                continue
            measured.append(other)
            residuals.append(math.log(value) - math.log(self._padded(target, other.raw[target][0])))
            noise.append(MEASUREMENT_SD_LOG ** 2 / max(1, len(other.counted_runs())))
        if measured:
            gram = np.array([[residual_kernel(target, a.config, b.config, a is b) for b in measured] for a in measured])
            gram += np.diag(noise)
            factor = np.linalg.cholesky(gram)
            solved = (measured, factor, np.linalg.solve(factor.T, np.linalg.solve(factor, np.array(residuals))))
        else:
            solved = (measured, None, None)
        self._solved[key] = solved
        return solved

    def _posterior(self, arm: Arm, target: str) -> tuple[float, float]:
        """The raw prediction plus the posterior mean of the model's error on this workload (a Gaussian
        process over configurations whose kernel adds what they share: `RESIDUAL_SD_LOG`), and the
        posterior spread, never below one run's noise."""
        mean, _ = arm.raw[target]
        log_value = math.log(self._padded(target, mean))
        prior_var = residual_kernel(target, arm.config, arm.config, True)
        if target in COMPILE_TARGETS and not arm.compiles:
            return log_value, math.sqrt(prior_var)
        measured, factor, alpha = self._residuals(target)
        if not measured:
            return log_value, math.sqrt(prior_var)
        cross = np.array([residual_kernel(target, arm.config, b.config, arm is b) for b in measured])
        half = np.linalg.solve(factor, cross)
        var = max(prior_var - float(half @ half), MEASUREMENT_SD_LOG ** 2)
        return log_value + float(cross @ alpha), math.sqrt(var)

    def overhead_s(self) -> float:
        """Seconds a measurement of this workload takes besides compiling: the median over the runs so far
        that started a process (a further window of one has no start, load or compile)."""
        spans = [r.wall_s - (r.compile_s or 0.0) for a in self.arms.values() for r in a.ok_runs()
                 if r.wall_s > 0 and r.fresh_process]
        return median(spans) if spans else DEFAULT_OVERHEAD_S

    def peak_ratio(self) -> float:
        ratios = []
        for arm in self.arms.values():
            runs = arm.counted_runs()
            peaks = [r.peak_power_w for r in runs if r.peak_power_w]
            powers = [r.avg_power_w for r in runs if r.avg_power_w]
            if peaks and powers:
                ratios.append(max(peaks) / median(powers))
        return median(ratios) if ratios else DEFAULT_PEAK_RATIO

    def rel_error_guess(self, arm: Arm) -> tuple[float, float] | None:
        """Numerical error from measured configurations of the same precision, or None. Every ok run counts,
        flagged ones too: a window warning says the run's energy and pace may be off, not its output."""
        logs = []
        for other in self.arms.values():
            if other is arm or other.config.get("precision") != arm.config.get("precision"):
                continue
            values = [r.max_rel_error for r in other.ok_runs() if r.max_rel_error is not None]
            if values:
                logs.append(math.log(max(median(values), 1e-12)))
        if not logs:
            return None
        mean = sum(logs) / len(logs)
        spread = math.sqrt(sum((v - mean) ** 2 for v in logs) / (len(logs) - 1)) if len(logs) > 1 else 0.0
        return mean, max(REL_ERROR_SPREAD_LOG, spread)

    def forecast(self, arm: Arm) -> Forecast:
        s = self.rules
        energy = self.calibrated(arm, s.energy_figure)
        power = self.calibrated(arm, "avg_power_w")
        latency = self.calibrated(arm, s.latency_figure)
        compile_log = self.calibrated(arm, "compile_s") if arm.compiles else None
        compile_s = max(0.0, math.exp(compile_log[0]) - COMPILE_PAD_S) if compile_log else 0.0
        power_w = math.exp(power[0]) if power else None
        unknown = (0.0, math.inf)
        log_obj = unknown
        if energy is not None:
            # Compile energy (GPU + CPU) as the model predicts it when it learnt it, else seconds x power.
            learnt = arm.compiles and "compile_energy_j" in arm.raw
            compile_log_j = self.calibrated(arm, "compile_energy_j") if learnt else None
            compile_j = math.exp(compile_log_j[0]) if compile_log_j else compile_s * (power_w or 0.0)
            amortised = math.exp(energy[0]) + compile_j / s.expected_inferences
            if s.per_sample:
                amortised /= max(1, int(arm.config.get("batch_size") or 1))
            log_obj = (math.log(amortised), energy[1])
        if s.objective == "latency":
            log_obj = latency or unknown
        elif s.objective == "edp":
            log_obj = (log_obj[0] + latency[0], math.hypot(log_obj[1], latency[1])) if latency else unknown
        p_total, worst, worst_p = 1.0, "", 2.0
        for limit, value in s.limits.items():
            bound = s.limits.bound(limit, value)
            figure = self._limit_figure(arm, limit, power, latency, compile_log)
            if figure is None or not math.isfinite(figure[1]):
                continue
            p = prob_below(figure[0], figure[1], bound + (COMPILE_PAD_S if limit == "max_compile_s" else 0.0))
            p_total *= p
            if p < worst_p:
                worst_p = p
                _, unit, words = LIMITS[limit]
                worst = (f"predicted {words} {fmt(math.exp(figure[0]), unit)} +- "
                         f"{fmt(math.exp(figure[0]) * figure[1], unit)}, {limit} {fmt(bound, unit)}")
        return Forecast(log_obj, p_total, worst, compile_s + self.overhead_s(), power_w)

    def _limit_figure(self, arm: Arm, limit: str, power: tuple[float, float] | None,
                      latency: tuple[float, float] | None, compile_log: tuple[float, float] | None
                      ) -> tuple[float, float] | None:
        if limit == "max_avg_power_w":
            return power
        if limit == "max_peak_power_w":
            return (power[0] + math.log(self.peak_ratio()), math.hypot(power[1], PEAK_RATIO_SPREAD_LOG)) \
                if power else None
        if limit == "max_compile_s":
            return compile_log if arm.compiles else None
        if limit == "max_rel_error":
            return self.rel_error_guess(arm)
        figure = LIMITS[limit][0]  # a latency: per call, or a generation's per token or to the first one
        return latency if figure == self.rules.latency_figure else self.calibrated(arm, figure)
