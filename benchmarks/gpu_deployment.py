"""Decide a power-capped policy from recorded runs, then serve it through the hook as a metered deployment.

    python benchmarks/gpu_deployment.py --db SWEEP.db --out OUT_DIR [--seconds 60] [--device cuda:0]

Steps: write OUT/policies/NAME.toml (an average-power envelope, tolerance, search space), resolve it against
the runs in --db on this device kind and record the decision, `joulepilot.compile(model, policy=...,
deployment=NAME)`, serve batches for --seconds, close the deployment, and write its report
(OUT/report.html, OUT/report.json). On a CPU (`--device cpu --workload mlp`) it is a smoke test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

POLICY = """\
name = "{name}"
workload = "{workload}"
batch_size = {batch}
[objective]
minimize = "energy"
expected_inferences = 10_000_000
[limits]
max_avg_power_w = {envelope}
max_rel_error = 2e-2
[search]
modes = ["eager", "default", "reduce-overhead"]
precisions = ["fp32", "bf16"]
[fallback]
mode = "eager"
[guard]
windows = 3
action = "warn"
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workload", default="torchvision:resnet50")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--envelope-w", type=float, default=450.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--name", default="resnet50-capped")
    args = parser.parse_args()

    import torch
    from joulepilot.compiler import load_workload
    from joulepilot.controller.report import build_report, render
    from joulepilot.policies import load_policy, record_decision, resolve, write_lock
    from joulepilot.runtime import current_device_kind
    from joulepilot.store import open_db

    import joulepilot

    args.out.mkdir(parents=True, exist_ok=True)
    policy_path = args.out / "policies" / f"{args.name}.toml"
    policy_path.parent.mkdir(exist_ok=True)
    policy_path.write_text(POLICY.format(name=args.name, workload=args.workload, batch=args.batch_size,
                                         envelope=args.envelope_w))
    db = open_db(args.db)
    policy = load_policy(policy_path)
    kind = current_device_kind(args.device)
    decision = resolve(policy, db, kind)
    record_decision(db, decision)
    write_lock(policy_path, decision)
    print(f"decision on {kind}: {decision.config['label']} [{decision.state}] {decision.reason}", flush=True)

    wl = load_workload(args.workload, batch_size=args.batch_size, device=args.device)
    served = joulepilot.compile(wl.model, policy=policy_path, device=args.device, db=args.db,
                                deployment=args.name)
    t0 = time.monotonic()
    for _ in range(20):  # compile and warm up; these calls are metered too, as in production
        served(*wl.example_inputs)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    print(f"compiled and warmed up in {time.monotonic() - t0:.1f} s", flush=True)
    t_end = time.monotonic() + args.seconds
    while time.monotonic() < t_end:
        served(*wl.example_inputs)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    served.close()

    report = build_report(db, args.name)
    (args.out / "report.html").write_text(render(report, "html"))
    (args.out / "report.json").write_text(render(report, "json"))
    totals = report["totals"]
    print(json.dumps({"decision": decision.config["label"], "state": decision.state, **{
        k: totals.get(k) for k in ("energy_j", "energy_kwh", "inferences", "j_per_inference", "avg_power_w",
                                   "peak_power_w", "energy_source", "metered_s")}}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
