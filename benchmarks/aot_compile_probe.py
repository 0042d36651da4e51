"""Probe: can torch's experimental whole-graph AOT compile save a workload's compiled forward and start a fresh
process from it without Dynamo tracing the model again, and how fast is that start against a cold compile?

    python benchmarks/aot_compile_probe.py transformers:BertConfig --batch-size 16 --seq-len 128 --out DIR
    python benchmarks/aot_compile_probe.py torchvision:resnet50 --batch-size 32 --out DIR

Not part of joulepilot's measuring path: a feasibility check for the 5x warm-start target (issue 14) on the
installed torch. Each step runs in a fresh process with empty Inductor and Triton caches:
1. `cold`: build the workload, `torch.compile(model, fullgraph=True)`, `_aot_compile` it for the example
   inputs (torch._dynamo.config.enable_aot_compile), make the first call; save the compiled module;
2. `warm`: build the workload again, load the saved module into a fresh `torch.compile` wrapper, make the
   first call; compare its output with the cold process's.
`cold_s` and `warm_s` are wall seconds from before compiling (or loading) to the end of the first call,
device-synchronised, building the model left out. Prints one JSON object; `--out` keeps it and the artifact.

`--guards serializable` compiles with a guard filter that keeps only the guards the saved module can carry:
it drops guards on globals and on objects' identities (ID_MATCH and the other kinds Dynamo cannot serialise),
as later torch versions do by default for an AOT compile. Unsafe in general (a different object of the same
shape passes), which is why it is a probe option and not joulepilot's path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _workload(args: argparse.Namespace):
    from joulepilot.compiler.workloads import load_workload

    return load_workload(args.spec, batch_size=args.batch_size, device=args.device, seq_len=args.seq_len)


def _serializable_guards(entries):
    """Keep a guard unless it is on a global or of a kind Dynamo cannot save with the compiled module."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ()) or ()) | {"ID_MATCH"}
    # A guard built on another (a closure's function match checks the function's identity) is refused by
    # what it derives from too, so those go as well.
    return [not (entry.is_global or entry.guard_type in unsupported
                 or unsupported.intersection(getattr(entry, "derived_guard_types", ()) or ()))
            for entry in entries]


def _step(args: argparse.Namespace) -> dict:
    import torch
    from joulepilot.compiler.precision import precision_scope

    out: dict = {"step": args.step, "torch": torch.__version__, "guards": args.guards}
    work = _workload(args)
    model, inputs = work.model, work.example_inputs
    sync = (lambda: torch.cuda.synchronize()) if args.device.startswith("cuda") else (lambda: None)
    artifact = Path(args.artifact)
    torch._dynamo.config.enable_aot_compile = True
    with torch.no_grad(), precision_scope(args.precision, args.device):
        options = {"guard_filter_fn": _serializable_guards} if args.guards == "serializable" else None
        compiled = torch.compile(model, fullgraph=True, options=options)
        sync()
        started = time.perf_counter()
        if args.step == "cold":
            from torch._dynamo.aot_compile import ModelInput

            compiled._aot_compile([ModelInput(args=tuple(inputs), kwargs={}, contexts=[])])
            out["aot_compile_s"] = time.perf_counter() - started
        else:
            compiled._load_aot_compiled_module(artifact.read_bytes())
            out["load_s"] = time.perf_counter() - started
        result = compiled(*inputs)
        sync()
        out[f"{args.step}_s"] = time.perf_counter() - started
        if args.step == "cold":
            saved = time.perf_counter()
            compiled._save_aot_compiled_module(str(artifact))
            out["save_s"] = time.perf_counter() - saved
            out["artifact_bytes"] = artifact.stat().st_size
            torch.save(result.float().cpu(), str(artifact) + ".out")
        else:
            cold = torch.load(str(artifact) + ".out")
            warm = result.float().cpu()
            out["max_rel_error_vs_cold"] = float((warm - cold).abs().max() / cold.abs().max().clamp_min(1e-12))
        started = time.perf_counter()
        for _ in range(20):
            compiled(*inputs)
        sync()
        out["ms_per_call"] = (time.perf_counter() - started) * 50.0
    return out


def _run_step(args: argparse.Namespace, step: str, artifact: Path, scratch: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(scratch / f"{step}-inductor"),
               TRITON_CACHE_DIR=str(scratch / f"{step}-triton"))
    command = [sys.executable, __file__, args.spec, "--step", step, "--artifact", str(artifact),
               "--batch-size", str(args.batch_size), "--device", args.device, "--precision", args.precision,
               "--guards", args.guards]
    if args.seq_len:
        command += ["--seq-len", str(args.seq_len)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"step": step, "error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--out", type=Path, help="folder to keep the result (probe.json) and the artifact in")
    parser.add_argument("--timeout-s", type=float, default=400.0)
    parser.add_argument("--guards", choices=("all", "serializable"), default="all",
                        help="serializable: drop guards on globals and identities (unsafe; see above)")
    parser.add_argument("--step", choices=("cold", "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--artifact", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        try:
            print(json.dumps(_step(args)))
        except Exception as exc:  # the probe's answer: where it failed and why
            print(json.dumps({"step": args.step, "error": f"{type(exc).__name__}: {exc}"[:2000],
                              "traceback": traceback.format_exc()[-4000:]}))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="aot-probe-"))
    folder = args.out or scratch
    folder.mkdir(parents=True, exist_ok=True)
    artifact = folder / "compiled.bin"
    result = {"spec": args.spec, "batch_size": args.batch_size, "seq_len": args.seq_len, "device": args.device,
              "precision": args.precision, "guards": args.guards, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result["cold"] = _run_step(args, "cold", artifact, scratch)
    if "error" not in result["cold"]:
        result["warm"] = _run_step(args, "warm", artifact, scratch)
        if "error" not in result["warm"]:
            result["ratio"] = result["cold"]["cold_s"] / result["warm"]["warm_s"]
    text = json.dumps(result, indent=1)
    if args.out:
        (folder / "probe.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
