"""What live metering costs the served model, and a metered serving run to report on.

    python benchmarks/deployment_overhead.py                    # hot-path overhead per call (CPU)
    python benchmarks/deployment_overhead.py --serve 60 --device cuda:0 --db /tmp/jp.db --out /tmp/report.html

The overhead is measured on a callable that does nothing, so what is left is the wrapper's own cost
(one attribute check and one `itertools.count` step); the metering thread runs meanwhile at a 0.5 s
interval so its GIL use is included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def overhead_ns(calls: int = 200_000, repeats: int = 5) -> dict[str, float]:
    from joulepilot.runtime import attach

    def noop(*args, **kwargs):
        return None

    with tempfile.TemporaryDirectory() as tmp:
        metered = attach(noop, "overhead", db=Path(tmp) / "jp.db", device="cpu", interval_s=0.5)
        plain_ns, wrapped_ns = [], []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                noop()
            plain_ns.append((time.perf_counter_ns() - t0) / calls)
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                metered()
            wrapped_ns.append((time.perf_counter_ns() - t0) / calls)
        metered.close()
    return {"plain_call_ns": statistics.median(plain_ns), "metered_call_ns": statistics.median(wrapped_ns),
            "overhead_ns": statistics.median(wrapped_ns) - statistics.median(plain_ns)}


def serve(seconds: float, device: str, db: str, out: str | None, mode: str) -> dict:
    """Serve ResNet-style convnet work (built-in `convnet`, batch 32) compiled with `mode` as a deployment."""
    import torch
    from joulepilot.compiler import CompileConfig, apply_config, load_workload
    from joulepilot.controller.report import build_report, render
    from joulepilot.runtime import attach
    from joulepilot.store import open_db, upsert_config, upsert_workload

    wl = load_workload("convnet", batch_size=32, device=device)
    cfg = CompileConfig(mode=mode, batch_size=32)
    store = open_db(db)
    upsert_workload(store, wl.describe(graph=False))
    upsert_config(store, cfg.to_row())
    model = apply_config(cfg, wl.model, device)
    for _ in range(20):  # compile and warm up before the deployment starts counting
        model(*wl.example_inputs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    served = attach(model, f"convnet-{mode}", db=store, device=device, interval_s=5.0,
                    workload_id=wl.id, config_id=cfg.id)
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        served(*wl.example_inputs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    served.close()
    report = build_report(store, served.name)
    if out:
        Path(out).write_text(render(report, "html"))
        Path(out).with_suffix(".json").write_text(render(report, "json"))
    t = report["totals"]
    return {k: t[k] for k in ("energy_j", "energy_kwh", "inferences", "j_per_inference", "avg_power_w",
                              "peak_power_w", "energy_source", "metered_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=float, help="serve for this many seconds instead of the overhead test")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default="default")
    parser.add_argument("--db", default=None)
    parser.add_argument("--out", default=None, help="HTML report path (a .json beside it)")
    args = parser.parse_args()
    if args.serve:
        db = args.db or str(Path(tempfile.mkdtemp()) / "jp.db")
        print(json.dumps(serve(args.serve, args.device, db, args.out, args.mode), indent=2))
    else:
        print(json.dumps(overhead_ns(), indent=2))


if __name__ == "__main__":
    main()
