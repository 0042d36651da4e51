"""EnergyMeter windows over the fake NVML: nesting, idle baseline, sampler peak and samples, sync order."""

from __future__ import annotations

import threading
import time

import pytest
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.telemetry import DeviceInfo, EnergyMeter, Measurement, Meter


@pytest.fixture(autouse=True)
def _no_cuda_env(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))


READ_SKEW_S = 0.1


def _wait_until(fake, t: float) -> None:
    while fake.now() < t:
        time.sleep(0.005)


def test_nested_and_overlapping_windows(monkeypatch):
    # A 10 ms counter step (finer than real GPUs' 100 ms) keeps the arithmetic checks tight.
    fake_pynvml.install(monkeypatch, [FakeGpu(power_w=200.0, counter_step_s=0.01)])
    with EnergyMeter("cuda:0", sampler=False) as meter:
        assert meter.primary_source == "nvml" and [d.id for d in meter.devices] == ["gpu:0"]
        meter.begin("outer")
        time.sleep(0.2)
        with meter.window("inner") as inner:
            time.sleep(0.3)
        meter.begin("overlap")
        time.sleep(0.1)
        outer = meter.end("outer")
        time.sleep(0.1)
        overlap = meter.end("overlap")
        with pytest.raises(ValueError, match="no open energy window named 'outer'"):
            meter.end("outer")
        meter.begin("dup")
        with pytest.raises(ValueError, match="already open"):
            meter.begin("dup")
        meter.end("dup")
    inner_m = inner.measurement
    assert isinstance(inner_m, Measurement)
    assert outer.duration_s > inner_m.duration_s + 0.25
    for m in (outer, inner_m, overlap):
        # the counter and the clock are read one after the other: on a loaded machine up to READ_SKEW_S apart
        assert m.energy_j == pytest.approx(200.0 * m.duration_s, abs=200.0 * READ_SKEW_S)
        assert m.samples == [] and m.devices[0].peak_power_w is None  # sampler off


def test_idle_baseline_gives_energy_above_idle(monkeypatch):
    trace = lambda t: 80.0 if t < 0.7 else 330.0  # noqa: E731
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(power_w=trace, counter_step_s=0.01)])
    with EnergyMeter("cuda:0", sampler=False) as meter:
        idle = meter.measure_idle(0.5)
        assert idle["gpu:0"] == pytest.approx(80.0, rel=0.1)
        _wait_until(fake, 0.75)
        with meter.window("busy") as w:
            time.sleep(0.5)
    d = w.measurement.devices[0]
    assert d.idle_power_w == idle["gpu:0"]
    assert d.energy_above_idle_j == pytest.approx((330.0 - idle["gpu:0"]) * d.duration_s, rel=0.1)
    assert w.measurement.to_dict()["energy_above_idle_j"] == pytest.approx(d.energy_above_idle_j)


def test_sampler_peak_and_samples(monkeypatch):
    trace = lambda t: 500.0 if 0.6 <= t < 0.9 else 150.0  # noqa: E731
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(power_w=trace)])
    with EnergyMeter("cuda:0", sample_hz=10.0) as meter:
        _wait_until(fake, 0.2)
        with meter.window("spike") as w:
            _wait_until(fake, 1.4)
        assert meter.read_power_w()["gpu:0"] == pytest.approx(150.0)
    m = w.measurement
    d = m.devices[0]
    assert d.peak_power_w == pytest.approx(500.0)
    assert 1 <= d.samples <= 14  # ~1.2 s at 10 Hz, fewer where a loaded machine runs the sampler late
    assert all(0.0 <= t <= m.duration_s and dev == "gpu:0" for t, dev, _ in m.samples)
    assert m.peak_power_w == pytest.approx(500.0)
    assert m.to_dict()["samples"][0][1] == "gpu:0"


def test_sample_rate_is_capped_unless_overridden(monkeypatch):
    fake_pynvml.install(monkeypatch, [FakeGpu()])
    with pytest.raises(ValueError, match="allow_fast_sampling"):
        EnergyMeter("cuda:0", sample_hz=50.0)
    with EnergyMeter("cuda:0", sample_hz=50.0, allow_fast_sampling=True) as meter:
        assert meter.primary_source == "nvml"


def test_power_derived_from_energy_where_no_instant_power(tmp_path, monkeypatch):
    from fakes.powercap import FakePowercap

    tree = FakePowercap(tmp_path / "pc", sockets=1, dram=False)
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tree.root))
    stop = threading.Event()

    def package_at_40_w():
        while not stop.is_set():
            tree.add_joules("cpu:0", 40.0 * 0.02)
            time.sleep(0.02)

    writer = threading.Thread(target=package_at_40_w, daemon=True)
    with EnergyMeter("cpu") as meter:
        assert meter.primary_source == "rapl"
        writer.start()
        with meter.window("w") as w:
            time.sleep(1.0)
        power = meter.read_power_w()
    stop.set()
    writer.join()
    powers = [p for _, _, p in w.measurement.samples]
    assert len(powers) >= 5 and sorted(powers)[len(powers) // 2] == pytest.approx(40.0, rel=0.35)
    assert w.measurement.devices[0].avg_power_w == pytest.approx(40.0, rel=0.35)
    assert power["cpu:0"] >= 0.0


class _BlockingMeter(Meter):
    """Instant power that blocks until released: proves the sampler holds no lock the caller needs."""

    source = "nvml"

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()
        self.events: list[str] = []

    def devices(self):
        return [DeviceInfo("gpu:0", "gpu", "nvml")]

    def energy_j(self):
        self.events.append("energy")
        return {"gpu:0": 1.0 + len(self.events)}

    def power_w(self):
        self.inside.set()
        self.release.wait(5.0)
        return {"gpu:0": 100.0}

    @property
    def has_instant_power(self) -> bool:
        return True

    def sync(self):
        self.events.append("sync")


def test_sampler_stays_off_the_callers_path():
    meter_impl = _BlockingMeter()
    meter = EnergyMeter(meters=[meter_impl])
    try:
        meter.begin("a")
        assert meter_impl.inside.wait(5.0)  # the sampler thread is now stuck inside power_w()
        meter.begin("b")  # neither call waits for it
        m = meter.end("b")
        assert m.energy_j > 0
        meter_impl.release.set()
        meter.end("a")
    finally:
        meter_impl.release.set()
        meter.close()
    # every reading that opens or closes a window comes right after a device sync
    reads = [i for i, e in enumerate(meter_impl.events) if e == "energy"]
    assert reads and all(meter_impl.events[i - 1] == "sync" for i in reads)


def test_peak_is_never_below_the_windows_mean_with_instant_power(monkeypatch):
    # One sampler tick a second: the only sample is read as the window opens, at 100 W; the GPU then draws 500 W
    # for the rest of the window, which the energy counter sees and no sample does.
    trace = lambda t: 100.0 if t < 0.45 else 500.0  # noqa: E731
    fake = fake_pynvml.install(monkeypatch, [FakeGpu(power_w=trace, counter_step_s=0.01)])
    with EnergyMeter("cuda:0", sample_hz=1.0) as meter:
        _wait_until(fake, 0.3)
        with meter.window("step") as w:
            _wait_until(fake, 1.0)
    m = w.measurement
    d = m.devices[0]
    sampled = [p for _, _, p in m.samples]
    assert sampled and max(sampled) < d.avg_power_w  # the samples alone miss the 500 W stretch
    assert d.avg_power_w > 300.0
    assert d.peak_power_w >= d.avg_power_w and m.peak_power_w >= m.avg_power_w


def test_peak_is_never_below_the_windows_mean_with_the_estimate(tmp_path, monkeypatch):
    # Power derived from CPU time, a tick every 2 s: the one sample covers the first two seconds, spent asleep;
    # the CPU is busy only after them, until the window closes (well before the next tick, even on a busy host).
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "absent"))
    with EnergyMeter("cpu", sample_hz=0.5) as meter:
        assert meter.primary_source == "estimate"
        with meter.window("late") as w:
            time.sleep(2.05)
            t = time.process_time()
            while time.process_time() - t < 0.3:
                pass
    m = w.measurement
    d = m.devices[0]
    sampled = [p for _, _, p in m.samples]
    assert sampled and max(sampled) < d.avg_power_w  # the samples alone read the quiet second
    assert d.peak_power_w >= d.avg_power_w and m.peak_power_w >= m.avg_power_w


def test_a_window_shorter_than_a_tick_has_its_mean_as_its_peak(tmp_path, monkeypatch):
    # A power derived from CPU time needs two ticks: a window inside one tick has no sample, and its peak is
    # then what it surely reached, its mean, rather than none.
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "absent"))
    # one tick a minute: the window's 0.3 CPU-seconds stay inside one tick however busy the machine is
    with EnergyMeter("cpu", sample_hz=1 / 60) as meter:
        with meter.window("short") as w:
            t = time.process_time()
            while time.process_time() - t < 0.3:
                pass
    m = w.measurement
    d = m.devices[0]
    assert d.samples == 0 and m.samples == [] and d.avg_power_w > 0
    assert d.peak_power_w == d.avg_power_w and m.peak_power_w == m.avg_power_w
