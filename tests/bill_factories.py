"""Runs of the built-in MLP (batch 8) stored straight into a real store with every figure the tuning bill reads,
and policy files over them, for the tuning bill's tests."""

from __future__ import annotations

import json
import time
from pathlib import Path

from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.policies import torch_minor
from joulepilot.store import insert_run, upsert_config, upsert_host, upsert_workload
from joulepilot.store.runs import workload_runs

WID = workload_id("mlp", 8)
POLICY = """name = "{name}"
workload = "mlp"
batch_size = 8
[objective]
minimize = "energy"
expected_inferences = 1_000_000
{limits}
[search]
modes = {modes}
precisions = {precisions}
[fallback]
mode = "eager"
"""
# Figures of one stored run: the first (compiling) call and the window are metered; warm-up, the latency
# pass and the rest of the job are not.
COMPILE_S, COMPILE_J, WARMUP_S, WINDOW_S = 5.0, 60.0, 1.0, 2.0
LATENCY_CALLS, LATENCY_MS_MEAN, JOB_WALL_S, IDLE_W = 100, 5.0, 30.0, 4.0


def write_policy(folder: Path, name: str = "svc", *, modes=("eager", "default"), precisions=("fp32", "bf16"),
                 limits: str = "") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(POLICY.format(name=name, limits=limits, modes=json.dumps(list(modes)),
                                  precisions=json.dumps(list(precisions))))
    return path


def store_run(db, mode: str, precision: str, j_per_call: float | None, *, avg_w: float = 20.0,
              policy: str | None = "svc", source: str = "rapl", idle_w: float | None = IDLE_W,
              job_wall_s: float | None = JOB_WALL_S, status: str = "ok", device: str = "cpu",
              device_name: str | None = None, compile_parts: dict | None = None,
              warm_first_call: tuple[float, float] | None = None) -> int:
    """One run of the built-in mlp (batch 8) on this host's CPU under the installed torch; `device` and
    `device_name` ('cuda:0', 'NVIDIA H200') make it a GPU run, `compile_parts` the `compile_energy_{gpu,cpu}_*`
    columns, whose joules then make up `compile_energy_j` (without them the run holds one compile figure);
    `warm_first_call` (seconds, joules) a repeat that started from saved artifacts, as the worker stores one: no
    compile figures, its metered first call in `extra.compile_window`."""
    host = upsert_host(db, {"id": "test-host", "hostname": "test", "cpu": "x86"})
    upsert_workload(db, {"id": WID, "spec": "mlp", "batch_size": 8, "params": 1000, "flops_per_inference": 1e6})
    cfg = CompileConfig(mode, precision=precision, batch_size=8)
    upsert_config(db, cfg.to_row())
    now = time.time()
    extra = {} if policy is None else {"policy": policy}
    if job_wall_s is not None:
        extra["job_wall_s"] = job_wall_s
    run = {"workload_id": WID, "config_id": cfg.id, "host_id": host, "device": device, "device_name": device_name,
           "status": status, "started_at": now, "finished_at": now + 20.0, "torch_version": f"{torch_minor()}.0",
           "extra": extra}
    if status == "ok":
        window_j = avg_w * WINDOW_S
        compiles = mode != "eager"
        extra |= {"latency_calls": LATENCY_CALLS, "latency_ms_mean": LATENCY_MS_MEAN}
        run |= {"compile_s": COMPILE_S if compiles else 0.01, "compile_energy_j": COMPILE_J if compiles else 0.1,
                "warmup_s": WARMUP_S, "window_s": WINDOW_S, "energy_j": window_j,
                "inferences": round(window_j / j_per_call), "energy_j_per_inference": j_per_call,
                "latency_ms_p50": 1.0, "latency_ms_p95": 1.2, "avg_power_w": avg_w, "peak_power_w": avg_w * 1.1,
                "idle_power_w": idle_w, "energy_source": source, "max_rel_error": 1e-4}
        if compile_parts is not None:
            run |= dict(compile_parts)
            run["compile_energy_j"] = sum(v for k, v in compile_parts.items() if k.endswith("_j") and v is not None)
        if warm_first_call is not None:
            first_s, first_j = warm_first_call
            run |= {"compile_s": None, "compile_energy_j": None, "warm_start_s": first_s + 0.5}
            extra |= {"warm_start_from": 1, "compile_window": {"duration_s": first_s, "sources": [source], "devices": [
                {"device": device, "source": source, "energy_j": first_j, "duration_s": first_s}]}}
    else:
        run["reason"] = "worker killed by SIGSEGV during compile"
    return insert_run(db, run)


def runs_of(db, device_kind: str = "cpu"):
    return workload_runs(db, WID, device_kind, torch_minor())
