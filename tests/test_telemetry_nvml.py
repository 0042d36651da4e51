"""NvmlMeter against a fake pynvml that steps its energy counter every 100 ms like real GPUs."""

from __future__ import annotations

import importlib.util
import math
import time

import pytest
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.telemetry import (
    GpuLost,
    MeterUnavailable,
    NullMeter,
    NvmlMeter,
    NvmlNotSupported,
    NvmlUnavailable,
    detect_meters,
    gpu_activity,
    meter_status,
    open_meter,
)
from joulepilot.telemetry.errors import NvmlError, NvmlNoPermission, map_nvml_error, nvml_errors
from joulepilot.telemetry.nvml import visible_nvml_indices


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"


@pytest.fixture(autouse=True)
def _no_cuda_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="nvidia-ml-py not installed")
def test_fake_mirrors_the_real_binding():
    import importlib

    real = importlib.import_module("pynvml")
    real_codes = {n: getattr(real, n) for n in dir(real) if n.startswith("NVML_ERROR_")}
    fake_codes = {n: getattr(fake_pynvml, n) for n in dir(fake_pynvml) if n.startswith("NVML_ERROR_")}
    assert fake_codes == real_codes
    assert fake_pynvml.NVML_FI_DEV_POWER_INSTANT == real.NVML_FI_DEV_POWER_INSTANT
    assert type(real.NVMLError(3)).__name__ == type(fake_pynvml.NVMLError(3)).__name__ == "NVMLError_NotSupported"
    used = [n for n in dir(fake_pynvml) if n.startswith("nvml") and callable(getattr(fake_pynvml, n))]
    assert [n for n in used if not hasattr(real, n)] == []


def test_window_energy_matches_true_integral_within_quantisation(monkeypatch):
    trace = lambda t: 250.0 + 100.0 * math.sin(2 * math.pi * t / 0.7)  # noqa: E731
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(power_w=trace)])
    meter = NvmlMeter(nvml=fake_pynvml)
    try:
        time.sleep(0.05)
        t0 = fake.now()
        e0 = meter.energy_j()["gpu:0"]
        time.sleep(1.0)
        t1 = fake.now()
        e1 = meter.energy_j()["gpu:0"]
        true_j = fake.true_energy_j(0, t1) - fake.true_energy_j(0, t0)
        step_j = 350.0 * 0.1  # one counter step at the trace's peak power
        assert abs((e1 - e0) - true_j) <= step_j
        assert meter.methods()["gpu:0"] == {"energy": "counter", "power": "instant-field"}

        readings = set()
        end = time.perf_counter() + 0.35
        while time.perf_counter() < end:
            readings.add(meter.energy_j()["gpu:0"])
        assert 2 <= len(readings) <= 5  # the counter steps every 100 ms, not continuously
    finally:
        meter.close()


def test_device_info_is_recorded_and_nothing_is_set(monkeypatch):
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(name="NVIDIA H200", uuid=_uuid(7), power_limit_w=650.0,
                                                     memory_total=141 * 2**30)])
    meter = NvmlMeter(nvml=fake_pynvml)
    (info,) = meter.devices()
    assert (info.id, info.kind, info.source, info.name, info.uuid) == ("gpu:0", "gpu", "nvml", "NVIDIA H200", _uuid(7))
    assert info.driver == "550.54.15" and info.power_limit_w == 650.0 and info.memory_bytes == 141 * 2**30
    meter.sync()  # torch here is a CPU build with CUDA never initialised: must be a no-op
    meter.power_w()
    meter.energy_j()
    meter.close()
    assert not [c for c in fake.calls if "Set" in c]
    assert fake.refcount == 0  # nvmlShutdown balanced nvmlInit


def test_instant_power_uses_the_field_and_falls_back_to_power_usage(monkeypatch):
    trace = lambda t: 100.0 if t < 0.6 else 400.0  # noqa: E731
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(power_w=trace), FakeGpu(power_w=trace, instant_field=False,
                                                                               uuid=_uuid(1))])
    meter = NvmlMeter(nvml=fake_pynvml)
    try:
        methods = meter.methods()
        assert methods["gpu:0"]["power"] == "instant-field"
        assert methods["gpu:1"]["power"] == "power-usage"
        while fake.now() < 0.9:
            time.sleep(0.02)
        power = meter.power_w()
        assert power["gpu:0"] == pytest.approx(400.0)
        # nvmlDeviceGetPowerUsage lags: a 1-s average still holds part of the 100 W phase
        assert 100.0 < power["gpu:1"] < 400.0
    finally:
        meter.close()


def test_energy_integrated_from_power_when_counter_not_supported(monkeypatch):
    trace = lambda t: 150.0 + 50.0 * math.sin(2 * math.pi * t)  # noqa: E731
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(power_w=trace, energy_counter=False)])
    meter = NvmlMeter(nvml=fake_pynvml, integrate_hz=50.0)
    try:
        assert meter.methods()["gpu:0"]["energy"] == "power-integration"
        time.sleep(0.1)
        t0, e0 = fake.now(), meter.energy_j()["gpu:0"]
        time.sleep(1.5)
        t1, e1 = fake.now(), meter.energy_j()["gpu:0"]
        true_j = fake.true_energy_j(0, t1) - fake.true_energy_j(0, t0)
        assert e1 - e0 == pytest.approx(true_j, rel=0.05)
        assert "nvmlDeviceGetFieldValues" in fake.calls
    finally:
        meter.close()


@pytest.mark.parametrize(
    ("code", "words"),
    [(fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found"),
     (fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded")],
)
def test_missing_driver_gives_null_meter_with_reason(monkeypatch, code, words):
    fake_pynvml.install(monkeypatch, [FakeGpu()], init_error=code)
    with pytest.raises(NvmlUnavailable, match=words):
        NvmlMeter(nvml=fake_pynvml)
    null = open_meter("nvml")
    assert isinstance(null, NullMeter) and words in null.reason and null.devices() == [] and not null.active
    status = {s.name: s for s in meter_status()}
    assert not status["nvml"].active and words in status["nvml"].reason
    assert not any(m.source == "nvml" for m in detect_meters(None))
    with pytest.raises(MeterUnavailable, match="cannot meter cuda:0"):
        detect_meters("cuda:0")


def test_no_binding_installed(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(NvmlUnavailable, match="pip install nvidia-ml-py"):
        NvmlMeter()
    assert gpu_activity(0).available is False


def test_cuda_visible_devices_indices_and_uuids(monkeypatch):
    fake_pynvml.install(monkeypatch, [FakeGpu(uuid=_uuid(i), name=f"gpu{i}") for i in range(4)])
    fake_pynvml.nvmlInit()
    try:
        assert visible_nvml_indices(fake_pynvml, None) == [0, 1, 2, 3]
        assert visible_nvml_indices(fake_pynvml, "2,0") == [2, 0]
        assert visible_nvml_indices(fake_pynvml, f"{_uuid(3)[:12]},1") == [3, 1]  # unique UUID prefix
        assert visible_nvml_indices(fake_pynvml, _uuid(2).upper().replace("GPU-", "GPU-")) == [2]
        assert visible_nvml_indices(fake_pynvml, "1,9,2") == [1]  # CUDA stops at the first invalid entry
        assert visible_nvml_indices(fake_pynvml, "3,3") == [3]
        assert visible_nvml_indices(fake_pynvml, "GPU-0000000") == []  # ambiguous prefix
        assert visible_nvml_indices(fake_pynvml, "-1") == []
        assert visible_nvml_indices(fake_pynvml, "") == []
    finally:
        fake_pynvml.nvmlShutdown()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{_uuid(3)},1")
    meter = NvmlMeter()
    assert [(d.id, d.name, d.uuid) for d in meter.devices()] == [("gpu:0", "gpu3", _uuid(3)), ("gpu:1", "gpu1", _uuid(1))]
    meter.close()
    only = detect_meters("cuda:1")[0]
    assert [d.name for d in only.devices()] == ["gpu1"]
    only.close()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(MeterUnavailable, match="no GPU visible"):
        NvmlMeter()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(MeterUnavailable, match="cuda:2 does not exist"):
        detect_meters("cuda:2")


def test_nvml_errors_map_to_typed_exceptions(monkeypatch):
    fake_pynvml.install(monkeypatch, [FakeGpu()])
    expected = {
        fake_pynvml.NVML_ERROR_NOT_SUPPORTED: NvmlNotSupported,
        fake_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: NvmlNotSupported,
        fake_pynvml.NVML_ERROR_NO_PERMISSION: NvmlNoPermission,
        fake_pynvml.NVML_ERROR_GPU_IS_LOST: GpuLost,
        fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: NvmlUnavailable,
        fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED: NvmlUnavailable,
        fake_pynvml.NVML_ERROR_TIMEOUT: NvmlError,
    }
    for code, cls in expected.items():
        mapped = map_nvml_error(fake_pynvml.NVMLError(code), "nvmlX", "gpu:3")
        assert type(mapped) is cls and "gpu:3 nvmlX" in str(mapped) and mapped.code == code
    if importlib.util.find_spec("pynvml") is not None:  # the real binding's errors map the same way
        real = importlib.import_module("pynvml")
        with pytest.raises(GpuLost):
            with nvml_errors("nvmlDeviceGetTotalEnergyConsumption", "gpu:0"):
                raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(KeyError):  # non-NVML errors pass through untouched
        with nvml_errors("x"):
            raise KeyError("k")


def test_lost_gpu_raises_gpu_lost_on_read(monkeypatch):
    fake = fake_pynvml.install(monkeypatch, [FakeGpu()])
    meter = NvmlMeter(nvml=fake_pynvml)
    fake.gpus[0].lost = True
    with pytest.raises(GpuLost, match="gpu:0"):
        meter.energy_j()
    with pytest.raises(GpuLost):
        meter.power_w()
    meter.close()
    with pytest.raises(GpuLost):
        NvmlMeter(nvml=fake_pynvml)
    status = {s.name: s for s in meter_status()}
    assert not status["nvml"].active and "lost" in status["nvml"].reason


def test_gpu_activity(monkeypatch):
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(utilization_pct=87, processes=[4242, 17],
                                                     process_sm_pct={4242: 80, 17: 5})])
    act = gpu_activity(0)
    assert act.available and act.utilization_pct == 87.0 and act.compute_pids == [17, 4242]
    assert act.process_utilization == {4242: 80.0, 17: 5.0}
    fake.gpus[0].process_sm_pct = {}
    assert gpu_activity(0).process_utilization == {}  # NVML says NOT_FOUND: nobody used it recently
    fake.gpus[0].process_sm_pct = None
    assert gpu_activity(0).process_utilization is None  # unsupported
    missing = gpu_activity(3)
    assert not missing.available and "cuda:3" in missing.reason
    assert fake.refcount == 0
    # the energy counter, in joules, where the GPU has one (an idle baseline over a quiet period reads it)
    first, second = gpu_activity(0).energy_j, (time.sleep(0.25), gpu_activity(0).energy_j)[1]
    assert first is not None and second > first >= fake.gpus[0].counter_origin_mj / 1000.0
    fake.gpus[0].energy_counter = False
    assert gpu_activity(0).energy_j is None  # a pre-Volta GPU: NOT_SUPPORTED is no error here

    fake_pynvml.install(monkeypatch, [FakeGpu()], init_error=fake_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    none = gpu_activity(0)
    assert none.reason.startswith("no NVML") and none.utilization_pct == 0.0 and none.compute_pids == []
