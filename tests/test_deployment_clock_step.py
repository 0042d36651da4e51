"""A deployment's windows are timed by the monotonic clock: a wall-clock step (an NTP step, a VM resuming)
neither stretches nor squeezes a window, so its power stays what the device drew.

The meter is a fake (no GPU here) whose energy counter advances at a constant power on the monotonic
clock, as a real counter does whatever the wall clock says. The wall clock seen by `runtime.metered` is
stepped while the deployment serves.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from joulepilot.controller.report import build_report
from joulepilot.runtime import attach, metered
from joulepilot.store import open_db
from joulepilot.store.deployments import get_deployment, read_samples

POWER_W = 300.0
STEP_S = 0.005  # the fake counter's resolution: fine, so a window's power is exact to a few percent
INTERVAL_S = 0.3


class ConstantPowerCounter:
    """Cumulative joules at POWER_W on the monotonic clock, in STEP_S steps."""

    devices: list = []
    primary_source = "nvml"

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def read_energy_j(self) -> dict[str, float]:
        return {"gpu:0": POWER_W * STEP_S * math.floor((time.monotonic() - self.t0) / STEP_S)}

    def read_power_w(self) -> dict[str, float]:
        return {"gpu:0": POWER_W}

    def close(self) -> None:
        pass


class SteppedWallClock:
    """`runtime.metered`'s view of the `time` module: the real one, with a wall clock that can be stepped.

    Records which threads read a clock, to show the serving thread never does."""

    def __init__(self) -> None:
        self.offset_s = 0.0
        self.readers: list[int] = []

    def step(self, seconds: float) -> None:
        self.offset_s += seconds

    def time(self) -> float:
        self.readers.append(threading.get_ident())
        return time.time() + self.offset_s

    def monotonic(self) -> float:
        self.readers.append(threading.get_ident())
        return time.monotonic()

    def perf_counter(self) -> float:
        self.readers.append(threading.get_ident())
        return time.perf_counter()

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture
def wall(monkeypatch) -> SteppedWallClock:
    clock = SteppedWallClock()
    monkeypatch.setattr(metered, "time", clock)
    return clock


def _serve(dep, seconds: float) -> int:
    calls, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        dep(1)
        calls += 1
        time.sleep(0.002)
    return calls


def _samples(db_path):
    db = open_db(db_path)
    dep_id = get_deployment(db, "svc")["id"]
    return db, read_samples(db, dep_id)


# How far apart the metering thread may read the counter and the clock on a loaded machine (preempted between
# the two): far less than the steps the tests make (0.27 s and more), which a wall-clock window would show.
READ_SKEW_S = 0.1


def _check_windows(samples) -> None:
    """Every window's stamps span the time its energy was metered: its energy is the device's power times its
    duration, to the counter's resolution and the read skew, whatever its length (a window may be short after
    a late one, on a loaded machine). A window timed by a stepped wall clock is off by the step."""
    assert len(samples) >= 3
    for s in samples:
        duration_s = s["t_end"] - s["t_start"]
        assert duration_s > 0, s
        assert abs(s["energy_j"] - POWER_W * duration_s) <= POWER_W * (STEP_S + READ_SKEW_S), s
        assert s["energy_j"] / duration_s == pytest.approx(s["avg_power_w"], rel=1e-5), s


@pytest.mark.parametrize("step_s", [-0.9 * INTERVAL_S, +0.9 * INTERVAL_S, -30.0], ids=["back", "forward", "far-back"])
def test_a_wall_clock_step_mid_window_leaves_every_window_at_the_devices_power(tmp_path, wall, step_s):
    db_path = tmp_path / "j.db"
    dep = attach(lambda x: x, "svc", db=db_path, device="cpu", interval_s=INTERVAL_S, meter=ConstantPowerCounter())
    calls = _serve(dep, 2.5 * INTERVAL_S)
    wall.step(step_s)  # in the middle of the third window
    calls += _serve(dep, 2.0 * INTERVAL_S)
    stepped_closing = time.time() + step_s
    dep.close()
    closed = time.time()
    stepped_closed = closed + step_s
    db, samples = _samples(db_path)
    _check_windows(samples)
    assert sum(s["inferences"] for s in samples) == calls == dep.inferences
    report = build_report(db, "svc")
    metered_s = sum(s["t_end"] - s["t_start"] for s in samples)
    assert abs(report.totals.avg_power_w - POWER_W) <= POWER_W * (STEP_S + READ_SKEW_S) / metered_s
    assert report.totals.metered_s == pytest.approx(sum(s["t_end"] - s["t_start"] for s in samples))
    # Windows never overlap and stay in order; the stamps follow a step forward at once (leaving a gap), and
    # never go back with a step back (they run ahead of the stepped wall clock by at most the step).
    for a, b in zip(samples, samples[1:], strict=False):
        assert b["t_start"] >= a["t_end"] - 1e-6
    gaps = [b["t_start"] - a["t_end"] for a, b in zip(samples, samples[1:], strict=False)]
    # the last window ends at close() (the tail folded in), on the wall clock as stepped, or ahead of it
    if step_s > 0:
        assert max(gaps) == pytest.approx(step_s, abs=READ_SKEW_S)
        assert stepped_closing - READ_SKEW_S <= samples[-1]["t_end"] <= stepped_closed
    else:
        # no gap of the step's size; what is left is the moment between the wall and monotonic clock reads,
        # microseconds, more on a loaded machine
        assert max(gaps) == pytest.approx(0.0, abs=READ_SKEW_S)
        assert stepped_closing < samples[-1]["t_end"] <= closed


@pytest.mark.parametrize("step_s", [-0.5, -30.0, +30.0], ids=["back", "far-back", "far-forward"])
def test_a_wall_clock_step_in_the_tail_keeps_the_folded_window_right_and_loses_nothing(tmp_path, wall, step_s):
    db_path = tmp_path / "j.db"
    dep = attach(lambda x: x, "svc", db=db_path, device="cpu", interval_s=INTERVAL_S, meter=ConstantPowerCounter(),
                 flush_interval_s=0.0)
    db = open_db(db_path)
    dep_id = get_deployment(db, "svc")["id"]
    calls = 0
    while len(read_samples(db, dep_id)) < 3:
        calls += _serve(dep, 0.05)
    calls += _serve(dep, 0.1)
    wall.step(step_s)  # in the short tail that close() folds into the last window
    calls += _serve(dep, 0.05)
    dep.close()
    samples = read_samples(db, dep_id)
    assert sum(s["inferences"] for s in samples) == calls == dep.inferences
    last = samples[-1]
    assert abs(last["energy_j"] - POWER_W * (last["t_end"] - last["t_start"])) <= POWER_W * (STEP_S + READ_SKEW_S)
    assert last["energy_j"] / (last["t_end"] - last["t_start"]) == pytest.approx(last["avg_power_w"], rel=1e-5)
    assert last["t_end"] - last["t_start"] > INTERVAL_S  # the tail was folded in, not written as a sliver


def test_the_serving_thread_reads_no_clock(tmp_path, wall):
    """The hot path stays one counter increment: no clock read on the caller's thread."""
    dep = attach(lambda x: x, "svc", db=tmp_path / "j.db", device="cpu", interval_s=INTERVAL_S,
                 meter=ConstantPowerCounter())
    caller = threading.get_ident()
    wall.readers.clear()
    for _ in range(2000):
        dep(1)
    served_readers = list(wall.readers)
    dep.close()
    assert dep.inferences == 2000
    assert caller not in served_readers
