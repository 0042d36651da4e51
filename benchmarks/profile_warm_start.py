"""Where a warm start's time goes on a GPU: `bench` of one configuration (default, bf16) with its warm start,
then the warm start's steps again in a fresh process (the compiler preloaded as the workload's zygote does,
empty caches, the saved artifacts loaded), with `apply_config` and the first call under cProfile.

    python benchmarks/profile_warm_start.py SPEC BATCH SEQ_LEN|-    > profile.txt 2> timings.txt

stdout: bench's figures (JSON), then the two profiles; stderr: the steps' seconds.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time


def _profile(label: str, fn, lines: int) -> None:
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    fn()
    profile.disable()
    print(f"{label} {time.perf_counter() - started:.3f}", file=sys.stderr)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(lines)
    print(out.getvalue())


def child(spec: str, batch: int, seq: int | None, artifacts: str) -> None:
    import torch

    started = time.perf_counter()
    torch.compile(lambda x: x)  # what the zygote preloads: torch.compile's imports, nothing compiled
    import torch._dynamo  # noqa: F401
    import torch.export  # noqa: F401

    print(f"preload {time.perf_counter() - started:.2f}", file=sys.stderr)
    from joulepilot.compiler import CompileConfig, load_workload
    from joulepilot.compiler.apply import apply_config
    from joulepilot.compiler.artifacts import load_warm_start

    workload = load_workload(spec, batch_size=batch, device="cuda:0", seq_len=seq)
    with torch.no_grad():
        workload.model(*workload.example_inputs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    info = load_warm_start(artifacts)
    print(f"load {time.perf_counter() - started:.2f} {info}", file=sys.stderr)
    config = CompileConfig("default", precision="bf16", batch_size=batch)
    applied: list = []
    _profile("apply", lambda: applied.append(apply_config(config, workload.model, "cuda:0")), 25)

    def first_call() -> None:
        applied[0](*workload.example_inputs)
        torch.cuda.synchronize()

    _profile("first call", first_call, 30)


def main() -> None:
    spec, batch = sys.argv[1], int(sys.argv[2])
    seq = int(sys.argv[3]) if sys.argv[3] != "-" else None
    if len(sys.argv) > 5 and sys.argv[4] == "child":
        child(spec, batch, seq, sys.argv[5])
        return
    home = tempfile.mkdtemp()
    os.environ["JOULEPILOT_HOME"] = home
    from joulepilot.compiler import CompileConfig, bench
    from joulepilot.store import open_db

    db = open_db(os.path.join(home, "profile.db"))
    (run,) = bench(spec, [CompileConfig("default", precision="bf16", batch_size=batch)], device="cuda:0",
                   min_seconds=1, db=db, idle_s=0, warm_start=True, batch_size=batch, seq_len=seq)
    warm = run["extra"].get("warm_start") or {}
    print(json.dumps({"status": run["status"], "compile_s": run.get("compile_s"), "warm_start_s": run.get("warm_start_s"),
                      "apply_s": warm.get("apply_s"), "first_call_s": warm.get("first_call_s"),
                      "timers": warm.get("compile_timers_s"), "worker": run["extra"].get("worker_process")}, indent=1),
          flush=True)
    subprocess.run([sys.executable, __file__, spec, str(batch), sys.argv[3], "child", run["artifacts_path"]],
                   env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp()),
                   check=False)


if __name__ == "__main__":
    main()
