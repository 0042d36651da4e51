"""Real NVML on a real GPU (run on the GPU machine: python -m pytest -m gpu tests/test_telemetry_gpu.py)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.gpu


def _busy(seconds: float) -> int:
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize()
        n += 20
    return n


def test_devices_match_torch():
    import torch
    from joulepilot.telemetry import NvmlMeter

    meter = NvmlMeter()
    try:
        devices = meter.devices()
        assert len(devices) == torch.cuda.device_count()
        for d in devices:
            assert d.id == f"gpu:{d.index}" and d.source == "nvml"
            assert d.name == torch.cuda.get_device_name(d.index)
            assert d.driver and d.uuid.startswith("GPU-") and d.power_limit_w and d.power_limit_w > 0
            assert d.memory_bytes and d.memory_bytes > 2**30
    finally:
        meter.close()


def test_counter_increases_under_load_and_instant_power_is_positive():
    from joulepilot.telemetry import NvmlMeter

    meter = NvmlMeter([0])
    try:
        assert meter.methods()["gpu:0"]["energy"] == "counter"  # every GPU lent here is Volta or newer
        e0 = meter.energy_j()["gpu:0"]
        t0 = time.perf_counter()
        _busy(2.0)
        power = meter.power_w()["gpu:0"]
        e1 = meter.energy_j()["gpu:0"]
        avg_w = (e1 - e0) / (time.perf_counter() - t0)
        assert e1 > e0 and avg_w > 30.0
        assert power > 0.0
        limit = meter.devices()[0].power_limit_w
        assert avg_w < 1.5 * limit
    finally:
        meter.close()


def test_energy_meter_window_on_gpu():
    import torch
    from joulepilot.telemetry import EnergyMeter

    torch.zeros(1, device="cuda")  # CUDA initialised: windows now synchronise the device
    with EnergyMeter("cuda:0") as meter:
        meter.measure_idle(1.0)
        with meter.window("load") as w:
            _busy(2.0)
    m = w.measurement
    d = m.devices[0]
    assert m.sources == ["nvml"] and d.device == "gpu:0" and d.method == "counter"
    assert d.energy_j > 0 and d.peak_power_w and d.peak_power_w >= 0.8 * d.avg_power_w
    assert d.samples >= 10 and d.idle_power_w is not None and d.energy_above_idle_j is not None


def test_gpu_activity_reports_nvml():
    from joulepilot.telemetry import gpu_activity

    act = gpu_activity(0)
    assert act.available, act.reason
    assert 0.0 <= act.utilization_pct <= 100.0
