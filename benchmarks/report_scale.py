"""How `joulepilot report` scales with a deployment's age: time and peak memory on a store of many windows.

    python benchmarks/report_scale.py                          # 1,000,000 windows (about 58 days at 5 s)
    python benchmarks/report_scale.py --windows 120960 --json  # one week at 5 s
    python benchmarks/report_scale.py --db /tmp/big.db --keep  # build once, time again later

The store holds one deployment with `--windows` 5-s windows (NVML-metered, a stretch estimated while the
meter failed, a fallback swap to another configuration, some windows shared with another process), a small
second deployment, a decision with a tuning bill (so the payback is worked out) and baseline runs. Each
command runs in a fresh `python -m joulepilot` process, timed from start to exit, its peak RSS read from
`wait4`; the output files' sizes are reported too. Not a test: run it by hand, the README quotes its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = 1_700_000_000.0
WINDOW_S = 5.0
BATCH = 50_000  # windows per insert transaction

COMMANDS = {
    "report --json": ["report", "-d", "big", "--json", "-o", "{out}/report.json"],
    "report (md)": ["report", "-d", "big", "-o", "{out}/report.md"],
    "report (html)": ["report", "-d", "big", "-o", "{out}/report.html"],
    "report --format csv": ["report", "-d", "big", "--format", "csv", "-o", "{out}/report.csv"],
    "report --since 24h --json": ["report", "-d", "big", "--since", "24h", "--json", "-o", "{out}/day.json"],
    "report --all --json": ["report", "--all", "--json", "-o", "{out}/all.json"],
}


def build_store(path: Path, windows: int) -> None:
    """The store described in the module docstring, `windows` windows ending now."""
    from joulepilot.compiler import CompileConfig
    from joulepilot.store import insert_run, open_db, upsert_config, upsert_host, upsert_workload
    from joulepilot.store.decisions import write_decision
    from joulepilot.store.deployments import insert_samples, register_deployment

    db = open_db(path)
    host = upsert_host(db)
    wl = upsert_workload(db, {"id": "wl-bench", "spec": "mlp", "batch_size": 8, "flops_per_inference": 1e6})
    served = CompileConfig(mode="default", precision="bf16", batch_size=8)
    fallback = CompileConfig(mode="eager", batch_size=8)
    stock = CompileConfig(mode="default", batch_size=8)
    for cfg, j in ((fallback, 0.02), (stock, 0.012), (served, 0.008)):
        upsert_config(db, cfg.to_row())
        for _ in range(3):
            insert_run(db, {"workload_id": wl, "config_id": cfg.id, "host_id": host, "device": "cpu",
                            "status": "ok", "started_at": T0, "energy_j_per_inference": j, "energy_source": "nvml"})
    bill = {"verdict": "pays_back", "why": "", "search": {"energy_j": 5e6, "source": "nvml+estimate",
                                                          "seconds": 3600.0, "runs": 9},
            "baseline": {"kind": "stock compile default fp32"}, "saving_j_per_inference": 0.004,
            "saving_source": "nvml", "payback_inferences": 1.25e9, "payback_source": "nvml+estimate"}
    write_decision(db, {"policy": "bench", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                        "config_id": served.id, "state": "verified", "reason": "fewest J per call",
                        "decided_at": T0, "details": {"bill": bill, "limits": {"max_avg_power_w": 260.0}}})
    dep = register_deployment(db, "big", policy="bench", workload_id=wl, config_id=served.id, host_id=host,
                              device="cpu", details={"device_kind": "cpu", "energy_source": "nvml"})
    start = time.time() - windows * WINDOW_S
    for first in range(0, windows, BATCH):
        rows = []
        for i in range(first, min(first + BATCH, windows)):
            watts = 200.0 + 70.0 * ((i * 7919) % 100) / 100.0
            estimated = windows // 3 <= i < windows // 3 + windows // 50  # the meter failed for a while
            rows.append({"t_start": start + WINDOW_S * i, "t_end": start + WINDOW_S * (i + 1),
                         "energy_j": watts * WINDOW_S, "inferences": 0 if i % 97 == 0 else 4000 + i % 500,
                         "avg_power_w": watts, "peak_power_w": watts * 1.2,
                         "energy_source": "estimate" if estimated else "nvml",
                         "config_id": fallback.id if windows // 2 <= i < windows // 2 + 100 else served.id,
                         "other_processes": 1 if i % 13 == 0 else 0, "share": 0.8 if i % 13 == 0 else 1.0})
        insert_samples(db, dep, rows)
    small = register_deployment(db, "small", device="cpu", host_id=host)
    insert_samples(db, small, [{"t_start": start + WINDOW_S * i, "t_end": start + WINDOW_S * (i + 1),
                                "energy_j": 100.0, "inferences": 10, "avg_power_w": 20.0, "peak_power_w": 22.0,
                                "energy_source": "rapl"} for i in range(100)])
    db.close()


def time_command(args: list[str]) -> dict[str, float]:
    """Wall seconds and peak RSS (MiB) of one `python -m joulepilot` process."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "joulepilot", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall_s = time.perf_counter() - started
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"joulepilot {' '.join(args)} failed: {stderr.strip()}")
    return {"wall_s": round(wall_s, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=1_000_000, help="windows of the big deployment")
    parser.add_argument("--db", help="store to build (or reuse with --keep); default a temporary one")
    parser.add_argument("--keep", action="store_true", help="reuse --db when it exists, and keep it")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(args.db) if args.db else Path(tmp) / "jp.db"
        build_s = None
        if not (args.keep and db.exists()):
            db.unlink(missing_ok=True)
            t = time.perf_counter()
            build_store(db, args.windows)
            build_s = round(time.perf_counter() - t, 1)
        baseline = time_command(["--version"])
        results = {}
        for name, command in COMMANDS.items():
            argv = [command[0], "--db", str(db), *[c.format(out=tmp) for c in command[1:]]]
            results[name] = time_command(argv)
            outputs = [Path(c.format(out=tmp)) for c in command if "{out}" in c]
            results[name]["output_bytes"] = sum(p.stat().st_size for p in outputs if p.exists())
        figures = {"windows": args.windows, "db_bytes": db.stat().st_size, "build_s": build_s,
                   "python_startup": baseline, "commands": results, "python": platform.python_version(),
                   "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        if args.db and not args.keep:
            db.unlink(missing_ok=True)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{args.windows:,} windows, store {figures['db_bytes'] / 2**20:,.0f} MiB"
          + (f" (built in {build_s} s)" if build_s is not None else ""))
    print(f"{'command':<28}{'wall s':>8}{'peak RSS MiB':>14}{'output':>12}")
    for name, r in results.items():
        print(f"{name:<28}{r['wall_s']:>8}{r['peak_rss_mib']:>14}{r['output_bytes'] / 1024:>10,.0f} KiB")
    print(f"(`joulepilot --version` alone: {baseline['wall_s']} s, {baseline['peak_rss_mib']} MiB)")


if __name__ == "__main__":
    main()
