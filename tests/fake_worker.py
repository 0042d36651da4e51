"""The fake benchmark worker, for tests about the daemon and the CLI where compiling is not the point.

Tests select it with `JOULEPILOT_WORKER_MODULE=tests.fake_worker` (the `fake_worker` fixture in conftest.py);
the runner then starts `python -m tests.fake_worker JOB.json` in place of `joulepilot.compiler.worker`.

It is the real worker with one thing taken out: `torch.compile` is swapped for a stand-in that runs the model
eagerly. Everything else is the worker's own code: the job, phase and result files and their formats, the
phases in their order, real forward calls of the workload (eager reference, warm-up, latency pass, energy
window), energy from the real meter (the labelled `estimate` on a CPU), the numerical check, the description,
and dying with its parent; the parent's budgets apply to it as to the real one. Its zygote (zygote_server.py)
preloads what the real one does except the compiler (COMPILER_MODULES), which it never calls. A compiled configuration's
first call ("compile" phase) waits `JOULEPILOT_FAKE_COMPILE_S` seconds (default FAKE_COMPILE_S) in place of
a compile, so a test can still catch a worker there (with `JOULEPILOT_FAKE_PRECOMPILE_FAILS` set, that call raises
when Dynamo's caching precompile is on, as some compiles did on torch 2.11); nothing is compiled, so no artifacts are saved (no warm
start follows). To stay cheap on a small shared machine it runs torch on one thread, caps warm-up at
WARMUP_MAX_S (an eager model is steady after a few calls) and makes the latency pass LATENCY_S long (still at
least ten calls); the energy window keeps the job's `min_seconds`. It samples power at most SAMPLE_HZ times a
second: the 10 Hz sampler thread slows the built-in models' sub-millisecond CPU calls by up to 40 % in the window,
so most runs would be flagged "repeat this run" and the daemon would repeat them, which the tests using this
worker are not about. Each result says in `extra.fake_worker` that it came from here, and in
`extra.fake_worker_env` the scheduling variables it was started with (compile threads, GPU order).

A job for a GPU (`cuda:N`) on a host without one (this CPU-only machine) runs its model on the CPU and meters
NVML's GPU N, which is then the NVML fake of the test (`fake_pynvml.subprocess_env`): the scheduling tests
see each measurement metered on its own fake GPU's counter.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def _import_untraced(name: str):
    """`import name` (a part of torch) with the test run's coverage tracer paused (torch is not measured; traced,
    its import costs a third more CPU in each of the suite's many fake workers)."""
    import importlib

    try:
        from coverage import Coverage
    except ImportError:
        Coverage = None  # noqa: N806
    cov = Coverage.current() if Coverage is not None else None
    if cov is not None:
        cov.stop()
    try:
        return importlib.import_module(name)
    finally:
        if cov is not None:
            cov.start()


torch = _import_untraced("torch")

from joulepilot.compiler import worker, zygote_server  # noqa: E402
from joulepilot.compiler.warmstart import precompile_enabled  # noqa: E402

FAKE_COMPILE_S_ENV = "JOULEPILOT_FAKE_COMPILE_S"
# Set: a compile with Dynamo's caching precompile on fails, as it did for some models on torch 2.11.
FAKE_PRECOMPILE_FAILS_ENV = "JOULEPILOT_FAKE_PRECOMPILE_FAILS"
FAKE_COMPILE_S = 0.3
WARMUP_MAX_S = 0.3
LATENCY_S = 0.05
SAMPLE_HZ = 2.0
NOTE = "tests.fake_worker: torch.compile replaced by eager calls; compile_s is a stand-in wait"


def fake_compile_s() -> float:
    return float(os.environ.get(FAKE_COMPILE_S_ENV) or FAKE_COMPILE_S)


class EagerStandIn:
    """What the fake `torch.compile` returns: the model itself, whose first call waits like a compile."""

    def __init__(self, model: Any, compile_s: float, kwargs: dict[str, Any]) -> None:
        self.model = model
        self.compile_s = compile_s
        self.compile_kwargs = kwargs
        self.compiled = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.compiled:
            if os.environ.get(FAKE_PRECOMPILE_FAILS_ENV) and precompile_enabled():
                raise TypeError("fake: this model cannot be saved into a torch.compile() package")
            time.sleep(self.compile_s)
            self.compiled = True
        return self.model(*args, **kwargs)


def eager_compile(model: Any = None, **kwargs: Any) -> EagerStandIn:
    if model is None or not callable(model):
        raise TypeError(f"fake torch.compile needs a callable model, got {model!r}")
    return EagerStandIn(model, fake_compile_s(), kwargs)


COMPILER_MODULES = ("torch._dynamo", "torch.export")
SCHEDULING_ENV = ("TORCHINDUCTOR_COMPILE_THREADS", "CUDA_DEVICE_ORDER")


def _meter_gpu_for_cpu_model(job: dict[str, Any]) -> None:
    """A GPU job without a GPU: the model on the CPU, the energy from the GPU's NVML counter (the fake's)."""
    gpu = str(job.get("device") or "")
    if not gpu.startswith("cuda") or torch.cuda.is_available():
        return
    job["device"] = "cpu"
    real_open_meter = worker._open_meter
    worker._open_meter = lambda _device, sample_hz: real_open_meter(gpu, sample_hz)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    job = dict(job)
    if job.get("describe"):
        # torch.export, which describing uses, loads Dynamo at its first call: loaded here untraced, as torch is
        _import_untraced("torch._dynamo")
    _meter_gpu_for_cpu_model(job)
    job["warmup_max_s"] = min(float(job.get("warmup_max_s") or WARMUP_MAX_S), WARMUP_MAX_S)
    job["latency_s"] = min(float(job.get("latency_s") or LATENCY_S), LATENCY_S)
    job["sample_hz"] = min(float(job.get("sample_hz") or SAMPLE_HZ), SAMPLE_HZ)
    result = real_run_job(job)
    if isinstance(result.get("extra"), dict):
        result["extra"]["fake_worker"] = NOTE
        result["extra"]["fake_worker_env"] = {name: os.environ.get(name) for name in SCHEDULING_ENV}
    return result


real_run_job = worker.run_job


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    torch.compile = eager_compile
    worker.run_job = run_job
    # Nothing is compiled here, so a zygote of this worker does not preload the compiler (Dynamo, and
    # torch.export, which imports it): about 1.5 s of CPU per zygote saved. A job that describes its workload
    # still imports Dynamo in its child (the FLOP counter's forward call does).
    zygote_server.PRELOAD_MODULES = tuple(name for name in zygote_server.PRELOAD_MODULES
                                          if name not in COMPILER_MODULES)
    return worker.main(argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the real worker ends
