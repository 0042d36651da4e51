"""Whole-model against regional compilation: cold compile, warm start from saved artifacts, and J per call.

    python benchmarks/warm_start_regional.py transformers:BertConfig --batch-size 16 --seq-len 128 \\
        --results benchmarks/results/warm_start/bert.json
    python benchmarks/warm_start_regional.py torchvision:resnet50 --batch-size 32 --variants whole
    python benchmarks/warm_start_regional.py tests.block_models:block_stack --device cpu --min-seconds 0.5
                                                      # the smoke test that runs anywhere (from the repo root)

Each variant (`--variants whole,regional`) is one configuration (`--mode`, `--precision`; regional
compiles the most repeated block class, or `--regional-block`) measured as `joulepilot bench` measures
it: a cold compile in a fresh worker with empty Inductor and Triton caches (compile s), the energy
window (J per call: joules per forward call of one batch, with its source), and a warm start: a second
fresh worker with empty caches that loads the saved artifacts (cache entries, kernel binaries and, with
`--precompile on`, Dynamo's precompiled frames; off by default, as in bench), applies the configuration
and makes the first call (warm s, to set against compile s: `ratio` = compile s / warm s). `--precompile
both` measures each variant twice, with and without Dynamo's precompiled frames; a compile or warm start
that fails with them is measured again without them, the row's `precompile_error` saying why.

For each, it also prints where the warm start's time went (loading the artifacts, applying, the first
call; frames Dynamo traced again; kernels built again) from the runs' `extra.warm_start`. Everything runs
in a scratch JOULEPILOT_HOME (`--home` to keep one) with its own database (`--db`). `--json` prints the
result as JSON on stdout (progress goes to stderr); `--results FILE` writes the same JSON to FILE, with the
device, the date and the torch version, ready to commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("whole", "regional")
PRECOMPILE = {"on": (True,), "off": (False,), "both": (True, False)}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _row(run: dict[str, Any], variant: str, precompile: bool) -> dict[str, Any]:
    extra = run.get("extra") or {}
    warm = extra.get("warm_start") or {}
    artifacts = warm.get("artifacts") or {}
    return {
        "variant": variant,
        "config": run.get("config_label"),
        "status": run.get("status"),
        "reason": run.get("reason"),
        "precompile_asked": precompile,
        "precompile_used": artifacts.get("precompile"),
        "precompile_error": extra.get("precompile_error"),
        "block": extra.get("regional"),
        "compile_s": run.get("compile_s"),
        "warm_start_s": run.get("warm_start_s"),
        "ratio": _ratio(run.get("compile_s"), run.get("warm_start_s")),
        "j_per_call": run.get("energy_j_per_inference"),
        "j_per_call_above_idle": run.get("energy_above_idle_j_per_inference"),
        "energy_source": run.get("energy_source"),
        "compile_energy_j": run.get("compile_energy_j"),
        "latency_ms_p50": run.get("latency_ms_p50"),
        "throughput_per_s": run.get("throughput_per_s"),
        "avg_power_w": run.get("avg_power_w"),
        "max_rel_error": run.get("max_rel_error"),
        "graph_breaks": run.get("graph_breaks"),
        "warm_start": {
            "artifacts_load_s": extra.get("artifacts_load_s"),
            "apply_s": warm.get("apply_s"),
            "first_call_s": warm.get("first_call_s"),
            "frames_traced": warm.get("dynamo_frames"),
            "caches": extra.get("warm_start_caches"),
            "kernels_loaded": artifacts.get("kernels"),
            "kernels_built": warm.get("kernels_built"),
            "max_rel_error": warm.get("max_rel_error"),
            "entries": artifacts.get("entries"),
            "compile_timers_s": warm.get("compile_timers_s"),
            "error": extra.get("warm_start_error"),
        },
        "cold_compile_timers_s": extra.get("compile_timers_s"),
        "run_id": run.get("run_id"),
    }


def _comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Regional against whole, per precompile setting: how much faster it compiles and starts, what it costs."""
    out = []
    for precompile in (True, False):
        by = {r["variant"]: r for r in rows if r["precompile_asked"] == precompile and r["status"] == "ok"}
        if {"whole", "regional"} <= set(by):
            whole, regional = by["whole"], by["regional"]
            out.append({
                "precompile_asked": precompile,
                "compile_speedup": _ratio(whole["compile_s"], regional["compile_s"]),
                "warm_start_speedup": _ratio(whole["warm_start_s"], regional["warm_start_s"]),
                "j_per_call_change_pct": (100.0 * (regional["j_per_call"] / whole["j_per_call"] - 1.0)
                                          if whole["j_per_call"] and regional["j_per_call"] else None),
                "latency_p50_change_pct": (100.0 * (regional["latency_ms_p50"] / whole["latency_ms_p50"] - 1.0)
                                           if whole["latency_ms_p50"] and regional["latency_ms_p50"] else None),
            })
    return out


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def print_table(result: dict[str, Any]) -> None:
    head = (f"{result['spec']} batch {result['batch_size']} on {result['device_name']} ({result['device']}), "
            f"torch {result['torch_version']}, {result['mode']}/{result['precision']}, {result['date_utc']}")
    print(head)
    columns = ("variant", "precompile", "compile s", "warm s", "ratio", "J/call", "source", "p50 ms",
               "warm: load/apply/call s", "traced", "built", "block")
    lines = [columns]
    for r in result["rows"]:
        w = r["warm_start"]
        block = r["block"]
        lines.append((
            r["variant"], "on" if r["precompile_used"] else ("unused" if r["precompile_asked"] else "off"), _fmt(r["compile_s"]), _fmt(r["warm_start_s"]),
            _fmt(r["ratio"], ".2f") + ("x" if r["ratio"] else ""), _fmt(r["j_per_call"], ".4g"),
            _fmt(r["energy_source"]), _fmt(r["latency_ms_p50"]),
            "/".join(_fmt(w[k], ".2f") for k in ("artifacts_load_s", "apply_s", "first_call_s")),
            _fmt(w["frames_traced"]), _fmt(w["kernels_built"]),
            f"{block['name']} x{block['instances']} ({block['variants']} variant(s))" if block else "-",
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(columns))]
    for line in lines:
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    for r in result["rows"]:
        if r["status"] != "ok":
            print(f"{r['variant']}: {r['status']}: {r['reason']}")
        elif r["warm_start"]["error"]:
            print(f"{r['variant']}: warm start failed: {r['warm_start']['error']}")
        if r.get("precompile_error"):
            print(f"{r['variant']}: measured without precompile: {r['precompile_error']}")
    for c in result["regional_vs_whole"]:
        print(f"regional vs whole (precompile {'on' if c['precompile_asked'] else 'off'}): compile "
              f"{_fmt(c['compile_speedup'], '.2f')}x faster, warm start {_fmt(c['warm_start_speedup'], '.2f')}x "
              f"faster, J/call {_fmt(c['j_per_call_change_pct'], '+.1f')}%, p50 {_fmt(c['latency_p50_change_pct'], '+.1f')}%")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from joulepilot.compiler import CompileConfig, bench, check_device, default_device

    device = check_device(args.device or default_device())
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise SystemExit(f"--variants: {', '.join(unknown) or 'nothing'} is not one of {', '.join(VARIANTS)}")
    configs = {v: CompileConfig(args.mode, precision=args.precision, batch_size=args.batch_size,
                                regional=(args.regional_block or "auto") if v == "regional" else "")
               for v in variants}
    rows: list[dict[str, Any]] = []
    origin: dict[str, Any] = {}
    for precompile in PRECOMPILE[args.precompile]:
        for variant, config in configs.items():
            log(f"{config.label}, precompile {'on' if precompile else 'off'}: cold compile, window, warm start")
            (run,) = bench(args.spec, [config], device=device, db=args.db, batch_size=args.batch_size,
                           seq_len=args.seq_len, image_size=args.image_size, min_seconds=args.min_seconds,
                           budget_s=args.budget_s, warm_start=True, precompile=precompile, force=True,
                           notice=log)
            row = _row(run, variant, precompile)
            log(f"  {row['status']}: compile {_fmt(row['compile_s'])} s, warm start {_fmt(row['warm_start_s'])} s, "
                f"{_fmt(row['j_per_call'], '.4g')} J/call")
            rows.append(row)
            origin = origin or {k: run.get(k) for k in ("device_name", "torch_version", "triton_version",
                                                        "driver_version", "joulepilot_version")}
    return {
        "spec": args.spec, "device": device, **origin,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "image_size": args.image_size,
        "mode": args.mode, "precision": args.precision, "min_seconds": args.min_seconds,
        "rows": rows, "regional_vs_whole": _comparison(rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="workload spec, as for joulepilot bench")
    parser.add_argument("--device", help="cuda:N or cpu (default: cuda:0 when available)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--mode", default="default")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--variants", default="whole,regional", help="whole, regional, or both (comma list)")
    parser.add_argument("--regional-block", help="block class for the regional variant (default: most repeated)")
    parser.add_argument("--precompile", choices=sorted(PRECOMPILE), default="off",
                        help="record and use Dynamo's precompiled frames with the artifacts (experimental; "
                             "default off, as bench)")
    parser.add_argument("--min-seconds", type=float, help="energy window (default 5 on a GPU, 2 on CPU)")
    parser.add_argument("--budget-s", type=float, default=900.0, help="cold-compile budget of each worker")
    parser.add_argument("--home", help="JOULEPILOT_HOME to use and keep (default: a scratch one, removed)")
    parser.add_argument("--db", help="database for the runs (default: HOME/warm_start_regional.db)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.add_argument("--results", type=Path, help="also write the JSON result to this file")
    args = parser.parse_args(argv)

    scratch = None if args.home else tempfile.mkdtemp(prefix="warm-start-regional-")
    home = Path(args.home or scratch)
    os.environ["JOULEPILOT_HOME"] = str(home)
    args.db = args.db or str(home / "warm_start_regional.db")
    try:
        result = measure(args)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(result, indent=1, default=str) + "\n")
        log(f"wrote {args.results}")
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print_table(result)
    return 0 if all(r["status"] == "ok" for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
