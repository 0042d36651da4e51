"""On a synchronous device (the CPU) the energy window's own calls are timed one by one and give the latency
percentiles; on a GPU a separate synchronised pass comes first and the window stays unsynchronised."""

from __future__ import annotations

import time

from joulepilot.compiler.measure import is_synchronous, latencies_and_window, timed_back_to_back


class RecordingMeter:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def begin(self, label: str) -> None:
        self.log.append(f"begin {label}")

    def end(self, label: str) -> dict[str, str]:
        self.log.append(f"end {label}")
        return {"label": label}


class RecordingPhases:
    def __init__(self) -> None:
        self.names: list[str] = []

    def enter(self, name: str) -> None:
        self.names.append(name)


def _sleeping_call(log: list[str], seconds: float):
    def call() -> None:
        log.append("call")
        time.sleep(seconds)

    return call


def test_only_cuda_devices_queue_their_work():
    assert is_synchronous("cpu") and not is_synchronous("cuda:0") and not is_synchronous("cuda")


def test_on_the_cpu_the_window_calls_are_the_latency_samples():
    log: list[str] = []
    syncs: list[int] = []
    phases = RecordingPhases()
    timed = latencies_and_window(_sleeping_call(log, 0.002), lambda: syncs.append(1), RecordingMeter(log),
                                 device="cpu", min_seconds=0.1, latency_s=5.0, phases=phases)
    assert phases.names == ["window"]  # no latency pass, though latency_s asked for 5 s
    assert log[0] == "begin window" and log[-1] == "end window"  # every call inside the metered window
    assert timed.calls == log.count("call") == len(timed.latencies_ms)
    assert timed.latency_source == "window" and timed.latency_pass_s == 0.0
    assert all(1.9 <= ms < 50 for ms in timed.latencies_ms)  # each sample is one 2-ms call
    columns, extra = timed.latency_columns(), timed.latency_extra()
    assert columns["latency_ms_p50"] <= columns["latency_ms_p95"]
    assert extra["latency_calls"] == timed.calls and extra["latency_s"] == 0.0


def test_on_a_gpu_a_synchronised_pass_comes_before_an_unsynchronised_window():
    log: list[str] = []
    syncs: list[int] = []
    phases = RecordingPhases()
    timed = latencies_and_window(_sleeping_call(log, 0.001), lambda: syncs.append(len(log)), RecordingMeter(log),
                                 device="cuda:0", min_seconds=0.05, latency_s=0.05, phases=phases)
    assert phases.names == ["latency", "window"]
    begin = log.index("begin window")
    assert log[:begin].count("call") == len(timed.latencies_ms) >= 10  # the pass, outside the window
    assert log[begin + 1:-1].count("call") == timed.calls
    assert timed.latency_source == "latency_pass" and timed.latency_pass_s >= 0.05
    # one sync before and after every pass call, then one before the window and one at its end
    assert len(syncs) == 2 * len(timed.latencies_ms) + 2


def test_a_long_window_of_short_calls_keeps_a_bounded_uniform_sample():
    counter = {"n": 0}

    def call() -> None:
        counter["n"] += 1

    calls, latencies = timed_back_to_back(call, min_seconds=0.05, min_calls=5_000, cap=1_000)
    assert calls == counter["n"] >= 5_000
    assert len(latencies) == 1_000
    assert all(ms >= 0 for ms in latencies)
