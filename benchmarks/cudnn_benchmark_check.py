"""Does cuDNN's benchmark mode explain ResNet-50's gap to DESIGN.md? (issue #3, a check, not a feature)

ResNet-50 (batch 32) ran 16-18 % slower per call than DESIGN.md's H200 table at 7-9 % lower power,
while BERT (no convolutions) matched. The sweep leaves `torch.backends.cudnn.benchmark` at its
default (off), so cuDNN picks convolution algorithms by heuristic. This script measures the same
configurations with the flag off and on, in one process, alternating off/on `--repeats` times so
drift (temperature, clocks) falls on both sides alike. Each measurement follows the worker's method
(compiler/measure.py): warm-up until stable, a synchronised latency pass, then an energy window of
back-to-back calls (`--window-s`) metered by the EnergyMeter.

Usage (on a GPU host):
    python benchmarks/cudnn_benchmark_check.py --out benchmarks/results/h200/cudnn_benchmark.json
Never changes power limits, clocks or persistence mode; the flag is process-local.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def measure(call: Any, sync: Any, meter: Any, batch_size: int, window_s: float) -> dict[str, Any]:
    from joulepilot.compiler.measure import back_to_back, latency_pass, percentile, warm_up

    warm_calls, _ = warm_up(call, sync, max_s=max(3.0, window_s))
    latencies = latency_pass(call, sync, seconds=1.0)
    sync()
    meter.begin("window")
    calls = back_to_back(call, sync, min_seconds=window_s)
    window = meter.end("window")
    return {
        "warmup_calls": warm_calls,
        "latency_ms_p50": percentile(latencies, 50),
        "latency_ms_p95": percentile(latencies, 95),
        "window_s": window.duration_s,
        "calls": calls,
        "window_ms_per_call": window.duration_s * 1000.0 / calls,
        "throughput_per_s": batch_size * calls / window.duration_s,
        "energy_j_per_inference": window.energy_j / calls,
        "avg_power_w": window.avg_power_w,
        "peak_power_w": window.peak_power_w,
        "energy_source": "+".join(window.sources),
    }


def check(spec: str, batch_size: int, configs: list[str], repeats: int, window_s: float,
          device: str) -> dict[str, Any]:
    import torch
    from joulepilot.compiler import CompileConfig, apply_config
    from joulepilot.compiler.measure import synchronizer, timed_call
    from joulepilot.compiler.provenance import provenance
    from joulepilot.compiler.workloads import load_workload
    from joulepilot.telemetry import EnergyMeter

    sync = synchronizer(device)
    meter = EnergyMeter(device=device)
    results: list[dict[str, Any]] = []
    try:
        for label in configs:
            mode, precision = label.split("/")
            workload = load_workload(spec, batch_size=batch_size, device=device)
            config = CompileConfig(mode=mode, precision=precision, batch_size=batch_size)
            run = apply_config(config, workload.model, device)
            inputs = workload.example_inputs

            def call(run: Any = run, inputs: tuple = inputs) -> Any:
                return run(*inputs)

            torch.backends.cudnn.benchmark = False
            log(f"{label}: first call {timed_call(call, sync)[1]:.1f} s")
            for repeat in range(repeats):
                for flag in (False, True):
                    torch.backends.cudnn.benchmark = flag
                    row = measure(call, sync, meter, batch_size, window_s)
                    row.update({"config": label, "cudnn_benchmark": flag, "repeat": repeat})
                    results.append(row)
                    log(f"  {label} benchmark={'on ' if flag else 'off'} #{repeat}: "
                        f"{row['energy_j_per_inference']:.4g} J/call, {row['avg_power_w']:.0f} W, "
                        f"{row['window_ms_per_call']:.3f} ms/call (p50 {row['latency_ms_p50']:.3f})")
            torch.backends.cudnn.benchmark = False
            torch.cuda.empty_cache()
    finally:
        meter.close()
    return {"spec": spec, "batch_size": batch_size, "device": device, "window_s": window_s,
            "repeats": repeats, "provenance": provenance(device),
            "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "measurements": results, "summary": summarise(results)}


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    summary = []
    for label in dict.fromkeys(r["config"] for r in results):
        side = {flag: [r for r in results if r["config"] == label and r["cudnn_benchmark"] is flag]
                for flag in (False, True)}
        mean = {flag: {key: statistics.fmean(r[key] for r in rows)
                       for key in ("energy_j_per_inference", "avg_power_w", "window_ms_per_call", "latency_ms_p50")}
                for flag, rows in side.items()}
        summary.append({
            "config": label, "off": mean[False], "on": mean[True],
            "energy_change": mean[True]["energy_j_per_inference"] / mean[False]["energy_j_per_inference"] - 1,
            "time_change": mean[True]["window_ms_per_call"] / mean[False]["window_ms_per_call"] - 1,
            "power_change": mean[True]["avg_power_w"] / mean[False]["avg_power_w"] - 1,
        })
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="torchvision:resnet50")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--configs", default="eager/fp32,eager/bf16,default/fp32,default/bf16",
                        help="comma list of MODE/PRECISION (no CUDA-graph modes: a recorded graph keeps its algorithms)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("cudnn_benchmark_check: no CUDA GPU visible to PyTorch; run this on a GPU host", file=sys.stderr)
        return 2
    report = check(args.spec, args.batch_size, [c.strip() for c in args.configs.split(",") if c.strip()],
                   args.repeats, args.window_s, args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    for row in report["summary"]:
        log(f"{row['config']}: benchmark on vs off: energy/call {row['energy_change']:+.1%}, "
            f"time/call {row['time_change']:+.1%}, power {row['power_change']:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
