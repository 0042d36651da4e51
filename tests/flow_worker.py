"""The flow worker: a benchmark worker without torch, for tests about the daemon's and the CLI's flow (queueing,
budgets, stop and kill, status, reports, scheduling over GPUs) where neither compiling nor the model is the point.

Tests select it with `JOULEPILOT_WORKER_MODULE=tests.flow_worker` (the `flow_worker` fixture in conftest.py); the
runner then starts `python -m tests.flow_worker --zygote SETUP.json` as the workload's zygote, or
`python -m tests.flow_worker JOB.json` as a fresh worker, as it starts the real one.

What is real: the parent's side of everything (the runner, its budgets and kills, the zygote pool, bench, the
daemon); the protocols between them and the worker (the job, phase and result files and their formats, the
zygote's JSON lines: ready, started, exited, and forking one worker per job that dies with its zygote, which dies
with its parent); the phases in the real worker's order; the energy, from the real meter (the labelled
`estimate` on a CPU, the fake NVML GPU of the test on `cuda:N`); the timing loops of `compiler.measure` (warm-up,
latency pass, energy windows, further windows) and the worker's own helpers that turn them into a result.

What is a stand-in: the model. The workload is never loaded (its spec is only named; `tests.flow_worker:cannot_be_built`
fails to load, as a factory that raises does) and nothing is compiled: each
"forward call" spins this thread's CPU for part of a fixed time and sleeps the rest (STAND_IN_CALL_S, or
`JOULEPILOT_FLOW_CALL_S` seconds, and BUSY_SHARE, shorter for a compiled configuration and for a lower
precision), so a configuration's latency and
its estimated energy per call are steady on a busy machine and differ between configurations; the first call of
a compiled configuration first waits `JOULEPILOT_FAKE_COMPILE_S` seconds (default FAKE_COMPILE_S) in place of a
compile. The result has the real worker's fields; those that only a model or a compiler can give are the
values of nothing happening: no graph breaks, no recompiles, max_rel_error 0.0 (the stand-in's output equals
its reference), no compile caches or timers, no artifacts (so no warm start follows), and the description fails
(`extra.describe_error`), as the real worker's does when describing raises. Each result says in
`extra.fake_worker` that it came from here, and in `extra.fake_worker_env` the scheduling variables it was
started with. A job it cannot stand in for (a shape set, a regional configuration, a mode or options whose
compile arguments come from torch, precompile, a warm start or doctor job) fails with the reason: such tests use
the `fake_worker` fixture (tests/fake_worker.py: the real worker with eager calls in place of torch.compile).

Its zygote preloads nothing but this module (a few tenths of a second of CPU against the real one's seconds) and
forks every job's worker; the forked worker's own CPU is a small share of its windows.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from joulepilot.compiler import worker, zygote_server
from joulepilot.compiler.compile_meter import compile_energy_fields, open_cpu_meter
from joulepilot.compiler.config import CompileConfig
from joulepilot.compiler.inductor import torch_compile_kwargs
from joulepilot.compiler.measure import ThreadProbe, latencies_and_window, timed_call, warm_up

NOTE = ("tests.flow_worker: no torch; the model is a stand-in call that spins the CPU for part of a fixed time "
        "and sleeps the rest; compile_s is a stand-in wait")
FAKE_COMPILE_S_ENV = "JOULEPILOT_FAKE_COMPILE_S"
FAKE_COMPILE_S = 0.1
STAND_IN_CALL_S = 0.002  # an eager fp32 call
# A longer call for tests that must not see a run flagged "repeat this run": on a loaded machine a few ms of
# waiting for a core slow a 2-ms call's window far more than its latency pass's median.
CALL_S_ENV = "JOULEPILOT_FLOW_CALL_S"
BUSY_SHARE = 0.25  # of each call, spent spinning this thread's CPU (the estimate meter's energy)
COMPILED_FACTOR = 0.75
LOW_PRECISION_FACTOR = 0.8
WARMUP_MAX_S = 0.05
LATENCY_S = 0.05
SAMPLE_HZ = 5.0
SCHEDULING_ENV = ("TORCHINDUCTOR_COMPILE_THREADS", "CUDA_DEVICE_ORDER")
PLAIN_MODES = ("eager", "default")  # modes whose torch.compile arguments need no torch to be named


def cannot_be_built(batch_size: int = 1) -> None:
    """A workload (`tests.flow_worker:cannot_be_built`) whose building fails in the "load" phase, as a real factory
    that raises does in the real worker: for tests of what a sweep does when its workload cannot be built."""
    raise RuntimeError("tests.flow_worker: this stand-in workload cannot be built")


class StandInRefused(Exception):
    """A job this worker cannot stand in for."""


def fake_compile_s() -> float:
    return float(os.environ.get(FAKE_COMPILE_S_ENV) or FAKE_COMPILE_S)


def call_seconds(config: CompileConfig) -> float:
    """The stand-in's time per call under `config`."""
    base = float(os.environ.get(CALL_S_ENV) or STAND_IN_CALL_S)
    seconds = base * (COMPILED_FACTOR if config.compiles else 1.0)
    return seconds * (LOW_PRECISION_FACTOR if config.precision in ("bf16", "fp16") else 1.0)


class StandInModel:
    """A forward call: spins this thread's CPU for BUSY_SHARE of `call_s`, then sleeps to the end of it."""

    def __init__(self, call_s: float) -> None:
        self.call_s = call_s
        self.busy_s = call_s * BUSY_SHARE

    def __call__(self) -> float:
        started = time.perf_counter()
        busy_until = time.thread_time() + self.busy_s
        while time.thread_time() < busy_until:
            pass
        left = self.call_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        return self.call_s


class FirstCallWaits:
    """The configuration applied: a compiled one's first call waits like a compile."""

    def __init__(self, model: StandInModel, compile_s: float) -> None:
        self.model = model
        self.compile_s = compile_s

    def __call__(self) -> float:
        if self.compile_s > 0:
            time.sleep(self.compile_s)
            self.compile_s = 0.0
        return self.model()


def _stand_in_config(job: dict[str, Any]) -> CompileConfig:
    if job.get("kind", "bench") != "bench":
        raise StandInRefused(f"a {job.get('kind')!r} job needs the real worker")
    if job.get("shapes"):
        raise StandInRefused("a shape set needs the real worker")
    if job.get("precompile"):
        raise StandInRefused("Dynamo's caching precompile needs the real worker")
    config = CompileConfig.from_row(job["config"])
    if config.regional or config.options or config.fusion != "default" or config.mode not in PLAIN_MODES:
        raise StandInRefused(f"configuration {config.label} needs torch to name its compile arguments")
    return config


def run_bench(job: dict[str, Any], phases: worker.Phases) -> dict[str, Any]:
    """The real worker's `run_bench`, phase by phase, on the stand-in model."""
    config = _stand_in_config(job)
    device = job["device"]
    min_seconds = float(job["min_seconds"])
    batch_size = config.batch_size
    result: dict[str, Any] = {"extra": {}}
    extra = result["extra"]
    if job.get("provenance"):
        origin = job["provenance"]
    else:
        from joulepilot.compiler.provenance import provenance

        origin = provenance(device)
    result.update({k: v for k, v in origin.items()
                   if k in ("device_name", "driver_version", "torch_version", "triton_version",
                            "joulepilot_version", "provenance_key", "host_id")})
    extra["provenance"] = {k: origin.get(k) for k in ("hostname", "cuda_version", "python_version")}

    phases.enter("load")
    if str(job["spec"]).rpartition(":")[2] == cannot_be_built.__name__:
        cannot_be_built()
    model = StandInModel(call_seconds(config))
    phases.enter("reference")
    reference = model()

    meter = worker._open_meter(device, min(float(job.get("sample_hz") or SAMPLE_HZ), SAMPLE_HZ))
    try:
        idle = worker.take_idle_baseline(meter, job, phases, extra)
        call = FirstCallWaits(model, fake_compile_s() if config.compiles else 0.0)
        sync = _no_sync

        phases.enter("compile")
        cpu_meter, cpu_error = open_cpu_meter(meter)
        try:
            meter.begin("compile")
            if cpu_meter is not None:
                cpu_meter.begin("compile")
            output, compile_s = timed_call(call, sync)
            cpu_compile_m = cpu_meter.end("compile") if cpu_meter is not None else None
            compile_m = meter.end("compile")
        finally:
            if cpu_meter is not None:
                cpu_meter.close()
        phases.enter("compiled")
        result["compile_s"] = compile_s
        compile_columns, compile_window = compile_energy_fields(compile_m, cpu_compile_m, cpu_error)
        result.update(compile_columns)
        result["max_rel_error"] = abs(output - reference) / reference
        extra["compile_timers_s"] = {}

        phases.enter("warmup")
        warm_calls, warmup_s = warm_up(call, sync, max_s=min(float(job.get("warmup_max_s") or WARMUP_MAX_S),
                                                               WARMUP_MAX_S))
        result["warmup_s"] = warmup_s
        extra["warmup_calls"] = warm_calls

        # the thread probe, as the real worker takes it on the CPU: the stand-in runs on one thread, so both of its
        # sides are one timed call of the model
        if not str(device).startswith("cuda"):
            _, probe_s = timed_call(model, sync)
            extra["thread_probe"] = ThreadProbe(1, probe_s * 1000.0, probe_s * 1000.0, 1).to_dict()

        latency_s = min(float(job.get("latency_s") or LATENCY_S), LATENCY_S)
        peak_before_window = _peak_memory_bytes()
        timed = latencies_and_window(call, sync, meter, device=device, min_seconds=min_seconds, latency_s=latency_s,
                                     phases=phases)
        calls, window = timed.calls, timed.measurement
        result.update(timed.latency_columns())
        extra.update(timed.latency_extra())
        peak_window = _peak_memory_bytes()
        further = []
        for index in range(2, worker._windows(job, result["max_rel_error"]) + 1):
            if not worker.gate_allows(job, index, result, timed, further, batch_size, idle, phases):
                break
            started_at = time.time()
            more = latencies_and_window(call, sync, meter, device=device, min_seconds=min_seconds,
                                        latency_s=latency_s, phases=phases)
            further.append((index, started_at, more, time.time()))
    finally:
        meter.close()

    result["graph_breaks"] = 0
    result["recompiles"] = 0
    extra["dynamo_frames_first_call"] = 0
    extra["torch_compile_kwargs"] = torch_compile_kwargs(config, device)  # torch-free for PLAIN_MODES
    extra["torch_threads"] = 1  # the stand-in runs on this one thread
    if job.get("threads_from"):
        extra["torch_threads_from"] = job["threads_from"]
    extra["compile_caches"] = {}
    result.update(worker._window_fields(window, calls, batch_size, idle))
    result["peak_memory_bytes"] = max(peak_before_window, peak_window)
    worker._check_window_pace(window.duration_s * 1000.0 / calls, result.get("latency_ms_p50"), extra,
                              timed.latency_source)
    extra["peak_memory_window_bytes"] = peak_window
    extra["window"] = {"devices": [d.to_dict() for d in window.devices]}
    extra["compile_window"] = compile_window
    result["power_samples"] = [list(s) for s in getattr(window, "samples", [])]
    if further:
        result["further_windows"] = [worker._further_window(*each, batch_size=batch_size, idle=idle) for each in further]

    if config.compiles and job.get("artifacts_path"):
        phases.enter("save_artifacts")
        result["artifacts_path"] = None  # nothing was compiled: nothing to save, and no warm start follows
    if job.get("describe"):
        phases.enter("describe")
        extra["describe_error"] = "StandInRefused: tests.flow_worker has no model to describe"
    extra["fake_worker"] = NOTE
    extra["fake_worker_env"] = {name: os.environ.get(name) for name in SCHEDULING_ENV}
    result["status"] = "ok"
    return result


def _no_sync() -> None:
    return None


def _peak_memory_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    phases = worker.Phases(job.get("phase_path"))
    started = time.time()
    try:
        result = run_bench(job, phases)
    except StandInRefused as exc:
        result = {"status": "failed", "phase": phases.current,
                  "reason": f"tests.flow_worker cannot stand in: {exc} (use the fake_worker fixture)"}
    except Exception as exc:
        tail = "".join(traceback.format_exception(exc)).strip().splitlines()[-8:]
        result = {"status": "failed", "reason": f"{type(exc).__name__} during {phases.current}: {exc}"[:2000],
                  "traceback_tail": tail, "phase": phases.current}
    result["started_at"] = started
    result["finished_at"] = time.time()
    return result


# --- the zygote: compiler/zygote_server.py's protocol, with nothing to preload --------------------------------

def _send(protocol: Any, message: dict[str, Any]) -> None:
    protocol.write(json.dumps(message) + "\n")
    protocol.flush()


def _child(command: dict[str, Any], protocol: Any) -> None:
    code = 1
    try:
        zygote_server.enter_child(command, protocol)
        code = main([command["job_path"]])
    except BaseException:
        traceback.print_exc()
    finally:
        zygote_server.exit_child(code)


def serve_zygote(setup_path: str) -> int:
    """Say ready (safe to fork: no thread, no child, nothing preloaded), then fork a worker per command."""
    setup = json.loads(Path(setup_path).read_text())
    worker.die_with_parent(setup.get("parent_pid"))
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the job's code prints cannot garble the answers
    _send(protocol, {"event": "ready", "pid": os.getpid(), "fork_safe": True, "why": None, "preloaded": [],
                     "built": False, "compiler": "none", "fake_worker": NOTE})
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        command = json.loads(line)
        if command.get("op") != "run":
            return 0
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(command, protocol)
        _send(protocol, {"event": "started", "pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(protocol, {"event": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--zygote":
        return serve_zygote(args[1])
    job = json.loads(Path(args[0]).read_text())
    worker.die_with_parent(job.get("parent_pid"))
    result = run_job(job)
    if job.get("result_path"):
        worker.write_result(result, job["result_path"])
    else:
        print(json.dumps(result, default=str))
    return 0 if result.get("status") == "ok" else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the real worker ends
