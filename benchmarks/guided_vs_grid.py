"""Score a daemon's guided search on the GPU against the exhaustive grid recorded for the same model.

    python benchmarks/guided_vs_grid.py GUIDED_RUNS.json GRID_EXPORT.json [--json]

GUIDED_RUNS.json is `joulepilot runs --json --limit 0` of the guided daemon's store for the policy's
workload (benchmarks/guided_daemon_gpu.sh writes it); GRID_EXPORT.json a runs export (store.exchange
format) holding the exhaustive sweeps of that workload. Only the configurations the guided policy could
choose from count (those of the grid whose label the guided store's policy grid covers: eager, default
and reduce-overhead in fp32/tf32/bf16/fp16 with the default fusion preset).

* cost: the guided runs' wall seconds (finished_at - started_at, every run, repeats included) against
  one run of every grid configuration (the median wall seconds of its recorded runs);
* oracle: the grid configuration with the lowest median amortised energy (J per call + compile energy
  over 10,000,000 calls, the policy's objective) among those whose median relative error is within 2e-2;
* regret: the oracle-grid median of the guided choice over the oracle's, minus one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

MODES = ("eager", "default", "reduce-overhead")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
EXPECTED_INFERENCES = 10_000_000
MAX_REL_ERROR = 2e-2


def _epoch(run: dict, key: str) -> float:
    value = run.get(f"{key}_epoch", run.get(key))
    return float(value)


def amortised_j(run: dict) -> float:
    compile_j = run.get("compile_energy_j")
    if compile_j is None:
        compile_j = (run.get("compile_s") or 0.0) * (run.get("avg_power_w") or 0.0)
    return run["energy_j_per_inference"] + compile_j / EXPECTED_INFERENCES


def in_policy_grid(config: dict) -> bool:
    return config["mode"] in MODES and config["precision"] in PRECISIONS and config["fusion"] == "default"


def compare(guided_runs: list[dict], grid: list[dict]) -> dict:
    spec = guided_runs[0]["workload"] if guided_runs else None
    by_label: dict[str, list[dict]] = defaultdict(list)
    for record in grid:
        if record["workload"]["spec"] == spec and in_policy_grid(record["config"]):
            by_label[record["config"]["label"]].append(record["run"])
    medians, walls = {}, {}
    for label, runs in by_label.items():
        walls[label] = statistics.median(_epoch(r, "finished_at") - _epoch(r, "started_at") for r in runs)
        ok = [r for r in runs if r["status"] == "ok"]
        if ok:
            medians[label] = (statistics.median(amortised_j(r) for r in ok),
                              statistics.median(r["max_rel_error"] for r in ok))
    feasible = {k: v[0] for k, v in medians.items() if v[1] <= MAX_REL_ERROR}
    oracle = min(feasible, key=feasible.get)
    guided_cost = sum(_epoch(r, "finished_at") - _epoch(r, "started_at") for r in guided_runs)
    measured = sorted({r["config_label"] for r in guided_runs})
    return {"workload": spec, "grid": len(by_label), "grid_runs": sum(len(v) for v in by_label.values()),
            "guided_runs": len(guided_runs), "measured": measured, "cost_s": round(guided_cost, 1),
            "exhaustive_cost_s": round(sum(walls.values()), 1),
            "cost_fraction": round(guided_cost / sum(walls.values()), 3),
            "oracle": oracle, "oracle_j": feasible[oracle], "grid_medians_j": feasible}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("guided_runs", type=Path)
    parser.add_argument("grid", type=Path)
    parser.add_argument("--chosen", required=True, help="the guided decision's configuration label")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = compare(json.loads(args.guided_runs.read_text()), json.loads(args.grid.read_text()))
    chosen = result["grid_medians_j"].get(args.chosen)
    result["chosen"] = args.chosen
    result["regret"] = None if chosen is None else round(chosen / result["oracle_j"] - 1.0, 4)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['workload']}: guided measured {len(result['measured'])} of {result['grid']} configurations in "
          f"{result['guided_runs']} runs, {result['cost_s']} s against {result['exhaustive_cost_s']} s for one run "
          f"of each (cost fraction {result['cost_fraction']}); chose {args.chosen}, oracle {result['oracle']}, "
          f"regret {'unknown' if result['regret'] is None else format(result['regret'], '.1%')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
