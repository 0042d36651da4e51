"""The runner's testing hook (JOULEPILOT_WORKER_MODULE) and the fake worker the suite runs through it: the real
worker's files, phases and meter, eager calls in place of a compile, and the parent's budget still in force. And
the worker's model calls run without a trace function, so that measuring coverage does not change its figures."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from joulepilot.compiler import CompileConfig, worker_budget
from joulepilot.compiler.runner import WORKER_MODULE, read_phases, run_worker_job, worker_module
from joulepilot.compiler.worker import untraced


def _job(mode: str) -> dict:
    return {"kind": "bench", "spec": "mlp", "device": "cpu", "config": CompileConfig(mode=mode, batch_size=4).to_row(),
            "min_seconds": 0.2, "idle_power_w": {}, "describe": True}


def _run(job: dict, budget_s: float = 60) -> tuple[dict, list[tuple[str, float]], list[str]]:
    result = run_worker_job(job, budget=worker_budget(budget_s, job["min_seconds"]), keep_dir=True)
    workdir = Path(result["workdir"])
    try:
        return result, read_phases(workdir / "phases.tsv"), sorted(p.name for p in workdir.iterdir())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_worker_module_is_the_real_one_unless_the_hook_names_another(monkeypatch):
    monkeypatch.delenv("JOULEPILOT_WORKER_MODULE", raising=False)
    assert worker_module() == WORKER_MODULE == "joulepilot.compiler.worker"
    monkeypatch.setenv("JOULEPILOT_WORKER_MODULE", "  ")
    assert worker_module() == WORKER_MODULE
    monkeypatch.setenv("JOULEPILOT_WORKER_MODULE", "tests.fake_worker")
    assert worker_module() == "tests.fake_worker"


def test_the_fake_worker_measures_eager_calls_through_the_real_workers_files_and_phases(fake_worker, monkeypatch):
    monkeypatch.setenv("JOULEPILOT_FAKE_COMPILE_S", "0.4")
    result, phases, files = _run(_job("default"))
    assert result["status"] == "ok", result.get("reason")
    assert "fake_worker" in result["extra"]  # it says where it came from
    # on the CPU the window's own calls give the latencies: no separate "latency" phase
    assert [name for name, _ in phases] == ["load", "reference", "compile", "compiled", "warmup", "window",
                                            "describe"]
    assert result["extra"]["latency_source"] == "window" and result["extra"]["latency_s"] == 0.0
    assert {"job.json", "phases.tsv", "result.json", "stderr.txt"} <= set(files)
    compile_began, compiled = dict(phases)["compile"], dict(phases)["compiled"]
    assert compiled - compile_began >= 0.4 and result["compile_s"] >= 0.4  # the stand-in for a compile
    assert result["extra"]["torch_compile_kwargs"] == {"dynamic": False}
    assert result["energy_source"] == "estimate" and result["energy_j"] > 0  # the real meter
    assert result["inferences"] >= 3 and result["window_s"] >= 0.2 and result["extra"]["latency_calls"] >= 10
    assert result["max_rel_error"] == 0.0  # the same eager model as the reference
    assert result["workload"]["params"] == 399_370 and not result.get("artifacts_path")  # nothing compiled


def test_the_fake_workers_compile_is_held_to_the_budget(fake_worker, monkeypatch):
    monkeypatch.setenv("JOULEPILOT_FAKE_COMPILE_S", "60")
    result, phases, _ = _run(_job("default"), budget_s=1)
    assert result["status"] == "failed" and result["phase"] == "compile"
    assert result["reason"] == "compile exceeded budget of 1 s"
    assert phases[-1][0] == "compile"


def test_model_calls_run_without_a_trace_function_which_is_given_back():
    def tracer(frame, event, arg):
        return None

    seen = []
    before = sys.gettrace()  # coverage's, when the suite measures itself
    sys.settrace(tracer)
    try:
        untraced(lambda: seen.append(sys.gettrace()))()
        after = sys.gettrace()
    finally:
        sys.settrace(before)
    assert seen == [None] and after is tracer
    sys.settrace(None)  # with none installed, none is installed afterwards either
    try:
        untraced(lambda: seen.append(sys.gettrace()))()
        after = sys.gettrace()
    finally:
        sys.settrace(before)
    assert seen == [None, None] and after is None
