"""The benchmark worker: measures one configuration in a process of its own.

Run as `python -m joulepilot.compiler.worker JOB.json` (or with the job on stdin), or in a process forked
from a workload's zygote (`--zygote SETUP.json`, see zygote_server.py), which calls `main` the same way.
The job is a JSON object (see `compiler/runner.py`, which writes it); the result is written as JSON to
`job["result_path"]`, and the phase reached so far is appended to `job["phase_path"]` so the parent can
tell a compile that overran its budget from a slow measurement. Kinds of job:

- "bench": load the workload, eager fp32 reference, apply the configuration, cold first call (compile,
  metered on the GPU and on the CPU that compiles: `compile_meter`), warm-up, latency pass, energy window,
  numerical check, optional artifact save and description.
- "warm_start": load saved artifacts into this (fresh) process's caches, then time applying the
  configuration and its first call (see `compiler.warmstart`).
- "bench" with `warm_from` (the artifacts an earlier run of the configuration saved): a repeat in a fresh
  process that starts from them, as a serving process does, and measures as any bench job; its first call is a
  warm start (`warm_start_s`), so it records no compile figures of its own (`extra.warm_start_from` names the
  run whose artifacts it loaded). Artifacts that cannot be loaded leave a cold compile, measured as one
  (`extra.warm_start_error`).
- "bench" of a generation (the job has `generation`): the same meters and phases, a generation's windows
  (`compiler/generation.py`).
- "doctor": graph breaks, graphs, recompiles and eager time of a workload (`compiler/doctor.py`).

The parent gives each job fresh TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR folders, so the first
call's time is a cold compile. The worker dies with its parent (`bench`, the daemon, or the zygote,
which dies with them): a SIGKILL of `bench` or the daemon leaves no measurement running on.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from . import window_gate
from .budget import windows_taken
from .cache_bypass import recording_cache_bypasses
from .graph_breaks import recording_graph_breaks

OOM_REASON = "out of memory"
PR_SET_PDEATHSIG = 1
PARENT_GONE_EXIT = 125


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), then make sure the parent
    did not die before the request took effect. Inductor's compile workers watch their own parent."""
    if not parent_pid:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(parent_pid):
        os._exit(PARENT_GONE_EXIT)


class Phases:
    """Appends 'name<TAB>time' lines the parent reads to know where a job is."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.current = "start"

    def enter(self, name: str) -> None:
        self.current = name
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(f"{name}\t{time.time()}\n")


def untraced(call: Callable[[], Any]) -> Callable[[], Any]:
    """`call` run with this thread's Python trace function (sys.settrace) taken off for its duration.

    For every call of the configuration's model: a trace function (coverage.py's, when the test suite
    measures this worker) makes Dynamo convert frames it otherwise never sees, which would change the
    recorded frame counts (graph breaks, recompiles), and it slows the Python-heavy compile and the timed
    calls."""

    def run() -> Any:
        trace = sys.gettrace()
        if trace is None:
            return call()
        sys.settrace(None)
        try:
            return call()
        finally:
            sys.settrace(trace)

    return run


def _peak_memory_bytes(device: str) -> int:
    import torch

    if str(device).startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux


def _dynamo_counters() -> Any | None:
    """Dynamo's counters, or None when this process never imported Dynamo: then nothing was compiled and every
    count is zero. An eager run does not import it, which takes about a second of CPU."""
    utils = sys.modules.get("torch._dynamo.utils")
    return None if utils is None else utils.counters


def _dynamo_counts() -> tuple[int, int]:
    """(graphs Dynamo handed to the backend so far, frames Dynamo has compiled so far); zeros when
    Dynamo was never imported (nothing was compiled)."""
    counters = _dynamo_counters()
    if counters is None:
        return 0, 0
    return int(counters["stats"]["unique_graphs"]), int(counters["frames"]["total"])


def _cache_counters() -> dict[str, int]:
    """Inductor FX-graph and AOTAutograd cache hits, misses and bypasses so far (shows whether a warm start
    hit)."""
    counters = _dynamo_counters()
    if counters is None:
        return {}
    wanted = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass", "autograd_cache_hit",
              "autograd_cache_miss", "autograd_cache_bypass")
    found = {**counters["inductor"], **counters["aot_autograd"]}
    return {k: int(found[k]) for k in wanted if found.get(k)}


def _open_meter(device: str, sample_hz: float) -> Any:
    from joulepilot.telemetry import EnergyMeter

    return EnergyMeter(device=device, sample_hz=sample_hz)


# Back-to-back calls should be at least as fast as synchronised ones; a window much slower than the
# latency pass was disturbed by something the pass was not (seen once on an H200: ResNet-50 eager bf16
# ran 8.6 ms a call in the window against a 5.9 ms p50), so its energy per call deserves a repeat.
WINDOW_SLOWDOWN_WARN = 1.25


def _check_window_pace(window_ms: float, p50_ms: float | None, extra: dict[str, Any],
                       latency_source: str = "latency_pass") -> None:
    """Flag a window whose calls took much longer on average than the median latency: a stall (host
    contention, launch stalls) the energy per inference would carry. The median comes from the separate
    synchronised pass, or, on a synchronous device, from the window's own calls."""
    from .measure import add_flag

    extra["window_ms_per_call"] = window_ms
    if p50_ms and window_ms > WINDOW_SLOWDOWN_WARN * p50_ms:
        median = "median of its own calls" if latency_source == "window" else "synchronised p50"
        add_flag(extra, f"calls took {window_ms:.3g} ms each in the energy window, {window_ms / p50_ms:.2f}x the "
                        f"{median} of {p50_ms:.3g} ms; something slowed the window (host contention, launch "
                        "stalls): repeat this run before relying on its energy per inference")


def _above_idle_j(measurement: Any, idle_power_w: dict[str, float]) -> float | None:
    if not idle_power_w:
        return getattr(measurement, "energy_above_idle_j", None)
    total = 0.0
    for dev in measurement.devices:
        if dev.device not in idle_power_w:
            return None
        total += max(0.0, dev.energy_j - idle_power_w[dev.device] * dev.duration_s)
    return total


def _idle_sum(measurement: Any, idle_power_w: dict[str, float]) -> float | None:
    values = [idle_power_w.get(dev.device) for dev in measurement.devices]
    if not values or any(v is None for v in values):
        return None
    return float(sum(values))


def _peak_power(measurement: Any) -> float | None:
    peak = getattr(measurement, "peak_power_w", None)
    if peak is not None:
        return peak
    peaks = [d.peak_power_w for d in measurement.devices if d.peak_power_w is not None]
    return max(peaks) if peaks else None


def _windows(job: dict[str, Any], max_rel_error: float | None) -> int:
    """How many energy windows the job takes in this process (`windows`, default 1; `budget.windows_taken` with
    the job's `windows_max_rel_error`)."""
    try:
        windows = max(1, int(job.get("windows") or 1))
    except (TypeError, ValueError):
        return 1
    bound = job.get("windows_max_rel_error")
    return windows_taken(windows, max_rel_error, float(bound) if isinstance(bound, int | float) else None)


def _window_fields(window: Any, calls: int, batch_size: int, idle: dict[str, float]) -> dict[str, Any]:
    """The runs-table columns an energy window of `calls` forward calls gives."""
    energy = window.energy_j
    above = _above_idle_j(window, idle)
    return {
        "window_s": window.duration_s,
        "inferences": calls,
        "throughput_per_s": batch_size * calls / window.duration_s,
        "energy_j": energy,
        "energy_j_per_inference": energy / calls,
        "energy_above_idle_j": above,
        "energy_above_idle_j_per_inference": None if above is None else above / calls,
        "idle_power_w": _idle_sum(window, idle),
        "avg_power_w": energy / window.duration_s if window.duration_s > 0 else None,
        "peak_power_w": _peak_power(window),
        "energy_source": "+".join(window.sources) if window.sources else None,
    }


def gate_allows(job: dict[str, Any], index: int, result: dict[str, Any], timed: Any, further: list[Any],
                batch_size: int, idle: dict[str, float], phases: Any) -> bool:
    """Whether to take further window `index`: always without a gate (`job["window_gate"]`), else what the parent
    answers, asked with the windows so far (`compiler.window_gate`)."""
    if not job.get("window_gate"):
        return True
    phases.enter("window_gate")
    so_far = [_first_window_fields(result, timed, batch_size, idle),
              *({**_further_window(*each, batch_size=batch_size, idle=idle), "status": "ok"} for each in further)]
    return window_gate.ask(Path(job["result_path"]).parent, index, so_far)


def _first_window_fields(result: dict[str, Any], timed: Any, batch_size: int, idle: dict[str, float]) -> dict[str, Any]:
    """The process's first window as the runs-table fields the window gate is asked with (`compiler.window_gate`):
    the compile's and the numerical check's figures, its latencies and energy window, its pace warning, and the
    run it warm-started from."""
    window = timed.measurement
    fields = {"status": "ok", **{k: result.get(k) for k in ("compile_s", "compile_energy_j", "max_rel_error")},
              **timed.latency_columns(), **_window_fields(window, timed.calls, batch_size, idle)}
    # a process that warm-started compiled nothing: the judge amortises it with its configuration's cold compile
    extra: dict[str, Any] = {k: v for k, v in result["extra"].items() if k == "warm_start_from"}
    _check_window_pace(window.duration_s * 1000.0 / timed.calls, fields.get("latency_ms_p50"), extra,
                       timed.latency_source)
    fields["extra"] = extra
    return fields


def _further_window(index: int, started_at: float, timed: Any, finished_at: float, batch_size: int,
                    idle: dict[str, float]) -> dict[str, Any]:
    """A further window of the process (a `TimedWindow`), as its own run's fields (the parent completes the
    row)."""
    window = timed.measurement
    extra: dict[str, Any] = {"window_in_process": index, **timed.latency_extra(),
                             "window": {"devices": [d.to_dict() for d in window.devices]}}
    fields = {"started_at": started_at, "finished_at": finished_at, **timed.latency_columns(),
              **_window_fields(window, timed.calls, batch_size, idle)}
    _check_window_pace(window.duration_s * 1000.0 / timed.calls, fields["latency_ms_p50"], extra,
                       timed.latency_source)
    fields["extra"] = extra
    fields["power_samples"] = [list(s) for s in getattr(window, "samples", [])]
    return fields


def origin_fields(job: dict[str, Any], device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run's provenance: (its runs-table columns, what its `extra.provenance` keeps), from the job's
    provenance (the sweep's) or this process's own."""
    from .provenance import provenance

    origin = job.get("provenance") or provenance(device)
    columns = {k: v for k, v in origin.items()
               if k in ("device_name", "driver_version", "torch_version", "triton_version", "joulepilot_version",
                        "provenance_key", "host_id")}
    return columns, {k: origin[k] for k in ("hostname", "cuda_version", "python_version")}


def record_compile_facts(result: dict[str, Any], config: Any, device: str, breaks: Any, frames_after_first: int,
                         threads_from: str | None = None) -> None:
    """What a run records of its compile, once measuring is done: graph breaks, recompiles since the first
    call, the torch.compile arguments, threads and cache hits."""
    import torch

    from . import inductor

    extra = result["extra"]
    _, frames = _dynamo_counts()
    # Breaks are a property of the model under this configuration: each place Dynamo broke the graph in
    # the first call, as `joulepilot doctor` lists them; graphs compiled later are recompiles.
    result["graph_breaks"] = len(breaks.breaks)
    result["recompiles"] = max(0, frames - frames_after_first)
    extra["dynamo_frames_first_call"] = frames_after_first
    if breaks.breaks:
        extra["graph_breaks"] = breaks.to_list()
    extra["torch_compile_kwargs"] = inductor.torch_compile_kwargs(config, device)
    extra["torch_threads"] = torch.get_num_threads()
    if threads_from:
        extra["torch_threads_from"] = threads_from
    extra["compile_caches"] = _cache_counters()
    if config.compiles and not str(device).startswith("cuda") and config.mode in ("reduce-overhead", "max-autotune"):
        extra["note"] = "CUDA graphs do not apply on a CPU device; they were left out"


def run_bench(job: dict[str, Any], phases: Phases) -> dict[str, Any]:
    import torch

    from .apply import apply_config
    from .artifacts import count_kernels, kernel_cache_dirs, save_warm_start
    from .compile_meter import CompileWindow
    from .config import CompileConfig
    from .measure import (
        add_flag,
        is_synchronous,
        latencies_and_window,
        synchronizer,
        thread_probe,
        timed_call,
        warm_up,
    )
    from .numerics import numeric_check
    from .precision import strict_fp32
    from .regional import describe_regional
    from .shapes import ShapeSetRun
    from .warmstart import compile_timers, enable_precompile
    from .workloads import load_workload

    device = job["device"]
    config = CompileConfig.from_row(job["config"])
    min_seconds = float(job["min_seconds"])
    result: dict[str, Any] = {"extra": {}}
    extra = result["extra"]
    columns, extra["provenance"] = origin_fields(job, device)
    result.update(columns)
    warm = None
    if config.compiles and job.get("warm_from"):
        phases.enter("load_artifacts")
        try:
            warm = _loaded_artifacts(job["warm_from"])
            why = None if warm.info is not None else "nothing could be loaded"
        except Exception as exc:  # a damaged file costs the warm start, never the measurement
            warm, why = None, f"{type(exc).__name__}: {exc}"
        if why is not None:
            extra["warm_start_error"] = f"artifacts {job['warm_from']}: {why}; compiled cold"
            warm = None

    phases.enter("load")
    workload = load_workload(job["spec"], batch_size=config.batch_size, device=device,
                             seq_len=job.get("seq_len"), image_size=job.get("image_size"),
                             seed=int(job.get("seed", 1234)), model_options=job.get("model_options"))
    model, inputs = workload.model, workload.example_inputs
    shape_run = ShapeSetRun.from_job(job, config, device)  # None unless the job measures a shape set
    if shape_run is not None:
        inputs = shape_run.first_inputs(inputs)
    sync = synchronizer(device)

    phases.enter("reference")
    with torch.no_grad(), strict_fp32():
        reference = model(*inputs)
    sync()

    meter = _open_meter(device, float(job.get("sample_hz", 10.0)))
    try:
        idle = take_idle_baseline(meter, job, phases, extra)

        if str(device).startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(torch.device(device))
        if config.compiles and job.get("precompile"):
            extra["precompile"] = enable_precompile()
        run = apply_config(config, model, device)
        if run.regional is not None:
            extra["regional"] = describe_regional(run.regional)
        call = untraced(lambda: run(*inputs))

        phases.enter("compile")
        with CompileWindow(meter) as compile_metered, recording_graph_breaks() as breaks, \
                recording_cache_bypasses() as bypasses:
            output, compile_s = timed_call(call, sync)
        if bypasses:
            extra["compile_cache_bypasses"] = bypasses
        phases.enter("compiled")
        compile_window = compile_metered.record
        if warm is None:
            result["compile_s"] = compile_s
            result.update(compile_metered.columns)
        else:  # a warm start, not a compile: the configuration's compile figures are its cold runs'
            result["warm_start_s"] = warm.load_s + compile_s
            extra["warm_start_from"] = job.get("warm_from_run_id")
            extra["warm_start"] = {"artifacts_load_s": warm.load_s, "first_call_s": compile_s,
                                   "kernels_built": count_kernels() - warm.kernels, "artifacts": warm.info.to_dict()}
        check = numeric_check(output, reference)
        result["max_rel_error"] = check.max_rel_error
        if check.note:
            extra["numeric_check"] = check.note
        del output
        _, frames_after_first = _dynamo_counts()
        extra["compile_timers_s"] = compile_timers()

        phases.enter("warmup")
        warm_calls, warmup_s = warm_up(call, sync, max_s=float(job.get("warmup_max_s") or max(2.0, min_seconds)))
        result["warmup_s"] = warmup_s
        extra["warmup_calls"] = warm_calls

        probe = None
        if is_synchronous(device) and run.regional is None:
            # The workload's eager calls on the worker's threads and on one (a regional configuration compiled the
            # model's blocks in place: it has no eager call left to time)
            def eager() -> Any:
                with torch.no_grad():
                    return model(*inputs)

            probe = thread_probe(untraced(eager), torch.get_num_threads())
            extra["thread_probe"] = probe.to_dict()

        latency_s = float(job.get("latency_s") or max(0.25, min(min_seconds / 2.0, 3.0)))
        peak_before_window = 0

        def before_window() -> None:
            nonlocal peak_before_window
            peak_before_window = _peak_memory_bytes(device)
            if not is_synchronous(device):
                torch.cuda.reset_peak_memory_stats(torch.device(device))

        timed = latencies_and_window(call, sync, meter, device=device, min_seconds=min_seconds, latency_s=latency_s,
                                     phases=phases, before_window=before_window)
        latencies, calls, window = timed.latencies_ms, timed.calls, timed.measurement
        result.update(timed.latency_columns())
        extra.update(timed.latency_extra())
        if shape_run is not None:
            shape_run.record_first(compile_s=compile_s, compile_window=compile_metered, max_rel_error=check.max_rel_error,
                                   latencies=latencies, window=window, calls=calls)
            shape_run.measure_rest(model=model, make_call=lambda args: untraced(lambda: run(*args)), meter=meter,
                                   sync=sync, phases=phases, min_seconds=min_seconds, latency_s=latency_s,
                                   warmup_max_s=float(job.get("warmup_max_s") or max(2.0, min_seconds)))
        peak_window = _peak_memory_bytes(device)
        further = []
        for index in range(2, _windows(job, check.max_rel_error) + 1) if shape_run is None else ():
            # A further window of this process (a repeat the search asked for without another compile): its
            # own latencies and energy window, stored as a run of its own; with a gate, only if the parent says so.
            if not gate_allows(job, index, result, timed, further, config.batch_size, idle, phases):
                break
            started_at = time.time()
            more = latencies_and_window(call, sync, meter, device=device, min_seconds=min_seconds,
                                        latency_s=latency_s, phases=phases)
            further.append((index, started_at, more, time.time()))
    finally:
        meter.close()

    record_compile_facts(result, config, device, breaks, frames_after_first, threads_from=job.get("threads_from"))
    result.update(_window_fields(window, calls, config.batch_size, idle))
    result["peak_memory_bytes"] = max(peak_before_window, peak_window)
    _check_window_pace(window.duration_s * 1000.0 / calls, result.get("latency_ms_p50"), extra,
                       timed.latency_source)
    if probe is not None:
        # an eager fp32 configuration's call is the probe's: its window's median is compared with one thread too
        same_call = config.mode == "eager" and config.precision == "fp32" and shape_run is None
        warning = probe.warning(result.get("latency_ms_p50") if same_call else None)
        if warning:
            add_flag(extra, warning)
    if shape_run is not None:
        shape_run.fold(result)
    extra["peak_memory_window_bytes"] = peak_window
    extra["window"] = {"devices": [d.to_dict() for d in window.devices]}
    extra["compile_window"] = compile_window
    result["power_samples"] = [list(s) for s in getattr(window, "samples", [])]
    if further:
        result["further_windows"] = [_further_window(*each, batch_size=config.batch_size, idle=idle) for each in further]

    if config.compiles and job.get("artifacts_path"):
        phases.enter("save_artifacts")
        try:
            # The parent gave this job fresh Inductor and Triton cache folders: their kernels are this compile's.
            saved = save_warm_start(job["artifacts_path"], kernels_from=kernel_cache_dirs())
            result["artifacts_path"] = str(saved.path) if saved else None
            if saved:
                extra["artifacts"] = saved.to_dict()
                if saved.precompile_error:
                    extra["precompile_error"] = f"saving precompiled frames: {saved.precompile_error}"
        except Exception as exc:  # a warm start is a bonus; its failure never fails the run
            extra["artifacts_error"] = f"{type(exc).__name__}: {exc}"

    if job.get("describe"):
        phases.enter("describe")
        try:
            described = workload.describe(with_details=True)
            extra["describe"] = described.pop("details", {})
            result["workload"] = described
        except Exception as exc:
            extra["describe_error"] = f"{type(exc).__name__}: {exc}"
    result["status"] = "ok"
    return result


class LoadedArtifacts(NamedTuple):
    info: Any  # `artifacts.ArtifactsInfo`, or None when nothing could be loaded
    load_s: float
    kernels: int  # kernel binaries in this process's caches after loading (unpacked, or copied from the host)


def _loaded_artifacts(path: str) -> LoadedArtifacts:
    """Saved artifacts loaded into this (fresh) process's caches, before anything compiles."""
    from .artifacts import count_kernels, load_warm_start

    started = time.perf_counter()
    info = load_warm_start(path)
    return LoadedArtifacts(info, time.perf_counter() - started, count_kernels())


def run_warm_start(job: dict[str, Any], phases: Phases) -> dict[str, Any]:
    """A fresh process's start from saved artifacts. `warm_start_s`, to set against the cold `compile_s`,
    counts loading them (kernel binaries, cache entries), applying the configuration (where precompiled
    frames are installed) and the first call; building the model is left out, as it is from `compile_s`.
    torch._dynamo is imported before the clock starts: the cold run's torch.compile imported it before
    its timed first call too."""
    import torch
    import torch._dynamo  # noqa: F401

    from .apply import apply_config
    from .artifacts import count_kernels
    from .config import CompileConfig
    from .measure import synchronizer, timed_call
    from .numerics import numeric_check
    from .precision import strict_fp32
    from .warmstart import compile_timers
    from .workloads import load_workload

    device = job["device"]
    config = CompileConfig.from_row(job["config"])
    phases.enter("load_artifacts")
    warm = _loaded_artifacts(job["artifacts_path"])
    loaded, load_s, present = warm.info, warm.load_s, warm.kernels
    if loaded is None:
        raise RuntimeError(f"no artifacts could be loaded from {job['artifacts_path']}")
    phases.enter("load")
    workload = load_workload(job["spec"], batch_size=config.batch_size, device=device,
                             seq_len=job.get("seq_len"), image_size=job.get("image_size"),
                             seed=int(job.get("seed", 1234)), model_options=job.get("model_options"))
    sync = synchronizer(device)
    phases.enter("reference")
    with torch.no_grad(), strict_fp32():  # to check that the loaded code computes what the model does
        reference = workload.model(*workload.example_inputs)
    phases.enter("compile")
    sync()
    started = time.perf_counter()
    # A warm start measured again without precompile (its first try failed with it) leaves the frames unused.
    use_precompile = loaded.precompile and job.get("precompile", True) is not False
    with recording_cache_bypasses() as bypasses:
        run = apply_config(config, workload.model, device, precompile=use_precompile)
        apply_s = time.perf_counter() - started
        output, first_call_s = timed_call(untraced(lambda: run(*workload.example_inputs)), sync)
    phases.enter("compiled")
    _, frames = _dynamo_counts()
    return {"status": "ok", "warm_start_s": load_s + apply_s + first_call_s, "artifacts_load_s": load_s,
            "caches": _cache_counters(), "cache_bypasses": bypasses, "apply_s": apply_s, "first_call_s": first_call_s,
            "dynamo_frames": frames, "artifacts": loaded.to_dict(), "compile_timers_s": compile_timers(),
            # What is in the job's cache folders beyond what was there after loading was built now.
            "kernels_built": count_kernels() - present,
            "max_rel_error": numeric_check(output, reference).max_rel_error}


def _failure(exc: BaseException, phase: str) -> dict[str, Any]:
    import torch

    tail = "".join(traceback.format_exception(exc)).strip().splitlines()[-8:]
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        reason = f"{OOM_REASON} during {phase}: {str(exc).splitlines()[0] if str(exc) else ''}"
    else:
        reason = f"{type(exc).__name__} during {phase}: {exc}".strip()
    return {"status": "failed", "reason": reason[:2000], "traceback_tail": tail, "phase": phase}



def take_idle_baseline(meter: Any, job: dict[str, Any], phases: Any, extra: dict[str, Any]) -> dict[str, float]:
    """Give `meter` the job's idle power (the sweep's baseline), or measure it for `idle_s` seconds, record in
    `extra` which devices are metered, and return the idle power by device."""
    idle = job.get("idle_power_w") or {}
    if idle:
        meter.set_idle_power_w(idle)
    elif float(job.get("idle_s", 0)) > 0:
        phases.enter("idle")
        idle = dict(meter.measure_idle(seconds=float(job["idle_s"])))
    extra["idle_power_by_device_w"] = idle
    extra["metered_devices"] = [d.id for d in meter.devices]
    # The device name is the same for every card of a kind; the UUID tells two runs' cards apart.
    extra["device_uuids"] = {d.id: d.uuid for d in meter.devices if d.uuid}
    # The card's enforced power limit (read, never set): no configuration can average above it.
    limits = {d.id: d.power_limit_w for d in meter.devices if d.power_limit_w}
    if limits:
        extra["power_limit_w"] = limits
    return idle


def set_threads(job: dict[str, Any]) -> None:
    """torch's intra-op threads as the job gives them (`threads`: set for a CPU job, see
    `device_pool.cpu_threads`); a job without them keeps torch's own default."""
    if job.get("threads"):
        import torch

        torch.set_num_threads(max(1, int(job["threads"])))


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    phases = Phases(job.get("phase_path"))
    started = time.time()
    try:
        set_threads(job)
        kind = job.get("kind", "bench")
        if kind == "doctor":
            from .doctor import run_doctor_job

            result = run_doctor_job(job, phases)
        elif kind == "bench" and job.get("generation"):
            from .generation import run_generation

            result = run_generation(job, phases)
        else:
            result = run_warm_start(job, phases) if kind == "warm_start" else run_bench(job, phases)
    except Exception as exc:
        result = _failure(exc, phases.current)
    result["started_at"] = started
    result["finished_at"] = time.time()
    return result


def write_result(result: dict[str, Any], path: str) -> None:
    target = Path(path)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(result, default=str, allow_nan=True))
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--zygote":  # a workload's zygote, which forks a worker per job (zygote_server.py)
        from .zygote_server import serve

        return serve(args[1], main)
    job = json.loads(Path(args[0]).read_text() if args and args[0] != "-" else sys.stdin.read())
    die_with_parent(job.get("parent_pid"))
    result = run_job(job)
    if job.get("result_path"):
        write_result(result, job["result_path"])
    else:
        print(json.dumps(result, default=str))
    return 0 if result.get("status") == "ok" else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk; skip interpreter teardown, where compile-worker pools can linger.
    os._exit(code)
