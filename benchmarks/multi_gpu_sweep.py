"""Two GPUs against one: a 12-configuration sweep's wall time, and one configuration's J per call on each GPU.

    python benchmarks/multi_gpu_sweep.py --out benchmarks/results/multi_gpu_h200x2           # both phases
    python benchmarks/multi_gpu_sweep.py --out OUT --phase one && \\
        python benchmarks/multi_gpu_sweep.py --out OUT --phase two                          # one call each
    python benchmarks/multi_gpu_sweep.py --out OUT --via daemon                              # daemon --once instead

Phase `one` sweeps the plan on the first GPU alone, phase `two` sweeps the same plan over both GPUs at once
(`bench --devices`, or the daemon with `devices = [i, j]`), each into a database of its own with every
configuration measured afresh. Each phase writes OUT/phase-<name>.json (wall time and runs) as soon as it ends,
so the phases may run in separate calls (a device tool's per-command limit); a phase already in OUT is not
run again unless asked by --phase. Once both are there, OUT/multi_gpu_sweep.json and OUT/summary.md hold:

- the wall-time ratio two / one (the issue's target: at most 0.6);
- for each configuration, its J per call in phase one (first GPU) and in phase two (whichever GPU took it).
  Configurations that phase two ran on the first GPU again give the run-to-run spread on one GPU; those it
  ran on the second GPU give the difference between the GPUs. The verdict compares the two: the second
  GPU agrees when its differences stay within the largest same-GPU difference.

The default plan is ResNet-50, batch 32: eager, default and reduce-overhead x fp32, tf32, bf16 and fp16,
3-s windows, no warm starts (the same in both phases). On an H200 a compiled configuration of it takes
about 35-45 s in `bench` and eager about 20 s, so phase one is about 7 minutes and phase two about 4.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from joulepilot.compiler import CompileConfig, bench, plan_configs
from joulepilot.store import list_runs, open_db

DEFAULT_SPEC = "torchvision:resnet50"
DEFAULT_MODES = "eager,default,reduce-overhead"
DEFAULT_PRECISIONS = "fp32,tf32,bf16,fp16"
FIELDS = ("config_id", "config_label", "device", "status", "reason", "energy_j_per_inference", "avg_power_w",
          "latency_ms_p50", "compile_s", "window_s", "started_at", "finished_at", "device_name", "torch_version")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _runs(db_path: Path) -> list[dict[str, Any]]:
    db = open_db(db_path)
    try:
        rows = sorted(list_runs(db), key=lambda r: r["id"])
    finally:
        db.close()
    out = []
    for row in rows:
        extra = json.loads(row["extra"]) if row.get("extra") else {}
        out.append({**{k: row.get(k) for k in FIELDS}, "device_uuids": extra.get("device_uuids"),
                    "window_warning": extra.get("window_warning"), "worker_env": extra.get("worker_env")})
    return out


def _torch_version(out: Path, runs: list[dict[str, Any]]) -> str | None:
    """The torch the runs were measured with (phase files written before they carried it: from their
    databases), not the torch of the process that compares them."""
    found = next((r["torch_version"] for r in runs if r.get("torch_version")), None)
    for name in ("one", "two"):
        db_path = out / f"phase-{name}" / "sweep.db"
        if found is None and db_path.exists():
            db = open_db(db_path, read_only=True)
            try:
                found = next((r["torch_version"] for r in list_runs(db) if r.get("torch_version")), None)
            finally:
                db.close()
    return found


def sweep_with_bench(args: argparse.Namespace, devices: list[str], db_path: Path, configs: list[CompileConfig]) -> None:
    def progress(index: int, total: int, config: CompileConfig, run: dict[str, Any] | None) -> None:
        if run is None:
            log(f"  [{index + 1}/{total}] {config.label} ...")
        elif run["status"] == "ok":
            log(f"  [{index}/{total}] {config.label} on {run['device']}: {run['energy_j_per_inference']:.4g} J/call, "
                f"{run['avg_power_w']:.0f} W, compile {run['compile_s']:.1f} s")
        else:
            log(f"  [{index}/{total}] {config.label} on {run['device']}: FAILED "
                f"{(run.get('reason') or '').splitlines()[0][:200]}")

    bench(args.spec, configs, devices=devices, min_seconds=args.min_seconds, budget_s=args.budget_s, db=db_path,
          batch_size=args.batch_size, seq_len=args.seq_len, image_size=args.image_size, warm_start=False,
          force=True, progress=progress)


def sweep_with_daemon(args: argparse.Namespace, devices: list[str], db_path: Path, folder: Path) -> None:
    """One `daemon --once` pass over an exhaustive policy with the plan's grid on `devices`."""
    policies = folder / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    shape = "".join(f"{key} = {value}\n" for key, value in (("seq_len", args.seq_len), ("image_size", args.image_size))
                    if value)
    (policies / "sweep.toml").write_text(
        f'name = "sweep"\nworkload = "{args.spec}"\nbatch_size = {args.batch_size}\n{shape}\n'
        f"[search]\nstrategy = \"exhaustive\"\nmodes = {json.dumps(_split(args.modes))}\n"
        f"precisions = {json.dumps(_split(args.precisions))}\n")
    indices = [d.split(":")[1] for d in devices]
    config = folder / "daemon.toml"
    config.write_text(
        f'db = "{db_path}"\npolicies = ["{policies}"]\ninterval_s = 3600\ndevices = [{", ".join(indices)}]\n'
        f"[bench]\nmin_seconds = {args.min_seconds}\nbudget_s = {args.budget_s}\n"
        "[idle]\nmin_idle_s = 0\npoll_s = 1\n[exporter]\nenabled = false\n")
    proc = subprocess.run([sys.executable, "-m", "joulepilot", "daemon", "--config", str(config), "--once", "--json"],
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"daemon --once failed with exit code {proc.returncode}")


def run_phase(args: argparse.Namespace, name: str, devices: list[str], configs: list[CompileConfig]) -> dict[str, Any]:
    folder = args.out / f"phase-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    db_path = folder / "sweep.db"
    if db_path.exists():
        db_path.unlink()  # every configuration measured afresh in each phase
    log(f"phase {name}: {len(configs)} configurations of {args.spec} on {', '.join(devices)} via {args.via}")
    started = time.monotonic()
    if args.via == "daemon":
        sweep_with_daemon(args, devices, db_path, folder)
    else:
        sweep_with_bench(args, devices, db_path, configs)
    wall_s = time.monotonic() - started
    runs = _runs(db_path)
    result = {"phase": name, "devices": devices, "via": args.via, "wall_s": wall_s, "runs": runs,
              "measured_s": sum((r["finished_at"] or 0) - (r["started_at"] or 0) for r in runs)}
    (args.out / f"phase-{name}.json").write_text(json.dumps(result, indent=1, default=str))
    log(f"phase {name}: {wall_s:.0f} s, {sum(r['status'] == 'ok' for r in runs)} ok of {len(runs)} runs")
    return result


def _last_ok(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each configuration's last ok run (a daemon repeat of a flagged run replaces the first)."""
    by_config: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run["status"] == "ok" and run.get("energy_j_per_inference"):
            by_config[run["config_id"]] = run
    return by_config


def compare(one: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    """Wall-time ratio and, per configuration, phase one's J per call against phase two's."""
    first_gpu = one["devices"][0]
    alone, shared = _last_ok(one["runs"]), _last_ok(two["runs"])
    rows = []
    for config_id, run in alone.items():
        other = shared.get(config_id)
        if other is None:
            continue
        diff = other["energy_j_per_inference"] / run["energy_j_per_inference"] - 1.0
        rows.append({"config": run["config_label"], "j_per_call_phase_one": run["energy_j_per_inference"],
                     "device_phase_two": other["device"], "j_per_call_phase_two": other["energy_j_per_inference"],
                     "rel_diff": diff, "same_gpu": other["device"] == first_gpu})
    same = [abs(r["rel_diff"]) for r in rows if r["same_gpu"]]
    cross = [abs(r["rel_diff"]) for r in rows if not r["same_gpu"]]
    spread = max(same) if same else None
    ratio = two["wall_s"] / one["wall_s"] if one["wall_s"] else None
    return {
        "wall_s_one_gpu": one["wall_s"], "wall_s_two_gpus": two["wall_s"], "wall_ratio": ratio,
        "wall_ratio_target": 0.6, "wall_ratio_met": ratio is not None and ratio <= 0.6,
        "configurations": rows,
        "same_gpu_spread_max": spread, "same_gpu_spread_median": statistics.median(same) if same else None,
        "cross_gpu_diff_max": max(cross) if cross else None,
        "cross_gpu_diff_median": statistics.median(cross) if cross else None,
        "cross_gpu_within_spread": None if spread is None or not cross else max(cross) <= spread,
    }


def summary_md(meta: dict[str, Any], result: dict[str, Any]) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f} %"

    lines = [f"{meta['date']}: {meta['spec']} batch {meta['batch_size']} on {meta['device_name']} x2, torch "
             f"{meta['torch_version']}, via {meta['via']}, {meta['min_seconds']:g}-s windows", "",
             f"- one GPU: {result['wall_s_one_gpu']:.0f} s; two GPUs: {result['wall_s_two_gpus']:.0f} s; ratio "
             f"{result['wall_ratio']:.2f} (target <= 0.6: {'met' if result['wall_ratio_met'] else 'NOT met'})",
             f"- J per call, same configuration: run-to-run on one GPU up to {pct(result['same_gpu_spread_max'])} "
             f"(median {pct(result['same_gpu_spread_median'])}); first GPU against second up to "
             f"{pct(result['cross_gpu_diff_max'])} (median {pct(result['cross_gpu_diff_median'])}); within the "
             f"spread: {result['cross_gpu_within_spread']}", "",
             "| configuration | J/call, one GPU | phase two on | J/call, two GPUs | difference |", "|---|---|---|---|---|"]
    for row in sorted(result["configurations"], key=lambda r: r["config"]):
        lines.append(f"| {row['config']} | {row['j_per_call_phase_one']:.4g} | {row['device_phase_two']} | "
                     f"{row['j_per_call_phase_two']:.4g} | {100 * row['rel_diff']:+.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--precisions", default=DEFAULT_PRECISIONS)
    parser.add_argument("--min-seconds", type=float, default=3.0)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--gpus", default="0,1", help="the two GPU indices (phase one uses the first)")
    parser.add_argument("--via", choices=("bench", "daemon"), default="bench")
    parser.add_argument("--phase", choices=("one", "two", "both"), default="both",
                        help="which phase to run now (both: those not in OUT yet)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    gpus = [f"cuda:{int(i)}" for i in _split(args.gpus)]
    if len(gpus) != 2 or gpus[0] == gpus[1]:
        parser.error("--gpus takes two different GPU indices, e.g. 0,1")
    configs = plan_configs(_split(args.modes), ["default"], _split(args.precisions), batch_size=args.batch_size)
    for name, devices in (("one", gpus[:1]), ("two", gpus)):
        done = (args.out / f"phase-{name}.json").exists()
        if args.phase == name or (args.phase == "both" and not done):
            run_phase(args, name, devices, configs)
    phases = {n: json.loads((args.out / f"phase-{n}.json").read_text())
              for n in ("one", "two") if (args.out / f"phase-{n}.json").exists()}
    if len(phases) < 2:
        log(f"{', '.join(phases) or 'no phase'} done; run the other with --phase to compare")
        return 0
    result = compare(phases["one"], phases["two"])
    runs = phases["one"]["runs"] + phases["two"]["runs"]
    meta = {"date": dt.date.today().isoformat(), "host": platform.node(), "spec": args.spec,
            "batch_size": args.batch_size, "via": args.via, "min_seconds": args.min_seconds,
            "configurations": len(configs), "torch_version": _torch_version(args.out, runs) or torch.__version__,
            "device_name": next((r["device_name"] for r in runs if r.get("device_name")), "?")}
    (args.out / "multi_gpu_sweep.json").write_text(json.dumps({"meta": meta, **result}, indent=1, default=str))
    text = summary_md(meta, result)
    (args.out / "summary.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
