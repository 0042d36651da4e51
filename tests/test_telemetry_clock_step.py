"""`joulepilot measure`'s stamps stay consistent with its duration when the wall clock steps mid-command.

The duration comes from perf_counter; the wall clock stamps the start once, and the end is derived from
the two, so a step (NTP, a VM resuming) cannot make `finished_at - started_at` disagree with `duration_s`.
"""

from __future__ import annotations

import sys
import time

import pytest
from joulepilot.telemetry import command, measure_command, monitor


class WallClockSteppedAfterFirstRead:
    """The `time` module as telemetry sees it: the wall clock steps by `step_s` after its first read."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.reads = 0

    def time(self) -> float:
        self.reads += 1
        return time.time() + (self.step_s if self.reads > 1 else 0.0)

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.mark.parametrize("step_s", [-5.0, 3600.0], ids=["back", "forward"])
def test_measured_command_stamps_span_its_duration_across_a_clock_step(tmp_path, monkeypatch, step_s):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))  # the CPU estimate meter
    clock = WallClockSteppedAfterFirstRead(step_s)
    monkeypatch.setattr(monitor, "time", clock)
    monkeypatch.setattr(command, "time", clock, raising=False)  # its end stamp, where it reads one
    before = time.time()
    result = measure_command([sys.executable, "-c", "import time; time.sleep(0.3)"], device="cpu", sampler=False)
    assert result["exit_code"] == 0
    assert clock.reads >= 1
    assert result["duration_s"] >= 0.3
    assert result["finished_at"] - result["started_at"] == pytest.approx(result["duration_s"], abs=1e-6)
    assert before <= result["started_at"] <= before + 5.0  # the start is the one wall-clock reading
