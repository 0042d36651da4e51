"""EstimateMeter: CPU time of a real process tree times watts per busy core."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import psutil
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


# Burns CPU, writes its own CPU seconds so far to `out`, stays alive until the test creates `release`, then burns
# as much again and writes its CPU seconds to `out` + ".end" just before it exits.
HELD_BURN = """import os, time
def burn(s):
    t = time.process_time()
    while time.process_time() - t < s: pass
def report(path):
    open(path + ".part", "w").write(str(time.process_time()))
    os.rename(path + ".part", path)
burn({s})
report({out!r})
while not os.path.exists({release!r}): time.sleep(0.01)
burn({s})
report({out!r} + ".end")
"""


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def test_live_grandchildren_are_counted_while_running_and_after_exit(tmp_path):
    """Compared with the CPU seconds the grandchild itself reports, not with a figure: on a busy machine its
    interpreter's start (and coverage's, where the suite measures subprocesses) costs more CPU than on a quiet one."""
    out, release = tmp_path / "cpu_s", tmp_path / "release"
    script = tmp_path / "burn.py"
    script.write_text(HELD_BURN.format(s=0.3, out=str(out), release=str(release)))
    w = 10.0
    meter = EstimateMeter(w_per_core=w, include_root=False)
    start, children_before = meter.energy_j()["cpu:0"], _children_cpu_s()
    shell = subprocess.Popen(["sh", "-c", f'"{sys.executable}" "{script}" & wait'])
    try:
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        own_cpu_s = float(out.read_text())  # the grandchild has burnt its CPU and waits, alive
        (grandchild,) = psutil.Process(shell.pid).children()
        seen_cpu_s = _cpu_s(grandchild)
        mid = meter.energy_j()["cpu:0"] - start  # counted through the live tree: at least what it has used
        assert grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE
        # 0.2 J: /proc's 10 ms ticks; 1e-6: the meter's sums of floats
        assert own_cpu_s >= 0.3 and mid >= w * seen_cpu_s - 1e-6 and w * seen_cpu_s >= w * own_cpu_s - 0.2
    finally:
        release.touch()
        shell.wait(timeout=60)
    end = meter.energy_j()["cpu:0"] - start  # reaped: counted through the children's times, once
    children_cpu_s = _children_cpu_s() - children_before
    total_own_cpu_s = float((tmp_path / "cpu_s.end").read_text())  # the second burn only ran after the read above
    assert total_own_cpu_s >= own_cpu_s + 0.3
    assert w * total_own_cpu_s - 0.2 <= end <= w * children_cpu_s + 0.2


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
