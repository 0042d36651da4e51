"""The speed/energy trade-off regression, refit from the store whenever it is needed.

One random forest per target (`TARGETS`), on the features of `controller.features`. Targets are
learnt in log space, and the two that grow with the amount of work (energy and latency per forward
call) are first divided by the workload's FLOPs, and compile time and compile energy by its graph size,
so that the trees learn "joules per FLOP under this configuration" — something that carries over to a workload
they have not seen, which raw joules do not.

Uncertainty: each prediction's `std` is the spread (standard deviation) of the forest's individual
trees, each tree's output mapped back to the target's units; the `mean` is the forest's average in log
space mapped back (a geometric mean). Tree spread captures how much the data disagrees near the
query; it understates the error on a workload unlike any seen, which is why `cross_validate` holds out
whole workloads.

Compile energy (`compile_energy_j`, GPU part + CPU part) is a target of its own, learnt only from runs
that metered both parts (see `TARGET_SOURCES`). Where RAPL cannot be read the CPU part is the labelled
estimate; `summary()["compile_energy_cpu_sources"]` counts how many of those runs rest on one.

Generation runs (`task = "generate"`) are learnt by a model of their own (`TradeoffModel.generation`), on a
generation's features (`controller.features.GENERATION_NUMBERS`: parameters, batch, prompt and new tokens, the
KV cache's size and kind, a compiled prefill) and targets (`GENERATION_TARGETS`: J per generated token, TPOT,
TTFT, power, compile): a forward pass's J per call and a generation's J per token are different quantities, so no
forest ever sees both. `predict_many` answers with the model of the workload's task.

Nothing is pickled: `fit(db)` takes well under a second on thousands of runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from joulepilot.store import Store
from joulepilot.store.catalog import workload_rows
from joulepilot.store.runs import ok_runs

from .features import FeatureSpace

TARGETS = ("energy_j_per_inference", "latency_ms_p95", "avg_power_w", "compile_s", "compile_energy_j")
GENERATION_TARGETS = ("energy_j_per_token", "tpot_ms_p50", "tpot_ms_p95", "ttft_ms_p50", "avg_power_w", "compile_s",
                      "compile_energy_j")
GENERATE = "generate"


def targets_of(task: str) -> tuple[str, ...]:
    return GENERATION_TARGETS if task == GENERATE else TARGETS
N_TREES = 64
# APE denominators are at least this much, so eager's near-zero compile time and energy do not dominate MAPE.
APE_FLOOR = {"compile_s": 1.0, "compile_energy_j": 100.0}
# The run attribute a target is learnt from, where it is not the target's own column: compile energy only
# from runs whose GPU and CPU parts were both metered (`store.compile_energy`). Runs from before the CPU
# part was metered hold the GPU part alone; learning from them would teach the model that compiling costs
# the GPU's joules only, and adding a guessed CPU part would pass a guess off as a measurement. With no
# complete run the target is not learnt, and callers fall back to compile seconds x average power.
TARGET_SOURCES = {"compile_energy_j": "complete_compile_energy_j"}
NOT_LEARNT = {"compile_energy_j": "no ok run has both parts of its compile energy metered (runs stored before "
                                  "joulepilot metered the CPU part of compiles hold the GPU part only); compile "
                                  "energy is predicted as compile seconds x average power"}


class TradeoffError(RuntimeError):
    """Not enough measurements to fit or cross-validate; the message says what to run."""


def _offset(target: str, workload: Mapping[str, Any]) -> float:
    """log of the quantity a target is divided by before learning: a forward call's FLOPs or graph size; for a
    generation, its parameters (a decode step reads every weight once per token), and for the first token the
    prompt's tokens too."""
    from .features import work_scale

    if workload.get("task") == GENERATE:
        params = max(1.0, float(workload.get("params") or 1))
        if target in ("energy_j_per_token", "tpot_ms_p50", "tpot_ms_p95"):
            return math.log(params)
        if target == "ttft_ms_p50":
            tokens = max(1, int(workload.get("batch_size") or 1)) * max(1, int(workload.get("prompt_len") or 1))
            return math.log(params * tokens)
        return 0.0
    if target in ("energy_j_per_inference", "latency_ms_p95"):
        return math.log(work_scale(workload))
    if target in ("compile_s", "compile_energy_j"):
        return math.log(1.0 + float(workload.get("graph_nodes") or 0))
    return 0.0


COMPILE_PAD_S = 0.05  # added before the log so eager's ~0 s compile stays finite
COMPILE_PAD_J = 1.0  # likewise for eager's few joules of first call
PADS = {"compile_s": COMPILE_PAD_S, "compile_energy_j": COMPILE_PAD_J}


def _to_learnt(target: str, value: float, workload: Mapping[str, Any]) -> float:
    return math.log(value + PADS.get(target, 0.0)) - _offset(target, workload)


def _from_learnt(target: str, learnt: np.ndarray, workload: Mapping[str, Any]) -> np.ndarray:
    value = np.exp(learnt + _offset(target, workload))
    if target in PADS:
        value = np.maximum(0.0, value - PADS[target])
    return value


def _usable(target: str, value: Any) -> bool:
    if value is None or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value >= 0 if target in PADS else value > 0


@dataclass
class Sample:
    """One ok run with what the regression needs."""

    workload: dict[str, Any]
    config: dict[str, Any]
    device: str
    targets: dict[str, float]
    group: str  # workload spec: cross-validation holds these out whole
    compile_cpu_source: str | None = None  # of the CPU part of compile_energy_j: 'rapl' or 'estimate'
    task: str = "forward"  # GENERATE: learnt by the generation model, on its own features and targets


def training_samples(db: Store) -> list[Sample]:
    """Every ok run of the store, joined with its workload row."""
    workloads = workload_rows(db)
    samples = []
    for run in ok_runs(db):
        workload = workloads.get(run.workload_id)
        if workload is None:
            continue
        task = GENERATE if workload.get("task") == GENERATE else "forward"
        values = {t: getattr(run, TARGET_SOURCES.get(t, t)) for t in targets_of(task)}
        samples.append(Sample(
            workload=workload,
            config={k: getattr(run, k) for k in ("mode", "fusion", "precision", "dynamic", "batch_size", "options",
                                                  "padding", "regional", "cache", "compile_prefill")},
            device=run.device_kind,
            targets={t: v for t, v in values.items() if _usable(t, v)},
            group=str(workload["spec"]),
            compile_cpu_source=run.compile_energy_cpu_source,
            task=task,
        ))
    return samples


@dataclass
class TradeoffModel:
    """Fitted forests, one per target; `predict` gives (mean, std) in the target's units."""

    space: FeatureSpace
    forests: dict[str, Any]
    n_samples: dict[str, int]
    workloads: list[str]
    devices: list[str]
    fitted_at: float = field(default_factory=time.time)
    # how many of the runs compile_energy_j was learnt from had a measured ('rapl') or estimated CPU part
    compile_cpu_sources: dict[str, int] = field(default_factory=dict)
    # the model of generation runs (None: the store has none); this one learnt the forward passes
    generation: TradeoffModel | None = None

    def predict_many(self, workload: Mapping[str, Any], configs: Sequence[Any],
                     device_name: str) -> list[dict[str, tuple[float, float]]]:
        """{target: (mean, std)} per configuration, from the model of the workload's task (nothing for a task
        with no run to learn from)."""
        if workload.get("task") == GENERATE and self.space.task != GENERATE:
            return self.generation.predict_many(workload, configs, device_name) if self.generation else \
                [{} for _ in configs]
        if not configs or not self.forests:
            return [{} for _ in configs]
        # The trees' own input type, converted once: each tree's predict then skips sklearn's input checks,
        # which cost far more than the prediction itself (64 trees per target, per call).
        x = np.ascontiguousarray([self.space.vector(workload, c, device_name) for c in configs], dtype=np.float32)
        out: list[dict[str, tuple[float, float]]] = [{} for _ in configs]
        for target, forest in self.forests.items():
            per_tree = np.stack([tree.predict(x, check_input=False) for tree in forest.estimators_])  # trees x configs
            values = _from_learnt(target, per_tree, workload)
            means = _from_learnt(target, per_tree.mean(axis=0), workload)
            stds = values.std(axis=0)
            for i in range(len(configs)):
                out[i][target] = (float(means[i]), float(stds[i]))
        return out

    def predict(self, workload_row: Mapping[str, Any], config: Any,
                device_name: str) -> dict[str, tuple[float, float]]:
        """{target: (mean, std)} for one workload row, configuration and device kind."""
        return self.predict_many(workload_row, [config], device_name)[0]

    @property
    def runs(self) -> int:
        """The most runs any target (of either task) was learnt from."""
        counts = [*self.n_samples.values(), *(self.generation.n_samples.values() if self.generation else ())]
        return max(counts, default=0)

    def summary(self) -> dict[str, Any]:
        out = {"targets": list(self.forests), "samples": self.n_samples, "workloads": self.workloads,
               "devices": self.devices, "features": self.space.names, "fitted_at": self.fitted_at,
               "uncertainty": "std of the random forest's per-tree predictions",
               "not_learnt": {t: NOT_LEARNT.get(t, "no ok run measured it") for t in targets_of(self.space.task)
                              if t not in self.forests},
               "compile_energy_cpu_sources": dict(self.compile_cpu_sources)}
        if self.space.task != GENERATE:
            out["generation"] = self.generation.summary() if self.generation else None
        return out


def _forest(seed: int = 0):
    from sklearn.ensemble import RandomForestRegressor

    return RandomForestRegressor(n_estimators=N_TREES, max_features=0.6, min_samples_leaf=1,
                                 random_state=seed, n_jobs=1)


def fit_samples(samples: Sequence[Sample]) -> TradeoffModel:
    """The forward passes' model, holding the generations' as `generation` (see the module docstring)."""
    if not samples:
        raise TradeoffError("no successful runs in the store to fit on; run `joulepilot bench WORKLOAD` first")
    generations = [s for s in samples if s.task == GENERATE]
    model = _fit_task([s for s in samples if s.task != GENERATE], "forward")
    model.generation = _fit_task(generations, GENERATE) if generations else None
    return model


def _fit_task(samples: Sequence[Sample], task: str) -> TradeoffModel:
    space = FeatureSpace.learn(((s.workload, s.config, s.device) for s in samples), task)
    forests, counts = {}, {}
    for target in targets_of(task):
        rows = [s for s in samples if target in s.targets]
        if not rows:
            continue
        x = np.array([space.vector(s.workload, s.config, s.device) for s in rows], dtype=float)
        y = np.array([_to_learnt(target, s.targets[target], s.workload) for s in rows])
        forests[target] = _forest().fit(x, y)
        counts[target] = len(rows)
    cpu_sources: dict[str, int] = {}
    for s in samples:
        if "compile_energy_j" in s.targets:
            key = s.compile_cpu_source or "unknown"
            cpu_sources[key] = cpu_sources.get(key, 0) + 1
    return TradeoffModel(space, forests, counts, sorted({s.group for s in samples}),
                         sorted({s.device for s in samples}), compile_cpu_sources=cpu_sources)


def fit(db: Store) -> TradeoffModel:
    """Fit every target on the store's ok runs."""
    return fit_samples(training_samples(db))


def _metrics(target: str, truth: Sequence[float], pred: Sequence[float]) -> dict[str, float | None]:
    t = np.asarray(truth, dtype=float)
    p = np.asarray(pred, dtype=float)
    floor = APE_FLOOR.get(target, 0.0)
    ape = np.abs(p - t) / np.maximum(np.abs(t), floor if floor else 1e-300)
    pad = PADS.get(target, 0.0)
    lt, lp = np.log(t + pad), np.log(p + pad)
    ss_tot = float(((lt - lt.mean()) ** 2).sum())
    r2 = 1.0 - float(((lt - lp) ** 2).sum()) / ss_tot if ss_tot > 0 else None
    return {"mape": float(ape.mean()), "median_ape": float(np.median(ape)), "r2_log": r2, "n": int(len(t))}


def cross_validate_samples(samples: Sequence[Sample], n_splits: int = 5) -> dict[str, dict[str, Any]]:
    """Per target (a generation's as 'generate:<target>'), each task's model held out by whole workloads."""
    tasks = {task: [s for s in samples if (s.task == GENERATE) == (task == GENERATE)] for task in ("forward", GENERATE)}
    out: dict[str, dict[str, Any]] = {}
    failures: list[TradeoffError] = []
    for task, mine in tasks.items():
        if not mine:
            continue
        try:
            scores = _cross_validate_task(mine, task, n_splits)
        except TradeoffError as exc:
            failures.append(exc)
            continue
        out.update({(f"{GENERATE}:{t}" if task == GENERATE else t): m for t, m in scores.items()})
    if not out:
        raise failures[0] if failures else TradeoffError("no successful runs in the store to cross-validate")
    return out


def _cross_validate_task(samples: Sequence[Sample], task: str, n_splits: int) -> dict[str, dict[str, Any]]:
    from sklearn.model_selection import GroupKFold

    targets = targets_of(task)
    groups = [s.group for s in samples]
    distinct = sorted(set(groups))
    if len(distinct) < 2:
        found = distinct[0] if distinct else "none"
        raise TradeoffError(
            f"cross-validation holds out whole workloads and needs at least 2 benchmarked workloads; "
            f"the store has {len(distinct)} ({found}); bench another one, e.g. `joulepilot bench convnet`")
    folds = GroupKFold(n_splits=min(n_splits, len(distinct)))
    truth: dict[str, list[float]] = {t: [] for t in targets}
    pred: dict[str, list[float]] = {t: [] for t in targets}
    for train_idx, test_idx in folds.split(samples, groups=groups):
        model = _fit_task([samples[i] for i in train_idx], task)
        for i in test_idx:
            s = samples[i]
            predicted = model.predict(s.workload, s.config, s.device)
            for target, value in s.targets.items():
                if target in predicted:
                    truth[target].append(value)
                    pred[target].append(predicted[target][0])
    return {
        target: _metrics(target, truth[target], pred[target]) | {
            "folds": folds.get_n_splits(), "workloads": len(distinct),
            "holdout": "whole workloads (GroupKFold by workload spec)"}
        for target in targets if truth[target]
    }


def cross_validate(db: Store, n_splits: int = 5) -> dict[str, dict[str, Any]]:
    """Per target: MAPE, median APE, R² of log values, holding out whole workloads (GroupKFold by spec)."""
    return cross_validate_samples(training_samples(db), n_splits)
