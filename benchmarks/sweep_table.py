"""Render a recorded sweep (run exchange JSON) as the markdown table in docs/gpu-sweep-h200.md.

    python benchmarks/sweep_table.py tests/data/gpu_sweep_h200.json
"""

from __future__ import annotations

import datetime as dt
import sys

from joulepilot.store import read_export

ORDER = {"eager": 0, "default": 1, "reduce-overhead": 2, "max-autotune-no-cudagraphs": 3, "max-autotune": 4}


def _f(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def table(records: list[dict]) -> str:
    lines = [
        "| workload | batch | mode | fusion | precision | started (UTC) | p50 ms | ms/call (window) | samples/s | compile s | warm start s "
        "| J/call | J/sample | avg W | peak W | max rel err | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = sorted(records, key=lambda r: (r["workload"]["spec"], r["config"]["precision"] != "fp32",
                                          ORDER.get(r["config"]["mode"], 9), r["config"]["fusion"] != "default",
                                          r["config"]["fusion"], r["run"]["started_at"]))
    for rec in rows:
        run, cfg, wl = rec["run"], rec["config"], rec["workload"]
        batch = wl["batch_size"]
        per_call = batch / run["throughput_per_s"] * 1000 if run.get("throughput_per_s") else None
        j = run.get("energy_j_per_inference")
        started = dt.datetime.fromtimestamp(run["started_at"], dt.UTC).strftime("%m-%d %H:%M")
        status = run["status"] if run["status"] == "ok" else f"failed: {(run.get('reason') or '').splitlines()[0]}"
        lines.append(
            f"| {wl['spec']} | {batch} | {cfg['mode']} | {cfg['fusion']} | {cfg['precision']} | {started} | {_f(run.get('latency_ms_p50'))} | "
            f"{_f(per_call)} | {_f(run.get('throughput_per_s'))} | {_f(run.get('compile_s'))} | "
            f"{_f(run.get('warm_start_s'))} | {_f(j)} | {_f(j / batch if j is not None else None)} | "
            f"{_f(run.get('avg_power_w'))} | {_f(run.get('peak_power_w'))} | {_f(run.get('max_rel_error'), 2)} | "
            f"{status} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(read_export(sys.argv[1])))
