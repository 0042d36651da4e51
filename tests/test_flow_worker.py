"""The flow worker (tests/flow_worker.py), which the daemon's and the CLI's flow tests run through the runner's
testing hook: its result has the fields of the real worker's (here the fake worker's, the real one with eager
calls), through the same files, phases and zygote protocol; it imports no torch; and it refuses, with the
reason, a job it cannot stand in for."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from daemon_factories import use_fake_worker, use_flow_worker
from joulepilot.compiler import CompileConfig, ZygotePool, worker_budget
from joulepilot.compiler.runner import read_phases, run_worker_job
from joulepilot.compiler.zygote import FORKED


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def _job(mode: str = "default", **more) -> dict:
    return {"kind": "bench", "spec": "mlp", "device": "cpu", "config": CompileConfig(mode=mode, batch_size=4).to_row(),
            "min_seconds": 0.2, "idle_power_w": {}, "describe": False, **more}


def _run(job: dict, zygotes: ZygotePool | None = None) -> tuple[dict, list[str]]:
    result = run_worker_job(job, budget=worker_budget(60, job["min_seconds"] * job.get("windows", 1)),
                            keep_dir=True, zygotes=zygotes)
    workdir = Path(result.pop("workdir"))
    try:
        return result, [name for name, _ in read_phases(workdir / "phases.tsv")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# in `extra` only when a window ran slower than its latency pass (a busy machine): either worker may add it
SOMETIMES = {"window_warning"}


def _shape(result: dict) -> dict:
    further = result.get("further_windows") or [{}]
    return {"fields": set(result), "extra": set(result["extra"]) - SOMETIMES, "further": set(further[0]),
            "further_extra": set(further[0].get("extra", {})) - SOMETIMES}


def test_the_flow_worker_gives_the_real_workers_fields_phases_and_files(monkeypatch):
    job = _job(windows=2, artifacts_path=None)
    use_fake_worker(monkeypatch)
    real, real_phases = _run(job)
    use_flow_worker(monkeypatch)
    flow, flow_phases = _run(job)
    assert real["status"] == flow["status"] == "ok", (real.get("reason"), flow.get("reason"))
    assert _shape(flow) == _shape(real)
    assert flow_phases == real_phases == ["load", "reference", "compile", "compiled", "warmup", "window", "window"]
    assert flow["extra"]["fake_worker"].startswith("tests.flow_worker: no torch")
    assert flow["energy_source"] == "estimate" and flow["energy_j"] > 0  # the real meter, on a CPU
    assert flow["compile_s"] >= 0.1 and flow["window_s"] >= 0.2 and flow["extra"]["latency_calls"] >= 10
    assert flow["extra"]["torch_compile_kwargs"] == real["extra"]["torch_compile_kwargs"] == {"dynamic": False}


def test_from_its_zygote_a_compiled_configuration_is_quicker_and_describing_fails_as_the_real_one_can(
        flow_worker, own_tmpdir):
    with ZygotePool() as pool:
        eager, eager_phases = _run(_job("eager", describe=True), zygotes=pool)
        compiled, _ = _run(_job("default"), zygotes=pool)
        assert pool.current is not None and pool.current.info["preloaded"] == []
    assert eager["worker_process"] == compiled["worker_process"] == FORKED
    assert eager_phases[-1] == "describe" and "workload" not in eager
    assert eager["extra"]["describe_error"] == "StandInRefused: tests.flow_worker has no model to describe"
    assert compiled["latency_ms_p50"] < eager["latency_ms_p50"]  # the stand-in's calls differ by configuration


@pytest.mark.parametrize(("job", "says"), [
    (_job(shapes={"dim": "batch_size", "sizes": [1, 2]}), "a shape set needs the real worker"),
    (_job(config=CompileConfig(mode="default", regional="auto").to_row()), "needs torch to name its compile"),
    (_job(config=CompileConfig(mode="max-autotune").to_row()), "needs torch to name its compile"),
    (_job(precompile=True), "caching precompile needs the real worker"),
    (_job(kind="warm_start"), "a 'warm_start' job needs the real worker"),
])
def test_a_job_it_cannot_stand_in_for_fails_with_the_reason(job, says):
    import tests.flow_worker as flow_worker

    result = flow_worker.run_job(job)
    assert result["status"] == "failed" and says in result["reason"]
    assert result["reason"].startswith("tests.flow_worker cannot stand in: ")
    assert result["reason"].endswith("(use the fake_worker fixture)")


def test_the_flow_worker_imports_no_torch(tmp_path):
    import subprocess

    code = ("import sys, tests.flow_worker as w\n"
            "r = w.run_job(" + repr(_job("default", idle_power_w={})) + ")\n"
            "assert r['status'] == 'ok', r\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
