"""Score a daemon's guided search on the GPU against the exhaustive grid recorded for the same model.

    python benchmarks/guided_vs_grid.py GUIDED_RUNS.json GRID_EXPORT.json --explain EXPLAIN.json [--json]
    python benchmarks/guided_vs_grid.py GUIDED_RUNS.json GRID_EXPORT.json --chosen LABEL [--json]

GUIDED_RUNS.json is `joulepilot runs --json --limit 0` of the guided daemon's store for the policy's
workload, EXPLAIN.json `joulepilot policy explain --json` of its decision (benchmarks/guided_daemon_gpu.sh
writes both); GRID_EXPORT.json a runs export (store.exchange format: `benchmarks/gpu_sweep.py`'s
OUT/runs.json) holding the exhaustive sweep of that workload, whose configurations are the policy's grid.

* cost: the guided runs' wall seconds (finished_at - started_at, every run, repeats and further windows
  included) against one run of every grid configuration (the median wall seconds of its recorded runs);
* oracle: as `benchmarks/search_replay.py` has it (`grid_medians`, `oracle_of`), without a power limit: the
  grid configuration with the lowest median objective (J per call + compile energy over 10,000,000 calls,
  the judge's `run_objective`) among those whose median relative error is within 2e-2;
* regret: the grid median of the guided choice over the oracle's, minus one; within the tolerance when
  it is at most 2%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from joulepilot.policies.judge import Run
from joulepilot.store import read_export
from search_replay import TARGET_REGRET, grid_medians, oracle_of, regret_of

TARGET_GPU_COST_FRACTION = 0.40  # issue 26's GPU acceptance: at most 40% of the grid's seconds


def _wall_s(run: dict[str, Any]) -> float:
    started = run.get("started_at_epoch", run.get("started_at"))
    finished = run.get("finished_at_epoch", run.get("finished_at"))
    return float(finished) - float(started)


def compare(guided_runs: list[dict[str, Any]], grid: list[dict[str, Any]], chosen_label: str) -> dict[str, Any]:
    spec = guided_runs[0]["workload"] if guided_runs else None
    configs: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for record in grid:
        if record["workload"]["spec"] == spec:
            configs.setdefault(record["config"]["id"], record["config"])
            runs.setdefault(record["config"]["id"], []).append(record["run"])
    if not configs:
        raise SystemExit(f"guided_vs_grid: the grid export holds no run of {spec}")
    medians = grid_medians(configs, runs)
    oracle, standing = oracle_of(medians, None)
    label_to_id = {c["label"]: cid for cid, c in configs.items()}
    chosen = label_to_id.get(chosen_label)
    regret = regret_of(chosen, "verified" if chosen else "fallback", oracle, standing, medians)
    exhaustive_s = sum(statistics.median(_wall_s(r) for r in (
        [r for r in rs if Run.from_row(r).ok] or rs)) for rs in runs.values())
    guided_s = sum(_wall_s(r) for r in guided_runs)
    return {"workload": spec, "grid": len(configs), "guided_runs": len(guided_runs),
            "measured": sorted({r["config_label"] for r in guided_runs}), "cost_s": round(guided_s, 1),
            "exhaustive_cost_s": round(exhaustive_s, 1), "cost_fraction": round(guided_s / exhaustive_s, 3),
            "chosen": chosen_label, "oracle": configs[oracle]["label"] if oracle else "none",
            "regret": None if regret == float("inf") else round(regret, 4),
            "within_tolerance": regret <= TARGET_REGRET,
            "within_cost": guided_s / exhaustive_s <= TARGET_GPU_COST_FRACTION}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("guided_runs", type=Path)
    parser.add_argument("grid", type=Path)
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--chosen", help="the guided decision's configuration label")
    chosen.add_argument("--explain", type=Path, help="`joulepilot policy explain --json` of the guided decision")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    label = args.chosen or json.loads(args.explain.read_text())["config"]["label"]
    result = compare(json.loads(args.guided_runs.read_text()), read_export(args.grid), label)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    regret = "inf" if result["regret"] is None else format(result["regret"], ".1%")
    print(f"{result['workload']}: guided measured {len(result['measured'])} of {result['grid']} configurations in "
          f"{result['guided_runs']} runs, {result['cost_s']} s against {result['exhaustive_cost_s']} s for one run "
          f"of each (cost fraction {result['cost_fraction']}, target <= {TARGET_GPU_COST_FRACTION}); chose "
          f"{label}, oracle {result['oracle']}, regret {regret} (target <= {TARGET_REGRET:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
