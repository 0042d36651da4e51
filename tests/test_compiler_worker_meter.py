"""The worker's energy accounting against a metered GPU (the fake NVML): source, per-call joules, card UUID."""

from __future__ import annotations

import pytest
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.compiler import CompileConfig
from joulepilot.compiler import worker as worker_mod
from joulepilot.telemetry import EnergyMeter


@pytest.fixture(autouse=True)
def _no_cuda_env(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))


def test_run_records_nvml_energy_the_cards_uuid_and_its_power_limit(monkeypatch):
    gpu = FakeGpu(power_w=250.0, uuid="GPU-5a1e0000-aaaa-bbbb-cccc-0123456789ab", power_limit_w=450.0)
    fake_pynvml.install(monkeypatch, [gpu])
    # The model runs on the CPU; the meter reads the (fake) GPU, as on a host whose GPU does the work.
    monkeypatch.setattr(worker_mod, "_open_meter", lambda device, hz: EnergyMeter("cuda:0", sample_hz=hz))
    job = {"device": "cpu", "spec": "mlp", "min_seconds": 0.6, "warmup_max_s": 0.2, "latency_s": 0.1,
           "config": CompileConfig(mode="eager", batch_size=4).to_row()}

    result = worker_mod.run_job(job)

    assert result["status"] == "ok", result.get("reason")
    assert result["energy_source"] == "nvml"
    assert result["extra"]["metered_devices"] == ["gpu:0"]
    assert result["extra"]["device_uuids"] == {"gpu:0": gpu.uuid}
    assert result["extra"]["power_limit_w"] == {"gpu:0": 450.0}  # read from NVML, as the card enforces it
    # 250 W for the whole window; the fake counter steps every 100 ms, so allow one step either side.
    assert result["avg_power_w"] == pytest.approx(250.0, rel=0.2)
    assert result["energy_j_per_inference"] == pytest.approx(result["energy_j"] / result["inferences"])
    assert result["energy_j"] == pytest.approx(250.0 * result["window_s"], abs=250.0 * 0.1 + 1e-9)
