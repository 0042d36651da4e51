"""`bench` stopped and started again: its worker dies with it, scratch folders do not pile up, and a
restarted sweep measures only what is missing."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from daemon_factories import is_worker, wait_for
from joulepilot.compiler import CompileConfig, bench
from joulepilot.store import list_runs

from joulepilot.cli import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    # the worker subprocess imports tests.workload_factories through the parent's import roots
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def _compiling_worker(bench_pid: int) -> tuple[list[psutil.Process], Path] | None:
    """bench's worker processes (the workload's zygote and the job's worker forked from it) and the job's
    scratch folder, once the job is inside its (endless) compile."""
    pattern = os.path.join(tempfile.gettempdir(), f"joulepilot-run-{bench_pid}-*", "phases.tsv")
    for phases in glob.glob(pattern):
        try:
            lines = Path(phases).read_text().strip().splitlines()
        except OSError:
            continue
        if lines and lines[-1].startswith("compile"):  # empty while the worker writes its first line
            try:
                family = psutil.Process(bench_pid).children(recursive=True)
            except psutil.Error:
                return None
            workers = [p for p in family if _is_worker(p)]
            return (workers, Path(phases).parent) if workers else None
    return None


def _is_worker(proc: psutil.Process) -> bool:
    try:
        return is_worker(proc.cmdline())
    except psutil.Error:
        return False


def _gone(proc: psutil.Process, timeout_s: float) -> bool:
    try:
        proc.wait(timeout=timeout_s)
    except psutil.TimeoutExpired:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
def test_killed_bench_takes_its_worker_along_and_leaves_no_scratch(tmp_path, sig, own_tmpdir, flow_worker,
                                                                   monkeypatch):
    monkeypatch.setenv("JOULEPILOT_FAKE_COMPILE_S", "600")  # the job's compile outlasts the test
    # bench as a user's terminal runs it, Ctrl-C raising KeyboardInterrupt: a process started in the background
    # by a non-interactive shell (a CI job's `cmd &`) inherits SIGINT ignored, and Python then keeps it ignored
    args = ["bench", "mlp", "--device", "cpu", "--modes", "default", "--no-warm-start",
            "--min-seconds", "0.2", "--budget-s", "600", "--db", str(tmp_path / "b.db")]
    cmd = [sys.executable, "-c", "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "sys.argv = ['joulepilot', *sys.argv[1:]]; runpy.run_module('joulepilot', run_name='__main__')", *args]
    # stderr into a file, not a pipe nobody reads while bench runs (a full pipe would block it)
    stderr_path = tmp_path / "bench.stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    try:
        workers, scratch = wait_for(lambda: _compiling_worker(proc.pid), 120, "the worker to start compiling")
        assert scratch.is_dir()
        assert len(workers) == 2  # the workload's zygote and the job's worker forked from it
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=60)  # seconds on an idle machine; a loaded CI machine gets room
        except subprocess.TimeoutExpired:
            pytest.fail(f"bench did not exit within 60 s of {sig.name}; its stderr ends:\n"
                        f"{stderr_path.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for worker in workers:
        assert _gone(worker, 10), f"worker {worker.pid} outlived bench after {sig.name}"
    if sig == signal.SIGKILL:
        assert scratch.is_dir()  # nothing could clean up; the next start does
        nxt = CliRunner().invoke(main, ["bench", "tests.workload_factories:nope", "--device", "cpu",
                                        "--db", str(tmp_path / "b.db")])
        assert nxt.exit_code == 1 and "has no attribute 'nope'" in nxt.output
        assert f"removed {scratch}" in nxt.stderr
    else:
        assert proc.returncode != 0
    assert not scratch.exists()
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{proc.pid}-*"))


def test_stale_scratch_of_a_live_process_is_kept(tmp_path):
    from joulepilot.compiler.runner import remove_stale_workdirs

    live = tmp_path / f"joulepilot-run-{os.getpid()}-abc123"
    sleeper = subprocess.Popen([sys.executable, "-c", "pass"])
    sleeper.wait()
    dead = tmp_path / f"joulepilot-run-{sleeper.pid}-def456"
    other = tmp_path / "joulepilot-run-legacyname"
    for folder in (live, dead, other):
        folder.mkdir()
        (folder / "job.json").write_text("{}")
    assert remove_stale_workdirs(tmp_path) == [dead]
    assert live.is_dir() and other.is_dir() and not dead.exists()


def test_restarted_sweep_skips_what_was_measured_ok_and_force_redoes_it(db, tmp_path, monkeypatch, fake_worker):
    spec = "tests.workload_factories:exits_under_autocast"
    configs = [CompileConfig(mode="eager", precision="bf16"), CompileConfig(mode="eager", precision="fp32")]
    first = bench(spec, configs, device="cpu", min_seconds=0.2, db=db, idle_s=0)
    assert [r["status"] for r in first] == ["failed", "ok"]

    # The same sweep again, through the CLI: only the failed configuration is measured again.
    db_path = tmp_path / "test.db"
    again = CliRunner().invoke(main, ["bench", spec, "--device", "cpu", "--modes", "eager", "--precision", "bf16,fp32",
                                      "--min-seconds", "0.2", "--db", str(db_path), "--json"])
    assert again.exit_code == 0, again.output
    ok_id = first[1]["run_id"]
    assert f"eager/fp32/b1: skipped, already measured ok as run {ok_id} under the same provenance" in again.stderr
    assert "eager/bf16/b1: compiling and measuring" in again.stderr
    runs = list_runs(db)
    assert len(runs) == 3  # one new run: the failed configuration, measured again
    assert sorted(r["status"] for r in runs) == ["failed", "failed", "ok"]

    # --force measures everything again.
    forced = bench(spec, configs, device="cpu", min_seconds=0.2, db=db, idle_s=0, force=True)
    assert not any(r.get("skipped") for r in forced)
    assert forced[1]["status"] == "ok" and forced[1]["run_id"] != ok_id
    assert len(list_runs(db)) == 5


def test_skipped_configuration_is_one_under_the_same_provenance(db, flow_worker):
    """A run measured under other software (another provenance key) does not count as measured."""
    (run,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db, idle_s=0)
    db.execute("UPDATE runs SET provenance_key = 'older-torch' WHERE id = ?", [run["run_id"]])
    (again,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db, idle_s=0)
    assert not again.get("skipped") and again["run_id"] != run["run_id"]
    (third,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db, idle_s=0)
    assert third["skipped"] and third["run_id"] == again["run_id"]


def test_bad_devices_are_one_clean_line(tmp_path):
    for device, message in [("tpu", "device 'tpu' cannot be benchmarked: use cpu, or cuda:N"),
                            ("cuda:x", "device 'cuda:x' cannot be benchmarked: use cpu, or cuda:N")]:
        result = CliRunner().invoke(main, ["bench", "mlp", "--device", device, "--db", str(tmp_path / "d.db")])
        assert result.exit_code == 1, result.output
        assert result.output.strip() == f"Error: {message} for GPU N (e.g. cuda:0)"
        assert "None" not in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["bench", "mlp", "--device", "cuda:7", "--db", str(tmp_path / "d.db")])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("Error: device 'cuda:7' ")
    assert any(why in result.output for why in ("CPU-only build", "no CUDA GPU is visible", "does not exist"))
    assert not (tmp_path / "d.db").exists()  # refused before anything was opened or measured
