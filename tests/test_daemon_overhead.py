"""What a daemon pass spends besides measuring: one idle baseline per pass and device, workers forked from
the workload's zygote, warm starts only for the decided configuration and the runner-up; and the start-up
check that ends a dead daemon's worker leaves a live sweep's forked workers alone."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
from daemon_factories import wait_for, write_daemon_config, write_policy
from joulepilot.compiler import CompileConfig, worker_budget
from joulepilot.compiler.runner import run_worker_job
from joulepilot.compiler.zygote import FORKED, ZygotePool
from joulepilot.controller.daemon import Daemon, _end_leftover_worker
from joulepilot.controller.daemon_config import load_daemon_config
from joulepilot.controller.redecide import warm_start_candidates
from joulepilot.policies.resolve import Candidate, Decision
from joulepilot.store import list_runs, open_db
from joulepilot.store.daemon_state import write_heartbeat
from joulepilot.store.jsonvalues import json_object


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def test_a_pass_takes_each_devices_idle_baseline_once_and_forks_its_workers(tmp_path, flow_worker, monkeypatch,
                                                                            own_tmpdir, restore_logging, live_children):
    import joulepilot.compiler as compiler

    contexts: list[str] = []
    real = compiler.sweep_context

    def counted(device, idle_s):
        contexts.append(device)
        return real(device, idle_s)

    monkeypatch.setattr(compiler, "sweep_context", counted)
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "mlp", modes=("eager",), precisions=("fp32", "bf16", "tf32"))
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, min_seconds=0.2))
    result = Daemon(cfg).run(once=True)
    assert result.exit_code == 0, result.summary
    assert result.summary["runs_ok"] >= 3
    assert contexts == ["cpu"]  # one idle baseline for the pass's jobs on the CPU
    runs = list_runs(open_db(db))
    assert {json_object(r["extra"])["worker_process"] for r in runs} == {FORKED}
    for run in runs:
        extra = json_object(run["extra"])
        assert extra["job_wall_s"] >= run["window_s"] + extra["latency_s"]
    # The pass's zygote ended with the pass.
    assert not live_children()


def _candidate(label: str, status: str, median: float | None, run_id: int | None = 1, source: str = "measured"):
    return Candidate(config={"id": label, "label": label}, label=label, source=source, status=status,
                     median=median, run_id=run_id)


def test_warm_starts_are_timed_for_the_decided_configuration_and_the_runner_up_only():
    decision = Decision(policy="p", policy_hash="h", device_kind="cpu", torch_version="2.13", workload="mlp",
                        workload_id="w", config={"id": "b", "label": "b"}, state="verified", reason="",
                        objective="energy",
                        expected_inferences=1, candidates=[
                            _candidate("a", "kept", 3.0), _candidate("b", "chosen", 1.0),
                            _candidate("c", "kept", 2.0), _candidate("d", "rejected", 0.5),
                            _candidate("e", "proposed", 0.1, run_id=None, source="predicted"),
                            _candidate("f", "flagged", 2.5)])
    assert [(role, c.label) for role, c in warm_start_candidates(decision)] == [("decided", "b"), ("runner-up", "c")]
    alone = Decision(**{**decision.__dict__, "candidates": [_candidate("b", "chosen", 1.0)]})
    assert [(role, c.label) for role, c in warm_start_candidates(alone)] == [("decided", "b")]
    # Provisional: the fallback (here eager, "x") is applied while the best run is flagged for a repeat.
    provisional = Decision(**{**decision.__dict__, "state": "provisional", "config": {"id": "x", "label": "x"},
                              "candidates": [_candidate("f", "flagged", 2.5), _candidate("x", "kept", 4.0)]})
    assert [(role, c.label) for role, c in warm_start_candidates(provisional)] == [("decided", "x"),
                                                                                  ("runner-up", "f")]


def test_the_start_up_check_leaves_a_live_sweeps_forked_worker_alone(tmp_path, own_tmpdir, flow_worker,
                                                                     monkeypatch):
    """A dead daemon's heartbeat may name a pid that now belongs to a worker of a live bench, forked from its
    zygote (so its parent is the zygote, not bench): it must not be ended. (The worker is the flow worker,
    whose stand-in compile outlasts the test: nothing here compiles.)"""
    monkeypatch.setenv("JOULEPILOT_FAKE_COMPILE_S", "600")
    job = {"kind": "bench", "spec": "mlp", "device": "cpu",
           "config": CompileConfig(mode="default").to_row(), "min_seconds": 0.2, "idle_power_w": {}}
    pids: list[int] = []
    stop = threading.Event()
    results: list[dict] = []
    with ZygotePool() as pool:
        thread = threading.Thread(target=lambda: results.append(run_worker_job(
            job, budget=worker_budget(120, 0.2), zygotes=pool, on_start=pids.append,
            cancel=lambda: "test over" if stop.is_set() else None)))
        thread.start()
        try:
            wait_for(lambda: pids, 120, "the forked worker")
            worker = psutil.Process(pids[0])
            assert worker.ppid() == pool.current.pid  # bench -> zygote -> worker
            db = open_db(tmp_path / "j.db")
            write_heartbeat(db, "sweeping", {"job": {"worker_pid": worker.pid}})
            _end_leftover_worker(db)
            time.sleep(1.0)
            assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        finally:
            stop.set()
            thread.join(60)
    assert results and results[0]["status"] == "cancelled"


def test_on_a_gpu_the_zygote_starts_while_the_daemon_waits_for_the_quiet_period(tmp_path, flow_worker, own_tmpdir,
                                                                                restore_logging):
    """Only on a GPU (its idle check looks at the GPU, which the zygote never touches); on a CPU device the
    zygote's start would be the very load the wait is about."""
    from joulepilot.compiler.zygote import ZygotePool
    from joulepilot.policies import load_policy
    from joulepilot.store import enqueue_job, queued_jobs, upsert_config

    policies = tmp_path / "policies"
    policy = load_policy(write_policy(policies, "mlp", modes=("eager",)))
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=policies))
    daemon = Daemon(cfg)
    daemon.db = open_db(tmp_path / "j.db")
    config = CompileConfig(mode="eager", batch_size=8)
    upsert_config(daemon.db, config.to_row())
    enqueue_job(daemon.db, policy="mlp", workload_id="w", config_id=config.id, provenance_key="p", max_attempts=3)
    (job,) = queued_jobs(daemon.db)
    with ZygotePool() as pool:
        daemon._zygotes = pool
        daemon._start_zygote_while_waiting(job, policy, "cpu")
        assert pool.pending is None
        daemon._start_zygote_while_waiting(job, policy, "cuda:0")
        assert pool.pending is not None and pool.pending.proc.poll() is None
        assert (pool.pending.key.spec, pool.pending.key.batch_size, pool.pending.key.device) == ("mlp", 8, "cuda:0")
    assert pool.pending is None


def test_on_a_gpu_the_next_workloads_zygote_starts_while_the_current_workload_measures(
        tmp_path, flow_worker, monkeypatch, own_tmpdir, restore_logging, live_children):
    """Two workloads on one GPU: while the first one's jobs run, the daemon starts the second one's zygote,
    whose first job is then forked from it without waiting for the imports and the model build."""
    import importlib

    from fakes import fake_pynvml
    from fakes.fake_pynvml import FakeGpu

    fake_pynvml.install_everywhere(monkeypatch, [FakeGpu(uuid="GPU-0a0a0a0a-1111-2222-3333-444444444444",
                                                         power_w=100.0)])
    monkeypatch.setattr(importlib.import_module("joulepilot.compiler.bench"), "default_idle_s", lambda device: 0.5)
    early: list[tuple[float, str, bool]] = []
    real = ZygotePool.start_early

    def recorded(pool, job, start):
        started = real(pool, job, start)
        early.append((time.time(), job["spec"], started))
        return started

    monkeypatch.setattr(ZygotePool, "start_early", recorded)
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "a_mlp", precisions=("fp32", "bf16"))
    write_policy(policies, "b_linear", workload="tests.workload_factories:linear", precisions=("fp32", "bf16"))
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, min_seconds=0.2)
    config.write_text("devices = [0]\n" + config.read_text().replace("[idle]\n", "[idle]\nmin_idle_s = 0\n"))
    result = Daemon.from_cli(config_path=str(config), db=None, policies=()).run(once=True)
    assert result.exit_code == 0, result.summary
    runs = sorted(list_runs(open_db(db)), key=lambda r: r["started_at"])
    assert len(runs) == 4 and {r["device"] for r in runs} == {"cuda:0"}, [r["reason"] for r in runs]
    first, second = runs[0]["workload"], runs[-1]["workload"]
    assert first != second and [r["workload"] for r in runs] == [first, first, second, second]
    extras = [json_object(r["extra"]) for r in runs]
    assert all(e["worker_process"] == FORKED for e in extras)
    assert extras[2]["zygote_early"]  # the second workload's first job used the zygote started ahead of it
    assert {e["idle_from"] for e in extras} == {"measured"}  # no quiet period to take the baseline from
    started_ahead = [t for t, spec, ok in early if ok and spec == second]
    assert started_ahead and runs[0]["started_at"] <= min(started_ahead) <= runs[2]["started_at"], (early, runs)
    assert not live_children()


def test_warm_starts_begin_with_the_policy_whose_workloads_zygote_is_up(tmp_path):
    """After a pass's jobs, the device's zygote is the last workload's: deciding (and timing the warm starts of)
    that policy first uses it, where the pass's first policy would close it and start its own again."""
    from types import SimpleNamespace

    from joulepilot.compiler.zygote import ZygoteKey
    from joulepilot.policies import load_policy

    policies = tmp_path / "policies"
    by_name = {name: load_policy(write_policy(policies, name, workload=workload))
               for name, workload in (("a", "mlp"), ("b", "tests.workload_factories:linear"), ("c", "convnet"))}
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=policies))
    daemon = Daemon(cfg)
    up = ZygoteKey("tests.workload_factories:linear", 8, None, None, 1234, "cuda:0")
    daemon._zygotes = SimpleNamespace(zygote_on=lambda device: SimpleNamespace(key=up) if device == "cuda:0" else None)
    assert daemon._warm_zygote_first(["a", "b", "c"], by_name, "cuda:0") == ["b", "a", "c"]
    assert daemon._warm_zygote_first(["a", "b", "c"], by_name, "cuda:1") == ["a", "b", "c"]
    daemon._zygotes = None
    assert daemon._warm_zygote_first(["c", "a"], by_name, "cuda:0") == ["c", "a"]
