"""The GPU sweep behind the figures in docs: four models x compile modes x precisions (x fusion presets).

    python benchmarks/gpu_sweep.py --out benchmarks/results/h100 [--models resnet50,bert] [--max-minutes 9]
    python benchmarks/gpu_sweep.py --device cpu --models mlp --modes eager,default --precisions fp32 \\
        --min-seconds 0.5 --out /tmp/smoke          # the smoke test that runs anywhere

Every finished run is in the database (`--db`, default OUT/gpu_sweep.db) and appended to OUT/runs.jsonl
the moment it finishes, so a time-out loses only the run in progress. At the end (or when the
`--max-minutes` deadline stops the sweep early) the runs are exported to OUT/runs.json and OUT/runs.csv
and a markdown table to OUT/summary.md. Progress lines go to stdout, flushed, so a log shows how far it got.

Configurations run in order of importance per model (eager and default first, fp32 before bf16) so a
deadline cuts the least informative ones. Warm starts (time to first inference from saved artifacts
against the cold compile) are measured for the `--warm-start` configurations (default/fp32).

Time on an H200 (torch 2.11, 16 cores), per configuration with --min-seconds 5: eager ~20 s, default and
reduce-overhead ~35-45 s for BERT-size models (cold compile 13-17 s), plus ~30 s for a warm start;
max-autotune-no-cudagraphs is bounded by --budget-s. Budget about 6-8 minutes per model for the default
plan: run one model per 9-minute call with --max-minutes 9, into the same --db.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

from joulepilot.compiler import CompileConfig, bench, plan_configs
from joulepilot.store import list_runs, open_db, power_samples
from sweep_log import SweepLog, log

MODELS: dict[str, dict[str, Any]] = {
    "resnet50": {"spec": "torchvision:resnet50", "batch_size": 32},
    "bert": {"spec": "transformers:BertConfig", "batch_size": 16, "seq_len": 128},
    "gpt2": {"spec": "transformers:GPT2Config", "batch_size": 8, "seq_len": 256},
    "vit": {"spec": "torchvision:vit_b_16", "batch_size": 32},
    "mlp": {"spec": "mlp", "batch_size": 64},
    "convnet": {"spec": "convnet", "batch_size": 64},
    "transformer": {"spec": "transformer", "batch_size": 32, "seq_len": 128},
    "mobilenet": {"spec": "torchvision:mobilenet_v3_large", "batch_size": 64},
    "distilbert": {"spec": "transformers:DistilBertConfig", "batch_size": 16, "seq_len": 128},
    "convnext": {"spec": "torchvision:convnext_tiny", "batch_size": 32},
    "efficientnet": {"spec": "torchvision:efficientnet_b0", "batch_size": 64},
    # In no committed sweep yet: candidates for the next held-out grid.
    "regnet": {"spec": "torchvision:regnet_y_800mf", "batch_size": 64},
    "swin": {"spec": "torchvision:swin_t", "batch_size": 32},
    "resnet18": {"spec": "torchvision:resnet18", "batch_size": 64},  # compiles in about half ResNet-50's time
}
DEFAULT_MODELS = "resnet50,bert,gpt2,vit"
EXPORT_FIELDS = ("run_id", "workload", "batch_size", "config_label", "mode", "fusion", "precision", "status",
                 "reason", "compile_s", "warm_start_s", "compile_energy_j", "latency_ms_p50", "latency_ms_p95",
                 "throughput_per_s", "energy_j_per_inference", "energy_above_idle_j_per_inference", "avg_power_w",
                 "peak_power_w", "idle_power_w", "energy_source", "window_s", "inferences", "peak_memory_bytes",
                 "max_rel_error", "graph_breaks", "recompiles", "device", "device_name", "driver_version",
                 "torch_version", "triton_version", "joulepilot_version", "provenance_key", "workload_id",
                 "config_id", "started_at", "finished_at")


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def ordered_plan(modes: list[str], precisions: list[str], fusions: list[str], fusion_modes: list[str],
                 batch_size: int) -> list[CompileConfig]:
    """Every mode x precision with the default fusion, then the extra presets for `fusion_modes` only."""
    configs: list[CompileConfig] = []
    for mode in modes:  # importance order: as given, eager and default first by default
        configs += plan_configs([mode], ["default"], precisions, batch_size=batch_size)
    extra = [f for f in fusions if f != "default"]
    if extra:
        for config in plan_configs([m for m in fusion_modes if m != "eager"], extra, precisions, batch_size=batch_size):
            if config not in configs:
                configs.append(config)
    return configs


def export(db_path: Path, out: Path) -> list[dict[str, Any]]:
    db = open_db(db_path)
    try:
        rows = sorted(list_runs(db), key=lambda r: r["id"])
        runs = []
        for run in rows:
            run["run_id"] = run["id"]
            run["extra"] = json.loads(run["extra"]) if run.get("extra") else {}
            run["power_samples"] = [[s["t_s"], s["device"], s["power_w"]] for s in power_samples(db, run["id"])]
            runs.append(run)
        workloads = [dict(r) for r in db.query("SELECT * FROM workloads")]
    finally:
        db.close()
    (out / "runs.json").write_text(json.dumps({"runs": runs, "workloads": workloads}, indent=1, default=str))
    with open(out / "runs.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=EXPORT_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)
    (out / "summary.md").write_text(summary_table(runs))
    return runs


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def per_sample(run: dict[str, Any]) -> float | None:
    energy = run.get("energy_j_per_inference")
    return None if energy is None else energy / run["batch_size"]


def summary_table(runs: list[dict[str, Any]]) -> str:
    device = next((r["device_name"] for r in runs if r.get("device_name")), "?")
    torch_version = next((r["torch_version"] for r in runs if r.get("torch_version")), "?")
    lines = [f"Device: {device}; torch {torch_version}; energy source: "
             f"{', '.join(sorted({r['energy_source'] for r in runs if r.get('energy_source')}))}", "",
             "J/inference is per forward call (one batch); J/sample divides it by the batch size.", "",
             "| workload | batch | config | J/inference | J/sample | above idle J/inf | avg W | peak W | p50 ms | p95 ms | "
             "samples/s | compile s | warm start s | max rel err | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["workload"], r["status"] != "ok", r.get("energy_j_per_inference") or 0)):
        status = r["status"] if r["status"] == "ok" else f"failed: {(r.get('reason') or '').splitlines()[0][:80]}"
        lines.append(
            f"| {r['workload']} | {r['batch_size']} | {r['config_label']} | {_fmt(r.get('energy_j_per_inference'))} | "
            f"{_fmt(per_sample(r))} | "
            f"{_fmt(r.get('energy_above_idle_j_per_inference'))} | {_fmt(r.get('avg_power_w'))} | "
            f"{_fmt(r.get('peak_power_w'))} | {_fmt(r.get('latency_ms_p50'))} | {_fmt(r.get('latency_ms_p95'))} | "
            f"{_fmt(r.get('throughput_per_s'))} | {_fmt(r.get('compile_s'))} | {_fmt(r.get('warm_start_s'))} | "
            f"{_fmt(r.get('max_rel_error'), 2)} | {status} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma list of {', '.join(MODELS)} or any workload spec (default {DEFAULT_MODELS})")
    parser.add_argument("--modes", default="eager,default,reduce-overhead,max-autotune-no-cudagraphs")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--fusions", default="default",
                        help="fusion presets; presets other than 'default' run only for --fusion-modes")
    parser.add_argument("--fusion-modes", default="default")
    parser.add_argument("--warm-start", default="default/fp32",
                        help="comma list of MODE/PRECISION whose runs also time a warm start from saved artifacts "
                             "(each costs a second worker process, ~30 s for BERT; '' for none)")
    parser.add_argument("--min-seconds", type=float, default=5.0, help="energy window per run")
    parser.add_argument("--budget-s", type=float, default=240.0, help="cold-compile budget per run")
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="stop starting runs when fewer than --reserve-s seconds would remain (0: no limit)")
    parser.add_argument("--reserve-s", type=float, default=75.0,
                        help="time kept back for the run in progress and the export when --max-minutes is set")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure every configuration this many times, each in a fresh worker (repeats after "
                             "the first re-measure configurations already in the database)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--db", type=Path, help="database (default OUT/gpu_sweep.db)")
    args = parser.parse_args(argv)

    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    db_path = args.db or args.out / "gpu_sweep.db"
    warm_pairs = {tuple(item.split("/", 1)) for item in _split(args.warm_start)}
    sweep = SweepLog(args.out, max_minutes=args.max_minutes, reserve_s=args.reserve_s, started=started,
                     figures=lambda run: (f"{run['energy_j_per_inference']:.4g} J/inf, {run['avg_power_w']:.0f} W avg, "
                                          f"p50 {run['latency_ms_p50']:.3f} ms, compile {run['compile_s']:.1f} s"
                                          + (f", warm start {run['warm_start_s']:.1f} s"
                                             if run.get("warm_start_s") else "")))

    for name in _split(args.models):
        if sweep.stopped_early:
            log(f"skipping {name}: out of time")
            continue
        model = MODELS.get(name, {"spec": name, "batch_size": 1})
        configs = ordered_plan(_split(args.modes), _split(args.precisions), _split(args.fusions),
                               _split(args.fusion_modes), model["batch_size"])
        log(f"{name}: {model['spec']} batch {model['batch_size']}, {len(configs)} configurations"
            + (f", {args.repeats} repeats" if args.repeats > 1 else ""))
        for repeat in range(args.repeats):
            if sweep.stopped_early:
                break
            try:
                bench(model["spec"], configs, device=args.device, min_seconds=args.min_seconds,
                      budget_s=args.budget_s, db=db_path, batch_size=model["batch_size"], seq_len=model.get("seq_len"),
                      image_size=model.get("image_size"), warm_start=lambda c: (c.mode, c.precision) in warm_pairs,
                      force=repeat > 0, progress=sweep.progress, stop_before=sweep.out_of_time)
            except Exception as exc:  # one model's setup failing (a missing package) must not end the sweep
                log(f"{name}: could not sweep: {type(exc).__name__}: {exc}")
                break
    sweep.close()
    runs = export(db_path, args.out)
    ok = sum(r["status"] == "ok" for r in runs)
    log(f"done in {time.time() - started:.0f} s: {ok} ok, {len(runs) - ok} failed; exported to {args.out}")
    print(summary_table(runs), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
