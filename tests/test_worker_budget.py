"""The one budget model: the first forward calls (eager reference + cold compile) are bounded by
`budget_s`, everything else by an allowance derived from `min_seconds`, and a hang anywhere is
killed within its limit plus a small grace."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from joulepilot.compiler import CompileConfig, worker_budget
from joulepilot.compiler.budget import FIRST_CALL_PHASES
from joulepilot.compiler.runner import kill_reason, read_phases, run_worker_job


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    # the worker subprocess imports tests.workload_factories through the parent's import roots
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def test_forward_hanging_on_its_first_call_is_killed_at_the_budget():
    budget = worker_budget(3, min_seconds=0.2)
    job = {"kind": "bench", "spec": "tests.workload_factories:hangs_on_first_call", "device": "cpu",
           "config": CompileConfig(mode="eager").to_row(), "min_seconds": 0.2, "idle_power_w": {}}
    result = run_worker_job(job, budget=budget, keep_dir=True)
    returned_at = time.time()
    workdir = Path(result["workdir"])
    try:
        phases = read_phases(workdir / "phases.tsv")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert result["status"] == "failed" and result["phase"] == "reference"
    assert result["reason"] == "the first forward call (eager reference) exceeded the compile budget of 3 s"
    reference_began = dict(phases)["reference"]
    # killed after the budget, and no later than the budget plus the documented grace
    assert budget.first_call_s <= returned_at - reference_began <= budget.first_call_s + budget.grace_s


def _timeline(*steps: tuple[str, float]) -> list[tuple[str, float]]:
    return list(steps)


def test_reference_and_compile_share_the_first_call_budget():
    budget = worker_budget(10, min_seconds=1)
    assert set(FIRST_CALL_PHASES) == {"reference", "compile"}
    reference = 5.0
    phases = _timeline(("load", 0.0), ("reference", reference), ("idle", reference + 4), ("compile", reference + 6))
    # 4 s of reference + 5.9 s of compile: within the 10 s
    assert kill_reason(phases, started=0.0, now=reference + 11.9, budget=budget) is None
    # 4 s + 6.1 s: over it, although the compile alone took only 6.1 s
    assert kill_reason(phases, started=0.0, now=reference + 12.1, budget=budget) == \
        "compile exceeded budget of 10 s"
    hung = _timeline(("load", 0.0), ("reference", reference))
    assert kill_reason(hung, started=0.0, now=reference + budget.first_call_s + 0.1, budget=budget).startswith(
        "the first forward call (eager reference) exceeded")


def test_everything_else_shares_the_allowance_derived_from_min_seconds():
    short, long = worker_budget(10, min_seconds=1), worker_budget(10, min_seconds=20)
    assert long.allowance_s > short.allowance_s  # a longer window gets a longer allowance
    assert short.total_s == short.first_call_s + short.allowance_s
    phases = _timeline(("load", 0.0), ("reference", 1.0), ("compile", 2.0), ("compiled", 3.0), ("warmup", 3.0))
    assert kill_reason(phases, started=0.0, now=short.total_s - 0.1, budget=short) is None
    reason = kill_reason(phases, started=0.0, now=short.total_s + 0.1, budget=short)
    assert reason is not None and reason.startswith(f"run exceeded its total budget of {short.total_s:g} s")
    assert reason.endswith("during warmup")
    assert kill_reason(phases, started=0.0, now=short.total_s + 0.1, budget=long) is None


def test_the_docs_state_the_model_the_code_computes(request):
    """README (bench and daemon sections), deploy/daemon.toml and the --budget-s help describe one model."""
    import re

    from joulepilot.compiler import budget as model

    root = Path(request.config.rootpath)
    texts = {"README.md": (root / "README.md").read_text(), "daemon.toml": (root / "deploy/daemon.toml").read_text()}
    for name, text in texts.items():
        stated = re.findall(r"(\d+) s \+ (\d+) x (?:bench\.)?min_seconds", text)
        assert stated, f"{name} does not state the allowance"
        assert {(float(a), float(b)) for a, b in stated} == {
            (model.SETUP_ALLOWANCE_S, model.MEASURE_ALLOWANCE_FACTOR)}, name
    grace = re.search(r"A kill lands within (\d+) s of its limit", texts["README.md"])
    assert grace and float(grace.group(1)) == model.KILL_GRACE_S
