"""A worker that crashes, hangs, runs out of memory or cannot build its model ends as a failed run with
its reason, and the sweep goes on. These use eager configurations so no Inductor compile is needed:
the misbehaving call is the configuration's first (the "compile" phase) either way. So the workers are the fake
worker (tests/fake_worker.py), which for an eager configuration runs the real worker's code, from a zygote that
does not preload the compiler that none of them calls."""

from __future__ import annotations

import time

import pytest
from joulepilot.compiler import CompileConfig, WorkloadError, bench
from joulepilot.store import list_runs


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request, fake_worker):
    # the worker subprocess imports tests.workload_factories through the parent's import roots
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def _bench(spec, db, configs=None, **kwargs):
    configs = configs or [CompileConfig(mode="eager")]
    return bench(spec, configs, device="cpu", min_seconds=0.2, db=db, idle_s=0, **kwargs)


def test_crash_is_recorded_and_the_sweep_goes_on(db):
    runs = _bench("tests.workload_factories:exits_under_autocast", db,
                  [CompileConfig(mode="eager", precision="bf16"), CompileConfig(mode="eager", precision="fp32")])
    crashed, fine = runs
    assert crashed["status"] == "failed"
    assert crashed["reason"].startswith("worker exited with code 3 during compile")
    assert crashed["compile_s"] is None and crashed["energy_j_per_inference"] is None
    assert fine["status"] == "ok" and fine["energy_j_per_inference"] > 0
    stored = {r["id"]: r for r in list_runs(db)}
    assert stored[crashed["run_id"]]["status"] == "failed"
    assert stored[fine["run_id"]]["status"] == "ok"
    assert stored[crashed["run_id"]]["device_name"] == fine["device_name"]
    assert stored[crashed["run_id"]]["provenance_key"] == fine["provenance_key"]


def test_segfault_names_the_signal(db):
    (run,) = _bench("tests.workload_factories:segfaults", db)
    assert run["status"] == "failed"
    assert "worker killed by SIGSEGV during compile" in run["reason"]


def test_hang_past_the_compile_budget_is_killed(db):
    started = time.monotonic()
    (run,) = _bench("tests.workload_factories:hangs", db, budget_s=3)
    assert run["status"] == "failed"
    assert run["reason"] == "compile exceeded budget of 3 s"
    assert time.monotonic() - started < 120
    assert run["extra"]["phase"] == "compile"


def test_out_of_memory_is_named(db):
    (run,) = _bench("tests.workload_factories:runs_out_of_memory", db)
    assert run["status"] == "failed"
    assert run["reason"].startswith("out of memory during compile")
    assert any("OutOfMemoryError" in line for line in run["extra"]["traceback_tail"])


def test_factory_that_raises_is_a_failed_run(db):
    (run,) = _bench("tests.workload_factories:raises", db)
    assert run["status"] == "failed"
    assert "WorkloadError during load" in run["reason"]
    assert "the factory raised ValueError: weights file /nonexistent/model.pt is missing" in run["reason"]


def test_a_workload_that_cannot_be_built_stops_the_sweep_at_its_first_configuration(db):
    notices = []
    configs = [CompileConfig(mode="eager", precision=p) for p in ("fp32", "bf16", "fp16")]
    runs = _bench("tests.workload_factories:raises", db, configs, notice=notices.append)
    assert [(r["config_label"], r["status"]) for r in runs] == [("eager/fp32/b1", "failed")]
    assert runs[0]["extra"]["phase"] == "load"
    assert [r["id"] for r in list_runs(db)] == [runs[0]["run_id"]]  # one run stored (and billed), not three
    stops = [n for n in notices if n.startswith("stopped")]
    assert len(stops) == 1 and "the other 2 configurations were not measured" in stops[0], notices


def test_bad_spec_is_refused_before_any_run(db):
    with pytest.raises(WorkloadError, match="module 'no_such_package.models' is not importable"):
        _bench("no_such_package.models:build", db)
    assert list_runs(db) == []


def test_cli_reports_a_bad_spec_plainly(tmp_path):
    from click.testing import CliRunner

    from joulepilot.cli import main

    result = CliRunner().invoke(main, ["bench", "tests.workload_factories:nope", "--device", "cpu",
                                       "--db", str(tmp_path / "x.db")])
    assert result.exit_code == 1
    assert "workload 'tests.workload_factories:nope': module 'tests.workload_factories' has no attribute 'nope'" \
        in result.output
