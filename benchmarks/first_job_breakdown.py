"""Where a workload's first job spends its time before measuring: the zygote's start (imports, model build),
the fork, and each worker phase, against a second job forked from the same zygote.

    python benchmarks/first_job_breakdown.py [SPEC] [--device cuda:0] [--batch-size 16] [--json]

Prints the zygote's own preload timings (`preload_s`: modules, workload), the time until it was ready, and
for each of two eager jobs (fp32 with the workload's description, then bf16 without) the seconds from the
job's start to each phase the worker entered, with the job's wall time. Nothing is written to a database.
"""

from __future__ import annotations

import argparse
import json
import time

from joulepilot.compiler import CompileConfig, worker_budget
from joulepilot.compiler.runner import run_worker_job
from joulepilot.compiler.zygote import ZygotePool


def one_job(pool: ZygotePool, spec: str, device: str, batch_size: int, precision: str, describe: bool) -> dict:
    config = CompileConfig(mode="eager", precision=precision, batch_size=batch_size)
    job = {"kind": "bench", "spec": spec, "device": device, "config": config.to_row(), "min_seconds": 2.0,
           "idle_power_w": {}, "describe": describe}
    started = time.monotonic()
    phases: list[tuple[str, float]] = []
    result = run_worker_job(job, budget=worker_budget(600, 2.0), zygotes=pool,
                            on_phase=lambda kind, phase: phases.append((phase, round(time.monotonic() - started, 2))))
    return {"config": config.label if hasattr(config, "label") else config.id, "status": result.get("status"),
            "reason": result.get("reason"), "job_wall_s": round(time.monotonic() - started, 2), "phases": phases,
            "worker_s": round(float(result.get("finished_at", 0)) - float(result.get("started_at", 0)), 2),
            "worker_process": result.get("worker_process")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default="transformers:BertConfig")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with ZygotePool() as pool:
        first = one_job(pool, args.spec, args.device, args.batch_size, "fp32", describe=True)
        zygote = pool.current
        info = dict(zygote.info) if zygote is not None else {}
        second = one_job(pool, args.spec, args.device, args.batch_size, "bf16", describe=False)
    report = {"spec": args.spec, "device": args.device, "zygote": {k: info.get(k) for k in
              ("preload_s", "preloaded", "fork_safe", "why", "built", "build_error", "preload_errors")},
              "jobs": [first, second]}
    print(json.dumps(report, indent=None if args.json else 2, default=str))


if __name__ == "__main__":
    main()
