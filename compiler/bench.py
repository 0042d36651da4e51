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
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from joulepilot.store import (
    Store,
    commit_run_or_set_aside,
    device_kind,
    find_ok_run,
    host_identity,
    list_runs,
    open_db,
    run_columns,
    workload_needs_description,
)
from joulepilot.store.jsonvalues import json_object
from joulepilot.store.runs import ok_runs_per_config
from joulepilot.store.side_file_imports import import_side_files
from joulepilot.store.torchversion import torch_major_minor

from .artifacts import artifact_path_for
from .budget import worker_budget
from .config import CompileConfig
from .device_pool import DevicePool, Finished, cpu_threads
from .device_pool import worker_env as default_worker_env
from .generation_workloads import (
    Generation,
    check_workload_request,
    plan_generation_configs,
    workload_columns,
)
from .generation_workloads import job_fields as generation_job_fields
from .inductor import checked_config, effective_key
from .measure import add_flag, far_slower
from .options import FUSION_PRESETS, MODES, ConfigError, check_regional
from .provenance import cpu_name, provenance
from .remote_cache import recorded_variables
from .runner import CancelCheck, phase_text, remove_stale_workdirs, run_worker_job, start_zygote_early
from .shape_set import ShapeSet
from .warmstart import precompile_opted_in
from .window_gate import Gate
from .workloads import check_spec, split_spec, workload_id
from .zygote import ZygoteKey, ZygotePool

log = logging.getLogger("joulepilot.bench")

# What a warm-start job reports besides its time, kept in the run's `extra.warm_start`.
WARM_START_DETAILS = ("apply_s", "first_call_s", "dynamo_frames", "artifacts", "compile_timers_s", "kernels_built",
                      "max_rel_error")

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
    compile_energy_j: float | None  # GPU part + CPU part
    compile_energy_gpu_j: float | None
    compile_energy_gpu_source: str | None
    compile_energy_cpu_j: float | None
    compile_energy_cpu_source: str | None
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
                 batch_size: int = 1, dynamic: bool = False, options: dict[str, Any] | None = None,
                 regional: Iterable[str | bool] = ("",)) -> list[CompileConfig]:
    """The cross product of modes x fusion presets x precisions x regional settings, in that order,
    without meaningless or duplicate points: eager appears once per precision (fusion presets, options
    and regional compilation do not apply to it), and a preset that only repeats what its mode already
    sets (max-autotune + coordinate-descent) is dropped. `regional`: the `CompileConfig.regional` values
    ('' whole model, 'auto', a block class name). Unknown names raise ConfigError."""
    modes, fusions, precisions = list(modes), list(fusions), list(precisions)
    regionals = list(dict.fromkeys(check_regional(r) for r in regional)) or [""]
    for fusion in fusions:
        if fusion not in FUSION_PRESETS:
            CompileConfig(mode="default", fusion=fusion)  # raises ConfigError naming the closest preset
    planned: list[CompileConfig] = []
    seen: set[str] = set()
    for mode, fusion, precision, regional_setting in itertools.product(modes, fusions, precisions, regionals):
        if mode not in MODES:
            CompileConfig(mode=mode)  # raises with the closest mode
        if mode == "eager":
            config = CompileConfig(mode="eager", precision=precision, dynamic=dynamic, batch_size=batch_size)
        else:
            config = checked_config(CompileConfig(mode=mode, fusion=fusion, options=options or {},
                                                  precision=precision, dynamic=dynamic, batch_size=batch_size,
                                                  regional=regional_setting))
        key = effective_key(config)
        if key in seen:
            continue
        seen.add(key)
        planned.append(config)
    return planned


def _open(db: Store | str | os.PathLike | None) -> tuple[Store, bool]:
    if isinstance(db, Store):
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
    # or "quiet period": the GPU's power over the daemon's wait for an idle device; or "none (estimate)": the
    # only meter is the CPU-time estimate, which counts the worker's own CPU seconds and so draws nothing idle
    idle_from: str = "measured"

    @property
    def provenance_key(self) -> str:
        return self.origin["provenance_key"]


def sweep_context(device: str, idle_s: float, *, quiet_power_w: float | None = None) -> SweepContext:
    """Provenance, metered devices and the idle baseline, taken once per sweep in this process.

    On a GPU only NVML is touched here (no CUDA context in the parent). `quiet_power_w`: the GPU's average
    power over a quiet period just observed (`idle_s` seconds of it, the daemon's wait for an idle device),
    used as the baseline instead of measuring one now. Where every metered device is the CPU-time estimate
    (no RAPL, no NVML), nothing is measured: the estimate counts only the worker's own CPU seconds, so its
    idle draw is 0 W by construction, and waiting `idle_s` to find that out would only delay the sweep."""
    from joulepilot.telemetry import EnergyMeter

    meter = EnergyMeter(device=device)
    try:
        devices = [d.to_dict() for d in meter.devices]
        from_quiet = quiet_power_w is not None and len(devices) == 1 and devices[0].get("kind") == "gpu"
        estimate_only = bool(devices) and all(d.get("source") == "estimate" for d in devices)
        if from_quiet:
            idle = {devices[0]["id"]: float(quiet_power_w)}
        elif estimate_only:
            idle, idle_s = {d["id"]: 0.0 for d in devices}, 0.0
        else:
            idle = meter.measure_idle(seconds=idle_s) if idle_s > 0 else {}
    finally:
        meter.close()
    gpu = next((d for d in devices if d.get("kind") == "gpu"), None)
    if gpu is not None:
        origin = provenance(device, name=gpu.get("name") or None, driver=gpu.get("driver") or None)
    else:
        origin = provenance(device, name=cpu_name())
    return SweepContext(device, origin, devices, dict(idle), float(idle_s),
                        "quiet period" if from_quiet else "none (estimate)" if estimate_only else "measured")


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
    # the further windows the same worker took (`windows` above 1): (row, samples) each, stored with this one
    further: list[tuple[dict[str, Any], list[tuple[float, str, float]]]] = field(default_factory=list)

    @property
    def load_error(self) -> str | None:
        """Why the workload could not be built, when that is how this run failed (LOAD_PHASE): the same for
        every configuration of the workload, unlike a configuration's own failure (a compile error). None
        otherwise."""
        if self.status != "failed" or (self.row.get("extra") or {}).get("phase") != LOAD_PHASE:
            return None
        return (self.reason or "no reason recorded").splitlines()[0]

    def references(self) -> dict[str, Any]:
        """Keyword arguments of `commit_run` for the rows this run points at (and the further windows)."""
        return {"host": host_identity(), "devices": self.devices, "workload": self.workload,
                "config": self.config.to_row(), "further": self.further}


# The worker's phase that builds the workload (imports its module or library, calls its factory, checks what it
# returned). A job that fails there failed for its workload, which every configuration of the sweep shares: the
# next configuration would fail the same way, so a sweep stops there (bench) and the daemon measures no other
# configuration of that workload in the pass.
LOAD_PHASE = "load"


# What a further window of a process does not have of its own: the compile, the warm-up and what they left.
_FIRST_WINDOW_COLUMNS = ("compile_s", "warmup_s", "artifacts_path", "warm_start_s")
_FIRST_WINDOW_EXTRA = ("window", "window_ms_per_call", "window_warning", "latency_calls", "latency_ms_mean",
                       "latency_ms_min", "latency_s", "compile_window", "compile_timers_s", "compile_caches",
                       "artifacts", "describe", "warmup_calls", "peak_memory_window_bytes", "job_wall_s",
                       "warm_start", "warm_start_from")


def further_window_rows(row: dict[str, Any], further: list[dict[str, Any]]
                        ) -> list[tuple[dict[str, Any], list[tuple[float, str, float]]]]:
    """The runs of a process's further windows, from its first run's `row` (completed in place: it now ends
    where the second window starts). Spans tile the job: each window's run lasts until the next one starts,
    the last one until the worker finished. A further window keeps the configuration's numerical check,
    graph breaks and memory, and has no compile, warm-up or compile energy of its own."""
    if not further:
        return []
    ordered = sorted(further, key=lambda w: w["extra"]["window_in_process"])
    ends = [w["started_at"] for w in ordered[1:]] + [row.get("finished_at")]
    rows = []
    for window, finished_at in zip(ordered, ends, strict=True):
        more = {k: v for k, v in row.items() if k not in _FIRST_WINDOW_COLUMNS and not k.startswith("compile_energy")}
        more.update({k: v for k, v in window.items() if k in row or k in ("started_at", "latency_ms_p50",
                                                                          "latency_ms_p95")})
        more["finished_at"] = finished_at
        extra = {k: v for k, v in row["extra"].items() if k not in _FIRST_WINDOW_EXTRA}
        extra.update(window["extra"])
        more["extra"] = extra
        rows.append((more, [tuple(s) for s in window.get("power_samples") or []]))
    row["finished_at"] = ordered[0]["started_at"]
    row["extra"]["windows_in_process"] = len(ordered) + 1
    if isinstance(row["extra"].get("job_wall_s"), float):  # the job's seconds, less its further windows'
        row["extra"]["job_wall_s"] -= further_span_s(rows)
    return rows  # type: ignore[return-value]


def describes_now(device: str, config: CompileConfig, a_later_job_compiles: bool, *,
                  next_job_planned_from_it: bool = False) -> bool:
    """Whether a job of a workload that still needs its description should take it. On a GPU the first job
    that compiles does, where one is to come: describing (FLOP count, graph capture) imports Dynamo, which
    the zygote there imports only after forking a first job that does not compile (the eager baseline), so
    that job does not wait for the import. Elsewhere, or when no job compiles, the first job does. So does the
    first job whose result the next job is chosen from (`next_job_planned_from_it`: a guided search's
    baseline), since the trade-off model predicts from the description: without it the pick after the
    baseline rests on a workload with no size, FLOPs or graph (on an H200 it predicted 0.28 J and 7 s for a
    configuration that took 1.23 J and 26 s, and measured that one first, three windows)."""
    return (next_job_planned_from_it or config.compiles or not str(device).startswith("cuda")
            or not a_later_job_compiles)


def further_span_s(further: list[tuple[dict[str, Any], Any]]) -> float:
    """Seconds the further windows' runs span (each is billed as its own run)."""
    return sum(max(0.0, float(r["finished_at"]) - float(r["started_at"])) for r, _ in further
               if isinstance(r.get("finished_at"), int | float) and isinstance(r.get("started_at"), int | float))


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
                                      "warm_start_caches": warm.get("caches"),
                                      **({"warm_start_cache_bypasses": warm["cache_bypasses"]}
                                         if warm.get("cache_bypasses") else {}),
                                      "warm_start": {k: warm.get(k) for k in WARM_START_DETAILS if k in warm}}
    return None, {"warm_start_error": warm.get("reason")}


def time_warm_start(spec: str, config: CompileConfig, artifacts_path: str, *, context: SweepContext,
                    min_seconds: float, budget_s: float, seq_len: int | None = None, image_size: int | None = None,
                    shapes: ShapeSet | None = None, cancel: CancelCheck | None = None,
                    on_start: Callable[[int], None] | None = None, zygotes: ZygotePool | None = None,
                    worker_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Time a worker with empty compile caches that loads `artifacts_path` (saved by a run of `config`) and
    makes its first call: the worker's result (`warm_start_s` when ok; status 'cancelled' when `cancel`
    stopped it). Used by the daemon for the configurations a decision names. With `shapes`, the first call
    is at the set's first size as the run made it (padded to its bucket), as in `measure_config`."""
    job = {"kind": "warm_start", "spec": spec, "device": context.device, "config": config.to_row(),
           "seq_len": seq_len, "image_size": image_size, "min_seconds": min_seconds,
           "artifacts_path": artifacts_path, "provenance": context.origin}
    if shapes is not None:
        job[shapes.dim] = shapes.run_size(shapes.sizes[0], config.padding)
    env = dict(worker_env) if worker_env is not None else default_worker_env(1)
    return run_worker_job(job, budget=worker_budget(budget_s, min_seconds), cancel=cancel, on_start=on_start,
                          zygotes=zygotes, env=env)


def worker_job_key(spec: str, config: CompileConfig, device: str, seq_len: int | None,
                   image_size: int | None, shapes: ShapeSet | None = None, *,
                   model_options: Mapping[str, Any] | None = None, generation: Generation | None = None
                   ) -> dict[str, Any]:
    """The fields of a worker job that name its workload (what a zygote preloads); with `shapes`, at the
    set's first size, as `measure_config` builds it."""
    key = {"spec": spec, "config": config.to_row(), "device": device, "seq_len": seq_len, "image_size": image_size,
           **generation_job_fields(generation, model_options)}
    if shapes is not None:
        key[shapes.dim] = shapes.sizes[0]
    return key


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
    shapes: ShapeSet | None = None,
    describe: bool = False,
    save_artifacts: bool = True,
    warm_start: bool = False,
    precompile: bool | None = None,
    sample_hz: float = 10.0,
    cancel: CancelCheck | None = None,
    on_start: Callable[[int], None] | None = None,
    on_phase: Callable[[str, str], None] | None = None,
    worker_env: dict[str, str] | None = None,
    zygotes: ZygotePool | None = None,
    windows: int = 1,
    windows_max_rel_error: float | None = None,
    window_gate: Gate | None = None,
    threads: int | None = None,
    model_options: Mapping[str, Any] | None = None,
    generation: Generation | None = None,
    warm_from_run: int | None = None,
) -> MeasuredRun:
    """Measure `spec` under one configuration in a fresh worker (and, with `warm_start`, time a second
    worker loading the saved artifacts). Nothing is written to the database. `warm_from_run`: the id of an
    earlier run of this configuration on this host that saved its artifacts, for a repeat in a fresh process:
    the worker starts from the artifacts saved for this workload, configuration and provenance (the path is
    derived here, never read from a run), so its first call is a warm start (`warm_start_s`), it records no
    compile figures and saves no artifacts; with no such file, or for a shape set or a generation, it compiles
    cold. `precompile` (default:
    $JOULEPILOT_PRECOMPILE, off unless set): the compile also records Dynamo's precompiled frames with the
    artifacts (where torch has caching precompile), so a warm start does not trace the model again. It is
    experimental: a compile or warm start that fails with it is run again without it, and that run is the
    one measured, `extra.precompile_error` saying why.
    With `zygotes`, the workers are forked from the workload's zygote (see `compiler/zygote.py`); the
    run's `extra.job_wall_s` is the wall time of the whole job, zygote start and warm start included.

    The worker runs under `worker_budget(budget_s, min_seconds)`; `cancel` (polled while a worker runs)
    returns a reason to stop, which ends the measurement with status 'cancelled'; `on_phase(kind,
    phase)` hears each phase its workers enter. `columns` are the runs
    table's columns (other result keys go into `extra`). `worker_env`: variables for its workers (see
    `device_pool.worker_env`: the device numbering and, beside other workers, the compile-thread share);
    recorded in the run's `extra.worker_env`, as compile time depends on them. With `shapes`, the worker measures every size of the
    set in turn (`compiler.shapes`): the budget covers every size's first call, and the allowance grows with
    the number of sizes. On the CPU the worker runs torch with `threads` intra-op threads (default:
    `device_pool.cpu_threads`), recorded in `extra.torch_threads` with where the number came from.
    `windows` energy windows are taken in the one worker, each stored as a run of its own, unless its numerical check
    is over `windows_max_rel_error` (the policy's limit): then one; with `window_gate`, each further window only when
    the gate, given the windows so far as runs-table fields, says so (`compiler.window_gate`). `model_options` override the model's config; `generation` measures a generation instead of a forward pass
    (`compiler.generation`: two windows, whole generations and prefills, so a larger allowance)."""
    job_started = time.monotonic()
    device = context.device
    origin = context.origin
    wid = workload_id(spec, config.batch_size, seq_len, image_size, shapes, model_options=model_options,
                      generation=generation)
    windows = 1 if shapes is not None or generation is not None else max(1, int(windows))
    # the allowance grows with the windows the worker takes (each size of a shape set, or further windows)
    budget = worker_budget(budget_s, min_seconds * (len(shapes.sizes) if shapes else 2 if generation else windows))
    if precompile is None:
        precompile = precompile_opted_in()
    artifacts = warm_from = None
    if config.compiles:
        saved = artifact_path_for(wid, config.id, origin["device_name"], origin["torch_version"],
                                  origin["triton_version"] or "")
        if warm_from_run is not None and shapes is None and generation is None and saved.is_file():
            warm_from = str(saved)
        elif save_artifacts:
            artifacts = str(saved)
    job = {
        "kind": "bench", "spec": spec, "device": device, "config": config.to_row(),
        "seq_len": seq_len, "image_size": image_size, "min_seconds": min_seconds,
        "idle_power_w": context.idle_power_w, "sample_hz": sample_hz, "describe": describe,
        "artifacts_path": artifacts, "provenance": origin, "precompile": bool(artifacts) and precompile,
        "windows": windows, "windows_max_rel_error": windows_max_rel_error,
        **generation_job_fields(generation, model_options),
    }
    if warm_from is not None:
        job["warm_from"], job["warm_from_run_id"] = warm_from, warm_from_run
    if device == "cpu":
        job["threads"], job["threads_from"] = cpu_threads(threads)
    if shapes is not None:  # the worker builds the workload at the set's first size, then the others
        job.update({"shapes": shapes.to_dict(), shapes.dim: shapes.sizes[0]})
    env = dict(worker_env) if worker_env is not None else default_worker_env(1)
    gate = window_gate if windows > 1 else None
    result = run_worker_job(job, budget=budget, cancel=cancel, on_start=on_start, on_phase=on_phase, zygotes=zygotes,
                            env=env, window_gate=gate)
    precompile_error = None
    if job["precompile"] and result.get("status") not in ("ok", "cancelled"):
        # Precompile must never cost a configuration its measurement: measure it again, as without it.
        precompile_error = f"compile with precompile: {result.get('reason')}"
        job = dict(job, precompile=False)
        result = run_worker_job(job, budget=budget, cancel=cancel, on_start=on_start, on_phase=on_phase, zygotes=zygotes,
                                env=env, window_gate=gate)
    if result.get("status") == "cancelled":
        return MeasuredRun(config, wid, "cancelled", result.get("reason"))
    if precompile_error:
        result.setdefault("extra", {})["precompile_error"] = precompile_error
    if result.get("status") == "ok" and result.get("artifacts_path") and warm_start:
        warm_job = dict(job, kind="warm_start", artifacts_path=result["artifacts_path"], describe=False)
        if shapes is not None:  # the first size, at the size the configuration ran it (padded to its bucket)
            warm_job[shapes.dim] = shapes.run_size(shapes.sizes[0], config.padding)
        # forked from the zygote where it preloaded this size (a padded size is another workload to a zygote,
        # which would otherwise be closed and started again twice for one warm start)
        same_workload = ZygoteKey.of_job(warm_job) == ZygoteKey.of_job(job)
        warm_zygotes = zygotes if same_workload else None
        warm = run_worker_job(warm_job, budget=budget, cancel=cancel, on_phase=on_phase, zygotes=warm_zygotes, env=env)
        extra = result.setdefault("extra", {})
        if job["precompile"] and warm.get("status") not in ("ok", "cancelled"):
            extra["precompile_error"] = f"warm start with precompile: {warm.get('reason')}"
            warm = run_worker_job(dict(warm_job, precompile=False), budget=budget, cancel=cancel, on_phase=on_phase,
                                  zygotes=warm_zygotes, env=env)
        result["warm_start_s"], warm_extra = warm_start_fields(warm)
        extra.update(warm_extra)
    described = result.get("workload")
    workload = dict(described) if described else {"id": wid, "spec": spec, "batch_size": config.batch_size,
                                                   **workload_columns(generation, model_options)}
    if shapes is not None:  # the worker described the workload at the set's first size
        workload["id"] = wid
    further = result.pop("further_windows", None) or []
    row, samples = _run_row(result, wid=wid, config=config, device=device, origin=origin, columns=columns)
    row["extra"]["idle_s"] = context.idle_s
    row["extra"]["idle_from"] = context.idle_from
    row["extra"]["budget"] = budget.to_dict()
    row["extra"]["worker_env"] = recorded_variables(env)
    row["extra"]["job_wall_s"] = time.monotonic() - job_started
    more = further_window_rows(row, further) if row["status"] == "ok" else []
    return MeasuredRun(config, wid, row["status"], row.get("reason"), row, samples, workload, context.devices,
                       more)


def _stored_run(database: Store, run_id: int) -> dict[str, Any]:
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


def remove_stale_scratch(notice: NoticeFn) -> None:
    """Remove the scratch folders of workers whose bench or daemon was killed, one `notice` line each."""
    for folder in remove_stale_workdirs():
        notice(f"removed {folder}, left by a worker whose bench or daemon was killed")


def _default_notice(text: str) -> None:
    log.warning("%s", text)


def flag_far_from_stored_runs(database: Store, measured: MeasuredRun) -> None:
    """Flag "repeat this run" (`measure.add_flag`) each ok run of `measured` (its further windows too) whose median
    latency is far slower (`measure.far_slower`) than the median over the configuration's unflagged ok runs
    already stored for the same workload on the same kind of device under the same torch (major.minor: another
    torch may be slower, and its runs are never compared with these): a disturbance the run's own checks cannot
    see when every call of it was slowed alike. Only slower: nothing outside a configuration makes it faster."""
    if measured.status != "ok":
        return
    torch_minor = torch_major_minor(measured.row.get("torch_version"))
    earlier = ok_runs_per_config(database, measured.workload_id, device_kind(measured.row),
                                 torch_minor).get(measured.config.id, [])
    latencies = [r.latency_ms_p50 for r in earlier if r.latency_ms_p50 and not r.extra.get("window_warning")]
    if not latencies:
        return
    reference = statistics.median(latencies)
    for row in [measured.row, *(more for more, _samples in measured.further)]:
        latency = row.get("latency_ms_p50")
        if far_slower(latency, reference):
            add_flag(row["extra"], f"calls took {latency:.3g} ms (median) against {reference:.3g} ms, the median of "
                                   f"this configuration's {len(latencies)} earlier run{'s' if len(latencies) != 1 else ''} "
                                   "on this kind of device: something slowed this run (host contention); repeat it "
                                   "before relying on its figures")


def _store_measured(database: Store, spec: str, measured: MeasuredRun, notice: NoticeFn
                    ) -> dict[str, Any]:
    """Commit one measured run (or set it aside when the commit fails); the run as `bench` returns it."""
    flag_far_from_stored_runs(database, measured)
    try:
        outcome = commit_run_or_set_aside(database, measured.row, measured.samples, **measured.references())
    except Exception:
        notice(_lost_run_text(measured))
        raise
    if outcome.run_id is not None:
        return _stored_run(database, outcome.run_id)
    assert outcome.pending_path is not None
    notice(f"{measured.config.label}: the run could not be stored: {outcome.error}; it is kept in "
           f"{outcome.pending_path} and imported the next time bench or the daemon opens this database")
    return _set_aside_view(spec, measured, outcome.pending_path, outcome.error)


def check_devices(devices: Sequence[str]) -> list[str]:
    """`bench --devices`: each one checked as by `check_device`, none twice, GPUs only when there are several
    (one CPU cannot run two measurements without each disturbing the other's)."""
    checked = [check_device(d if not str(d).strip().isdigit() else f"cuda:{str(d).strip()}") for d in devices]
    repeated = sorted({d for d in checked if checked.count(d) > 1})
    if repeated:
        raise ConfigError(f"--devices names {', '.join(repeated)} more than once; one measurement per GPU at a time")
    if len(checked) > 1 and "cpu" in checked:
        raise ConfigError("--devices: cpu cannot share a sweep with other devices (its measurements would disturb "
                          "each other's); give GPU indices like 0,1, or --device cpu")
    return checked


def bench(
    spec: str,
    configs: Sequence[CompileConfig] | None = None,
    *,
    device: str | None = None,
    devices: Sequence[str] | None = None,
    min_seconds: float | None = None,
    budget_s: float = 600.0,
    db: Store | str | os.PathLike | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    image_size: int | None = None,
    shapes: ShapeSet | None = None,
    idle_s: float | None = None,
    warm_start: bool | Callable[[CompileConfig], bool] | None = None,
    save_artifacts: bool = True,
    precompile: bool | None = None,
    sample_hz: float = 10.0,
    threads: int | None = None,
    force: bool = False,
    model_options: Mapping[str, Any] | None = None,
    generation: Generation | None = None,
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
    returned with `skipped: True`) unless `force`. A run that fails while building the workload (its module,
    factory or what that returned: `MeasuredRun.load_error`) ends the sweep there, with one `notice` line:
    every other configuration would fail the same way. A configuration's own failure (a compile error, a
    crash in its first call) is stored and the sweep goes on. `batch_size`, when given, overrides the configs'
    own. On the CPU each worker runs torch with `threads` intra-op threads (default `device_pool.cpu_threads`:
    OMP_NUM_THREADS, else the cores this process may run on), said in one `notice` line. `budget_s` bounds
    each worker's first forward calls (eager reference and cold compile);
    the rest of the worker gets an allowance derived from `min_seconds` (see
    `joulepilot.compiler.budget`). `warm_start` (default: on for GPUs; or a predicate on the config)
    times a second fresh process that loads the saved compile artifacts; `precompile` (default:
    $JOULEPILOT_PRECOMPILE, off unless set) has the compile record Dynamo's precompiled frames with them
    (see `measure_config`). `shapes` measures each
    configuration over a shape set (a weighted mix of input sizes; see `compiler.shapes`), the only case
    where a configuration's `padding` means anything. `model_options` override attributes of a transformers
    config; `generation` (prompt and new tokens) measures a generation instead of a forward pass
    (`compiler.generation`; the default plan is then eager with the dynamic cache and compiled modes with the
    static one; warm starts are not timed for it yet). `stop_before(config)`
    returning True ends the sweep before that configuration (a wall-clock deadline, say).

    `devices` (several GPUs, e.g. ["cuda:0", "cuda:1"]) measures that many configurations at once, one
    per GPU, each metered on its own GPU and stored with it, each worker compiling with its share of the
    cores; a configuration measured ok on any of them is skipped. Runs are stored as they finish, by this
    thread. Without it, `device` (default: cuda:0 when available, else cpu) measures one at a time.

    A run whose commit fails (disk full) is kept in a side file beside the database and imported at
    the next start; it is returned with `pending_path` set and no `run_id`. `notice` receives one line
    per such event (default: a logged warning). Returns the runs (see RunResult), in plan order.
    Raises WorkloadError for a spec that cannot be resolved, ConfigError for a bad configuration or
    device, the telemetry's MeterUnavailable when the device cannot be metered, and the store's
    RunNotStored when a run can be neither committed nor set aside. `progress(index, total, config, run)`
    is called before each configuration (run None) and after it (index + 1, the stored run);
    `phase_progress(index, total, config, doing)` whenever its worker moves on ('compiling',
    'warming up', 'measuring', ...). Both are called from this thread, also with several devices.
    """
    notice = notice or _default_notice
    remove_stale_scratch(notice)
    chosen = check_devices(devices) if devices else [check_device(device or default_device())]
    device = chosen[0]
    on_gpu = device.startswith("cuda")
    split_spec(spec)
    check_spec(spec)
    if configs is None:
        plan = plan_generation_configs if generation is not None else plan_configs
        configs = plan(default_modes(device), precisions=default_precisions(device), batch_size=batch_size or 1)
    configs = [c.replace(batch_size=batch_size) if batch_size and c.batch_size != batch_size else c for c in configs]
    check_workload_request(spec, generation=generation, model_options=model_options, configs=configs,
                           seq_len=seq_len, image_size=image_size, shapes=shapes)
    if generation is not None:  # a generation's warm start (artifacts, first generate call) is not timed yet
        warm_start, save_artifacts = False, False
    if shapes is None and any(c.padding != "none" for c in configs):
        raise ConfigError("padding to buckets needs a shape set to pad: pass shapes=ShapeSet(...) (bench --shapes)")
    min_seconds = default_min_seconds(device) if min_seconds is None else float(min_seconds)
    idle_s = default_idle_s(device) if idle_s is None else float(idle_s)
    wants_warm_start = warm_start if callable(warm_start) else _constant(on_gpu if warm_start is None else warm_start)

    database, owned = _open(db)
    if device == "cpu":  # once the database is open: a refused --db is the only line
        count, source = cpu_threads(threads)
        notice(f"torch runs on {count} thread{'s' if count != 1 else ''} on the CPU ({source}; --threads N to change)")
    stack = contextlib.ExitStack()
    try:
        # runs an earlier commit could not store, windows a deployment could not write
        for line, _kept in import_side_files(database).notes():
            notice(line)
        zygotes = stack.enter_context(ZygotePool())  # one for the sweep, a zygote per device in it
        sweep = _Sweep(spec, configs, database=database, force=force, progress=progress, notice=notice,
                       stop_before=stop_before, phase_progress=phase_progress,
                       measure_kwargs={"min_seconds": min_seconds, "budget_s": budget_s, "seq_len": seq_len,
                                       "image_size": image_size, "shapes": shapes, "save_artifacts": save_artifacts,
                                       "precompile": precompile, "sample_hz": sample_hz, "threads": threads,
                                       "model_options": model_options, "generation": generation},
                       wants_warm_start=wants_warm_start, zygotes=zygotes)
        if on_gpu and configs:  # the zygotes' CPU work does not disturb the GPUs' idle power: overlap them
            for each in chosen:
                start_zygote_early(zygotes, worker_job_key(spec, configs[0], each, seq_len, image_size, shapes,
                                                           model_options=model_options, generation=generation),
                                   default_worker_env(len(chosen)))
        if len(chosen) > 1:
            return sweep.on_devices(chosen, idle_s)
        return sweep.one_at_a_time(sweep_context(device, idle_s))
    finally:
        stack.close()  # the zygotes, if any were started
        if owned:
            database.close()


@dataclass
class _Sweep:
    """One `bench` call's configurations and the callbacks it reports to."""

    spec: str
    configs: list[CompileConfig]
    database: Store
    force: bool
    progress: ProgressFn | None
    notice: NoticeFn
    stop_before: Callable[[CompileConfig], bool] | None
    phase_progress: PhaseProgressFn | None
    measure_kwargs: dict[str, Any]
    wants_warm_start: Callable[[CompileConfig], bool]
    zygotes: ZygotePool | None = None  # shared by the sweep's devices (each device has its own zygote in it)

    def _workload_id(self, config: CompileConfig) -> str:
        return workload_id(self.spec, config.batch_size, self.measure_kwargs["seq_len"],
                           self.measure_kwargs["image_size"], self.measure_kwargs.get("shapes"),
                           model_options=self.measure_kwargs.get("model_options"),
                           generation=self.measure_kwargs.get("generation"))

    def _already_measured(self, index: int, config: CompileConfig, contexts: Sequence[SweepContext]
                          ) -> dict[str, Any] | None:
        """The stored ok run that makes measuring `config` again unnecessary (reported as skipped), if any."""
        if self.force:
            return None
        wid = self._workload_id(config)
        for context in contexts:
            done = find_ok_run(self.database, workload_id=wid, config_id=config.id,
                               provenance_key=context.provenance_key, device=context.device)
            if done is not None:
                stored = _stored_run(self.database, done)
                stored["skipped"] = True
                if self.progress:
                    self.progress(index + 1, len(self.configs), config, stored)
                return stored
        return None

    def _on_phase(self, index: int, config: CompileConfig) -> Callable[[str, str], None] | None:
        if self.phase_progress is None:
            return None
        report = self.phase_progress

        def on_phase(kind: str, phase: str) -> None:
            report(index, len(self.configs), config, phase_text(kind, phase))

        return on_phase

    def _measure(self, config: CompileConfig, context: SweepContext, *, columns: set[str], describe: bool,
                 **kwargs: Any) -> MeasuredRun:
        return measure_config(self.spec, config, context=context, columns=columns, describe=describe,
                              warm_start=self.wants_warm_start(config), zygotes=self.zygotes, **self.measure_kwargs,
                              **kwargs)

    def one_at_a_time(self, context: SweepContext) -> list[dict[str, Any]]:
        columns = run_columns(self.database)
        runs: list[dict[str, Any]] = []
        for index, config in enumerate(self.configs):
            if self.stop_before is not None and self.stop_before(config):
                break
            skipped = self._already_measured(index, config, [context])
            if skipped is not None:
                runs.append(skipped)
                continue
            if self.progress:
                self.progress(index, len(self.configs), config, None)
            describe = workload_needs_description(self.database, self._workload_id(config)) and describes_now(
                context.device, config, any(later.compiles for later in self.configs[index + 1:]))
            measured = self._measure(config, context, columns=columns, describe=describe,
                                     on_phase=self._on_phase(index, config))
            stored = _store_measured(self.database, self.spec, measured, self.notice)
            runs.append(stored)
            if self.progress:
                self.progress(index + 1, len(self.configs), config, stored)
            if measured.load_error is not None:
                self._stopped_at_load_error(measured, len(self.configs) - index - 1)
                break
        return runs

    def _stopped_at_load_error(self, measured: MeasuredRun, left: int) -> None:
        """One line for a sweep that stops because its workload could not be built."""
        if left:
            self.notice(f"stopped: the workload could not be built ({measured.config.label} failed while loading "
                        f"it), which no configuration changes; the other {left} configuration"
                        f"{'s were' if left != 1 else ' was'} not measured; fix the workload and run bench again")

    def on_devices(self, devices: list[str], idle_s: float) -> list[dict[str, Any]]:
        """The configurations in plan order over `devices`, one running per device; each run stored here as
        it finishes. An error, Ctrl-C or SIGTERM stops every worker before it propagates."""
        pool = DevicePool(devices)
        stop = threading.Event()
        env = default_worker_env(pool.concurrent)
        columns = run_columns(self.database)
        contexts = self._contexts(pool, idle_s)
        by_index: dict[int, dict[str, Any]] = {}
        pending = list(enumerate(self.configs))
        describing: set[str] = set()
        total = len(self.configs)

        def cancelled() -> str | None:
            return "the sweep was stopped" if stop.is_set() else None

        try:
            while True:
                for device in pool.free():
                    item = self._next_to_measure(pending, contexts, by_index)
                    if item is None:
                        break
                    index, config = item
                    wid = self._workload_id(config)
                    describe = wid not in describing and workload_needs_description(self.database, wid) \
                        and describes_now(device, config, any(later.compiles for _, later in pending))
                    if describe:
                        describing.add(wid)
                    if self.progress:
                        self.progress(index, total, config, None)
                    key = (index, config, wid)

                    def measure(device: str = device, config: CompileConfig = config, key: Any = key,
                                describe: bool = describe) -> MeasuredRun:
                        return self._measure(config, contexts[device], describe=describe, columns=columns,
                                             cancel=cancelled, worker_env=env,
                                             on_phase=lambda kind, phase: pool.post(device, key, "phase",
                                                                                    (kind, phase)))

                    pool.start(device, key, measure)
                if not pool.running():
                    break
                event = pool.next_event(timeout=1.0)
                if event is None:
                    continue
                index, config, wid = event.key
                if not isinstance(event, Finished):
                    if self.phase_progress is not None:
                        self.phase_progress(index, total, config, phase_text(*event.value))
                    continue
                describing.discard(wid)
                if event.error is not None:
                    raise event.error
                if event.result.status == "cancelled":  # stopped below, after another GPU's load error
                    continue
                stored = _store_measured(self.database, self.spec, event.result, self.notice)
                by_index[index] = stored
                if self.progress:
                    self.progress(index + 1, total, config, stored)
                if event.result.load_error is not None and not stop.is_set():
                    # the workload cannot be built: stop what runs on the other GPUs, start nothing more
                    stop.set()
                    self._stopped_at_load_error(event.result, len(pending) + len(pool.running()))
                    pending.clear()
        except BaseException:
            stop.set()
            _drain(pool)
            raise
        return [by_index[i] for i in sorted(by_index)]

    def _contexts(self, pool: DevicePool, idle_s: float) -> dict[str, SweepContext]:
        """Each device's provenance and idle baseline, all devices at once."""
        for device in pool.devices:
            pool.start(device, device, lambda device=device: sweep_context(device, idle_s))
        contexts: dict[str, SweepContext] = {}
        error: BaseException | None = None
        while pool.running():
            event = pool.next_event(timeout=1.0)
            if isinstance(event, Finished):
                if event.error is not None:
                    error = error or event.error
                else:
                    contexts[event.device] = event.result
        if error is not None:
            raise error
        return contexts

    def _next_to_measure(self, pending: list[tuple[int, CompileConfig]], contexts: dict[str, SweepContext],
                         by_index: dict[int, dict[str, Any]]) -> tuple[int, CompileConfig] | None:
        """The next configuration to hand to a free device; skipped ones are answered from the store on the
        way. None when none is left or `stop_before` ends the sweep."""
        while pending:
            index, config = pending[0]
            if self.stop_before is not None and self.stop_before(config):
                pending.clear()
                return None
            pending.pop(0)
            skipped = self._already_measured(index, config, list(contexts.values()))
            if skipped is None:
                return index, config
            by_index[index] = skipped
        return None


def _drain(pool: DevicePool, timeout_s: float = 60.0) -> None:
    """Wait for the measurements still running (told to stop) to end, their workers killed."""
    deadline = time.monotonic() + timeout_s
    while pool.running() and time.monotonic() < deadline:
        pool.next_event(timeout=0.5)
