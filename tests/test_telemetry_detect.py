"""Which meters a device choice gets: NVML for cuda:N, RAPL or the estimate for cpu, never a silent mix."""

from __future__ import annotations

import pytest
import torch
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from fakes.powercap import FakePowercap
from joulepilot.telemetry import EnergyMeter, detect_meters, parse_device


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "absent"))


def _sources(device):
    meters = detect_meters(device)
    try:
        return [(m.source, [d.id for d in m.devices()]) for m in meters]
    finally:
        for m in meters:
            m.close()


def test_parse_device():
    assert parse_device(None) == ("all", None)
    assert parse_device("cpu") == ("cpu", None)
    assert parse_device(torch.device("cpu")) == ("cpu", None)
    assert parse_device("cuda") == ("cuda", 0)
    assert parse_device("CUDA:3") == ("cuda", 3)
    with pytest.raises(ValueError, match="'mps'"):
        parse_device("mps")


def test_gpu_host_without_rapl_meters_gpus_only(monkeypatch):
    fake_pynvml.install(monkeypatch, [FakeGpu(), FakeGpu(uuid="GPU-2")])
    assert _sources(None) == [("nvml", ["gpu:0", "gpu:1"])]  # no estimate mixed in with measured joules
    assert _sources("cuda:1") == [("nvml", ["gpu:1"])]
    assert _sources("cpu") == [("estimate", ["cpu:0"])]


def test_gpu_host_with_rapl(monkeypatch, tmp_path):
    fake_pynvml.install(monkeypatch, [FakeGpu()])
    tree = FakePowercap(tmp_path / "pc", sockets=1)
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tree.root))
    assert _sources(None) == [("nvml", ["gpu:0"]), ("rapl", ["cpu:0", "dram:0"])]
    assert _sources("cpu") == [("rapl", ["cpu:0", "dram:0"])]
    assert _sources("cuda:0") == [("nvml", ["gpu:0"])]
    with EnergyMeter(None, sampler=False) as meter:
        assert meter.primary_source == "nvml" and meter.sources == ["nvml", "rapl"]
        with meter.window("w") as w:
            tree.add_joules("cpu:0", 3.0)
    assert w.measurement.sources == ["nvml", "rapl"]
    assert {d.device: d.source for d in w.measurement.devices} == {"gpu:0": "nvml", "cpu:0": "rapl", "dram:0": "rapl"}


def test_bare_host_gets_the_labelled_estimate(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    assert _sources(None) == [("estimate", ["cpu:0"])]
    with EnergyMeter(None, sampler=False) as meter:
        assert meter.primary_source == "estimate"
        assert meter.describe()["methods"]["cpu:0"]["energy"].startswith("cpu-time x 10 W/core")
