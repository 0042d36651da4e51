"""The daemon on a host with two GPUs: a job on every idle GPU at once, each metered on its own GPU's counter,
compile threads split between them; a GPU with production work on it gets no job while the idle one does, and
production returning on one GPU stops only that GPU's job.

No GPU here: NVML is the fake (in this process, where the daemon runs, and through
`fake_pynvml.subprocess_env` in its workers), and the workers are the flow worker (tests/flow_worker.py: the
worker's protocols and timing loops on a stand-in for the model, the energy from the fake GPU's counter). A production process is a live process of this test that the fake lists
on a GPU. The SIGKILL test for the parallel sweep is in test_multi_gpu_daemon_kill.py.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import threading
import time

import pytest
from daemon_factories import query, write_daemon_config, write_policy
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.compiler import device_pool
from joulepilot.compiler.zygote import FORKED
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.idle import own_process_tree

UUIDS = ("GPU-0a0a0a0a-1111-2222-3333-444444444444", "GPU-1b1b1b1b-1111-2222-3333-444444444444")
WATTS = (100.0, 300.0)  # far apart, so a run metered on the wrong GPU shows it
CORES = 16  # the host's cores as the scheduler is told them (this machine has fewer)
IDLE_S = 0.5  # each job's idle baseline (2 s on a GPU): these tests check which GPU it is taken on, not its length


# The daemon configures the `joulepilot` logger (its own handler, no propagation): conftest's fixture puts
# it back, or later tests in this process that read log records through pytest would see none.
pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture
def gpus(monkeypatch, flow_worker):
    two = [FakeGpu(uuid=uuid, power_w=watts) for uuid, watts in zip(UUIDS, WATTS, strict=True)]
    fake_pynvml.install_everywhere(monkeypatch, two)
    monkeypatch.delenv(device_pool.COMPILE_THREADS_ENV, raising=False)
    monkeypatch.setattr(device_pool, "available_cores", lambda: CORES)
    monkeypatch.setattr(importlib.import_module("joulepilot.compiler.bench"), "default_idle_s", lambda device: IDLE_S)
    return two


@pytest.fixture
def production():
    """A live process outside the daemon's process tree (the daemon runs in this test's process, so not a child
    of it: a shell's orphan), standing for production work once the fake lists it on a GPU."""
    shell = subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                           check=True)
    pid = int(shell.stdout.strip())
    assert pid not in own_process_tree()
    yield pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def two_gpu_daemon(tmp_path, *, devices: str = "[0, 1]", interval_s: float = 3600, min_seconds: float = 1.0,
                   **policy) -> tuple[Daemon, object]:
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "mlp", **({"modes": ("eager",), "precisions": ("fp32", "bf16")} | policy))
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, interval_s=interval_s,
                                 min_seconds=min_seconds)
    config.write_text(f"devices = {devices}\n" + config.read_text().replace("[idle]\n", "[idle]\nmin_idle_s = 0\n"))
    return Daemon.from_cli(config_path=str(config), db=None, policies=()), db


def runs_of(db) -> list[dict]:
    runs = query(db, "SELECT * FROM runs ORDER BY id")
    for run in runs:
        run["extra"] = json.loads(run["extra"])
    return runs


def overlap_s(a: dict, b: dict) -> float:
    return min(a["finished_at"], b["finished_at"]) - max(a["started_at"], b["started_at"])


def test_two_jobs_at_once_each_on_its_own_gpu_and_counter(tmp_path, gpus):
    daemon, db = two_gpu_daemon(tmp_path)
    result = daemon.run(once=True)
    assert result.exit_code == 0, result.summary
    summary = result.summary
    assert summary["devices"] == ["cuda:0", "cuda:1"] and summary["runs_failed"] == 0
    assert [d["policy"] for d in summary["decided"]] == ["mlp"]

    runs = runs_of(db)
    first, second = runs[:2]  # the two jobs, started together (a flagged run's repeat may follow)
    assert {first["device"], second["device"]} == {"cuda:0", "cuda:1"}
    assert first["config_id"] != second["config_id"]
    assert overlap_s(first, second) > 0.5  # measured at the same time
    for run in runs:
        index = int(run["device"].split(":")[1])
        extra = run["extra"]
        assert run["status"] == "ok" and run["energy_source"] == "nvml"
        assert extra["device_uuids"] == {f"gpu:{index}": UUIDS[index]}  # metered on its own GPU, by UUID
        # ... that GPU's counter: within a third of its watts, which tells 100 W from 300 W apart while a
        # 1-s window on a busy host reads the ~100 ms counter steps with a few steps' error (348 W seen)
        assert run["avg_power_w"] == pytest.approx(WATTS[index], rel=1 / 3)
        assert run["idle_power_w"] == pytest.approx(WATTS[index], rel=1 / 3)  # its idle baseline: the same GPU
        # each worker compiled with half of the cores, and numbered GPUs as NVML does
        assert extra["fake_worker_env"] == {"TORCHINDUCTOR_COMPILE_THREADS": str(CORES // 2),
                                            "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        # ... forked from its GPU's zygote of the workload, which applied the job's variables to it
        assert extra["worker_process"] == FORKED
    # the heartbeats named both running jobs with their GPUs and workers (what `status` and a restart read)
    beats = [json.loads(b["detail"]) for b in query(db, "SELECT detail FROM heartbeats WHERE state = 'sweeping'")]
    both = [b["jobs"] for b in beats if len(b["jobs"]) == 2 and all(j.get("worker_pid") for j in b["jobs"])]
    assert both and {j["device"] for j in both[-1]} == {"cuda:0", "cuda:1"}
    jobs = query(db, "SELECT * FROM jobs ORDER BY id")
    assert len(jobs) == 2 and all(j["state"] == "done" for j in jobs)
    for job in jobs:  # each job linked to the run it produced, and back
        run = next(r for r in runs if r["id"] == job["run_id"])
        assert run["extra"]["job_id"] == job["id"] and run["config_id"] == job["config_id"]


def test_a_busy_gpu_gets_no_job_while_the_idle_one_does(tmp_path, gpus, production):
    gpus[0].processes = [production]
    daemon, db = two_gpu_daemon(tmp_path, min_seconds=0.5)  # about where the jobs run, not their windows
    result = daemon.run(once=True)
    assert result.exit_code == 0, result.summary
    assert not result.summary["paused"] and result.summary["runs_ok"] >= 2
    runs = runs_of(db)
    assert {r["device"] for r in runs} == {"cuda:1"}  # nothing ran beside the production work
    assert all(r["extra"]["device_uuids"] == {"gpu:1": UUIDS[1]} for r in runs)
    assert overlap_s(runs[0], runs[1]) < 0  # one after another, on the one idle GPU
    assert [j["state"] for j in query(db, "SELECT state FROM jobs")] == ["done", "done"]


def test_a_gpu_waiting_for_its_quiet_period_has_its_zygote_started_meanwhile(tmp_path, gpus, production,
                                                                             monkeypatch, live_children):
    """While production work keeps cuda:0 from being idle, the daemon starts the zygote of the next job's
    workload there (CPU work only, which does not disturb the GPU's quiet period), and ends it with the pass.
    The idle GPU's two jobs share one idle baseline, taken at its first job."""
    import joulepilot.compiler as compiler
    from joulepilot.compiler.zygote import ZygotePool

    contexts: list[str] = []
    real_context = compiler.sweep_context
    monkeypatch.setattr(compiler, "sweep_context", lambda device, idle_s: contexts.append(device) or
                        real_context(device, idle_s))
    early: list[tuple[str, bool]] = []
    real = ZygotePool.start_early

    def recorded(pool, job, start):
        real(pool, job, start)
        early.append((job["device"], pool.pending_on(job["device"]) is not None))

    monkeypatch.setattr(ZygotePool, "start_early", recorded)
    gpus[0].processes = [production]
    daemon, db = two_gpu_daemon(tmp_path)
    result = daemon.run(once=True)
    assert result.exit_code == 0, result.summary
    runs = runs_of(db)
    assert {r["device"] for r in runs} == {"cuda:1"} and len(runs) >= 2
    assert contexts == ["cuda:1"]
    assert ("cuda:0", True) in early  # started on the busy GPU while it waited
    assert not [p for p in live_children() if p.pid != production]


def test_production_returning_on_one_gpu_stops_only_its_job(tmp_path, gpus, production):
    # 1.5 s windows: the job on cuda:0 is stopped within a poll (0.5 s) of its worker's start, well before its end
    daemon, db = two_gpu_daemon(tmp_path, min_seconds=1.5)
    stopped: dict[str, int] = {}

    def production_starts_on_gpu0() -> None:
        # once the job on cuda:0 has its worker, production work appears on that GPU
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            on_gpu0 = [j for j in daemon.running_jobs() if j["device"] == "cuda:0" and j.get("worker_pid")]
            if on_gpu0:
                stopped["job"] = on_gpu0[0]["id"]
                gpus[0].processes = [production]
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=production_starts_on_gpu0, daemon=True)
    watcher.start()
    result = daemon.run(once=True)
    watcher.join(timeout=5)
    assert result.exit_code == 0, result.summary
    summary = result.summary
    assert "job" in stopped and summary["requeued"] == 1 and not summary["paused"]
    runs = runs_of(db)
    # the job on cuda:1 went on; the stopped one went back to the queue and was measured on cuda:1 after it
    assert {r["device"] for r in runs} == {"cuda:1"}
    stopped_run = next(r for r in runs if r["extra"]["job_id"] == stopped["job"])
    assert stopped_run["status"] == "ok" and stopped_run["started_at"] > runs[0]["started_at"]
    jobs = query(db, "SELECT * FROM jobs ORDER BY id")
    assert [j["state"] for j in jobs] == ["done", "done"]
    assert all(len([r for r in runs if r["extra"]["job_id"] == j["id"]]) >= 1 for j in jobs)


def test_every_gpu_busy_pauses_without_starting_anything(tmp_path, gpus, production):
    for gpu in gpus:
        gpu.processes = [production]
    daemon, db = two_gpu_daemon(tmp_path, interval_s=1)
    started = time.monotonic()
    result = daemon.run(once=True)
    assert result.summary["paused"] and result.summary["runs_ok"] == 0
    assert time.monotonic() - started < 60
    assert query(db, "SELECT COUNT(*) AS n FROM runs")[0]["n"] == 0
    assert {j["state"] for j in query(db, "SELECT state FROM jobs")} == {"queued"}
    beats = query(db, "SELECT detail FROM heartbeats WHERE state = 'paused'")
    assert any("waiting for an idle device" in json.loads(b["detail"])["doing"] for b in beats)
