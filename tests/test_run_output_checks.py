"""What a run reports about the model's output and graph: the numerical check when there is nothing to
compare, and graph breaks, each with its place in the code. The worker runs in this process
on the CPU; the compiled configuration uses Dynamo's "eager" backend, since the count is the point and an
Inductor compile would only add time."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from joulepilot.compiler import CompileConfig, inductor, load_workload
from joulepilot.compiler.worker import run_job

MODELS = Path(__file__).parent / "output_models.py"


def _job(factory: str, config: CompileConfig) -> dict:
    return {"kind": "bench", "spec": f"{MODELS}:{factory}", "device": "cpu", "config": config.to_row(),
            "min_seconds": 0.05, "warmup_max_s": 0.2, "latency_s": 0.05, "idle_power_w": {}, "sample_hz": 5.0}


@pytest.fixture
def fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # the worker counts from a fresh process; so must this test
    yield
    torch._dynamo.reset()
    counters.clear()


def test_an_output_without_tensors_is_not_a_zero_error():
    from joulepilot.compiler.numerics import max_rel_error, numeric_check

    check = numeric_check({"total": 1.5, "peak": 2.0}, {"total": 1.5, "peak": 2.0})
    assert check.max_rel_error is None and "no tensors in the output" in check.note
    assert max_rel_error(None, None) is None
    empty = numeric_check(torch.empty(0, 3), torch.empty(0, 3))
    assert empty.max_rel_error is None and "empty" in empty.note
    zero = numeric_check(torch.zeros(2), torch.zeros(2))
    assert zero.max_rel_error is None and "identically zero" in zero.note
    # something to compare: a real figure and no note
    ok = numeric_check(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    assert ok.max_rel_error == pytest.approx(0.2) and ok.note is None
    # a missing tensor is a mismatch, not "nothing to compare"
    missing = numeric_check((), (torch.ones(2),))
    assert math.isinf(missing.max_rel_error) and "0 tensor(s)" in missing.note


def test_worker_records_why_an_output_was_not_checked(fresh_dynamo):
    result = run_job(_job("scalar_output", CompileConfig(mode="eager")))
    assert result["status"] == "ok", result.get("reason")
    assert result["max_rel_error"] is None
    assert result["extra"]["numeric_check"] == "no tensors in the output: nothing to compare"


def test_graph_breaks_are_counted_and_placed(fresh_dynamo, monkeypatch):
    workload = load_workload(f"{MODELS}:print_and_branch", batch_size=2)
    explained = torch._dynamo.explain(workload.model)(*workload.example_inputs)
    assert explained.graph_break_count == 2  # the print() and the data-dependent branch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # explain's own graphs are counted too

    monkeypatch.setattr(inductor, "torch_compile_kwargs", lambda config, device=None: {"backend": "eager"})
    result = run_job(_job("print_and_branch", CompileConfig(mode="default")))
    assert result["status"] == "ok", result.get("reason")
    assert result["graph_breaks"] == explained.graph_break_count
    assert result["recompiles"] == 0
    places = result["extra"]["graph_breaks"]  # as `joulepilot doctor` lists them (tests/test_doctor.py)
    assert [(Path(b["file"]).name, b["function"], b["kind"]) for b in places] == [
        ("output_models.py", "forward", "print"), ("output_models.py", "forward", "data_dependent_branch")]
    assert result["max_rel_error"] == 0.0 and "numeric_check" not in result["extra"]


def test_an_eager_run_counts_zero_compiles_without_importing_dynamo(monkeypatch):
    """A worker that compiled nothing never imported Dynamo, whose import alone takes about a second of CPU:
    its graph and cache counts are zeros without it. (Dynamo's import is blocked here: a run that needed it
    would fail.)"""
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", None)
    result = run_job(_job("print_and_branch", CompileConfig(mode="eager")))
    assert result["status"] == "ok", result.get("reason")
    assert result["graph_breaks"] == 0 and result["recompiles"] == 0
    assert result["extra"]["dynamo_frames_first_call"] == 0 and result["extra"]["compile_caches"] == {}
