"""A sweep: one workload under many configurations, each measured in its own worker and stored at once."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypedDict

import sqlite_utils
from joulepilot.store import (
    insert_run,
    list_runs,
    open_db,
    upsert_config,
    upsert_devices,
    upsert_host,
    upsert_workload,
)

from .artifacts import artifact_path_for
from .config import CompileConfig
from .options import FUSION_PRESETS, MODES
from .provenance import cpu_name, provenance
from .runner import phase_text, run_worker_job
from .workloads import check_spec, split_spec, workload_id

CPU_MODES = ("eager", "default")
GPU_MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


class RunResult(TypedDict, total=False):
    """One run as `bench` returns it: the runs-table columns joined with workload and configuration, as
    `joulepilot.store.list_runs` gives them, plus `run_id` (= `id`) and `extra` as a dict."""

    run_id: int
    id: int
    workload: str
    workload_id: str
    config_id: str
    config_label: str
    mode: str
    fusion: str
    precision: str
    options: str
    dynamic: int
    batch_size: int
    status: str
    reason: str | None
    compile_s: float | None
    compile_energy_j: float | None
    latency_ms_p50: float | None
    latency_ms_p95: float | None
    throughput_per_s: float | None
    energy_j_per_inference: float | None
    energy_above_idle_j_per_inference: float | None
    avg_power_w: float | None
    peak_power_w: float | None
    energy_source: str | None
    max_rel_error: float | None
    graph_breaks: int | None
    recompiles: int | None
    warm_start_s: float | None
    artifacts_path: str | None
    extra: dict[str, Any]


ProgressFn = Callable[[int, int, CompileConfig, "dict[str, Any] | None"], None]
# (index, total, config, what the worker is doing now: 'compiling', 'warming up', 'measuring', ...)
PhaseProgressFn = Callable[[int, int, CompileConfig, str], None]


def default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def default_modes(device: str) -> tuple[str, ...]:
    return GPU_MODES if str(device).startswith("cuda") else CPU_MODES


def default_precisions(device: str) -> tuple[str, ...]:
    return ("fp32", "bf16") if str(device).startswith("cuda") else ("fp32",)


def default_min_seconds(device: str) -> float:
    return 5.0 if str(device).startswith("cuda") else 2.0


def plan_configs(modes: Iterable[str], fusions: Iterable[str] = ("default",), precisions: Iterable[str] = ("fp32",),
                 batch_size: int = 1, dynamic: bool = False, options: dict[str, Any] | None = None
                 ) -> list[CompileConfig]:
    """The cross product of modes x fusion presets x precisions, in that order, without meaningless or
    duplicate points: eager appears once per precision (fusion presets and options do not apply to it),
    and a preset that only repeats what its mode already sets (max-autotune + coordinate-descent) is
    dropped. Unknown names raise ConfigError."""
    modes, fusions, precisions = list(modes), list(fusions), list(precisions)
    for fusion in fusions:
        if fusion not in FUSION_PRESETS:
            CompileConfig(mode="default", fusion=fusion)  # raises ConfigError naming the closest preset
    planned: list[CompileConfig] = []
    seen: set[str] = set()
    for mode, fusion, precision in itertools.product(modes, fusions, precisions):
        if mode not in MODES:
            CompileConfig(mode=mode)  # raises with the closest mode
        if mode == "eager":
            config = CompileConfig(mode="eager", precision=precision, dynamic=dynamic, batch_size=batch_size)
        else:
            config = CompileConfig(mode=mode, fusion=fusion, options=options or {}, precision=precision,
                                   dynamic=dynamic, batch_size=batch_size)
        key = config.effective_key()
        if key in seen:
            continue
        seen.add(key)
        planned.append(config)
    return planned


def _open(db: sqlite_utils.Database | str | os.PathLike | None) -> tuple[sqlite_utils.Database, bool]:
    if isinstance(db, sqlite_utils.Database):
        return db, False
    return open_db(db), True


def _sweep_context(device: str, idle_s: float) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, float]]:
    """Provenance, metered devices and the idle baseline, taken once per sweep in this process.

    On a GPU only NVML is touched here (no CUDA context in the parent)."""
    from joulepilot.telemetry import EnergyMeter

    meter = EnergyMeter(device=device)
    try:
        devices = [d.to_dict() for d in meter.devices]
        idle = meter.measure_idle(seconds=idle_s) if idle_s > 0 else {}
    finally:
        meter.close()
    gpu = next((d for d in devices if d.get("kind") == "gpu"), None)
    if gpu is not None:
        origin = provenance(device, name=gpu.get("name") or None, driver=gpu.get("driver") or None)
    else:
        origin = provenance(device, name=cpu_name())
    return origin, devices, idle


def _ensure_workload(db: sqlite_utils.Database, spec: str, batch_size: int, seq_len: int | None,
                     image_size: int | None) -> tuple[str, bool]:
    """The workload's id, and whether it still needs describing (a row without params)."""
    wid = workload_id(spec, batch_size, seq_len, image_size)
    row = db.execute("SELECT params, flops_per_inference FROM workloads WHERE id = ?", [wid]).fetchone()
    if row is None:
        upsert_workload(db, {"id": wid, "spec": spec, "batch_size": batch_size})
        return wid, True
    return wid, row[0] is None and row[1] is None


def _run_row(result: dict[str, Any], *, wid: str, config: CompileConfig, device: str, origin: dict[str, Any],
             columns: set[str]) -> tuple[dict[str, Any], list[tuple[float, str, float]]]:
    result = dict(result)
    samples = [tuple(s) for s in result.pop("power_samples", None) or []]
    result.pop("workload", None)
    extra = dict(result.pop("extra", None) or {})
    row: dict[str, Any] = {
        "workload_id": wid,
        "config_id": config.id,
        "device": device,
        "status": result.get("status", "failed"),
    }
    for key in ("host_id", "device_name", "driver_version", "torch_version", "triton_version",
                "joulepilot_version", "provenance_key"):
        row[key] = origin.get(key)
    for key, value in result.items():
        if key in columns and key not in ("id",):
            row[key] = value
        elif key not in ("status",):
            extra[key] = value
    row.setdefault("started_at", time.time())
    row["extra"] = extra
    return row, samples  # type: ignore[return-value]


def _constant(flag: bool) -> Callable[[CompileConfig], bool]:
    return lambda _config: bool(flag)


def _warm_start(job: dict[str, Any], artifacts: str, budget_s: float, total_budget_s: float,
                on_phase: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    warm_job = dict(job, kind="warm_start", artifacts_path=artifacts, describe=False)
    return run_worker_job(warm_job, compile_budget_s=budget_s, total_budget_s=total_budget_s, on_phase=on_phase)


def bench(
    spec: str,
    configs: Sequence[CompileConfig] | None = None,
    *,
    device: str | None = None,
    min_seconds: float | None = None,
    budget_s: float = 600.0,
    total_budget_s: float | None = None,
    db: sqlite_utils.Database | str | os.PathLike | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    image_size: int | None = None,
    idle_s: float | None = None,
    warm_start: bool | Callable[[CompileConfig], bool] | None = None,
    save_artifacts: bool = True,
    sample_hz: float = 10.0,
    progress: ProgressFn | None = None,
    stop_before: Callable[[CompileConfig], bool] | None = None,
    phase_progress: PhaseProgressFn | None = None,
) -> list[dict[str, Any]]:
    """Measure `spec` under each configuration, one worker process per configuration.

    Each finished run (ok or failed) is written to the database before the next starts, so an
    interrupted sweep keeps everything it finished. `batch_size`, when given, overrides the configs'
    own. `budget_s` bounds each cold compile; `total_budget_s` each whole worker (default: budget plus
    room for loading and measuring). `warm_start` (default: on for GPUs; or a predicate on the config)
    times a second fresh process that loads the saved compile artifacts. `stop_before(config)` returning
    True ends the sweep before that configuration (a wall-clock deadline, say). `progress(index, total,
    config, run)` is called before each configuration (run None) and after it (index + 1, the stored
    run); `phase_progress(index, total, config, doing)` whenever its worker moves on ('compiling',
    'warming up', 'measuring', ...). Returns the stored runs
    (see RunResult), in plan order.
    Raises WorkloadError for a spec that cannot be resolved, ConfigError for a bad configuration, and
    the telemetry's MeterUnavailable when the device cannot be metered.
    """
    device = device or default_device()
    on_gpu = str(device).startswith("cuda")
    split_spec(spec)
    check_spec(spec)
    if configs is None:
        configs = plan_configs(default_modes(device), precisions=default_precisions(device), batch_size=batch_size or 1)
    configs = [c.replace(batch_size=batch_size) if batch_size and c.batch_size != batch_size else c for c in configs]
    min_seconds = default_min_seconds(device) if min_seconds is None else float(min_seconds)
    idle_s = (2.0 if on_gpu else 0.5) if idle_s is None else float(idle_s)
    wants_warm_start = warm_start if callable(warm_start) else _constant(on_gpu if warm_start is None else warm_start)
    total_budget_s = total_budget_s or (budget_s + 300.0 + 6.0 * min_seconds)

    database, owned = _open(db)
    try:
        origin, devices, idle = _sweep_context(device, idle_s)
        upsert_host(database)
        upsert_devices(database, origin["host_id"], devices)
        columns = set(database["runs"].columns_dict)
        runs: list[dict[str, Any]] = []
        for index, config in enumerate(configs):
            if stop_before is not None and stop_before(config):
                break
            if progress:
                progress(index, len(configs), config, None)
            upsert_config(database, config.to_row())
            wid, needs_describe = _ensure_workload(database, spec, config.batch_size, seq_len, image_size)
            artifacts = None
            if config.compiles and save_artifacts:
                artifacts = str(artifact_path_for(wid, config.id, origin["device_name"], origin["torch_version"],
                                                  origin["triton_version"] or ""))
            job = {
                "kind": "bench", "spec": spec, "device": device, "config": config.to_row(),
                "seq_len": seq_len, "image_size": image_size, "min_seconds": min_seconds,
                "idle_power_w": idle, "sample_hz": sample_hz, "describe": needs_describe,
                "artifacts_path": artifacts, "provenance": origin,
            }
            on_phase = None
            if phase_progress is not None:
                def on_phase(kind: str, phase: str, index: int = index, config: CompileConfig = config) -> None:
                    phase_progress(index, len(configs), config, phase_text(kind, phase))
            result = run_worker_job(job, compile_budget_s=budget_s, total_budget_s=total_budget_s, on_phase=on_phase)
            if result.get("status") == "ok" and result.get("artifacts_path") and wants_warm_start(config):
                warm = _warm_start(job, result["artifacts_path"], budget_s, total_budget_s, on_phase)
                extra = result.setdefault("extra", {})
                if warm.get("status") == "ok":
                    result["warm_start_s"] = warm["warm_start_s"]
                    extra["artifacts_load_s"] = warm.get("artifacts_load_s")
                    extra["warm_start_caches"] = warm.get("caches")
                else:
                    extra["warm_start_error"] = warm.get("reason")
            if result.get("workload"):
                upsert_workload(database, result["workload"])
            row, samples = _run_row(result, wid=wid, config=config, device=device, origin=origin, columns=columns)
            row["extra"]["idle_s"] = idle_s
            run_id = insert_run(database, row, samples)
            stored = list_runs(database, where="runs.id = ?", params=[run_id])[0]
            stored["run_id"] = run_id
            stored["extra"] = json.loads(stored["extra"]) if stored.get("extra") else {}
            runs.append(stored)
            if progress:
                progress(index + 1, len(configs), config, stored)
        return runs
    finally:
        if owned:
            database.close()
