"""A configuration measured over a shape set, inside the benchmark worker.

The worker measures the set's first size as it measures any workload (cold first call, warm-up, latency
pass, energy window). `ShapeSetRun` then measures every other size the same way in the same process, so
the compiled model meets the sizes one after another as a server would: a static compile recompiles for
each new size, a dynamic one compiles once or twice, padding to buckets leaves fewer distinct shapes. For
each size it records the first call (and whether Dynamo compiled new frames for it), J per call from its
own energy window, and its latencies; `fold` turns these into the run's figures, weighted by the sizes'
shares of the calls:

- energy_j_per_inference (and above idle): sum of share x J per call;
- throughput_per_s and avg_power_w: from the share-weighted time per call;
- latency_ms_p50/p95: percentiles of every size's latencies, each weighted by its size's share;
- compile_s / compile_energy_j: every size's first call together (compile plus recompiles). Each later size's
  first call is metered as the worker meters the compile (`compile_meter.CompileWindow`: the run's meter and,
  on a GPU, the CPU meter or its labelled estimate), so the GPU and CPU parts are sums over the sizes with
  their sources, and compile_energy_j is the sum of the parts;
- max_rel_error: the worst size; peak_power_w: the highest.

Padded inputs are zeros past the real size (token id 0, black pixels) and are computed like any other
positions, so padding's extra compute is in the energy. Whether padding changes the model's outputs
(an attention without a mask sees the pad tokens) is the model's business: the numerical check compares
the compiled model with eager on the same padded inputs.

Dynamo stops compiling a function after `torch._dynamo.config.recompile_limit` (`cache_size_limit` in
older torch) versions and runs it eagerly from then on; a run that hit the limit is marked
(`extra.recompile_limit_hit`, and per size).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .compile_meter import CompileWindow, summed_compile_fields
from .config import CompileConfig
from .options import ConfigError
from .shape_set import ShapeSet

# What Dynamo writes when a function reaches the recompile limit: the graph-break record of torch >= 2.7 and
# the warning of every version ("torch._dynamo hit config.recompile_limit (8)", cache_size_limit before 2.6).
LIMIT_MARKERS = ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")


# A size's first-call fields (extra.shapes.sizes) from the compile-energy columns of that call.
_FIRST_CALL_KEY = {"compile_energy_j": "first_call_energy_j", "compile_energy_gpu_j": "first_call_energy_gpu_j",
                   "compile_energy_gpu_source": "first_call_energy_gpu_source",
                   "compile_energy_cpu_j": "first_call_energy_cpu_j",
                   "compile_energy_cpu_source": "first_call_energy_cpu_source"}


def recompile_limit() -> int | None:
    """Dynamo's recompile limit in this torch (versions of one function it compiles before running it eagerly)."""
    from torch._dynamo import config

    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


class _LimitLog(logging.Handler):
    """Counts Dynamo's 'hit config.recompile_limit' warnings while attached."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not format is not ours to count
            return
        if "hit config." in text and any(m in text for m in LIMIT_MARKERS):
            self.hits += 1


def _limit_records() -> int:
    """How many times Dynamo's counters recorded the recompile limit being reached, so far."""
    from torch._dynamo.utils import counters

    total = 0
    for group in ("unimplemented", "graph_break"):
        for text, count in counters[group].items():
            if any(m in str(text).lower() for m in LIMIT_MARKERS):
                total += int(count)
    return total


def _frames_compiled() -> int:
    """Frames Dynamo has compiled so far in this process (a limit hit converts a frame without compiling it)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def pad_like(value: Any, target: Any) -> Any:
    """`value` with every tensor zero-padded at the end of each dimension up to the matching tensor of
    `target` (the same inputs built at the bucket size); anything that is not a tensor is kept."""
    import torch

    if isinstance(value, torch.Tensor):
        if not isinstance(target, torch.Tensor) or value.dim() != target.dim() or \
                any(v > t for v, t in zip(value.shape, target.shape, strict=True)):
            raise ValueError(f"an input of shape {tuple(value.shape)} cannot be padded to "
                             f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
        if value.shape == target.shape:
            return value
        padded = value.new_zeros(target.shape)
        padded[tuple(slice(0, n) for n in value.shape)] = value
        return padded
    if isinstance(value, tuple | list):
        return type(value)(pad_like(v, t) for v, t in zip(value, target, strict=True))
    if isinstance(value, dict):
        return {k: pad_like(v, target[k]) for k, v in value.items()}
    return value


def _tensor_shapes(value: Any) -> tuple:
    """The shapes of every tensor in `value` (nested tuples, lists and dicts), in order."""
    import torch

    if isinstance(value, torch.Tensor):
        return (tuple(value.shape),)
    if isinstance(value, tuple | list):
        return tuple(shape for item in value for shape in _tensor_shapes(item))
    if isinstance(value, dict):
        return tuple(shape for key in sorted(value, key=str) for shape in _tensor_shapes(value[key]))
    return ()


def _weighted_percentile(samples: list[tuple[float, float]], q: float) -> float | None:
    """The q-th percentile of (value, weight) pairs: the smallest value whose cumulative weight reaches q %."""
    ordered = sorted(samples)
    total = sum(w for _, w in ordered)
    if not ordered or total <= 0:
        return None
    wanted = total * q / 100.0
    running = 0.0
    for value, weight in ordered:
        running += weight
        if running >= wanted - 1e-12 * total:
            return value
    return ordered[-1][0]


class ShapeSetRun:
    """The sizes of a job's shape set, measured one after another by one worker (see the module doc)."""

    def __init__(self, job: dict[str, Any], config: CompileConfig, device: str) -> None:
        self.job = job
        self.config = config
        self.device = device
        self.shape_set = ShapeSet.from_dict(job["shapes"])
        self.padding = config.padding
        self.sizes: list[dict[str, Any]] = []
        self._latencies: list[list[float]] = []
        self._windows: list[Any] = []
        self._first_calls: list[dict[str, Any]] = []  # each size's first call, as compile-energy columns
        self._bucket_inputs: dict[int, tuple] = {}
        self._built: dict[int, tuple] = {}  # inputs built ahead of their size's turn (the second size's)
        self._sizes_by_shapes: dict[tuple, int] = {}  # the input shapes each size was built with
        self._log = _LimitLog()
        self._frames_at_start = _frames_compiled()
        self._limit_records_at_start = _limit_records()

    @classmethod
    def from_job(cls, job: dict[str, Any], config: CompileConfig, device: str) -> ShapeSetRun | None:
        return cls(job, config, device) if job.get("shapes") else None

    # --- inputs ----------------------------------------------------------------------------------------
    def _build_inputs(self, size: int) -> tuple:
        """The workload's example inputs at `size`, on the CPU (the model built with them is dropped)."""
        from .workloads import load_workload

        args = {"seq_len": self.job.get("seq_len"), "image_size": self.job.get("image_size"), self.shape_set.dim: size}
        built = load_workload(self.job["spec"], batch_size=self.config.batch_size, device="cpu",
                              seed=int(self.job.get("seed", 1234)), **args)
        return built.example_inputs

    def padded(self, inputs: tuple, size: int) -> tuple:
        """`inputs` (built at `size`) as this configuration runs them: padded up to the bucket when it pads."""
        run_size = self.shape_set.run_size(size, self.padding)
        if run_size == size:
            return inputs
        if run_size not in self._bucket_inputs:
            self._bucket_inputs[run_size] = self._build_inputs(run_size)
        return pad_like(inputs, self._bucket_inputs[run_size])

    def _check_varies(self, size: int, inputs: tuple) -> None:
        """Refuse a set whose sizes do not change the workload's inputs (a workload that ignores the set's
        dimension, or clamps it): its sizes would be measured as one, under the set's name."""
        shapes = _tensor_shapes(inputs)
        same = self._sizes_by_shapes.setdefault(shapes, size)
        if same != size:
            dim, spec = self.shape_set.dim, self.job["spec"]
            raise ConfigError(
                f"shape set {self.shape_set.label}: workload {spec!r} builds the same inputs at {dim} {same} and "
                f"{size} (shapes {', '.join(map(str, shapes)) or 'none'}), so it does not take {dim} from the set; "
                f"measure it without a shape set, or give its factory a {dim} argument that sizes its inputs")

    def first_inputs(self, inputs: tuple) -> tuple:
        """The worker's inputs (built at the set's first size) as this configuration runs them. The second
        size's inputs are built now too, to refuse a set that does not change the inputs before anything runs."""
        sizes = self.shape_set.sizes
        self._check_varies(sizes[0], inputs)
        if len(sizes) > 1:
            self._built[sizes[1]] = self._build_inputs(sizes[1])
            self._check_varies(sizes[1], self._built[sizes[1]])
        return self.padded(inputs, sizes[0])

    def _inputs_for(self, size: int) -> tuple:
        from .workloads import _to_device

        built = self._built.pop(size, None)
        if built is None:
            built = self._build_inputs(size)
            self._check_varies(size, built)
        return tuple(_to_device(self.padded(built, size), self.device))

    # --- measuring -------------------------------------------------------------------------------------
    def _limit_hits(self) -> int:
        return max(_limit_records() - self._limit_records_at_start, self._log.hits)

    def _record(self, size: int, *, first_call_s: float, first_call: dict[str, Any], cpu_meter_error: str | None,
                max_rel_error: float | None, compiled_frames: int, limit_hit: bool, latencies: list[float],
                window: Any, calls: int) -> None:
        from .measure import percentile

        above = window.energy_above_idle_j
        self.sizes.append({
            "size": size,
            "run_size": self.shape_set.run_size(size, self.padding),
            "share": self.shape_set.shares[len(self.sizes)],
            "first_call_s": first_call_s,
            # first_call_energy_j and its GPU and CPU parts, each with its source
            **{_FIRST_CALL_KEY[key]: value for key, value in first_call.items() if key in _FIRST_CALL_KEY},
            "compiled_frames": compiled_frames,
            "recompile_limit_hit": limit_hit,
            "max_rel_error": max_rel_error,
            "latency_ms_p50": percentile(latencies, 50),
            "latency_ms_p95": percentile(latencies, 95),
            "window_s": window.duration_s,
            "calls": calls,
            "energy_j": window.energy_j,
            "energy_j_per_inference": window.energy_j / calls,
            "energy_above_idle_j_per_inference": None if above is None else above / calls,
            "avg_power_w": window.avg_power_w,
            "peak_power_w": window.peak_power_w,
            "window_ms_per_call": window.duration_s * 1000.0 / calls,
        })
        if cpu_meter_error:
            self.sizes[-1]["first_call_cpu_meter_error"] = cpu_meter_error
        self._latencies.append(list(latencies))
        self._windows.append(window)
        self._first_calls.append(dict(first_call))

    def record_first(self, *, compile_s: float, compile_window: CompileWindow, max_rel_error: float | None,
                     latencies: list[float], window: Any, calls: int) -> None:
        """The first size, as the worker measured it (`compile_window`: its metered compile)."""
        self._record(self.shape_set.sizes[0], first_call_s=compile_s, first_call=compile_window.columns,
                     cpu_meter_error=compile_window.record.get("cpu_meter_error"),
                     max_rel_error=max_rel_error, compiled_frames=_frames_compiled() - self._frames_at_start,
                     limit_hit=self._limit_hits() > 0, latencies=latencies, window=window, calls=calls)

    def measure_rest(self, *, model: Any, make_call: Callable[[tuple], Callable[[], Any]], meter: Any,
                     sync: Callable[[], None], phases: Any, min_seconds: float, warmup_max_s: float,
                     latency_s: float) -> None:
        """Every size after the first: eager reference, first call (a recompile when Dynamo needs one),
        warm-up, latency pass and energy window, each in the worker's phases (so budgets apply)."""
        dynamo_log = logging.getLogger("torch._dynamo")
        dynamo_log.addHandler(self._log)
        try:
            for size in self.shape_set.sizes[1:]:
                self._measure_size(size, model=model, make_call=make_call, meter=meter, sync=sync, phases=phases,
                                   min_seconds=min_seconds, warmup_max_s=warmup_max_s, latency_s=latency_s)
        finally:
            dynamo_log.removeHandler(self._log)

    def _measure_size(self, size: int, *, model: Any, make_call: Callable[[tuple], Callable[[], Any]], meter: Any,
                      sync: Callable[[], None], phases: Any, min_seconds: float, warmup_max_s: float,
                      latency_s: float) -> None:
        import torch

        from .measure import latencies_and_window, timed_call, warm_up
        from .numerics import numeric_check
        from .precision import strict_fp32

        phases.enter("load")
        inputs = self._inputs_for(size)
        phases.enter("reference")
        with torch.no_grad(), strict_fp32():
            reference = model(*inputs)
        sync()
        call = make_call(inputs)
        frames_before, hits_before = _frames_compiled(), self._limit_hits()
        phases.enter("compile")
        with CompileWindow(meter) as first_call:
            output, first_s = timed_call(call, sync)
        phases.enter("compiled")
        check = numeric_check(output, reference)
        del output, reference
        compiled, hit = _frames_compiled() - frames_before, self._limit_hits() > hits_before
        phases.enter("warmup")
        warm_up(call, sync, max_s=warmup_max_s)
        timed = latencies_and_window(call, sync, meter, device=self.device, min_seconds=min_seconds,
                                     latency_s=latency_s, phases=phases)
        self._record(size, first_call_s=first_s, first_call=first_call.columns,
                     cpu_meter_error=first_call.record.get("cpu_meter_error"), max_rel_error=check.max_rel_error,
                     compiled_frames=compiled, limit_hit=hit, latencies=timed.latencies_ms,
                     window=timed.measurement, calls=timed.calls)

    # --- the run's figures -------------------------------------------------------------------------------
    def fold(self, result: dict[str, Any]) -> None:
        """Replace the run's figures (the first size's, as the worker set them) by the shape set's."""
        from .measure import is_synchronous
        from .worker import _check_window_pace

        sizes, extra = self.sizes, result["extra"]
        shares = [s["share"] for s in sizes]
        energy = sum(share * s["energy_j_per_inference"] for share, s in zip(shares, sizes, strict=True))
        above = [s["energy_above_idle_j_per_inference"] for s in sizes]
        seconds_per_call = sum(share * s["window_s"] / s["calls"] for share, s in zip(shares, sizes, strict=True))
        samples = [(ms, share / len(lat)) for share, lat in zip(shares, self._latencies, strict=True) for ms in lat]
        errors = [s["max_rel_error"] for s in sizes if s["max_rel_error"] is not None]
        peaks = [s["peak_power_w"] for s in sizes if s["peak_power_w"] is not None]
        limit_sizes = [s["size"] for s in sizes if s["recompile_limit_hit"]]
        above_total = [w.energy_above_idle_j for w in self._windows]
        result.update({
            "energy_j_per_inference": energy,
            "energy_above_idle_j_per_inference": None if any(a is None for a in above) else
            sum(share * a for share, a in zip(shares, above, strict=True)),
            "throughput_per_s": self.config.batch_size / seconds_per_call,
            "avg_power_w": energy / seconds_per_call,
            "peak_power_w": max(peaks) if peaks else None,
            "latency_ms_p50": _weighted_percentile(samples, 50),
            "latency_ms_p95": _weighted_percentile(samples, 95),
            "compile_s": sum(s["first_call_s"] for s in sizes),
            **summed_compile_fields(self._first_calls),
            "max_rel_error": max(errors) if errors else None,
            # Totals over every size's window; energy_j / inferences is their unweighted mean, not the figure above.
            "window_s": sum(s["window_s"] for s in sizes),
            "inferences": sum(s["calls"] for s in sizes),
            "energy_j": sum(s["energy_j"] for s in sizes),
            "energy_above_idle_j": None if any(a is None for a in above_total) else sum(above_total),
        })
        first_start = self._windows[0].start_time
        result["power_samples"] = [[t + w.start_time - first_start, d, p] for w in self._windows
                                   for t, d, p in getattr(w, "samples", [])]
        warnings = [extra["window_warning"]] if extra.get("window_warning") else []
        for entry in sizes[1:]:
            pace: dict[str, Any] = {}
            _check_window_pace(entry["window_ms_per_call"], entry["latency_ms_p50"], pace,
                               "window" if is_synchronous(self.device) else "latency_pass")
            if pace.get("window_warning"):
                warnings.append(f"{self.shape_set.dim} {entry['size']}: {pace['window_warning']}")
        if warnings:
            extra["window_warning"] = "; ".join(warnings)
        limit = recompile_limit()
        extra["shapes"] = {
            "set": self.shape_set.to_dict(),
            "label": self.shape_set.label,
            "padding": self.padding,
            "distinct_run_sizes": len(set(self.shape_set.run_sizes(self.padding))),
            "recompile_limit": limit,
            "recompile_limit_hit": bool(limit_sizes),
            "sizes": sizes,
        }
        if limit_sizes:
            extra["recompile_limit_hit"] = True
            extra["recompile_warning"] = (
                f"hit torch._dynamo's recompile limit ({limit}) at {self.shape_set.dim} {limit_sizes[0]}: from then on "
                "Dynamo runs new shapes of that function eagerly instead of compiling them; dynamic shapes or "
                "padding to buckets keep the compiled versions below the limit")
