"""EstimateMeter: CPU time of a real process tree times watts per busy core."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest
from joulepilot.telemetry import DEFAULT_W_PER_CORE, EnergyMeter, EstimateMeter, TelemetryError

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_child_cpu_time_times_watts_per_core():
    meter = EstimateMeter(w_per_core=12.0, include_root=False)
    before_j, before_cpu = meter.energy_j()["cpu:0"], _children_cpu_s()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.5)], check=True)
    after_j, after_cpu = meter.energy_j()["cpu:0"], _children_cpu_s()
    child_cpu_s = after_cpu - before_cpu
    assert child_cpu_s >= 0.5
    assert after_j - before_j == pytest.approx(child_cpu_s * 12.0, rel=0.05, abs=0.1)


def test_live_grandchildren_are_counted_while_running_and_after_exit(tmp_path):
    script = tmp_path / "burn.py"
    script.write_text(BURN.format(s=0.6))
    meter = EstimateMeter(w_per_core=10.0, include_root=False)
    start = meter.energy_j()["cpu:0"]
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" "{script}" & wait'])
    # Read while the grandchild burns (the shell waits for it): on a busy machine it may take a while to get its
    # first 0.1 s of CPU, so the read is repeated until then rather than made once after a fixed sleep.
    mid, deadline = 0.0, time.monotonic() + 60
    while mid <= 1.0 and shell.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        mid = meter.energy_j()["cpu:0"] - start  # the grandchild is alive: counted through the live tree
    alive = shell.poll() is None
    shell.wait()
    end = meter.energy_j()["cpu:0"] - start  # reaped: counted through children_user/system
    assert mid > 1.0 and alive  # counted while it still ran
    assert end >= mid and end == pytest.approx(0.6 * 10.0, rel=0.25)


def test_default_and_environment_watts_per_core(monkeypatch):
    monkeypatch.delenv("JOULEPILOT_ESTIMATE_W_PER_CORE", raising=False)
    assert EstimateMeter().w_per_core == DEFAULT_W_PER_CORE == 10.0
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", "4.5")
    meter = EstimateMeter()
    assert meter.w_per_core == 4.5 and "4.5 W" in meter.devices()[0].name
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", "lots")
    with pytest.raises(TelemetryError, match="JOULEPILOT_ESTIMATE_W_PER_CORE='lots'"):
        EstimateMeter()
    for value in ("inf", "-inf", "nan", "0", "-2"):  # only finite watts above 0
        monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", value)
        with pytest.raises(TelemetryError, match=f"JOULEPILOT_ESTIMATE_W_PER_CORE='{value}' is not a finite number"):
            EstimateMeter()


def test_estimate_is_labelled_everywhere(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "none"))
    with EnergyMeter("cpu") as meter:
        assert meter.primary_source == "estimate"
        assert [(d.id, d.source) for d in meter.devices] == [("cpu:0", "estimate")]
        with meter.window("w") as w:
            t = time.process_time()
            while time.process_time() - t < 0.3:
                pass
    m = w.measurement
    assert m.sources == ["estimate"]
    assert m.devices[0].source == "estimate" and "W/core" in m.devices[0].method
    assert m.energy_j == pytest.approx(0.3 * 10.0, rel=0.3)
    assert m.to_dict()["devices"][0]["source"] == "estimate"
