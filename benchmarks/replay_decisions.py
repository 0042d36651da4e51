"""The decisions the resolver makes on a recorded sweep: the README's and the docs' decision tables.

    python benchmarks/replay_decisions.py tests/data/gpu_sweep_h200.json [--envelope-w 450] [--json]

Imports the run-exchange file into a temporary database and, for each sweep model with measured runs,
resolves an energy policy (10 million inferences, `max_rel_error` 2e-2 unless --max-rel-error, every
mode, precision and fusion preset the sweep measured) without an envelope and with `--envelope-w`.
Each row gives the chosen configuration's measured J per call and average power, and the saving against
eager fp32 and stock `torch.compile` (default fp32). Measured figures only; nothing is predicted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpu_sweep import MODELS
from joulepilot.policies import resolve, torch_minor, validate
from joulepilot.store import import_runs, list_runs, open_db, read_export


def _policy(model: dict[str, Any], runs: list[dict[str, Any]], limits: dict[str, float],
            expected: int) -> Any:
    raw: dict[str, Any] = {
        "name": "replay", "workload": model["spec"], "batch_size": model["batch_size"],
        "objective": {"minimize": "energy", "expected_inferences": expected},
        "limits": limits,
        "search": {"modes": sorted({r["mode"] for r in runs}), "precisions": sorted({r["precision"] for r in runs}),
                   "fusion": sorted({r["fusion"] for r in runs})},
        "fallback": {"mode": "eager"},
    }
    if model.get("seq_len"):
        raw["seq_len"] = model["seq_len"]
    return validate(raw)


def _figure(runs: list[dict[str, Any]], mode: str, precision: str) -> float | None:
    """Latest ok run's J per call of `mode`/`precision` with the default fusion preset."""
    for run in runs:  # newest first
        if run["mode"] == mode and run["precision"] == precision and run["fusion"] == "default":
            return run["energy_j_per_inference"]
    return None


def decisions(path: Path, envelopes: list[float | None], max_rel_error: float | None,
              expected: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        db = open_db(Path(tmp) / "replay.db")
        import_runs(db, read_export(path))
        ok = list_runs(db, status="ok")
        for name, model in MODELS.items():
            runs = [r for r in ok if r["workload"] == model["spec"] and r["batch_size"] == model["batch_size"]]
            if len(runs) < 2:
                continue
            device, torch_version = runs[0]["device_name"], torch_minor(runs[0]["torch_version"])
            eager = _figure(runs, "eager", "fp32")
            stock = _figure(runs, "default", "fp32")
            for envelope in envelopes:
                limits = {"max_avg_power_w": envelope} if envelope else {}
                if max_rel_error is not None:
                    limits["max_rel_error"] = max_rel_error
                decision = resolve(_policy(model, runs, limits, expected), db, device, torch_version=torch_version)
                # A measured configuration the resolver chose (verified, provisional on too few runs, or
                # infeasible), not the fallback a provisional or fallback decision may apply instead.
                chosen = next((c for c in decision.candidates if c.status == "chosen"), None)
                figures = chosen.figures if chosen is not None else {}
                energy = figures.get("energy_j_per_inference")
                rows.append({
                    "model": name, "device": device, "torch": torch_version, "envelope_w": envelope,
                    "state": decision.state, "config": (decision.config or {}).get("label"),
                    "energy_j_per_inference": energy, "avg_power_w": figures.get("avg_power_w"),
                    "peak_power_w": figures.get("peak_power_w"), "compile_s": figures.get("compile_s"),
                    "run_id": figures.get("run_id"),
                    "saving_vs_eager_fp32": None if energy is None or not eager else 1 - energy / eager,
                    "saving_vs_default_fp32": None if energy is None or not stock else 1 - energy / stock,
                    "reason": decision.reason,
                })
        db.close()
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%} less"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | envelope | state | chosen | J/call | avg W | vs eager fp32 | vs default fp32 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        energy = "-" if r["energy_j_per_inference"] is None else f"{r['energy_j_per_inference']:.3g} J"
        power = "-" if r["avg_power_w"] is None else f"{r['avg_power_w']:.0f} W"
        envelope = f"{r['envelope_w']:g} W" if r["envelope_w"] else "none"
        lines.append(f"| {r['model']} | {envelope} | {r['state']} | "
                     f"{r['config']} | {energy} | {power} | {_pct(r['saving_vs_eager_fp32'])} | "
                     f"{_pct(r['saving_vs_default_fp32'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="run-exchange JSON (tests/data/gpu_sweep_<device>.json)")
    parser.add_argument("--envelope-w", type=float, default=450.0, help="the capped policy's max_avg_power_w")
    parser.add_argument("--max-rel-error", type=float, default=2e-2, help="0 for no tolerance limit")
    parser.add_argument("--expected-inferences", type=int, default=10_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not args.sweep.is_file():
        print(f"replay_decisions: {args.sweep}: no such file", file=sys.stderr)
        return 2
    rows = decisions(args.sweep, [None, args.envelope_w], args.max_rel_error or None, args.expected_inferences)
    print(json.dumps(rows, indent=1) if args.json else markdown(rows), end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
