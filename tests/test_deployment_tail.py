"""Closing a deployment folds a short last window into the one before it instead of writing a sliver.

The meter is a fake (no GPU here) that behaves like NVML's energy counter: it advances in 100 ms steps
at a constant power, so a window of a few milliseconds reads either 0 J or one whole step.
"""

from __future__ import annotations

import math
import time

import pytest
from joulepilot.runtime import attach
from joulepilot.store import open_db
from joulepilot.store.deployments import get_deployment, read_samples

POWER_W = 100.0
STEP_S = 0.1


class SteppingCounter:
    """A fake energy meter: cumulative joules at POWER_W, updated every STEP_S like NVML's counter."""

    devices: list = []
    primary_source = "nvml"

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def read_energy_j(self) -> dict[str, float]:
        steps = math.floor((time.monotonic() - self.t0) / STEP_S)
        return {"gpu:0": POWER_W * steps * STEP_S}

    def read_power_w(self) -> dict[str, float]:
        return {"gpu:0": POWER_W}

    def close(self) -> None:
        pass


def _serve_until(dep, db, dep_id, windows: int, timeout_s: float = 20.0) -> None:
    """Call the model until `windows` windows are in the store."""
    t_end = time.monotonic() + timeout_s
    while len(read_samples(db, dep_id)) < windows:
        assert time.monotonic() < t_end, "the meter wrote no window"
        dep(1)
        time.sleep(0.002)


def _check_tiling_and_totals(samples, dep, meter) -> None:
    for a, b in zip(samples, samples[1:], strict=False):
        assert b["t_start"] == pytest.approx(a["t_end"])
    assert sum(s["inferences"] for s in samples) == dep.inferences
    assert sum(s["energy_j"] for s in samples) == pytest.approx(meter.read_energy_j()["gpu:0"], abs=POWER_W * STEP_S)


@pytest.mark.parametrize("flush_interval_s", [0.0, 3600.0], ids=["already-written", "still-buffered"])
def test_short_last_window_is_folded_into_the_previous_one(tmp_path, flush_interval_s):
    db_path = tmp_path / "jp.db"
    meter = SteppingCounter()
    dep = attach(lambda x: x, "tail", db=db_path, device="cpu", interval_s=0.5, meter=meter,
                 flush_interval_s=flush_interval_s)
    db = open_db(db_path)
    dep_id = get_deployment(db, "tail")["id"]
    if flush_interval_s == 0:
        _serve_until(dep, db, dep_id, 2)  # at least one window already in the store when the tail comes
    else:
        t_end = time.monotonic() + 1.2
        while time.monotonic() < t_end:
            dep(1)
            time.sleep(0.002)
    dep.close()
    samples = read_samples(db, dep_id)
    assert len(samples) >= 2
    last = samples[-1]
    # No sliver: every window, the last included, spans at least one sampling interval.
    assert all(s["t_end"] - s["t_start"] >= 0.5 * 0.95 for s in samples)
    assert last["avg_power_w"] == pytest.approx(POWER_W, rel=0.35)  # not 0 W, not a one-step spike
    assert last["peak_power_w"] >= last["avg_power_w"]
    _check_tiling_and_totals(samples, dep, meter)


def test_a_short_only_window_is_written_as_it_is(tmp_path):
    db_path = tmp_path / "jp.db"
    meter = SteppingCounter()
    dep = attach(lambda x: x, "brief", db=db_path, device="cpu", interval_s=5.0, meter=meter)
    for _ in range(3):
        dep(1)
    time.sleep(0.25)
    dep.close()
    db = open_db(db_path)
    samples = read_samples(db, get_deployment(db, "brief")["id"])
    assert len(samples) == 1
    assert samples[0]["inferences"] == 3
    assert 0.2 <= samples[0]["t_end"] - samples[0]["t_start"] < 5.0
    _check_tiling_and_totals(samples, dep, meter)
