"""On a GPU the quiet period the daemon waits out before a pass is its idle baseline: the GPU's energy counter
over the period, read with each quiet load reading, instead of a baseline measured after it."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
from daemon_factories import write_daemon_config, write_policy
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import IdleConfig
from joulepilot.controller.idle import IdleTracker, LoadProbe
from joulepilot.store import list_runs, open_db
from joulepilot.store.jsonvalues import json_object


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _tracker(readings, clock, min_idle_s=10.0, poll_s=1.0) -> IdleTracker:
    activity = iter(SimpleNamespace(utilization_pct=util, compute_pids=[], process_utilization={}, available=True,
                                    reason="", energy_j=energy) for util, energy in readings)
    probe = LoadProbe("cuda:0", IdleConfig(max_utilization_pct=10, min_idle_s=min_idle_s, poll_s=poll_s),
                      gpu_activity=lambda index: next(activity))
    return IdleTracker(probe, clock=clock)


def _poll_at(tracker: IdleTracker, clock: Clock, t: float) -> bool:
    clock.t = t
    return tracker.poll(set())


def test_the_quiet_period_gives_the_average_power_from_its_first_reading_to_its_last():
    clock = Clock()
    # 60 W while quiet; then production load (an 80 % reading) ends the period and a new one starts at t=20
    tracker = _tracker([(2, 1000.0), (3, 1300.0), (1, 1600.0), (80, 5000.0), (0, 6000.0), (0, 6150.0),
                        (0, 6300.0)], clock)
    assert not _poll_at(tracker, clock, 0.0) and tracker.quiet_power_w(2.0) is None  # one reading spans nothing
    assert not _poll_at(tracker, clock, 5.0)
    assert tracker.quiet_power_w(2.0) == pytest.approx((60.0, 5.0))
    assert tracker.quiet_power_w(6.0) is None  # shorter than asked for
    assert _poll_at(tracker, clock, 10.0)  # quiet for min_idle_s: ready
    assert tracker.quiet_power_w(2.0) == pytest.approx((60.0, 10.0))
    clock.t = 14.0
    assert tracker.quiet_power_w(2.0) is None  # the last reading is four seconds old: not this period's end
    assert not _poll_at(tracker, clock, 15.0) and tracker.quiet_power_w(0.0) is None  # busy: no quiet period
    _poll_at(tracker, clock, 20.0)
    _poll_at(tracker, clock, 21.0)
    _poll_at(tracker, clock, 22.0)
    assert tracker.quiet_power_w(2.0) == pytest.approx((150.0, 2.0))  # only the new period counts


def test_a_gap_in_the_counter_or_a_counter_that_went_back_gives_no_baseline():
    clock = Clock()
    no_counter = _tracker([(0, 100.0), (0, None), (0, 400.0)], clock)  # a read that lost the counter
    for t in (0.0, 1.0, 2.0):
        _poll_at(no_counter, clock, t)
    assert no_counter.quiet_power_w(0.5) is None  # the period's energy before the gap is unknown
    clock.t = 0.0
    reloaded = _tracker([(0, 5000.0), (0, 10.0)], clock)  # a driver reload restarts the counter
    _poll_at(reloaded, clock, 0.0)
    _poll_at(reloaded, clock, 2.0)
    assert reloaded.quiet_power_w(1.0) is None


def test_our_own_job_on_the_gpu_ends_the_baseline():
    clock = Clock()
    tracker = _tracker([(0, 0.0), (0, 500.0), (95, 900.0)], clock, min_idle_s=1.0)
    _poll_at(tracker, clock, 0.0)
    assert _poll_at(tracker, clock, 5.0)
    clock.t = 5.5
    tracker.probe.read = lambda own, during_job=False: SimpleNamespace(busy=False, reason="ours", energy_j=None)
    assert not tracker.busy_now(set())  # the daemon's worker computes there: not idle power any more
    assert tracker.quiet_power_w(0.0) is None


def test_a_daemon_pass_on_a_gpu_takes_its_idle_baseline_from_the_quiet_period(tmp_path, flow_worker, monkeypatch,
                                                                              own_tmpdir, restore_logging, capfd):
    from fakes import fake_pynvml
    from fakes.fake_pynvml import FakeGpu

    fake_pynvml.install_everywhere(monkeypatch, [FakeGpu(uuid="GPU-0a0a0a0a-1111-2222-3333-444444444444",
                                                         power_w=85.0)])
    monkeypatch.setattr(importlib.import_module("joulepilot.compiler.bench"), "default_idle_s", lambda device: 1.0)
    monkeypatch.setenv("JOULEPILOT_FLOW_CALL_S", "0.01")  # no run flagged "repeat this run" on a loaded machine
    measured: list[str] = []
    real_measure_idle = importlib.import_module("joulepilot.telemetry").EnergyMeter.measure_idle

    def recorded(meter, seconds=2.0):
        measured.append(str(meter.device))
        return real_measure_idle(meter, seconds)

    monkeypatch.setattr(importlib.import_module("joulepilot.telemetry").EnergyMeter, "measure_idle", recorded)
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "mlp", precisions=("fp32", "bf16"))
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, min_seconds=0.2)
    config.write_text("devices = [0]\n" + config.read_text().replace(
        "[idle]\npoll_s = 0.5\n", "[idle]\nmin_idle_s = 2\npoll_s = 0.25\n"))
    result = Daemon.from_cli(config_path=str(config), db=None, policies=()).run(once=True)
    assert result.exit_code == 0, result.summary
    runs = list_runs(open_db(db))
    assert len(runs) == 2 and {r["device"] for r in runs} == {"cuda:0"}, [r["reason"] for r in runs]
    extras = [json_object(r["extra"]) for r in runs]
    assert {e["idle_from"] for e in extras} == {"quiet period"}
    assert all(e["idle_s"] >= 1.0 for e in extras)  # the period spanned at least the baseline's seconds
    assert all(r["idle_power_w"] == pytest.approx(85.0, rel=0.05) for r in runs)  # the fake GPU's idle power
    assert measured == []  # no baseline measured after the wait
    assert "cuda:0: idle baseline " in capfd.readouterr().err  # the daemon's log says where it came from


def test_a_cpu_sweep_metered_by_the_estimate_alone_has_nothing_idle_to_wait_for(tmp_path, monkeypatch):
    from joulepilot.compiler.bench import sweep_context

    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))  # no RAPL: the estimate
    waited: list[float] = []
    monkeypatch.setattr(importlib.import_module("joulepilot.telemetry").EnergyMeter, "measure_idle",
                        lambda meter, seconds=2.0: waited.append(seconds) or {})
    context = sweep_context("cpu", 0.5)
    assert waited == []  # the CPU-time estimate counts the worker's own seconds: 0 W idle by construction
    assert [d["source"] for d in context.devices] == ["estimate"]
    assert context.idle_power_w == {context.devices[0]["id"]: 0.0}
    assert context.idle_s == 0.0 and context.idle_from == "none (estimate)"


def test_a_cpu_sweep_metered_by_rapl_measures_its_idle_baseline(tmp_path, monkeypatch):
    from fakes.powercap import FakePowercap
    from joulepilot.compiler.bench import sweep_context

    fake = FakePowercap(tmp_path / "powercap")
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(fake.root))
    context = sweep_context("cpu", 0.3)
    assert {d["source"] for d in context.devices} == {"rapl"}
    assert context.idle_from == "measured" and context.idle_s == 0.3
    assert set(context.idle_power_w) == {d["id"] for d in context.devices}
