"""The fake benchmark worker, for tests about the daemon and the CLI where compiling is not the point.

Tests select it with `JOULEPILOT_WORKER_MODULE=tests.fake_worker` (the `fake_worker` fixture in conftest.py);
the runner then starts `python -m tests.fake_worker JOB.json` in place of `joulepilot.compiler.worker`.

It is the real worker with one thing taken out: `torch.compile` is swapped for a stand-in that runs the model
eagerly. Everything else is the worker's own code: the job, phase and result files and their formats, the
phases in their order, real forward calls of the workload (eager reference, warm-up, latency pass, energy
window), energy from the real meter (the labelled `estimate` on a CPU), the numerical check, the description,
and dying with its parent; the parent's budgets apply to it as to the real one. A compiled configuration's
first call ("compile" phase) waits `JOULEPILOT_FAKE_COMPILE_S` seconds (default FAKE_COMPILE_S) in place of
a compile, so a test can still catch a worker there; nothing is compiled, so no artifacts are saved (no warm
start follows). To stay cheap on a small shared machine it runs torch on one thread, caps warm-up at
WARMUP_MAX_S (an eager model is steady after a few calls) and makes the latency pass LATENCY_S long (still at
least ten calls); the energy window keeps the job's `min_seconds`. It samples power at most SAMPLE_HZ times a
second: the 10 Hz sampler thread slows the built-in models' sub-millisecond CPU calls by up to 40 % in the window,
so most runs would be flagged "repeat this run" and the daemon would repeat them, which the tests using this
worker are not about. Each result says in `extra.fake_worker` that it came from here.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from joulepilot.compiler import worker

FAKE_COMPILE_S_ENV = "JOULEPILOT_FAKE_COMPILE_S"
FAKE_COMPILE_S = 0.3
WARMUP_MAX_S = 0.3
LATENCY_S = 0.1
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
            time.sleep(self.compile_s)
            self.compiled = True
        return self.model(*args, **kwargs)


def eager_compile(model: Any = None, **kwargs: Any) -> EagerStandIn:
    if model is None or not callable(model):
        raise TypeError(f"fake torch.compile needs a callable model, got {model!r}")
    return EagerStandIn(model, fake_compile_s(), kwargs)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    job = dict(job)
    job["warmup_max_s"] = min(float(job.get("warmup_max_s") or WARMUP_MAX_S), WARMUP_MAX_S)
    job["latency_s"] = min(float(job.get("latency_s") or LATENCY_S), LATENCY_S)
    job["sample_hz"] = min(float(job.get("sample_hz") or SAMPLE_HZ), SAMPLE_HZ)
    result = real_run_job(job)
    if isinstance(result.get("extra"), dict):
        result["extra"]["fake_worker"] = NOTE
    return result


real_run_job = worker.run_job


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(1)
    torch.compile = eager_compile
    worker.run_job = run_job
    return worker.main(argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the real worker ends
