"""The worker meters a configuration's compile window on the GPU and on the CPU: RAPL where its counters can
be read, the labelled estimate of the compiling process tree where they cannot; compile_energy_j is the sum.

The GPU is the fake NVML (the model runs on the CPU here; the meter reads the fake card, as on a host whose
GPU does the work); RAPL is a fake powercap tree in a temp dir. What "compiles" is the first call, which
each test makes do CPU work it can account for."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from fakes.powercap import FakePowercap
from joulepilot.compiler import CompileConfig
from joulepilot.compiler import measure as measure_mod
from joulepilot.compiler import worker as worker_mod
from joulepilot.telemetry import EnergyMeter

GPU_W = 250.0
CHILD_CPU_S = 0.6
W_PER_CORE = 10.0


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", str(W_PER_CORE))


def _on_a_gpu(monkeypatch) -> None:
    fake_pynvml.install(monkeypatch, [FakeGpu(power_w=GPU_W)])
    monkeypatch.setattr(worker_mod, "_open_meter", lambda device, hz: EnergyMeter("cuda:0", sample_hz=hz))


def _during_the_compile(monkeypatch, action) -> None:
    """Run `action` inside the first timed call (the cold first call, the compile window) and only there."""
    real = measure_mod.timed_call
    done = []

    def timed_call(call, sync):
        if done:
            return real(call, sync)
        done.append(True)
        return real(lambda: (action(), call())[1], sync)

    monkeypatch.setattr(measure_mod, "timed_call", timed_call)


def _burn_in_a_child() -> None:
    """CPU work in a child process, as Inductor's compile workers do it."""
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    f"while time.process_time() - t < {CHILD_CPU_S}: pass"], check=True)


def _job() -> dict:
    return {"device": "cpu", "spec": "mlp", "min_seconds": 0.3, "warmup_max_s": 0.1, "latency_s": 0.05,
            "config": CompileConfig(mode="eager", batch_size=4).to_row()}


def test_a_gpu_runs_compile_cpu_part_is_metered_by_rapl_when_readable(monkeypatch, tmp_path):
    tree = FakePowercap(tmp_path / "powercap")
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tree.root))
    _on_a_gpu(monkeypatch)
    _during_the_compile(monkeypatch, lambda: (tree.add_joules("cpu:0", 7.5), tree.add_joules("dram:0", 1.25)))

    result = worker_mod.run_job(_job())

    assert result["status"] == "ok", result.get("reason")
    assert result["compile_energy_cpu_source"] == "rapl"
    # package and DRAM of the sockets, and nothing else: no other counter moved
    assert result["compile_energy_cpu_j"] == pytest.approx(8.75)
    assert result["compile_energy_gpu_source"] == "nvml"
    window_s = result["extra"]["compile_window"]["duration_s"]
    assert result["compile_energy_gpu_j"] == pytest.approx(GPU_W * window_s, abs=GPU_W * 0.1 + 1e-9)
    assert result["compile_energy_j"] == pytest.approx(result["compile_energy_gpu_j"] + 8.75)
    devices = {d["device"]: d["source"] for d in result["extra"]["compile_window"]["devices"]}
    assert devices == {"gpu:0": "nvml", "cpu:0": "rapl", "dram:0": "rapl", "cpu:1": "rapl", "dram:1": "rapl"}
    # the inference window is still the GPU's alone
    assert result["energy_source"] == "nvml"


def test_without_rapl_the_cpu_part_is_the_labelled_estimate_of_the_compiling_process_tree(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))
    _on_a_gpu(monkeypatch)
    _during_the_compile(monkeypatch, _burn_in_a_child)

    result = worker_mod.run_job(_job())

    assert result["status"] == "ok", result.get("reason")
    assert result["compile_energy_cpu_source"] == "estimate"
    # the child's CPU seconds count: the estimate is of the worker's whole process tree
    assert result["compile_energy_cpu_j"] >= CHILD_CPU_S * W_PER_CORE
    (cpu,) = [d for d in result["extra"]["compile_window"]["devices"] if d["device"] == "cpu:0"]
    assert cpu["source"] == "estimate" and "process tree" in cpu["method"] and "10 W/core" in cpu["method"]
    assert result["compile_energy_gpu_source"] == "nvml"
    assert result["compile_energy_j"] == pytest.approx(result["compile_energy_gpu_j"] + result["compile_energy_cpu_j"])


def test_a_cpu_run_meters_its_compile_with_its_own_cpu_meter_and_has_no_gpu_part(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))
    _during_the_compile(monkeypatch, _burn_in_a_child)

    result = worker_mod.run_job(_job())

    assert result["status"] == "ok", result.get("reason")
    assert result["energy_source"] == "estimate"
    assert (result["compile_energy_gpu_j"], result["compile_energy_gpu_source"]) == (None, None)
    assert result["compile_energy_cpu_source"] == "estimate"
    assert result["compile_energy_cpu_j"] >= CHILD_CPU_S * W_PER_CORE
    assert result["compile_energy_j"] == result["compile_energy_cpu_j"]


def test_a_cpu_meter_that_cannot_open_leaves_the_cpu_part_not_metered_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", "lots")
    _on_a_gpu(monkeypatch)

    result = worker_mod.run_job(_job())

    assert result["status"] == "ok", result.get("reason")
    assert (result["compile_energy_cpu_j"], result["compile_energy_cpu_source"]) == (None, None)
    assert "JOULEPILOT_ESTIMATE_W_PER_CORE" in result["extra"]["compile_window"]["cpu_meter_error"]
    assert result["compile_energy_j"] == result["compile_energy_gpu_j"]
