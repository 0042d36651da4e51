"""The daemon under faults, for real: SIGKILL mid-sweep, SIGTERM mid-compile, a second daemon, SIGHUP,
a broken policy file beside good ones."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from daemon_factories import (
    TESTS_DIR,
    daemon_cmd,
    is_worker,
    poll_query,
    query,
    wait_for,
    write_daemon_config,
    write_policy,
)
from joulepilot.compiler import worker_budget

from joulepilot.cli import main


def status_json(db: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "joulepilot", "status", "--db", str(db), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def start_daemon(config: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(daemon_cmd("--config", str(config)), stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"), stdin=subprocess.DEVNULL)


def family(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _parent(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def all_gone(procs: list[psutil.Process], timeout_s: float = 10) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_sigkill_mid_sweep_then_restart_resumes_without_duplicates(tmp_path, flow_worker, own_tmpdir,
                                                                   restore_logging):
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    # The restart must find the first job's run current: a workload whose calls a busy machine cannot get
    # flagged "repeat this run" (which would make the restart measure it again).
    write_policy(policies, "mlp", workload=f"{TESTS_DIR / 'workload_factories.py'}:steady", modes=("eager",),
                 precisions=("fp32", "bf16"))
    (policies / "broken.toml").write_text('name = "broken"\nworkload = "mlp"\nbatch_size = 8\nobjectiv = 1\n')
    # 1 s windows: the second job spends over a second in its worker, time enough to be caught running
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, min_seconds=1.0)

    daemon = start_daemon(config, tmp_path / "first.log")
    try:
        # Let the first job finish and the second start, then kill the daemon outright.
        wait_for(lambda: poll_query(db, "SELECT 1 FROM jobs WHERE id = 2 AND state = 'running'"), 180,
                 "the second job to start")
        assert query(db, "SELECT state FROM jobs WHERE id = 1")[0]["state"] == "done"
        wait_for(lambda: [p for p in family(daemon.pid) if is_worker(_cmdline(p))], 60,
                 "the second job's worker")
        children = family(daemon.pid)
        os.kill(daemon.pid, signal.SIGKILL)
        daemon.wait(timeout=10)
    finally:
        if daemon.poll() is None:
            daemon.kill()
    # Its zygote and the worker forked from it die with it (PR_SET_PDEATHSIG).
    assert not any("job_child" in " ".join(_cmdline(p)) for p in children)
    assert all_gone(children, 15), [p.cmdline() for p in children if p.is_running()]
    scratch = glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{daemon.pid}-*"))
    assert scratch  # nothing could clean up after a SIGKILL: the restart does
    assert query(db, "SELECT state FROM jobs ORDER BY id") == [{"state": "done"}, {"state": "running"}]
    assert len(query(db, "SELECT id FROM runs")) == 1  # the killed job left nothing half-written
    assert "broken.toml" in (tmp_path / "first.log").read_text()

    # Restart: the orphaned job goes back in the queue and runs; the finished one is not redone. The restart, about
    # what the next daemon makes of what the killed one left, runs the same command in this process (through
    # click), which saves a process start with its imports.
    logging.getLogger("joulepilot").handlers.clear()  # the daemon logs to the stderr the runner gives it
    proc = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert proc.exit_code == 1, (proc.output, proc.stderr)  # non-zero: a policy file was skipped
    assert re.search(r"job\(s\) 2 re-queued", proc.stderr)
    summary = json.loads(proc.stdout)
    # The re-queued job runs; a run that bench flagged "repeat this run" (a loaded machine) may add a repeat.
    assert summary["runs_ok"] >= 1 and [d["policy"] for d in summary["decided"]] == ["mlp"]
    assert [e["file"] for e in summary["policy_errors"]] == [str(policies / "broken.toml")]
    assert "objectiv" in summary["policy_errors"][0]["error"]  # the validation message, naming the key

    runs = query(db, "SELECT * FROM runs ORDER BY id")
    assert len({(r["workload_id"], r["config_id"], r["provenance_key"]) for r in runs}) == 2
    assert all(r["status"] == "ok" and r["finished_at"] and r["energy_j_per_inference"] for r in runs)
    job_of_run = {r["id"]: json.loads(r["extra"])["job_id"] for r in runs}
    for config_id in {r["config_id"] for r in runs}:  # a second run of a configuration is a flagged run's repeat
        same = [r for r in runs if r["config_id"] == config_id]
        assert all(json.loads(r["extra"]).get("window_warning") for r in same[:-1])
        assert len({job_of_run[r["id"]] for r in same}) == 1  # (the repeat re-runs the same job)
    jobs = query(db, "SELECT * FROM jobs ORDER BY id")
    assert [j["state"] for j in jobs] == ["done", "done"] and jobs[1]["attempts"] >= 2
    for job in jobs:
        assert job_of_run[job["run_id"]] == job["id"]
    assert not any(os.path.exists(folder) for folder in scratch)  # the killed daemon's scratch removed
    assert f"removed {scratch[0]}" in proc.stderr
    extra = json.loads(next(r for r in runs if r["id"] == jobs[1]["run_id"])["extra"])
    assert extra["budget"] == worker_budget(300, 1.0).to_dict()  # the config's budget_s, the one model

    status = status_json(db)
    assert [d["policy"] for d in status["decisions"]] == ["mlp"]
    assert status["policy_errors"][0]["file"].endswith("broken.toml")


def _worker_phase(daemon_pid: int) -> str | None:
    """The phase its running job's worker last entered, from the job's scratch folder."""
    for phases in glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{daemon_pid}-*", "phases.tsv")):
        try:
            lines = Path(phases).read_text().strip().splitlines()
        except OSError:
            continue
        if lines:
            return lines[-1].split("\t")[0]
    return None


def test_sigterm_during_a_compile_stops_within_seconds_and_requeues(tmp_path):
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "slow", workload=f"{TESTS_DIR / 'daemon_factories.py'}:deep_mlp", modes=("default",))
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)
    daemon = start_daemon(config, tmp_path / "daemon.log")
    try:
        wait_for(lambda: _worker_phase(daemon.pid) == "compile", 180, "the worker to start compiling")
        children = family(daemon.pid)
        workers = [p for p in children if "joulepilot.compiler.worker" in " ".join(_cmdline(p))]
        # daemon -> the workload's zygote -> the job's worker, forked from it
        zygotes = [p for p in workers if _parent(p) == daemon.pid]
        assert len(zygotes) == 1 and [_parent(p) for p in workers if p not in zygotes] == [zygotes[0].pid]
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if daemon.poll() is None:
            daemon.kill()
    log = (tmp_path / "daemon.log").read_text()
    assert code == 0, log
    assert took < 10, f"took {took:.1f}s to stop"
    assert all_gone(children, 5)  # the compiler's worker and Inductor's compile workers
    job = query(db, "SELECT * FROM jobs")[0]
    assert job["state"] == "queued" and job["attempts"] == 0  # back in the queue, the attempt not counted
    assert query(db, "SELECT COUNT(*) AS n FROM runs")[0]["n"] == 0
    beat = query(db, "SELECT * FROM heartbeats ORDER BY id DESC LIMIT 1")[0]
    assert beat["state"] == "stopped" and "SIGTERM" in json.loads(beat["detail"])["doing"]
    assert "re-queued" in log and "received SIGTERM" in log


def test_loop_mode_lock_exporter_sighup_and_stop(tmp_path):
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    policies.mkdir()
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, exporter=True, port=0)
    log_path = tmp_path / "daemon.log"
    daemon = start_daemon(config, log_path)
    try:
        port = int(wait_for(lambda: re.search(r"exporter: http://127\.0\.0\.1:(\d+)/metrics", log_path.read_text()),
                            60, "the exporter").group(1))
        wait_for(lambda: "pass done" in log_path.read_text(), 60, "the first pass")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert "joulepilot_daemon_up 1.0" in metrics

        second = subprocess.run(daemon_cmd("--db", str(db), "--policies", str(policies), "--once"),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert f"pid {daemon.pid}" in second.stderr and "already serves this database" in second.stderr

        config.write_text(config.read_text().replace("interval_s = 3600", "interval_s = 1800"))
        daemon.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: reloaded" in log_path.read_text(), 30, "the reload")
        beat = wait_for(lambda: [b for b in poll_query(db, "SELECT detail FROM heartbeats ORDER BY id DESC LIMIT 1")
                                 if json.loads(b["detail"]).get("interval_s") == 1800], 60, "a heartbeat after reload")
        assert beat

        status = status_json(db)
        assert status["daemon"]["alive"] and status["daemon"]["pid"] == daemon.pid

        daemon.send_signal(signal.SIGINT)
        assert daemon.wait(timeout=15) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
    assert query(db, "SELECT state FROM heartbeats ORDER BY id DESC LIMIT 1")[0]["state"] == "stopped"


@pytest.mark.parametrize("strategy", ["exhaustive", "guided"])
def test_a_workload_that_cannot_be_built_is_one_failed_run_and_one_policy_error(tmp_path, flow_worker,
                                                                                  restore_logging, strategy):
    db, policies = tmp_path / "j.db", tmp_path / "policies"
    policy = write_policy(policies, "broken", workload="tests.flow_worker:cannot_be_built", modes=("eager", "default"),
                          precisions=("fp32", "bf16"), strategy=strategy)
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)
    logging.getLogger("joulepilot").handlers.clear()
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert result.exit_code == 1, (result.output, result.stderr)  # a pass with a policy error exits 1
    summary = json.loads(result.stdout)
    # one run stored (and billed) for the first configuration, not one per configuration
    assert summary["runs_failed"] == 1 and summary["runs_ok"] == 0
    (run,) = query(db, "SELECT status, reason, extra FROM runs")
    assert run["status"] == "failed" and json.loads(run["extra"])["phase"] == "load"
    # every job ends failed, each with the attempt it would have failed, as jobs that ran and failed do (a guided
    # search queues one job at a time, and stops)
    jobs = query(db, "SELECT state, attempts, run_id FROM jobs ORDER BY id")
    assert len(jobs) == (4 if strategy == "exhaustive" else 1), jobs
    assert all(j["state"] == "failed" and j["attempts"] == 1 for j in jobs), jobs
    assert sum(j["run_id"] is not None for j in jobs) == 1
    (error,) = summary["policy_errors"]
    assert error["file"] == str(policy)
    assert "its workload cannot be built (" in error["error"] and "cannot be built" in run["reason"]
    if strategy == "exhaustive":
        assert "its 3 other queued configurations failed without being measured" in error["error"]
    else:
        assert "the guided search stops for this pass" in error["error"]
    assert sum("its workload cannot be built" in line for line in result.stderr.splitlines()
               if line.startswith("[job ")) == 1, result.stderr
