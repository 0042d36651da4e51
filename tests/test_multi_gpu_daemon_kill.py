"""SIGKILL of the daemon in the middle of a sweep over two GPUs, then a restart: no half-written run, no
duplicate, every job measured once.

The daemon that is killed is a real process; NVML in it and in its workers is the fake with two GPUs
(`fake_pynvml.subprocess_env`), and the workers are the flow worker (tests/flow_worker.py: the worker's
protocols and timing loops on a stand-in for the model, the energy from the fake GPU's counter). The restart,
about what the next daemon makes of what the killed one left, runs the same command in this process (`joulepilot daemon --once` through click, NVML the same fake installed here), which
saves a process start with its imports.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import signal
import subprocess

import psutil
from click.testing import CliRunner
from daemon_factories import (
    daemon_cmd,
    is_worker,
    poll_query,
    query,
    wait_for,
    write_daemon_config,
    write_policy,
)
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu

from joulepilot.cli import main

UUIDS = ("GPU-0a0a0a0a-1111-2222-3333-444444444444", "GPU-1b1b1b1b-1111-2222-3333-444444444444")


def workers_of(pid: int) -> list[psutil.Process]:
    """Every benchmark worker process under `pid`: each GPU's zygote of the workload, and the jobs' workers
    forked from them."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for proc in children:
        try:
            if is_worker(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def job_workers_of(pid: int) -> list[psutil.Process]:
    """The workers running a job under `pid` (not the zygotes, the daemon's own children, that fork them)."""
    found = []
    for proc in workers_of(pid):
        try:
            if proc.ppid() != pid:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_sigkill_mid_parallel_sweep_then_restart_leaves_no_half_written_or_duplicate_run(
        tmp_path, monkeypatch, flow_worker, own_tmpdir, restore_logging):
    gpus = [FakeGpu(uuid=UUIDS[0], power_w=100.0), FakeGpu(uuid=UUIDS[1], power_w=300.0)]
    for name, value in fake_pynvml.subprocess_env(gpus).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "mlp", modes=("eager", "default"), precisions=("fp32", "bf16"))  # four jobs
    # 1 s windows: each job spends over a second in its worker, time enough to be caught running
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, min_seconds=1.0)
    config.write_text('devices = "auto"\n' + config.read_text().replace("[idle]\n", "[idle]\nmin_idle_s = 0\n"))

    daemon = subprocess.Popen(daemon_cmd("--config", str(config)), stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "first.log", "w"), stdin=subprocess.DEVNULL)
    try:
        # Kill it outright once a job is done and two others run at once, each with its worker.
        def two_running_after_one_done() -> list[psutil.Process] | None:
            states = [r["state"] for r in poll_query(db, "SELECT state FROM jobs")]
            running = states.count("done") >= 1 and states.count("running") == 2
            found = job_workers_of(daemon.pid) if running else []
            return found if len(found) == 2 else None

        job_workers = wait_for(two_running_after_one_done, 240, "a finished job and two running at once")
        zygotes = [p for p in workers_of(daemon.pid) if p not in job_workers]
        assert len(zygotes) == 2  # each GPU's zygote of the workload, which forked the job's worker there
        workers = job_workers + zygotes
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait(timeout=10)
    finally:
        if daemon.poll() is None:
            daemon.kill()
    _, alive = psutil.wait_procs(workers, timeout=15)  # zygotes and workers die with it (PR_SET_PDEATHSIG)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    jobs = query(db, "SELECT * FROM jobs ORDER BY id")
    running = [j["id"] for j in jobs if j["state"] == "running"]
    done = [j for j in jobs if j["state"] == "done"]
    assert len(running) == 2 and done
    runs = query(db, "SELECT * FROM runs ORDER BY id")
    # nothing of the two killed jobs was stored; every stored run is a finished job's, whole
    assert {json.loads(r["extra"])["job_id"] for r in runs} == {j["id"] for j in done}
    assert all(r["status"] == "ok" and r["finished_at"] and r["energy_j_per_inference"] for r in runs)
    assert {r["device"] for r in query(db, "SELECT device FROM runs")} <= {"cuda:0", "cuda:1"}
    for run in runs:
        samples = query(db, "SELECT COUNT(*) AS n FROM power_samples WHERE run_id = ?", [run["id"]])[0]["n"]
        assert samples > 0  # the run and its samples, written together

    # Restart: both orphaned jobs go back in the queue and are measured; the finished ones are not redone.
    fake_pynvml.install(monkeypatch, gpus, call_latency_s=0.0035)
    # each job's idle baseline 0.5 s, not a GPU's 2 s: what matters here is which jobs are measured, and where
    monkeypatch.setattr(importlib.import_module("joulepilot.compiler.bench"), "default_idle_s", lambda device: 0.5)
    logging.getLogger("joulepilot").handlers.clear()  # the daemon logs to the stderr the runner gives it
    restart = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert restart.exit_code == 0, (restart.output, restart.stderr)
    assert re.search(rf"job\(s\) {running[0]}, {running[1]} re-queued", restart.stderr)
    summary = json.loads(restart.stdout)
    assert summary["devices"] == ["cuda:0", "cuda:1"] and [d["policy"] for d in summary["decided"]] == ["mlp"]

    jobs = query(db, "SELECT * FROM jobs ORDER BY id")
    assert len(jobs) == 4 and all(j["state"] == "done" for j in jobs)
    runs = query(db, "SELECT * FROM runs ORDER BY id")
    job_of_run = {r["id"]: json.loads(r["extra"])["job_id"] for r in runs}
    for job in jobs:
        assert job_of_run[job["run_id"]] == job["id"]
    # One run per configuration; a second one only as the repeat of a run flagged "repeat this run" (a loaded
    # machine), which re-runs the same job, never as a second job for it.
    for config_id in {r["config_id"] for r in runs}:
        same = [r for r in runs if r["config_id"] == config_id]
        assert all(json.loads(r["extra"]).get("window_warning") for r in same[:-1])
        assert len({job_of_run[r["id"]] for r in same}) == 1
    assert len({r["config_id"] for r in runs}) == 4
    for run in runs:  # each measured on the GPU it names
        index = int(run["device"].split(":")[1])
        assert json.loads(run["extra"])["device_uuids"] == {f"gpu:{index}": UUIDS[index]}
