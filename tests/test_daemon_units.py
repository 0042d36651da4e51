"""The daemon's parts without a benchmark: config, instance lock, queue, heartbeats, planner, idle, runner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from joulepilot.controller.daemon_config import DaemonConfigError, load_daemon_config
from joulepilot.controller.idle import IdleTracker, LoadProbe
from joulepilot.controller.instance_lock import (
    DaemonAlreadyRunning,
    InstanceLock,
    lock_is_held,
    lock_path_for,
    read_lock_pid,
)
from joulepilot.controller.job_runner import JobRunner
from joulepilot.controller.planner import compile_cost_rank, stale_reason
from joulepilot.policies.noise import MODE_SIMPLICITY
from joulepilot.store.daemon_state import (
    add_request,
    claim_job,
    drop_queued_jobs,
    enqueue_job,
    finish_job,
    latest_heartbeat,
    mark_requests_handled,
    queue_counts,
    queued_jobs,
    recover_jobs,
    requeue_job,
    unhandled_requests,
    write_heartbeat,
)
from joulepilot.store.decisions import DecisionRow

# --- config -----------------------------------------------------------------------------------------


def test_defaults_need_no_file(_isolated_home):
    cfg = load_daemon_config(None)
    assert cfg.db == _isolated_home / "joulepilot.db"
    assert cfg.policies == (_isolated_home / "policies",)
    assert cfg.interval_s == 300 and cfg.max_decision_age_s == 7 * 86400
    assert cfg.devices == ("auto",)
    assert cfg.exporter.bind == "127.0.0.1" and cfg.exporter.port == 9464


def test_example_config_parses_and_overrides_win(tmp_path):
    cfg = load_daemon_config("deploy/daemon.toml")
    assert cfg.interval_s == 300 and cfg.idle.max_utilization_pct == 10 and cfg.bench.min_seconds == 5
    over = cfg.with_overrides(db=tmp_path / "x.db", policies=[tmp_path / "a", tmp_path / "b"])
    assert over.db == tmp_path / "x.db" and over.policies == (tmp_path / "a", tmp_path / "b")


def test_relative_paths_are_relative_to_the_config_file(tmp_path):
    path = tmp_path / "conf" / "d.toml"
    path.parent.mkdir()
    path.write_text('db = "state/j.db"\npolicies = "pols"\ndevices = [0, "cuda:1"]\n')
    cfg = load_daemon_config(path)
    assert cfg.db == path.parent.resolve() / "state/j.db"
    assert cfg.policies == (path.parent.resolve() / "pols",)
    assert cfg.devices == ("0", "1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("intervl_s = 5", "unknown key 'intervl_s'; did you mean 'interval_s'?"),
        ("[idle]\nmax_utilisation_pct = 5", "did you mean 'max_utilization_pct'?"),
        ("interval_s = 'often'", "interval_s must be a number"),
        ("devices = 'gpu'", 'devices must be "auto", "cpu" or a list of GPU indices'),
        ("[exporter]\nport = 70000", "exporter.port must be an integer from 0 to 65,535 (a TCP port"),
        ("[idle]\nmax_utilization_pct = 150", "idle.max_utilization_pct must be a number from 1 to 100 (percent)"),
        ("interval_s = = 3", "not valid TOML"),
    ],
)
def test_bad_config_names_file_key_and_fix(tmp_path, text, message):
    path = tmp_path / "daemon.toml"
    path.write_text(text + "\n")
    with pytest.raises(DaemonConfigError) as err:
        load_daemon_config(path)
    assert message in str(err.value)
    assert str(path.name) in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # TOML puts every key below a [section] header into that section: a key written below the wrong header,
        # or above all of them, gets where it belongs (it once got 'did you mean 'exporter'?' or a list of keys)
        ("port = 9464", "unknown key 'port'; did you mean 'exporter.port'? move it under the [exporter] header"),
        ("min_seconds = 2", "unknown key 'min_seconds'; did you mean 'bench.min_seconds'? move it under the [bench] "
                            "header"),
        ("[bench]\npoll_s = 1", "[bench]: unknown key 'poll_s'; did you mean 'idle.poll_s'? move it under the [idle] "
                                "header"),
        ("[idle]\npoll_s = 1\ninterval_s = 60", "[idle]: unknown key 'interval_s'; interval_s is a top-level key: "
                                                "move it above the first [section] header"),
    ],
)
def test_a_key_below_the_wrong_header_is_pointed_to_where_it_belongs(tmp_path, text, message):
    path = tmp_path / "daemon.toml"
    path.write_text(text + "\n")
    with pytest.raises(DaemonConfigError) as err:
        load_daemon_config(path)
    assert str(err.value).startswith(str(path.resolve())) and str(err.value).endswith(message)
    assert "\n" not in str(err.value)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(DaemonConfigError, match="cannot read daemon config .*nope.toml"):
        load_daemon_config(tmp_path / "nope.toml")


# --- instance lock ----------------------------------------------------------------------------------


def test_lock_names_the_holder_pid_and_is_released_on_death(tmp_path):
    db = tmp_path / "j.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from joulepilot.controller.instance_lock import InstanceLock
            InstanceLock({str(db)!r}).acquire()
            print("held", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock_file = tmp_path / "j.db.daemon.lock"
        assert lock_is_held(lock_file) and read_lock_pid(lock_file) == holder.pid
        with pytest.raises(DaemonAlreadyRunning) as err:
            InstanceLock(db).acquire()
        assert f"pid {holder.pid}" in str(err.value) and str(lock_file) in str(err.value)
    finally:
        holder.kill()  # SIGKILL: the kernel drops the flock with the process
        holder.wait()
    with InstanceLock(db) as lock:
        assert lock.held and read_lock_pid(lock.path) == os.getpid()
    assert not lock_is_held(tmp_path / "j.db.daemon.lock")


def test_two_paths_to_one_database_share_its_lock(tmp_path, monkeypatch):
    db = tmp_path / "daemon.db"
    db.write_bytes(b"")
    alias = tmp_path / "alias.db"
    alias.symlink_to(db)
    monkeypatch.chdir(tmp_path)
    with InstanceLock(db) as lock:
        assert lock.held
        for other in (alias, Path("daemon.db"), Path("alias.db")):
            with pytest.raises(DaemonAlreadyRunning):
                InstanceLock(other).acquire()
        assert lock_is_held(lock_path_for(alias))


# --- queue, heartbeats, requests --------------------------------------------------------------------


def _job(db, config_id="c1", key="p1", policy="mlp"):
    return enqueue_job(db, policy=policy, workload_id="w1", config_id=config_id, provenance_key=key, max_attempts=2)


def test_queue_is_unique_per_workload_config_provenance(db):
    first, created = _job(db)
    again, created_again = _job(db)
    assert created and not created_again and first == again
    other, _ = _job(db, key="p2")  # new software: a new measurement
    assert other != first
    assert [j["id"] for j in queued_jobs(db)] == [first, other]


def test_job_lifecycle_and_recovery(db):
    job, _ = _job(db)
    assert claim_job(db, job) and not claim_job(db, job)
    requeue_job(db, job)  # stopped: back in the queue, the attempt not counted
    row = next(db.query("SELECT * FROM jobs WHERE id = ?", [job]))
    assert row["state"] == "queued" and row["attempts"] == 0
    assert claim_job(db, job, host_id="this-host")
    assert recover_jobs(db, "another-host") == []  # another host's claim, and its lease holds (none given)
    assert recover_jobs(db, "this-host") == [job]  # this host's daemon died with it running: the attempt counts
    row = next(db.query("SELECT * FROM jobs WHERE id = ?", [job]))
    assert row["state"] == "queued" and row["attempts"] == 1
    claim_job(db, job)
    finish_job(db, job, state="failed", run_id=None)
    assert _job(db) == (job, False)  # two attempts, max_attempts 2: left failed
    assert db.execute("UPDATE jobs SET attempts = 1").rowcount == 1
    assert _job(db) == (job, True)  # one attempt: queued again
    assert queue_counts(db) == {"queued": 1, "running": 0, "done": 0, "failed": 0}


def test_drop_queued_jobs_keeps_the_plan(db):
    a, _ = _job(db, "a")
    b, _ = _job(db, "b")
    c, _ = _job(db, "c", policy="other")
    assert drop_queued_jobs(db, "mlp", keep_ids=[a]) == 1
    assert [j["id"] for j in queued_jobs(db)] == [a, c]
    assert b not in [j["id"] for j in queued_jobs(db)]


def test_heartbeats_and_requests(db):
    write_heartbeat(db, "idle", {"doing": "nothing"}, keep=3)
    for _ in range(5):
        write_heartbeat(db, "sweeping", {"doing": "measuring"}, keep=3)
    hb = latest_heartbeat(db)
    assert hb["state"] == "sweeping" and hb["detail"]["doing"] == "measuring" and hb["pid"] == os.getpid()
    assert db.execute("SELECT COUNT(*) FROM heartbeats").fetchone()[0] == 3
    with pytest.raises(ValueError, match="heartbeat state"):
        write_heartbeat(db, "dancing")
    r1 = add_request(db, "mlp", workload="mlp")
    assert add_request(db, "mlp") == r1  # one open request per policy
    mark_requests_handled(db, [r1])
    assert unhandled_requests(db) == []
    assert next(db.query("SELECT * FROM requests WHERE id = ?", [r1]))["handled_at"] is not None


# --- planner ----------------------------------------------------------------------------------------


def test_cheapest_compile_first():
    configs = [SimpleNamespace(mode=m, precision=p, fusion=f) for m, p, f in [
        ("max-autotune", "fp32", "default"), ("default", "bf16", "default"), ("eager", "bf16", "default"),
        ("default", "fp32", "no-epilogue-fusion"), ("reduce-overhead", "fp32", "default"),
        ("default", "fp32", "default"), ("eager", "fp32", "default")]]
    ordered = sorted(configs, key=compile_cost_rank)
    assert [(c.mode, c.fusion, c.precision) for c in ordered] == [
        ("eager", "default", "fp32"), ("eager", "default", "bf16"), ("default", "default", "fp32"),
        ("default", "default", "bf16"), ("default", "no-epilogue-fusion", "fp32"),
        ("reduce-overhead", "default", "fp32"), ("max-autotune", "default", "fp32")]
    assert MODE_SIMPLICITY[0] == "eager" and MODE_SIMPLICITY[-1] == "max-autotune"


def test_stale_reasons():
    now = time.time()

    def row(**changed):
        columns = {"id": 1, "policy": "p", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                   "config_id": "c", "state": "verified", "reason": "", "decided_at": now - 10,
                   "details": '{"provenance_key": "k"}'}
        return DecisionRow.from_columns(columns | changed)

    kw = {"policy_hash": "h", "provenance_key": "k", "max_age_s": 3600, "now": now}
    assert stale_reason(row(), **kw) is None
    assert stale_reason(None, **kw) == "no decision yet"
    assert "policy file changed" in stale_reason(row(policy_hash="old"), **kw)
    assert "torch, triton or joulepilot changed" in stale_reason(row(details='{"provenance_key": "x"}'), **kw)
    assert "older than" in stale_reason(row(decided_at=now - 7200), **kw)
    assert "broke the envelope" in stale_reason(row(state="violated"), **kw)


# --- idle detection (no GPU here: NVML's answers are played back) -----------------------------------


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _activity(util, pids=(), per_proc=None):
    return SimpleNamespace(utilization_pct=util, compute_pids=list(pids), process_utilization=per_proc,
                           available=True, reason="")


def test_gpu_idle_needs_a_quiet_period_and_no_other_processes():
    from joulepilot.controller.daemon_config import IdleConfig

    readings = iter([_activity(3), _activity(4), _activity(80), _activity(2), _activity(1), _activity(1, [1])])
    clock = Clock()
    tracker = IdleTracker(LoadProbe("cuda:0", IdleConfig(max_utilization_pct=10, min_idle_s=60),
                                    gpu_activity=lambda i: next(readings)), clock=clock)
    own = {os.getpid()}
    assert not tracker.poll(own)  # quiet, but not for long enough
    clock.t = 61
    assert tracker.poll(own)  # quiet for 61 s
    clock.t = 62
    assert not tracker.poll(own)  # production load: 80 %
    clock.t = 100
    assert not tracker.poll(own)  # quiet again from t=100
    clock.t = 161
    assert tracker.poll(own)
    assert tracker.busy_now(own)  # another (live) process appears on the GPU during our job
    assert "[1]" in tracker.last.reason


def test_own_worker_does_not_count_but_foreign_utilisation_does():
    from joulepilot.controller.daemon_config import IdleConfig

    worker = os.getppid()  # stands for a live process of ours
    stranger = 1  # a live process that is not ours
    ghost = 2**22 + 17  # a pid outside our namespace, as NVML reports inside containers
    cfg = IdleConfig(max_utilization_pct=10)
    probe = LoadProbe("cuda:0", cfg, gpu_activity=lambda i: _activity(95, [worker], {worker: 95}))
    assert not probe.read({os.getpid(), worker}, during_job=True).busy  # 95 % is our own benchmark
    assert probe.read({os.getpid()}).busy  # between jobs 95 % is production load
    probe = LoadProbe("cuda:0", cfg, gpu_activity=lambda i: _activity(95, [ghost], {ghost: 95}))
    assert not probe.read({os.getpid()}, during_job=True).busy  # our worker seen through a pid namespace
    assert probe.read({os.getpid()}).busy
    relaxed = IdleConfig(max_utilization_pct=10, allow_other_processes=True)
    probe = LoadProbe("cuda:0", relaxed, gpu_activity=lambda i: _activity(95, [worker, stranger],
                                                                          {worker: 60, stranger: 35}))
    reading = probe.read({os.getpid(), worker}, during_job=True)
    assert reading.busy and "35%" in reading.reason


def test_cpu_device_is_idle_without_threshold_and_nvml_absence_is_said():
    from joulepilot.controller.daemon_config import IdleConfig
    from joulepilot.telemetry import gpu_activity

    tracker = IdleTracker(LoadProbe("cpu", IdleConfig()))
    assert tracker.poll() and not tracker.needs_quiet_period
    reading = LoadProbe("cuda:0", IdleConfig(), gpu_activity=gpu_activity).read()  # real NVML: absent here
    assert not reading.busy and "cannot judge load" in reading.reason


# --- the job runner stops the worker and everything below it -----------------------------------------


def _fake_worker(tmp_path, monkeypatch, name: str, body: str) -> None:
    """A stand-in for the compiler's worker module (the tests are about stopping it, not compiling)."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(textwrap.dedent(body))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr("joulepilot.compiler.runner.WORKER_MODULE", f"{name}.main")


def _scratch_of_this_process() -> list[str]:
    import glob
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{os.getpid()}-*"))


def test_runner_cancel_kills_the_whole_tree(tmp_path, monkeypatch):
    import threading

    import psutil
    from joulepilot.compiler import worker_budget
    from joulepilot.compiler.runner import run_worker_job

    # The worker starts a grandchild in its own session, out of reach of a process-group kill.
    marker = tmp_path / "grandchild.pid"
    _fake_worker(tmp_path, monkeypatch, "fakeworker", f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        open({str(marker)!r}, "w").write(str(p.pid))
        time.sleep(120)
    """)
    runner = JobRunner()

    def cancel_once_the_grandchild_runs() -> None:  # the worker has started it: the whole tree is there
        deadline = time.monotonic() + 60
        while not (marker.is_file() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        runner.cancel("test stop")

    threading.Thread(target=cancel_once_the_grandchild_runs, daemon=True).start()
    t0 = time.monotonic()
    outcome = runner.run(lambda stop, started: run_worker_job({}, budget=worker_budget(60, 1), cancel=stop,
                                                               on_start=started))
    assert outcome.kind == "stopped" and outcome.reason == "test stop"
    assert outcome.result["status"] == "cancelled"
    assert time.monotonic() - t0 < 10
    grandchild = int(marker.read_text())
    for _ in range(50):
        if not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert runner.pid is None and not _scratch_of_this_process()  # scratch folder removed
    # A stop is final: the daemon is going away, so a later job does not even start.
    assert runner.run(lambda stop, started: pytest.fail("started after a stop")).kind == "stopped"


def test_runner_returns_as_soon_as_the_worker_ends(tmp_path, monkeypatch):
    from joulepilot.compiler import runner, worker_budget

    _fake_worker(tmp_path, monkeypatch, "quick", """
        import json, sys
        job = json.load(open(sys.argv[1]))
        json.dump({"status": "ok"}, open(job["result_path"], "w"))
    """)
    # The parent looks at a running worker's phases every POLL_S; its end must not wait for the next look.
    monkeypatch.setattr(runner, "POLL_S", 30.0)
    t0 = time.monotonic()
    result = runner.run_worker_job({}, budget=worker_budget(60, 1))
    assert result["status"] == "ok"
    assert time.monotonic() - t0 < 15


def test_runner_preempts_when_production_load_returns(tmp_path, monkeypatch):
    from joulepilot.compiler import worker_budget
    from joulepilot.compiler.runner import run_worker_job

    _fake_worker(tmp_path, monkeypatch, "sleeper", "import time\ntime.sleep(120)\n")
    checks = iter([None, None, "GPU 0 utilisation 85% >= 10%"])
    runner = JobRunner()
    pids: list[int] = []
    outcome = runner.run(lambda stop, started: run_worker_job({}, budget=worker_budget(60, 1), cancel=stop,
                                                               on_start=started),
                         preempt_check=lambda: next(checks), preempt_every_s=0.3, on_start=pids.append)
    assert outcome.kind == "preempted" and "85%" in outcome.reason
    assert len(pids) == 1 and not psutil_alive(pids[0])
    assert runner.pid is None and not _scratch_of_this_process()


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def db(backend_db):
    """Every test here on both backends (SQLite and PostgreSQL)."""
    return backend_db


def test_a_host_takes_the_jobs_of_configurations_it_has_not_measured_first(db):
    # A contender's repeat queued beside another configuration's: this host measured the contender already, so
    # it takes the other job first and leaves the repeat to another host of the fleet where one is free.
    from types import SimpleNamespace

    from joulepilot.controller.daemon import Daemon
    from joulepilot.store import insert_run, upsert_config, upsert_host, upsert_workload

    upsert_host(db, {"id": "me", "hostname": "me"})
    upsert_workload(db, {"id": "w1", "spec": "mlp", "batch_size": 8})
    for config in ("c1", "c2"):
        upsert_config(db, {"id": config, "label": config, "mode": "eager", "fusion": "default", "options": {},
                           "precision": "fp32", "dynamic": 0, "batch_size": 8})
    insert_run(db, {"workload_id": "w1", "config_id": "c1", "host_id": "me", "device": "cpu", "status": "ok",
                    "started_at": 1.0, "provenance_key": "p1"})
    repeat, _ = _job(db, "c1")
    other, _ = _job(db, "c2")
    daemon = Daemon.__new__(Daemon)
    daemon.db, daemon.host_id = db, "me"
    probe = SimpleNamespace(provenance_key="p1")
    assert [j.id for j in daemon._runnable_jobs({"mlp": object()}, probe)] == [other, repeat]
    daemon.host_id = "another-host"  # it measured neither: the queue's order
    assert [j.id for j in daemon._runnable_jobs({"mlp": object()}, probe)] == [repeat, other]


def test_a_decision_another_host_stored_during_the_pass_is_not_made_again(db, tmp_path):
    # Told by the decisions' ids (one database numbers them in order), not by the hosts' clocks.
    from types import SimpleNamespace

    from daemon_factories import write_policy
    from joulepilot.compiler import CompileConfig
    from joulepilot.controller.daemon import Daemon
    from joulepilot.policies import load_policy
    from joulepilot.store import upsert_config
    from joulepilot.store.decisions import write_decision

    policy = load_policy(write_policy(tmp_path / "policies", "mlp"))
    probe = SimpleNamespace(device_kind="cpu", provenance_key="p1")
    daemon = Daemon.__new__(Daemon)
    daemon.db, daemon.cfg = db, load_daemon_config(None)
    upsert_config(db, CompileConfig(mode="eager", batch_size=8).to_row())

    def decide(at: float, state: str = "verified") -> int:
        return write_decision(db, {"policy": "mlp", "policy_hash": policy.hash, "device_kind": "cpu",
                                   "torch_version": "2.13",
                                   "config_id": CompileConfig(mode="eager", batch_size=8).id, "state": state, "reason": "", "decided_at": at,
                                   "details": {"provenance_key": "p1", "config": CompileConfig(mode="eager", batch_size=8).to_row()}})

    seen = decide(time.time() - 3600)
    daemon._decision_seen = {"mlp": seen}  # what this pass read (a second ago): the sweep was unfinished
    assert not daemon._decided_elsewhere(policy, probe)  # nothing new: this host decides
    decide(time.time() - 2)  # another host decided since, its clock two seconds behind this one's
    assert daemon._decided_elsewhere(policy, probe)
    daemon._decision_seen = {"mlp": decide(time.time(), state="violated")}
    decide(time.time())
    assert daemon._decided_elsewhere(policy, probe)
