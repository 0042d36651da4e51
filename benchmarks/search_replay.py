"""Replay recorded sweeps through the guided search and score its choices against an oracle.

    python benchmarks/search_replay.py EXPORT.json [EXPORT.json ...] [--json] [--seed N] [--windows process]
                                       [--measured-only]

EXPORT files are in the `store.exchange` format (`joulepilot runs export`). A workload is one workload
(spec, batch, shape) measured on one host (device kind and torch version); its grid is the set of
configurations recorded for it. For every workload and each scenario:

* `free`: no power limit; `power_p25`, `power_p50`, `power_p75`: `max_avg_power_w` at that percentile
  (numpy's linear interpolation) of the medians of average power of the workload's configurations
  with an ok run; always `max_rel_error = 2e-2` and 10,000,000 expected inferences, energy objective;
* the real guided search (`controller.search`) runs on the grid; measuring a configuration returns one
  of its recorded ok runs, drawn with a seeded RNG with replacement (a configuration whose runs all
  failed returns one of its failed runs); its wall seconds (finished_at - started_at) are the cost;
  every draw costs its whole wall time, except the further windows a repeat asks for in the same
  process (`controller.search.Step.windows`), which the daemon takes in one worker: those cost the drawn
  run's warm-up, latency pass and window (`WINDOW_COST`); a further window's figures are another draw
  (`--windows independent`, the default) or its process's draw moved by the spread windows of one worker show
  (`--windows process`, `WINDOW_MODELS`); a repeat in a fresh process starts from the saved artifacts, as the
  daemon's does: where the drawn run recorded a warm start (`warm_start_s`) it costs that in place of its
  compile and keeps no compile figures (`warm_repeat`), else it costs the whole cold process it was;
* the trade-off model (`controller.tradeoff`) is fitted on the runs of the *other* workload specs only:
  those of the exports and of the repository's committed data (`tests/data/*.json`, whose synthetic sweep was
  made up for the tests, not measured), never any run of the replayed spec (at any batch size or on any device);
  with `--measured-only` on measured runs only (no run marked `extra.synthetic`);
* a configuration is within the accuracy limit when the median relative error of its recorded ok runs is
  (a configuration whose runs never measured the error cannot be verified, so it is not), and, against a
  power limit, *clearly within* it when every recorded ok run's average power is, *clearly over* it when
  every one is over, *straddling* otherwise: its runs alone cannot say on which side it is;
* oracle: the clearly-within configuration (within the accuracy limit too) with the lowest median objective
  over all its recorded ok runs, or `none`;
* regret = median(chosen) / median(oracle) - 1 by those recorded medians; choosing a straddling
  configuration is no error: its regret is counted the same way, from 0 when its median is lower than the
  oracle's (0 where the oracle is `none`); choosing a clearly-over configuration, or one outside the
  accuracy limit, is infinite regret (`null` in JSON, `inf` in the table); where the oracle is `none` the
  search must answer `infeasible` or a straddling configuration (regret 0), and answering `infeasible` where
  the oracle is not `none` is infinite regret. `chosen` is the configuration's label, or `infeasible`;
* `measured` counts distinct configurations measured, `cost_s` the drawn runs' wall seconds (repeats
  included), `exhaustive_cost_s` one run per configuration (the median wall seconds of the runs a draw
  could return).

`--json` prints {"scenarios": [...], "summary": {"scenarios", "cost_fraction", "regret_p90",
"regret_max"}}; `cost_fraction` is the sum of cost_s over the sum of exhaustive_cost_s. Progress goes
to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from joulepilot.controller.features import device_kind
from joulepilot.controller.search import SearchSettings, run_search
from joulepilot.controller.tradeoff import TradeoffError, fit_samples, training_samples
from joulepilot.policies.judge import Rules, Run, run_objective
from joulepilot.policies.resolve import torch_minor
from joulepilot.policies.schema import Limits
from joulepilot.store import ExportFormatError, StoreError, import_runs, open_db, read_export
from joulepilot.store.jsonvalues import json_column
from joulepilot.store.replay import runs_with_rows

COMMITTED_DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
SCENARIOS = {"free": None, "power_p25": 25, "power_p50": 50, "power_p75": 75}
MAX_REL_ERROR = 2e-2
EXPECTED_INFERENCES = 10_000_000
TARGET_REGRET = 0.02
TARGET_REGRET_MAX = 0.05
TARGET_COST_FRACTION = 0.35
TARGET_SMALL_COST_FRACTION = 1.0
LARGE_GRID = 16
# Whether a further window in the same process costs only its warm-up, latency pass and window: the daemon
# takes a repeat's windows in one worker, each stored as a run whose span is its latency pass and window
# (`compiler.bench.further_window_rows`), so a draw for a further window costs what such a run records.
# The recorded runs are whole processes; their warm-up is counted too, which a further window does not do.
WINDOW_COST = True
# What a further window measures (`--windows`). `independent`: another recorded run, drawn like a fresh
# process's (the recorded runs are whole processes, so this treats a window as independent evidence).
# `process`: the figures of the run its process drew, each energy figure times 1 + e: windows of one worker
# agree far more closely than processes do, but not always. On the H200 guided passes of 2026-12-02/03 the three
# windows of a process had a relative spread (std / mean) of 0.03-0.5% in six processes of eight and 1.7% and
# 4.5% in the other two, while a grid's two processes of one configuration differ by up to 14%: so e ~ Normal(0,
# 0.3%), or Normal(0, 3%) in a quarter of the windows.
WINDOW_MODELS = ("independent", "process")
WITHIN_PROCESS_REL = 0.003
WITHIN_PROCESS_WIDE_REL = 0.03
WITHIN_PROCESS_WIDE_P = 0.25
_ENERGY_FIELDS = ("energy_j_per_inference", "energy_above_idle_j_per_inference", "energy_j_per_token")


@dataclass
class ReplayWorkload:
    key: tuple[str, str, str, str]  # workload id, device kind, torch minor, host id
    label: str
    spec: str
    workload_row: dict[str, Any]
    device: str
    hostname: str
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # config id -> configs row
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # config id -> runs rows

    def ok_runs(self, config_id: str) -> list[dict[str, Any]]:
        return [r for r in self.runs[config_id] if Run.from_row(r).ok]


RULES = Rules(objective="energy", expected_inferences=EXPECTED_INFERENCES)


def _objective(run: Mapping[str, Any], config: Mapping[str, Any]) -> float | None:
    return run_objective(Run.from_row(run), config, RULES)


def grid_medians(configs: Mapping[str, Mapping[str, Any]], runs: Mapping[str, Sequence[Mapping[str, Any]]]
                 ) -> dict[str, dict[str, Any]]:
    """config id -> median objective, average power and relative error over its recorded ok runs, and
    every one of their average powers (configurations with no ok run are left out)."""
    out = {}
    for config_id, config in configs.items():
        ok = [r for r in runs.get(config_id, ()) if Run.from_row(r).ok]
        if not ok:
            continue
        objectives = [v for v in (_objective(r, config) for r in ok) if v is not None]
        powers = [r["avg_power_w"] for r in ok if r.get("avg_power_w") is not None]
        errors = [r["max_rel_error"] for r in ok if r.get("max_rel_error") is not None]
        out[config_id] = {"objective": statistics.median(objectives) if objectives else None,
                          "power": statistics.median(powers) if powers else None,
                          "error": statistics.median(errors) if errors else None, "powers": powers}
    return out


WITHIN, STRADDLING, OVER = "within", "straddling", "over"


def _standing(figures: Mapping[str, Any], power_limit: float | None) -> str:
    """WITHIN every limit clearly, STRADDLING the power limit (its runs fall on both sides), or OVER a limit
    (every run over the power limit, or the accuracy limit not met or not measured)."""
    if figures["objective"] is None or figures["error"] is None or figures["error"] > MAX_REL_ERROR:
        return OVER
    if power_limit is None:
        return WITHIN
    powers = figures["powers"]
    if not powers or all(p > power_limit for p in powers):
        return OVER
    return WITHIN if all(p <= power_limit for p in powers) else STRADDLING


def oracle_of(medians: Mapping[str, Mapping[str, Any]], power_limit: float | None
              ) -> tuple[str | None, dict[str, str]]:
    """(the oracle: the clearly-within configuration with the lowest median objective, or None; config id ->
    WITHIN, STRADDLING or OVER)."""
    standing = {cid: _standing(f, power_limit) for cid, f in medians.items()}
    within = [cid for cid, where in standing.items() if where == WITHIN]
    return (min(within, key=lambda cid: medians[cid]["objective"]) if within else None), standing


def regret_of(chosen: str | None, state: str, oracle: str | None, standing: Mapping[str, str],
              medians: Mapping[str, Mapping[str, Any]]) -> float:
    """The regret of a choice (see the module docstring): from the recorded medians; a straddling choice
    counted from 0; infinite for a clearly-over choice, or an `infeasible` answer where the oracle exists."""
    if chosen is None or state == "infeasible":
        return 0.0 if oracle is None else math.inf
    where = standing.get(chosen, OVER)
    if where == OVER:
        return math.inf
    if oracle is None:
        return 0.0
    regret = medians[chosen]["objective"] / medians[oracle]["objective"] - 1.0
    return max(0.0, regret) if where == STRADDLING else regret


def _wall_s(run: Mapping[str, Any]) -> float:
    return Run.from_row(run).wall_s


def window_cost_s(run: Mapping[str, Any]) -> float:
    """What a further window in a worker that has compiled the configuration costs: the run's warm-up,
    latency pass and energy window (no process start, load, reference, compile or numerical check)."""
    extra = run.get("extra") or {}
    if isinstance(extra, str):
        extra = json.loads(extra)
    latency_s = float(extra.get("latency_calls") or 0) * float(extra.get("latency_ms_mean") or 0) / 1000.0
    parts = float(run.get("warmup_s") or 0) + latency_s + float(run.get("window_s") or 0)
    return min(parts, _wall_s(run)) if parts > 0 else _wall_s(run)


def warm_repeat(observation: Run, run: Mapping[str, Any]) -> Run:
    """A repeat of a compiled configuration in a fresh process, as the daemon runs one: started from the
    artifacts its first run saved, so the recorded compile is replaced by the warm start the run records
    (`warm_start_s`), and the run keeps no compile figures of its own (the judge amortises it with the
    configuration's cold compile). A run recorded without a warm start is replayed as the cold process it was,
    costing more than the daemon would spend."""
    warm_s = run.get("warm_start_s")
    if not isinstance(warm_s, int | float) or observation.compile_s is None:
        return observation
    return dataclasses.replace(observation, wall_s=max(0.0, observation.wall_s - observation.compile_s) + warm_s,
                               compile_s=None, compile_energy_j=None, warm_started=True)


def exhaustive_cost_s(workload: ReplayWorkload) -> float:
    total = 0.0
    for config_id in workload.configs:
        pool = workload.ok_runs(config_id) or workload.runs[config_id]
        total += statistics.median(_wall_s(r) for r in pool)
    return total


def synthetic(record: Mapping[str, Any]) -> bool:
    """An exported run made up rather than measured (`extra.synthetic`: tests/data/synthetic_sweep.json)."""
    extra = json_column(record["run"].get("extra"), {})
    return isinstance(extra, dict) and bool(extra.get("synthetic"))


def load(paths: Sequence[Path], db: Any, train_db: Any = None) -> tuple[list[ReplayWorkload], set[int]]:
    """Import the exports, then the committed data (training only); the exports' workloads to replay. With
    `train_db`, what the trade-off model learns from goes there too, measured runs only."""
    replay_ids: set[int] = set()
    for path in paths:
        records = read_export(path)
        replay_ids.update(import_runs(db, records, source=str(path)))
        if train_db is not None:
            import_runs(train_db, [r for r in records if not synthetic(r)], source=str(path))
    for path in sorted(COMMITTED_DATA.glob("*.json")):
        records = read_export(path)
        import_runs(db, records, source=str(path))
        if train_db is not None:
            import_runs(train_db, [r for r in records if not synthetic(r)], source=str(path))
    workloads: dict[tuple[str, str, str, str], ReplayWorkload] = {}
    for record in runs_with_rows(db, replay_ids):
        run, workload_row, config = record["run"], record["workload"], record["config"]
        kind = device_kind(run)
        key = (run["workload_id"], kind, torch_minor(run.get("torch_version") or "0.0"), run["host_id"])
        if key not in workloads:
            label = f"{workload_row['spec']}/b{workload_row['batch_size']}"
            hostname = str((record["host"] or {}).get("hostname") or run["host_id"])
            workloads[key] = ReplayWorkload(key, label, workload_row["spec"], workload_row, kind, hostname)
        wl = workloads[key]
        wl.configs.setdefault(config["id"], config)
        wl.runs.setdefault(config["id"], []).append(run)
    labels = [w.label for w in workloads.values()]
    for wl in workloads.values():  # the same workload on several hosts: say which
        if labels.count(wl.label) > 1:
            wl.label = f"{wl.label} ({wl.device}, {wl.hostname})"
    return list(workloads.values()), replay_ids


class ModelCache:
    """The trade-off model fitted without one workload spec, once per spec."""

    def __init__(self, db: Any) -> None:
        self.samples = training_samples(db)
        self.models: dict[str, Any] = {}
        self.fit_s: list[float] = []

    def without(self, spec: str) -> Any:
        if spec not in self.models:
            started = time.perf_counter()
            try:
                self.models[spec] = fit_samples([s for s in self.samples if s.group != spec])
            except TradeoffError:
                self.models[spec] = None  # no other workload: the search runs without predictions
            self.fit_s.append(time.perf_counter() - started)
        return self.models[spec]


def _same_process_window(run: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """A further window of the process that measured `run` (`--windows process`). Bench checks each window's pace
    on its own, so the window warning of the process's first window is not carried over."""
    wide = rng.random() < WITHIN_PROCESS_WIDE_P
    factor = 1.0 + rng.gauss(0.0, WITHIN_PROCESS_WIDE_REL if wide else WITHIN_PROCESS_REL)
    window = {**run, **{k: run[k] * factor for k in _ENERGY_FIELDS if isinstance(run.get(k), int | float)}}
    extra = json_column(run.get("extra"), {})
    if isinstance(extra, dict) and extra.get("window_warning"):
        window["extra"] = {k: v for k, v in extra.items() if k != "window_warning"}
    return window


def replay_scenario(workload: ReplayWorkload, scenario: str, model: Any, seed: int,
                    medians: Mapping[str, Mapping[str, float | None]], predictions: Mapping[str, Any],
                    windows: str = "independent") -> dict[str, Any]:
    percentile = SCENARIOS[scenario]
    powers = [f["power"] for f in medians.values() if f["power"] is not None]
    power_limit = float(np.percentile(powers, percentile)) if percentile is not None else None
    rng = random.Random(f"{seed}/{'/'.join(workload.key)}/{scenario}")
    cost = [0.0]

    process_run: dict[str, Mapping[str, Any]] = {}  # config id -> the run its latest process drew

    def measure(config: Mapping[str, Any], fresh_process: bool) -> Run:
        pool = workload.ok_runs(config["id"]) or workload.runs[config["id"]]
        repeat = fresh_process and config["id"] in process_run
        if windows == "process" and not fresh_process and config["id"] in process_run:
            run = _same_process_window(process_run[config["id"]], rng)
        else:
            run = rng.choice(pool)
            process_run[config["id"]] = run
        observation = Run.from_row(run, fresh_process=fresh_process)
        if not fresh_process and WINDOW_COST:  # a further window of the process that just measured it
            observation = dataclasses.replace(observation, wall_s=window_cost_s(run))
        elif repeat and observation.ok:
            observation = warm_repeat(observation, run)
        cost[0] += observation.wall_s
        return observation

    def predict(configs: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [predictions.get(c["id"], {}) for c in configs]

    rules = Rules(objective="energy", expected_inferences=EXPECTED_INFERENCES,
                  limits=Limits(max_avg_power_w=power_limit, max_rel_error=MAX_REL_ERROR))
    result = run_search(list(workload.configs.values()), measure, predict if model is not None else None,
                        rules=rules, settings=SearchSettings())
    oracle, standing = oracle_of(medians, power_limit)
    regret = regret_of(result.chosen_config_id, result.state, oracle, standing, medians)
    chosen_label = "infeasible" if result.chosen_config_id is None or result.state == "infeasible" \
        else result.chosen_label
    return {
        "workload": workload.label, "scenario": scenario, "grid": len(workload.configs),
        "measured": len({s.config_id for s in result.steps}), "cost_s": round(cost[0], 1),
        "exhaustive_cost_s": round(exhaustive_cost_s(workload), 1), "chosen": chosen_label,
        "oracle": workload.configs[oracle]["label"] if oracle else "none", "regret": regret,
        "_power_limit_w": power_limit, "_result": result,
    }


def percentile_with_inf(values: Sequence[float], q: float) -> float:
    """numpy's linear percentile, where an infinite neighbour makes the result infinite."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    if math.isinf(ordered[low]) or math.isinf(ordered[high]):
        return math.inf
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def replay(paths: Sequence[Path], seed: int = 0, progress: Any = None, windows: str = "independent",
           measured_only: bool = False) -> dict[str, Any]:
    """Every scenario of every workload in the exports; see the module docstring. `measured_only`: the trade-off
    model learns from no synthetic run (`synthetic`); such runs are still replayed when an export holds them."""
    with tempfile.TemporaryDirectory(prefix="joulepilot-replay-") as tmp:
        db = open_db(Path(tmp) / "replay.db")
        train_db = open_db(Path(tmp) / "train.db") if measured_only else None
        try:
            workloads, _ = load(paths, db, train_db)
            models = ModelCache(train_db or db)
        finally:
            db.close()
            if train_db is not None:
                train_db.close()
    scenarios = []
    search_s = 0.0
    for workload in workloads:
        medians = grid_medians(workload.configs, workload.runs)
        if not medians:
            if progress:
                progress(f"{workload.label}: no ok run in {len(workload.configs)} configurations, skipped")
            continue
        model = models.without(workload.spec)
        predictions = {}
        if model is not None:
            configs = list(workload.configs.values())
            predictions = {c["id"]: p for c, p in
                           zip(configs, model.predict_many(workload.workload_row, configs, workload.device),
                               strict=True)}
        if progress:
            progress(f"{workload.label} on {workload.device}: {len(workload.configs)} configurations")
        for scenario in SCENARIOS:
            started = time.perf_counter()
            scenarios.append(replay_scenario(workload, scenario, model, seed, medians, predictions, windows))
            search_s += time.perf_counter() - started
    measurements = sum(s["_result"].measurements for s in scenarios)
    if progress and measurements:
        progress(f"trade-off model fitted {len(models.fit_s)} times ({sum(models.fit_s):.1f} s in all); the search "
                 f"took {search_s * 1000 / measurements:.1f} ms per measurement ({measurements} measurements), "
                 f"its per-measurement update included")
    return {"scenarios": scenarios, "summary": summary(scenarios),
            "_timing": {"fit_s": models.fit_s, "search_s": search_s, "measurements": measurements}}


def summary(scenarios: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    exhaustive = sum(s["exhaustive_cost_s"] for s in scenarios)
    regrets = [s["regret"] for s in scenarios]
    return {"scenarios": len(scenarios),
            "cost_fraction": sum(s["cost_s"] for s in scenarios) / exhaustive if exhaustive else None,
            "regret_p90": percentile_with_inf(regrets, 90) if regrets else None,
            "regret_max": max(regrets) if regrets else None}


def targets(scenarios: Sequence[Mapping[str, Any]]) -> list[str]:
    """The issue's targets, checked where they apply, as lines of text."""
    lines = []
    large = [s for s in scenarios if s["grid"] >= LARGE_GRID]
    if large:
        fraction = sum(s["cost_s"] for s in large) / sum(s["exhaustive_cost_s"] for s in large)
        within = sum(1 for s in large if s["regret"] <= TARGET_REGRET) / len(large)
        worst = max(s["regret"] for s in large)
        lines.append(f"grids of >= {LARGE_GRID} configurations ({len(large)} scenarios): cost_fraction "
                     f"{fraction:.2f} (target <= {TARGET_COST_FRACTION}), regret <= 2% in {within:.0%} "
                     f"(target >= 90%), max {_pct(worst)} (target <= 5%)")
    small = [s for s in scenarios if 6 <= s["grid"] <= 10]
    if small:
        within = sum(1 for s in small if s["regret"] <= TARGET_REGRET)
        fraction = sum(s["cost_s"] for s in small) / sum(s["exhaustive_cost_s"] for s in small)
        lines.append(f"grids of 6-10 configurations ({len(small)} scenarios): cost_fraction {fraction:.2f} (target "
                     f"<= {TARGET_SMALL_COST_FRACTION}), regret <= 2% in {within} of {len(small)} (target: all)")
    return lines


def _pct(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.1%}"


def public(result: Mapping[str, Any]) -> dict[str, Any]:
    """The documented JSON: private keys dropped, infinities as null."""
    from joulepilot.store import json_safe

    scenarios = [{k: v for k, v in s.items() if not k.startswith("_")} for s in result["scenarios"]]
    return json_safe({"scenarios": scenarios, "summary": result["summary"]})


def table(result: Mapping[str, Any]) -> str:
    header = ("workload", "scenario", "limit W", "grid", "measured", "cost s", "exhaustive s", "chosen",
              "oracle", "regret")
    rows = [header]
    for s in result["scenarios"]:
        limit = s["_power_limit_w"]
        rows.append((s["workload"], s["scenario"], "-" if limit is None else f"{limit:.0f}", str(s["grid"]),
                     str(s["measured"]), f"{s['cost_s']:.0f}", f"{s['exhaustive_cost_s']:.0f}", s["chosen"],
                     s["oracle"], _pct(s["regret"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    summ = result["summary"]
    fraction = summ["cost_fraction"]
    lines.append("")
    lines.append(f"{summ['scenarios']} scenarios: cost_fraction {'-' if fraction is None else f'{fraction:.2f}'}, "
                 f"regret p90 {_pct(summ['regret_p90'])}, max {_pct(summ['regret_max'])}")
    lines.extend(targets(result["scenarios"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+", type=Path, help="runs export files (store.exchange format)")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws of recorded runs (default 0)")
    parser.add_argument("--windows", choices=WINDOW_MODELS, default="independent",
                        help="what a further window of a process measures (default independent; see WINDOW_MODELS)")
    parser.add_argument("--measured-only", action="store_true",
                        help="the trade-off model learns from measured runs only, not the synthetic sweep's")
    args = parser.parse_args(argv)
    for path in args.exports:
        if not path.is_file():
            print(f"search_replay: {path}: no such file; give a runs export (joulepilot runs export FILE)",
                  file=sys.stderr)
            return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        result = replay(args.exports, args.seed, progress, args.windows, args.measured_only)
    except (ExportFormatError, StoreError) as exc:
        print(f"search_replay: {exc}", file=sys.stderr)
        return 2
    if not result["scenarios"]:
        print("search_replay: the exports hold no workload with an ok run to replay", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(public(result), indent=1))
    else:
        print(table(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
