"""A sweep: one workload under many configurations, each measured in its own worker and stored at once.

`measure_config` measures one configuration without touching the database (the daemon stores its
result with the job's end); `bench` measures a list of them and stores each run as it finishes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import sqlite_utils
from joulepilot.store import (
    commit_run_or_set_aside,
    describe_import,
    find_ok_run,
    host_identity,
    import_pending_runs,
    list_runs,
    open_db,
    run_columns,
    workload_needs_description,
)
from joulepilot.store.jsonvalues import json_object

from .artifacts import artifact_path_for
from .budget import worker_budget
from .config import CompileConfig
from .inductor import checked_config, effective_key
from .options import FUSION_PRESETS, MODES, ConfigError
from .provenance import cpu_name, provenance
from .runner import CancelCheck, phase_text, remove_stale_workdirs, run_worker_job, start_zygote_early
from .workloads import check_spec, split_spec, workload_id
from .zygote import ZygotePool

log = logging.getLogger("joulepilot.bench")

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
    skipped: bool  # True: already measured ok under this provenance, not measured again
    pending_path: str | None  # set when the commit failed and the run waits in a side file


ProgressFn = Callable[[int, int, CompileConfig, "dict[str, Any] | None"], None]
NoticeFn = Callable[[str], None]
# (index, total, config, what the worker is doing now: 'compiling', 'warming up', 'measuring', ...)
PhaseProgressFn = Callable[[int, int, CompileConfig, str], None]


def default_device() -> str:
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


_DEVICE = re.compile(r"cpu|cuda:\d+")


def check_device(device: str) -> str:
    """The device in the form bench uses ('cpu' or 'cuda:N'); ConfigError naming the fix otherwise."""
    text = str(device).strip().lower()
    text = "cuda:0" if text == "cuda" else text
    if not _DEVICE.fullmatch(text):
        raise ConfigError(f"device {str(device)!r} cannot be benchmarked: use cpu, or cuda:N for GPU N (e.g. cuda:0)")
    if text.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device {str(device)!r} cannot be benchmarked: {why}; use --device cpu")
        count = torch.cuda.device_count()
        if int(text[5:]) >= count:
            raise ConfigError(f"device {str(device)!r} does not exist: this host has {count} CUDA GPU(s), "
                              f"cuda:0 to cuda:{count - 1}")
    return text


def default_modes(device: str) -> tuple[str, ...]:
    return GPU_MODES if str(device).startswith("cuda") else CPU_MODES


def default_precisions(device: str) -> tuple[str, ...]:
    return ("fp32", "bf16") if str(device).startswith("cuda") else ("fp32",)


def default_min_seconds(device: str) -> float:
    return 5.0 if str(device).startswith("cuda") else 2.0


def default_idle_s(device: str) -> float:
    """Seconds of idle baseline measured before a sweep (or before each daemon job)."""
    return 2.0 if str(device).startswith("cuda") else 0.5


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
            config = checked_config(CompileConfig(mode=mode, fusion=fusion, options=options or {},
                                                  precision=precision, dynamic=dynamic, batch_size=batch_size))
        key = effective_key(config)
        if key in seen:
            continue
        seen.add(key)
        planned.append(config)
    return planned


def _open(db: sqlite_utils.Database | str | os.PathLike | None) -> tuple[sqlite_utils.Database, bool]:
    if isinstance(db, sqlite_utils.Database):
        return db, False
    return open_db(db), True


@dataclass(frozen=True)
class SweepContext:
    """What every run of a sweep shares: provenance, the metered devices and the idle baseline."""

    device: str
    origin: dict[str, Any]
    devices: list[dict[str, Any]]
    idle_power_w: dict[str, float]
    idle_s: float

    @property
    def provenance_key(self) -> str:
        return self.origin["provenance_key"]


def sweep_context(device: str, idle_s: float) -> SweepContext:
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
    return SweepContext(device, origin, devices, dict(idle), float(idle_s))


@dataclass
class MeasuredRun:
    """One configuration measured (or stopped): the runs-table row, its power samples, and the rows it
    references, ready for `joulepilot.store.commit_run`."""

    config: CompileConfig
    workload_id: str
    status: str  # 'ok' | 'failed' | 'cancelled' (stopped from outside: nothing to store)
    reason: str | None
    row: dict[str, Any] = field(default_factory=dict)
    samples: list[tuple[float, str, float]] = field(default_factory=list)
    workload: dict[str, Any] | None = None
    devices: list[dict[str, Any]] = field(default_factory=list)

    def references(self) -> dict[str, Any]:
        """Keyword arguments of `commit_run` for the rows this run points at."""
        return {"host": host_identity(), "devices": self.devices, "workload": self.workload,
                "config": self.config.to_row()}


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


def warm_start_fields(warm: dict[str, Any]) -> tuple[float | None, dict[str, Any]]:
    """A warm-start worker's result as a run keeps it: (`warm_start_s`, what goes into `extra`)."""
    if warm.get("status") == "ok":
        return warm["warm_start_s"], {"artifacts_load_s": warm.get("artifacts_load_s"),
                                      "warm_start_caches": warm.get("caches")}
    return None, {"warm_start_error": warm.get("reason")}


def time_warm_start(spec: str, config: CompileConfig, artifacts_path: str, *, context: SweepContext,
                    min_seconds: float, budget_s: float, seq_len: int | None = None, image_size: int | None = None,
                    cancel: CancelCheck | None = None, on_start: Callable[[int], None] | None = None,
                    zygotes: ZygotePool | None = None) -> dict[str, Any]:
    """Time a worker with empty compile caches that loads `artifacts_path` (saved by a run of `config`) and
    makes its first call: the worker's result (`warm_start_s` when ok; status 'cancelled' when `cancel`
    stopped it). Used by the daemon for the configurations a decision names."""
    job = {"kind": "warm_start", "spec": spec, "device": context.device, "config": config.to_row(),
           "seq_len": seq_len, "image_size": image_size, "min_seconds": min_seconds,
           "artifacts_path": artifacts_path, "provenance": context.origin}
    return run_worker_job(job, budget=worker_budget(budget_s, min_seconds), cancel=cancel, on_start=on_start,
                          zygotes=zygotes)


def worker_job_key(spec: str, config: CompileConfig, device: str, seq_len: int | None,
                   image_size: int | None) -> dict[str, Any]:
    """The fields of a worker job that name its workload (what a zygote preloads)."""
    return {"spec": spec, "config": config.to_row(), "device": device, "seq_len": seq_len,
            "image_size": image_size}


def measure_config(
    spec: str,
    config: CompileConfig,
    *,
    context: SweepContext,
    columns: set[str],
    min_seconds: float,
    budget_s: float,
    seq_len: int | None = None,
    image_size: int | None = None,
    describe: bool = False,
    save_artifacts: bool = True,
    warm_start: bool = False,
    sample_hz: float = 10.0,
    cancel: CancelCheck | None = None,
    on_start: Callable[[int], None] | None = None,
    on_phase: Callable[[str, str], None] | None = None,
    zygotes: ZygotePool | None = None,
) -> MeasuredRun:
    """Measure `spec` under one configuration in a worker of its own, with fresh compile caches (and, with
    `warm_start`, time a second such worker loading the saved artifacts). Nothing is written to the database.
    With `zygotes`, the workers are forked from the workload's zygote (see `compiler/zygote.py`); the
    run's `extra.job_wall_s` is the wall time of the whole job, zygote start and warm start included.

    The worker runs under `worker_budget(budget_s, min_seconds)`; `cancel` (polled while a worker runs)
    returns a reason to stop, which ends the measurement with status 'cancelled'; `on_phase(kind,
    phase)` hears each phase its workers enter. `columns` are the runs
    table's columns (other result keys go into `extra`)."""
    job_started = time.monotonic()
    device = context.device
    origin = context.origin
    wid = workload_id(spec, config.batch_size, seq_len, image_size)
    budget = worker_budget(budget_s, min_seconds)
    artifacts = None
    if config.compiles and save_artifacts:
        artifacts = str(artifact_path_for(wid, config.id, origin["device_name"], origin["torch_version"],
                                          origin["triton_version"] or ""))
    job = {
        "kind": "bench", "spec": spec, "device": device, "config": config.to_row(),
        "seq_len": seq_len, "image_size": image_size, "min_seconds": min_seconds,
        "idle_power_w": context.idle_power_w, "sample_hz": sample_hz, "describe": describe,
        "artifacts_path": artifacts, "provenance": origin,
    }
    result = run_worker_job(job, budget=budget, cancel=cancel, on_start=on_start, on_phase=on_phase, zygotes=zygotes)
    if result.get("status") == "cancelled":
        return MeasuredRun(config, wid, "cancelled", result.get("reason"))
    if result.get("status") == "ok" and result.get("artifacts_path") and warm_start:
        warm_job = dict(job, kind="warm_start", artifacts_path=result["artifacts_path"], describe=False)
        warm = run_worker_job(warm_job, budget=budget, cancel=cancel, on_phase=on_phase, zygotes=zygotes)
        result["warm_start_s"], warm_extra = warm_start_fields(warm)
        result.setdefault("extra", {}).update(warm_extra)
    described = result.get("workload")
    workload = dict(described) if described else {"id": wid, "spec": spec, "batch_size": config.batch_size}
    row, samples = _run_row(result, wid=wid, config=config, device=device, origin=origin, columns=columns)
    row["extra"]["idle_s"] = context.idle_s
    row["extra"]["budget"] = budget.to_dict()
    row["extra"]["job_wall_s"] = time.monotonic() - job_started
    return MeasuredRun(config, wid, row["status"], row.get("reason"), row, samples, workload, context.devices)


def _stored_run(database: sqlite_utils.Database, run_id: int) -> dict[str, Any]:
    stored = list_runs(database, run_id=run_id)[0]
    stored["run_id"] = run_id
    stored["extra"] = json_object(stored.get("extra"))
    return stored


def _set_aside_view(spec: str, measured: MeasuredRun, pending: Path, error: str) -> dict[str, Any]:
    """A run that waits in a side file, shaped like a stored one (no id yet)."""
    config = measured.config
    view: dict[str, Any] = {**measured.row, "id": None, "run_id": None, "workload": spec,
                            "config_label": config.label, "mode": config.mode, "fusion": config.fusion,
                            "precision": config.precision, "batch_size": config.batch_size,
                            "pending_path": str(pending), "store_error": error}
    return view


def _lost_run_text(measured: MeasuredRun) -> str:
    row = measured.row
    figures = {k: row.get(k) for k in ("status", "reason", "compile_s", "latency_ms_p50", "energy_j_per_inference",
                                       "avg_power_w", "energy_source") if row.get(k) is not None}
    return f"lost run of {measured.config.label}: {json.dumps(figures, default=str)}"


def _default_notice(text: str) -> None:
    log.warning("%s", text)


def bench(
    spec: str,
    configs: Sequence[CompileConfig] | None = None,
    *,
    device: str | None = None,
    min_seconds: float | None = None,
    budget_s: float = 600.0,
    db: sqlite_utils.Database | str | os.PathLike | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    image_size: int | None = None,
    idle_s: float | None = None,
    warm_start: bool | Callable[[CompileConfig], bool] | None = None,
    save_artifacts: bool = True,
    sample_hz: float = 10.0,
    force: bool = False,
    progress: ProgressFn | None = None,
    notice: NoticeFn | None = None,
    stop_before: Callable[[CompileConfig], bool] | None = None,
    phase_progress: PhaseProgressFn | None = None,
) -> list[dict[str, Any]]:
    """Measure `spec` under each configuration, one worker process per configuration (forked from the
    workload's zygote, which imports torch and builds the model once for the whole sweep).

    Each finished run (ok or failed) is written to the database before the next starts, so an
    interrupted sweep keeps everything it finished; a configuration already measured ok for this
    workload on this device under the same provenance is not measured again (its stored run is
    returned with `skipped: True`) unless `force`. `batch_size`, when given, overrides the configs'
    own. `budget_s` bounds each worker's first forward calls (eager reference and cold compile);
    the rest of the worker gets an allowance derived from `min_seconds` (see
    `joulepilot.compiler.budget`). `warm_start` (default: on for GPUs; or a predicate on the config)
    times a second fresh process that loads the saved compile artifacts. `stop_before(config)`
    returning True ends the sweep before that configuration (a wall-clock deadline, say).

    A run whose commit fails (disk full) is kept in a side file beside the database and imported at
    the next start; it is returned with `pending_path` set and no `run_id`. `notice` receives one line
    per such event (default: a logged warning). Returns the runs (see RunResult), in plan order.
    Raises WorkloadError for a spec that cannot be resolved, ConfigError for a bad configuration or
    device, the telemetry's MeterUnavailable when the device cannot be metered, and the store's
    RunNotStored when a run can be neither committed nor set aside. `progress(index, total, config, run)`
    is called before each configuration (run None) and after it (index + 1, the stored run);
    `phase_progress(index, total, config, doing)` whenever its worker moves on ('compiling',
    'warming up', 'measuring', ...).
    """
    notice = notice or _default_notice
    for folder in remove_stale_workdirs():
        notice(f"removed {folder}, left by a worker whose bench or daemon was killed")
    device = check_device(device or default_device())
    on_gpu = device.startswith("cuda")
    split_spec(spec)
    check_spec(spec)
    if configs is None:
        configs = plan_configs(default_modes(device), precisions=default_precisions(device), batch_size=batch_size or 1)
    configs = [c.replace(batch_size=batch_size) if batch_size and c.batch_size != batch_size else c for c in configs]
    min_seconds = default_min_seconds(device) if min_seconds is None else float(min_seconds)
    idle_s = default_idle_s(device) if idle_s is None else float(idle_s)
    wants_warm_start = warm_start if callable(warm_start) else _constant(on_gpu if warm_start is None else warm_start)

    database, owned = _open(db)
    stack = contextlib.ExitStack()
    try:
        for item in import_pending_runs(database):
            notice(describe_import(item))
        zygotes = stack.enter_context(ZygotePool())
        if on_gpu and configs:  # the zygote's CPU work does not disturb the GPU's idle power: overlap them
            start_zygote_early(zygotes, worker_job_key(spec, configs[0], device, seq_len, image_size))
        context = sweep_context(device, idle_s)
        columns = run_columns(database)
        runs: list[dict[str, Any]] = []
        for index, config in enumerate(configs):
            if stop_before is not None and stop_before(config):
                break
            wid = workload_id(spec, config.batch_size, seq_len, image_size)
            done = None if force else find_ok_run(database, workload_id=wid, config_id=config.id,
                                                  provenance_key=context.provenance_key, device=device)
            if done is not None:
                stored = _stored_run(database, done)
                stored["skipped"] = True
                runs.append(stored)
                if progress:
                    progress(index + 1, len(configs), config, stored)
                continue
            if progress:
                progress(index, len(configs), config, None)
            on_phase = None
            if phase_progress is not None:
                def on_phase(kind: str, phase: str, index: int = index, config: CompileConfig = config) -> None:
                    phase_progress(index, len(configs), config, phase_text(kind, phase))
            measured = measure_config(
                spec, config, context=context, columns=columns, min_seconds=min_seconds, budget_s=budget_s,
                seq_len=seq_len, image_size=image_size, describe=workload_needs_description(database, wid),
                save_artifacts=save_artifacts, warm_start=wants_warm_start(config), sample_hz=sample_hz,
                on_phase=on_phase, zygotes=zygotes,
            )
            try:
                outcome = commit_run_or_set_aside(database, measured.row, measured.samples, **measured.references())
            except Exception:
                notice(_lost_run_text(measured))
                raise
            if outcome.run_id is not None:
                stored = _stored_run(database, outcome.run_id)
            else:
                assert outcome.pending_path is not None
                notice(f"{config.label}: the run could not be stored in the database ({outcome.error}); it is "
                       f"kept in {outcome.pending_path} and imported the next time bench or the daemon opens "
                       "this database")
                stored = _set_aside_view(spec, measured, outcome.pending_path, outcome.error)
            runs.append(stored)
            if progress:
                progress(index + 1, len(configs), config, stored)
        return runs
    finally:
        stack.close()  # the zygote, if one was started
        if owned:
            database.close()
