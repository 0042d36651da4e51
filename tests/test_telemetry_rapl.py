"""RaplMeter on a fake powercap tree: two sockets, dram, overlapping zones, wraparound, permissions."""

from __future__ import annotations

import builtins
import logging
import os
import time

import pytest
from fakes.powercap import FakePowercap
from joulepilot.telemetry import (
    EstimateMeter,
    MeterUnavailable,
    RaplMeter,
    RaplPermissionError,
    detect_meters,
    meter_status,
)
from joulepilot.telemetry.rapl import MAX_POLL_INTERVAL_S, MIN_POLL_INTERVAL_S, poll_interval_s


@pytest.fixture
def tree(tmp_path, monkeypatch):
    fake = FakePowercap(tmp_path / "powercap")
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(fake.root))
    return fake


@pytest.fixture
def deny(monkeypatch):
    """Make chosen energy_uj files raise PermissionError when opened.

    Tests run as root here, and root reads mode-000 files, so chmod cannot reproduce the error.
    Patching builtins.open for exactly those paths keeps RaplMeter's real code path (it opens the
    file and gets the same PermissionError the kernel gives a non-root user since CVE-2020-8694).
    """
    denied: set[str] = set()
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike) and os.fspath(file) in denied:
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    return lambda path: denied.add(os.fspath(path))


def test_packages_and_dram_of_two_sockets_without_overlapping_zones(tree):
    meter = RaplMeter(background=False)
    try:
        assert [(d.id, d.kind, d.source) for d in meter.devices()] == [
            ("cpu:0", "cpu", "rapl"), ("dram:0", "dram", "rapl"), ("cpu:1", "cpu", "rapl"), ("dram:1", "dram", "rapl")]
        e0 = meter.energy_j()
        for zone, joules in {"cpu:0": 12.5, "cpu:1": 30.0, "dram:0": 2.0, "dram:1": 3.25,
                             "core:0": 9.0, "uncore:1": 4.0, "psys": 100.0, "mmio": 50.0}.items():
            tree.add_joules(zone, joules)
        e1 = meter.energy_j()
        deltas = {k: round(e1[k] - e0[k], 6) for k in e1}
        # core/uncore are inside the package; psys and mmio overlap it: none of them is added
        assert deltas == {"cpu:0": 12.5, "cpu:1": 30.0, "dram:0": 2.0, "dram:1": 3.25}
        assert any("core" in s for s in meter.skipped) and any("psys" in s for s in meter.skipped)
    finally:
        meter.close()


def test_wraparound_mid_window(tree):
    max_range = tree.max_range_uj("cpu:0")
    tree.set_energy_uj("cpu:0", max_range - 3_000_000)  # 3 J before the wrap
    meter = RaplMeter(background=False)
    start = meter.energy_j()["cpu:0"]
    tree.add_joules("cpu:0", 10.0)
    assert tree.energy_uj("cpu:0") < 3_000_000 + 7_000_001  # the file really wrapped
    assert meter.energy_j()["cpu:0"] - start == pytest.approx(10.0, abs=1e-6)
    meter.close()


def test_several_wraps_in_one_long_window(tmp_path):
    tree = FakePowercap(tmp_path / "pc", sockets=1, package_range_uj=10_000_000, dram_range_uj=4_000_000)
    meter = RaplMeter(tree.root, background=False)
    start = meter.energy_j()
    for _ in range(25):  # 25 x 7 J through a 10 J counter: 17 wraps; poll between writes
        tree.add_joules("cpu:0", 7.0)
        tree.add_joules("dram:0", 3.0)
        meter.poll()
    end = meter.energy_j()
    assert end["cpu:0"] - start["cpu:0"] == pytest.approx(175.0, abs=1e-6)
    assert end["dram:0"] - start["dram:0"] == pytest.approx(75.0, abs=1e-6)
    meter.close()


def test_poll_interval_is_a_quarter_of_the_wrap_time():
    assert poll_interval_s([262_143_328_850]) == MAX_POLL_INTERVAL_S  # 262 s wrap at 1 kW -> capped at 60 s
    assert poll_interval_s([262_143_328_850, 65_712_999_613]) == pytest.approx(65.713 / 4, rel=1e-3)
    assert poll_interval_s([1_000]) == MIN_POLL_INTERVAL_S


def test_background_poll_counts_wraps_between_reads(tmp_path):
    # 100 J range at a (fictitious) 200 W max -> 0.5 s wrap -> 0.125 s polls. Each write adds 60 J,
    # so two writes without a poll in between would lose a wrap; the test never reads in between.
    tree = FakePowercap(tmp_path / "pc", sockets=1, dram=False, package_range_uj=100_000_000)
    meter = RaplMeter(tree.root, max_power_w=200.0)
    try:
        assert meter.poll_interval_s == pytest.approx(0.125)
        start = meter.energy_j()["cpu:0"]
        for _ in range(5):
            tree.add_joules("cpu:0", 60.0)
            time.sleep(0.4)
        assert meter.energy_j()["cpu:0"] - start == pytest.approx(300.0, abs=1e-6)
    finally:
        meter.close()


def test_unreadable_zone_gives_one_message_and_readable_zones_keep_working(tree, deny, caplog):
    deny(tree.energy_path("cpu:1"))
    deny(tree.energy_path("dram:1"))
    meter = RaplMeter(background=False)
    try:
        assert [d.id for d in meter.devices()] == ["cpu:0", "dram:0"]
        message = meter.permission_message
        for text in (str(tree.energy_path("cpu:1")), str(tree.energy_path("dram:1")), "CVE-2020-8694",
                     'SUBSYSTEM=="powercap", ACTION=="add", RUN+="/bin/chmod o+r /sys%p/energy_uj"', "chmod g+r"):
            assert text in message
        e0 = meter.energy_j()["cpu:0"]
        tree.add_joules("cpu:0", 5.0)
        assert meter.energy_j()["cpu:0"] - e0 == pytest.approx(5.0)
    finally:
        meter.close()
    status = {s.name: s for s in meter_status()}
    assert status["rapl"].active and "CVE-2020-8694" in status["rapl"].reason
    with caplog.at_level(logging.WARNING, logger="joulepilot.telemetry"):
        meters = detect_meters("cpu")
    assert [m.source for m in meters] == ["rapl"]
    assert sum("CVE-2020-8694" in r.getMessage() for r in caplog.records) == 1
    for m in meters:
        m.close()


def test_all_zones_unreadable_falls_back_to_the_estimate(tree, deny):
    for zone in ("cpu:0", "cpu:1", "dram:0", "dram:1"):
        deny(tree.energy_path(zone))
    with pytest.raises(RaplPermissionError) as info:
        RaplMeter(background=False)
    assert len(info.value.paths) == 4 and "udev" in str(info.value)
    status = {s.name: s for s in meter_status()}
    assert not status["rapl"].active and "CVE-2020-8694" in status["rapl"].reason
    assert status["estimate"].active and "ESTIMATED" in status["estimate"].reason
    (meter,) = detect_meters("cpu")
    assert isinstance(meter, EstimateMeter)


def test_missing_tree_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "nope"))
    with pytest.raises(MeterUnavailable, match="no powercap tree at .*nope"):
        RaplMeter()
    (tmp_path / "empty").mkdir()
    with pytest.raises(MeterUnavailable, match="no package zone"):
        RaplMeter(tmp_path / "empty")
