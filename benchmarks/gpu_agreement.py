"""Do two GPUs of one host give the same J per call? Each GPU measures the same configurations several times,
both at once (as a two-GPU sweep runs them), and each configuration's difference between the GPUs' medians is
compared with its run-to-run spread on each GPU.

    python benchmarks/gpu_agreement.py --out benchmarks/results/gpu_agreement_h200x2 [--repeats 3]
        [--spec torchvision:resnet50 --batch-size 32 --configs eager/fp32,default/bf16,reduce-overhead/bf16]

One `bench` process per GPU (`--gpus 0,1`), each with its own database under OUT, measures the configurations
in turn, `--repeats` rounds (eager fp32, default bf16, reduce-overhead bf16, then again), every run forced and
cold (no warm start). OUT/gpu_agreement.json and OUT/summary.md hold, per configuration and GPU, the runs'
J per call, their median and their spread ((max - min) / median), and the difference between the two GPUs'
medians; a configuration agrees when that difference is within the larger of its two spreads. A single
comparison of one run per GPU (as in `multi_gpu_sweep.py`) mixes the GPUs' difference with each window's
noise; repeats on both GPUs separate the two.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_CONFIGS = "eager/fp32,default/bf16,reduce-overhead/bf16"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _configs(text: str, batch_size: int) -> list[Any]:
    from joulepilot.compiler import CompileConfig

    out = []
    for item in text.split(","):
        mode, _, precision = item.strip().partition("/")
        out.append(CompileConfig(mode=mode, precision=precision or "fp32", batch_size=batch_size))
    return out


def measure_on(args: argparse.Namespace) -> int:
    """The per-GPU process: every configuration, `repeats` rounds, into OUT/<gpu>.db."""
    from joulepilot.compiler import bench

    configs = _configs(args.configs, args.batch_size)
    db_path = args.out / f"{args.gpu.replace(':', '')}.db"
    bench(args.spec, configs * args.repeats, device=args.gpu, min_seconds=args.min_seconds, budget_s=args.budget_s,
          db=db_path, batch_size=args.batch_size, warm_start=False, save_artifacts=False, force=True)
    return 0


def _runs(db_path: Path) -> list[dict[str, Any]]:
    from joulepilot.store import list_runs, open_db

    db = open_db(db_path, read_only=True)
    try:
        return [r for r in list_runs(db) if r.get("status") == "ok"]
    finally:
        db.close()


def compare(by_gpu: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    gpus = sorted(by_gpu)
    labels = sorted({r["config_label"] for runs in by_gpu.values() for r in runs})
    rows = []
    for label in labels:
        row: dict[str, Any] = {"config": label}
        for gpu in gpus:
            values = [r["energy_j_per_inference"] for r in by_gpu[gpu] if r["config_label"] == label]
            median = statistics.median(values) if values else None
            row[gpu] = {"j_per_call": values, "median": median,
                        "spread": (max(values) - min(values)) / median if values and median else None}
        first, second = row[gpus[0]], row[gpus[1]]
        if first["median"] and second["median"]:
            row["difference"] = second["median"] / first["median"] - 1.0
            spreads = [s for s in (first["spread"], second["spread"]) if s is not None]
            row["agrees"] = abs(row["difference"]) <= max(spreads) if spreads else None
        rows.append(row)
    return {"gpus": gpus, "configurations": rows,
            "all_agree": all(r.get("agrees") for r in rows) if rows else None}


def summary_md(meta: dict[str, Any], result: dict[str, Any]) -> str:
    a, b = result["gpus"]
    lines = [f"{meta['date']}: {meta['spec']} batch {meta['batch_size']} on {meta['device_name']}, torch "
             f"{meta['torch_version']}, {meta['repeats']} runs per configuration and GPU, both GPUs at once, "
             f"{meta['min_seconds']:g}-s windows; wall {meta['wall_s']:.0f} s", "",
             f"Every configuration's GPU-to-GPU difference within its run-to-run spread: {result['all_agree']}", "",
             f"| configuration | {a} J/call (runs) | {a} median | {a} spread | {b} J/call (runs) | {b} median | "
             f"{b} spread | {b} vs {a} | within spread |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["configurations"]:
        cells = [row["config"]]
        for gpu in (a, b):
            side = row[gpu]
            cells += [", ".join(f"{v:.4g}" for v in side["j_per_call"]),
                      "-" if side["median"] is None else f"{side['median']:.4g}",
                      "-" if side["spread"] is None else f"{100 * side['spread']:.1f} %"]
        cells += ["-" if row.get("difference") is None else f"{100 * row['difference']:+.1f} %",
                  str(row.get("agrees"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--spec", default="torchvision:resnet50")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="mode/precision, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=3.0)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--gpus", default="0,1")
    parser.add_argument("--gpu", help=argparse.SUPPRESS)  # the per-GPU process
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        return measure_on(args)
    gpus = [f"cuda:{int(i)}" for i in args.gpus.split(",")]
    started = time.perf_counter()
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    procs = {gpu: subprocess.Popen([sys.executable, __file__, *passed, "--gpu", gpu]) for gpu in gpus}
    codes = {gpu: proc.wait() for gpu, proc in procs.items()}
    wall_s = time.perf_counter() - started
    log(f"both GPUs done in {wall_s:.0f} s: exit codes {codes}")
    by_gpu = {gpu: _runs(args.out / f"{gpu.replace(':', '')}.db") for gpu in gpus}
    runs = [r for rs in by_gpu.values() for r in rs]
    result = compare(by_gpu)
    meta = {"date": dt.date.today().isoformat(), "spec": args.spec, "batch_size": args.batch_size,
            "repeats": args.repeats, "min_seconds": args.min_seconds, "wall_s": wall_s, "exit_codes": codes,
            "torch_version": next((r["torch_version"] for r in runs if r.get("torch_version")), "?"),
            "device_name": next((r["device_name"] for r in runs if r.get("device_name")), "?")}
    (args.out / "gpu_agreement.json").write_text(json.dumps({"meta": meta, **result}, indent=1, default=str))
    text = summary_md(meta, result)
    (args.out / "summary.md").write_text(text)
    print(text, flush=True)
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
