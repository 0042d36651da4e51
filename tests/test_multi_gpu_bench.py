"""`bench --devices 0,1` on two GPUs: configurations measured at once, one per GPU, each metered on its own GPU.

No GPU here: NVML is the fake (in this process and, through `fake_pynvml.subprocess_env`, in the workers), the
workers are the flow worker (tests/flow_worker.py: the worker's protocols and timing loops on a stand-in for the
model, the energy from the fake GPU's counter), and torch is told it sees two CUDA devices so that `cuda:0` and `cuda:1` pass bench's
device check.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import signal
import tempfile
import threading
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from daemon_factories import is_worker, wait_for
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.compiler import device_pool
from joulepilot.compiler.zygote import FORKED
from joulepilot.store import open_db

from joulepilot.cli import main

UUIDS = ("GPU-0a0a0a0a-1111-2222-3333-444444444444", "GPU-1b1b1b1b-1111-2222-3333-444444444444")
WATTS = (100.0, 300.0)  # far apart, so a run metered on the wrong GPU shows it
CORES = 16  # the host's cores as the scheduler is told them (this machine has fewer)


@pytest.fixture
def two_gpus(monkeypatch):
    import torch

    gpus = [FakeGpu(uuid=uuid, power_w=watts) for uuid, watts in zip(UUIDS, WATTS, strict=True)]
    fake_pynvml.install_everywhere(monkeypatch, gpus)
    monkeypatch.delenv(device_pool.COMPILE_THREADS_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(device_pool, "available_cores", lambda: CORES)
    # each device's idle baseline 0.5 s, not a GPU's 2 s: these tests check where runs are metered, not idle power
    monkeypatch.setattr(importlib.import_module("joulepilot.compiler.bench"), "default_idle_s", lambda device: 0.5)
    return gpus


def _bench(db, *args, modes="eager,default", precisions="fp32"):
    return CliRunner().invoke(main, ["bench", "mlp", "--db", str(db), "--min-seconds", "1", "--no-warm-start",
                                     "--modes", modes, "--precision", precisions, *args])


def _overlap(a, b) -> float:
    return min(a["finished_at"], b["finished_at"]) - max(a["started_at"], b["started_at"])


def test_bench_devices_measures_on_both_gpus_at_once_each_on_its_own_counter(tmp_path, two_gpus, flow_worker):
    db = tmp_path / "j.db"
    result = _bench(db, "--devices", "0,1", "--json")
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)
    assert len(runs) == 2 and all(r["status"] == "ok" for r in runs), runs
    assert {r["device"] for r in runs} == {"cuda:0", "cuda:1"}
    for run in runs:
        index = int(run["device"].split(":")[1])
        extra = run["extra"]
        assert extra["device_uuids"] == {f"gpu:{index}": UUIDS[index]}  # its own GPU, by UUID
        assert run["energy_source"] == "nvml"
        assert run["avg_power_w"] == pytest.approx(WATTS[index], rel=0.15)  # that GPU's counter, not the other's
        # each worker compiled with its share of the cores, and numbers GPUs as NVML does
        assert extra["fake_worker_env"] == {"TORCHINDUCTOR_COMPILE_THREADS": str(CORES // 2),
                                            "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        assert extra["worker_env"]["TORCHINDUCTOR_COMPILE_THREADS"] == str(CORES // 2)
        assert extra["worker_process"] == FORKED  # from its GPU's zygote, with the job's variables applied
    # each configuration measured once and stored once, with its device; the two GPUs' runs overlap in time
    stored = [dict(r) for r in open_db(db).query("SELECT config_id, device, started_at, finished_at FROM runs")]
    assert sorted((r["config_id"], r["device"]) for r in stored) == sorted((r["config_id"], r["device"]) for r in runs)
    by_device = {d: [r for r in stored if r["device"] == d] for d in ("cuda:0", "cuda:1")}
    assert max(_overlap(a, b) for a in by_device["cuda:0"] for b in by_device["cuda:1"]) > 0.5
    assert "on cuda:1" in result.stderr and "on cuda:0" in result.stderr

    # a second sweep over the same GPUs measures nothing again
    again = _bench(db, "--devices", "cuda:0,cuda:1", "--json")
    assert again.exit_code == 0, again.output
    assert all(r.get("skipped") for r in json.loads(again.stdout))
    assert open_db(db).execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 2


def test_a_workload_that_cannot_be_built_stops_the_sweep_on_every_gpu(tmp_path, two_gpus, flow_worker):
    db = tmp_path / "j.db"
    result = CliRunner().invoke(main, ["bench", "tests.flow_worker:cannot_be_built", "--db", str(db), "--devices", "0,1",
                                       "--min-seconds", "1", "--no-warm-start", "--modes", "eager,default",
                                       "--precision", "fp32,bf16", "--json"])
    assert result.exit_code == 1, result.output
    runs = json.loads(result.stdout)
    # the first configuration on each GPU started at once; at most both failed building it, the other two never ran
    assert 1 <= len(runs) <= 2 and all(r["status"] == "failed" and r["extra"]["phase"] == "load" for r in runs), runs
    assert open_db(db).execute("SELECT COUNT(*) FROM runs").fetchone()[0] == len(runs)
    stops = [line for line in result.stderr.splitlines() if "stopped: the workload could not be built" in line]
    assert len(stops) == 1 and "were not measured" in stops[0], result.stderr


def test_one_device_keeps_every_core_for_its_compile(tmp_path, two_gpus, flow_worker):
    result = _bench(tmp_path / "j.db", "--devices", "1", "--json", modes="eager")
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    assert run["device"] == "cuda:1" and run["avg_power_w"] == pytest.approx(WATTS[1], rel=0.15)
    assert run["extra"]["fake_worker_env"]["TORCHINDUCTOR_COMPILE_THREADS"] is None  # Inductor's own default


@pytest.mark.parametrize(("args", "message"), [
    (["--devices", "0,0"], "cuda:0 more than once"),
    (["--devices", "0,cpu"], "cpu cannot share a sweep"),
    (["--devices", "0,7"], "does not exist: this host has 2 CUDA GPU(s)"),
    (["--devices", "0,1", "--device", "cuda:0"], "either --device or --devices"),
    (["--devices", ","], "--devices ',' has an empty value; give values separated by commas, e.g. --devices 0,1"),
])
def test_bad_devices_is_one_clean_line(tmp_path, two_gpus, flow_worker, args, message):
    result = _bench(tmp_path / "j.db", *args)
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def _hanging_workers() -> tuple[list[str], list[psutil.Process]] | None:
    """Once a job is inside its (long) compile on each GPU: the devices of those jobs (from their scratch
    folders), and every benchmark worker process of this process (each GPU's zygote of the workload and the
    job's worker forked from it)."""
    devices = []
    for phases in glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{os.getpid()}-*", "phases.tsv")):
        try:
            lines = Path(phases).read_text().strip().splitlines()
            job = json.loads(Path(phases).with_name("job.json").read_text())
        except (OSError, ValueError):
            continue  # a file still being written
        if lines and lines[-1].startswith("compile"):
            devices.append(job["device"])
    if len(devices) != 2:
        return None
    workers = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if is_worker(proc.cmdline()):
                workers.append(proc)
        except psutil.Error:
            continue
    return devices, workers


def test_sigterm_stops_every_gpu_worker_and_leaves_no_scratch(tmp_path, two_gpus, flow_worker, own_tmpdir,
                                                              monkeypatch):
    monkeypatch.setenv("JOULEPILOT_FAKE_COMPILE_S", "600")  # each job's compile outlasts the test
    seen: dict[str, list[psutil.Process]] = {}

    def terminate_once_both_hang() -> None:
        seen["devices"], seen["workers"] = wait_for(_hanging_workers, 120, "a compiling worker on each GPU")
        os.kill(os.getpid(), signal.SIGTERM)  # bench's handler turns it into an exit in the main thread

    killer = threading.Thread(target=terminate_once_both_hang, daemon=True)
    killer.start()
    result = CliRunner().invoke(main, ["bench", "mlp", "--db",
                                       str(tmp_path / "j.db"), "--devices", "0,1", "--modes", "default",
                                       "--precision", "fp32,bf16,fp16", "--min-seconds", "0.2", "--no-warm-start"])
    killer.join(timeout=5)
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    workers = seen["workers"]
    assert sorted(seen["devices"]) == ["cuda:0", "cuda:1"]
    assert len(workers) == 4  # on each GPU, the workload's zygote and the job's worker forked from it
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive  # both killed before bench exited
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"joulepilot-run-{os.getpid()}-*"))
    assert open_db(tmp_path / "j.db").execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0  # nothing half-written
