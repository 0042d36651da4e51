"""The guided search's view of a configuration it has not measured: objective, limits, cost.

The trade-off model predicts each target from other workloads; what was measured of *this* workload
corrects it. Each measured configuration's log ratio measured / predicted is its residual. The model's
error on an unseen workload is mostly one offset shared by all its configurations (about 1.2 in log
energy across the committed workloads, against about 0.26 between configurations of one workload), so
the mean residual shifts every prediction almost whole after the first measurement; what is left of
the residuals is shared with similar configurations (`similarity`: precision matters most, then eager
versus compiled, mode, fusion, batch size), shrunk towards no correction by `CALIBRATION_PRIOR_WEIGHT`.
The log-space spread is `SPREAD_UNCALIBRATED_LOG` before anything is measured, then falls from
`SPREAD_FAR_LOG` (the forest's own spread, up to `SPREAD_FAR_MAX_LOG`) towards `SPREAD_NEAR_LOG` as
similar configurations are measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from joulepilot.policies.noise import counted, median
from joulepilot.policies.schema import Limits

from .search_types import LIMIT_FIGURES, LIMIT_UNITS, Observation, SearchSettings, fmt, limit_value

# The model's log error on an unseen workload: about 1.2 before anything of it is measured (one offset
# for the whole workload: FLOPs do not translate into joules alike on every model and device), about
# 0.26 between configurations once that offset is removed (committed sweeps, leave-one-workload-out).
SPREAD_UNCALIBRATED_LOG = 1.2
SPREAD_FAR_LOG = 0.26
SPREAD_FAR_MAX_LOG = 0.45
SPREAD_NEAR_LOG = 0.07
OFFSET_PRIOR_N = 0.1
SPREAD_NO_MODEL_LOG = 0.5  # a guess from measured neighbours alone
CALIBRATION_PRIOR_WEIGHT = 0.5
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
    runs: list[Observation] = field(default_factory=list)
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

    def counted_runs(self) -> list[Observation]:
        return [self.runs[i] for i in counted([r.mark() for r in self.runs])]

    def ok_runs(self) -> list[Observation]:
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

    def optimistic(self, k: float) -> float:
        return math.exp(self.log_objective[0] - k * self.log_objective[1])


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

    def __init__(self, arms: Mapping[str, Arm], limits: Limits, settings: SearchSettings, per_sample: bool) -> None:
        self.arms = arms
        self.limits = limits
        self.settings = settings
        self.per_sample = per_sample

    @staticmethod
    def _padded(target: str, value: float) -> float:
        return value + COMPILE_PAD_S if target == "compile_s" else value

    def measured_figure(self, arm: Arm, target: str) -> float | None:
        values = [self._padded(target, getattr(r, target)) for r in arm.counted_runs()
                  if getattr(r, target) is not None]
        values = [v for v in values if v > 0]
        return median(values) if values else None

    def calibrated(self, arm: Arm, target: str) -> tuple[float, float] | None:
        """(log mean, log sd) of `target` for `arm`, corrected by the measured arms; None: no idea.

        The model's log error on a workload is mostly one offset shared by all its configurations (its
        spread across workloads, about 1.2 for energy, dwarfs the spread within one, about 0.26): the
        mean residual is applied almost whole after one measurement (shrunk by n / (n + OFFSET_PRIOR_N)),
        then the residuals left by it are shared with similar configurations (`similarity`)."""
        residuals: list[tuple[float, float]] = []  # (weight, log residual)
        neighbours: list[tuple[float, float]] = []  # (weight, log measured), for a guess without a model
        for other in self.arms.values():
            if other is arm:
                continue
            measured = self.measured_figure(other, target)
            if measured is None:
                continue
            weight = similarity(arm.config, other.config)
            neighbours.append((weight, math.log(measured)))
            if target in other.raw:
                residuals.append((weight, math.log(measured) - math.log(self._padded(target, other.raw[target][0]))))
        if target in arm.raw:
            mean, std = arm.raw[target]
            log_value = math.log(self._padded(target, mean))
            # The trees' spread mostly measures disagreement about the workload offset, which the
            # calibration removes: it widens the spread between configurations only up to a cap.
            within = min(max(std / mean, SPREAD_FAR_LOG), SPREAD_FAR_MAX_LOG)
            if not residuals:
                return log_value, max(within, SPREAD_UNCALIBRATED_LOG)
            n = len(residuals)
            offset = sum(r for _, r in residuals) / n * n / (n + OFFSET_PRIOR_N)
            total = sum(w for w, _ in residuals)
            shift = offset + sum(w * (r - offset) for w, r in residuals) / (total + CALIBRATION_PRIOR_WEIGHT)
            share_far = CALIBRATION_PRIOR_WEIGHT / (total + CALIBRATION_PRIOR_WEIGHT)
            spread_sq = SPREAD_NEAR_LOG ** 2 + (within ** 2 - SPREAD_NEAR_LOG ** 2) * share_far
            return log_value + shift, math.sqrt(spread_sq + within ** 2 / (n + OFFSET_PRIOR_N) * share_far)
        if not neighbours:
            return None
        total = sum(w for w, _ in neighbours)
        return sum(w * v for w, v in neighbours) / total, SPREAD_NO_MODEL_LOG

    def overhead_s(self) -> float:
        """Seconds a measurement of this workload takes besides compiling (median of the runs so far)."""
        spans = [r.wall_s - (r.compile_s or 0.0) for a in self.arms.values() for r in a.ok_runs() if r.wall_s > 0]
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
        """Numerical error from measured configurations of the same precision, or None."""
        logs = []
        for other in self.arms.values():
            if other is arm or other.config.get("precision") != arm.config.get("precision"):
                continue
            values = [r.max_rel_error for r in other.counted_runs() if r.max_rel_error is not None]
            if values:
                logs.append(math.log(max(median(values), 1e-12)))
        if not logs:
            return None
        mean = sum(logs) / len(logs)
        spread = math.sqrt(sum((v - mean) ** 2 for v in logs) / (len(logs) - 1)) if len(logs) > 1 else 0.0
        return mean, max(REL_ERROR_SPREAD_LOG, spread)

    def forecast(self, arm: Arm) -> Forecast:
        s = self.settings
        energy = self.calibrated(arm, "energy_j_per_inference")
        power = self.calibrated(arm, "avg_power_w")
        latency = self.calibrated(arm, "latency_ms_p95")
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
            if self.per_sample:
                amortised /= max(1, int(arm.config.get("batch_size") or 1))
            log_obj = (math.log(amortised), energy[1])
        if s.objective == "latency":
            log_obj = latency or unknown
        elif s.objective == "edp":
            log_obj = (log_obj[0] + latency[0], math.hypot(log_obj[1], latency[1])) if latency else unknown
        p_total, worst, worst_p = 1.0, "", 2.0
        for limit, value in self.limits.items():
            bound = limit_value(limit, value, s.margin_pct)
            figure = self._limit_figure(arm, limit, power, latency, compile_log)
            if figure is None or not math.isfinite(figure[1]):
                continue
            p = prob_below(figure[0], figure[1], bound + (COMPILE_PAD_S if limit == "max_compile_s" else 0.0))
            p_total *= p
            if p < worst_p:
                worst_p = p
                unit = LIMIT_UNITS[limit]
                worst = (f"predicted {LIMIT_FIGURES[limit]} {fmt(math.exp(figure[0]), unit)} +- "
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
        if limit == "max_p95_latency_ms":
            return latency
        if limit == "max_compile_s":
            return compile_log if arm.compiles else None
        return self.rel_error_guess(arm)
