"""A run slowed by something outside its configuration is flagged "repeat this run": CPU workers run torch on a
number of threads chosen on purpose and recorded; a probe of the workload's eager calls on those threads and on
one tells contended cores; and a run far slower than its configuration's stored runs on the same kind of device
is flagged when it is stored. The rules are fed figures here (no assertion on this machine's speed); one sweep
checks that a real worker records its threads and its probe."""

from __future__ import annotations

import time

import pytest
import torch
from joulepilot.compiler import CompileConfig, bench, device_pool
from joulepilot.compiler.bench import MeasuredRun, _store_measured
from joulepilot.compiler.measure import FAR_SLOWER, ThreadProbe, thread_probe
from joulepilot.policies.resolve import run_flag
from joulepilot.store import host_identity, list_runs

CONFIG = CompileConfig(mode="eager", batch_size=1)
WORKLOAD = {"id": "w-disturbed", "spec": "mlp", "batch_size": 1}


def test_cpu_threads_are_chosen_on_purpose_and_say_why(monkeypatch):
    monkeypatch.setattr(device_pool, "available_cores", lambda: 6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert device_pool.cpu_threads() == (6, "the cores this process may run on")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert device_pool.cpu_threads() == (3, "OMP_NUM_THREADS")
    assert device_pool.cpu_threads(2) == (2, "--threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "many")  # not a count: the cores again
    assert device_pool.cpu_threads() == (6, "the cores this process may run on")


def test_the_probe_flags_threads_far_slower_than_one_thread():
    # the host: eager calls 24-40 ms against 0.23 ms possible
    contended = ThreadProbe(threads=2, ms_at_threads=30.0, ms_one_thread=0.23, pairs=5)
    assert "30 ms with torch's 2 threads against 0.23 ms on one thread" in contended.warning()
    calm = ThreadProbe(threads=2, ms_at_threads=0.2, ms_one_thread=0.23, pairs=5)
    assert calm.warning() is None
    # an eager fp32 configuration's window compared with the probe's one thread
    assert "calls took 24 ms (median) in the energy window against 0.23 ms" in calm.warning(window_p50_ms=24.0)
    assert calm.warning(window_p50_ms=0.23 * FAR_SLOWER * 0.9) is None
    one = ThreadProbe(threads=1, ms_at_threads=30.0, ms_one_thread=0.23, pairs=5)
    assert one.warning() is None  # one thread against one thread: nothing to tell about threads


def test_the_probe_leaves_torch_on_the_workers_threads():
    before = torch.get_num_threads()
    seen = []
    probe = thread_probe(lambda: seen.append(torch.get_num_threads()), before, pairs=3)
    assert torch.get_num_threads() == before
    assert probe.pairs == 3 and seen == [before, 1] * 3
    assert probe.to_dict()["threads"] == before


def _measured(latency_ms: float, *, flagged: bool = False, further_ms: float | None = None,
              torch_version: str = "2.13.0") -> MeasuredRun:
    now = time.time()
    row = {"torch_version": torch_version, "workload_id": WORKLOAD["id"], "config_id": CONFIG.id, "host_id": host_identity()["id"], "device": "cpu",
           "status": "ok", "started_at": now, "finished_at": now + 1, "window_s": 1.0, "inferences": 100,
           "energy_j": 1.0, "energy_j_per_inference": 0.01, "latency_ms_p50": latency_ms, "energy_source": "estimate",
           "extra": {"window_warning": "calls took ... repeat this run"} if flagged else {}}
    further = []
    if further_ms is not None:
        more = dict(row, latency_ms_p50=further_ms, extra={"window_in_process": 2})
        further.append((more, []))
    return MeasuredRun(CONFIG, WORKLOAD["id"], "ok", None, row, [], WORKLOAD, [], further)


def test_a_run_far_slower_than_its_configurations_stored_runs_is_flagged(db):
    notices = []
    for latency in (0.22, 0.23, 0.25):
        assert not _store_measured(db, "mlp", _measured(latency), notices.append)["extra"].get("window_warning")
    _store_measured(db, "mlp", _measured(40.0, flagged=True), notices.append)  # flagged: not a reference
    slow = _store_measured(db, "mlp", _measured(24.0, further_ms=0.24), notices.append)
    assert "calls took 24 ms (median) against 0.23 ms, the median of this configuration's 3 earlier runs" in \
        run_flag(slow)
    stored = {r["id"]: r for r in list_runs(db)}
    assert run_flag(stored[slow["run_id"]]) is not None  # stored with the flag, which the resolver reads
    assert run_flag(stored[slow["run_id"] + 1]) is None  # its further window ran at the usual pace
    calm = _store_measured(db, "mlp", _measured(0.3), notices.append)
    assert run_flag(calm) is None
    # another torch may be slower: its first run has nothing to be compared with
    assert run_flag(_store_measured(db, "mlp", _measured(24.0, torch_version="2.14.0"), notices.append)) is None


def test_a_cpu_sweep_records_its_threads_and_the_probe(db, fake_worker):
    notices = []
    (run,) = bench("mlp", [CONFIG], device="cpu", min_seconds=0.1, db=db, idle_s=0, threads=2,
                   notice=notices.append)
    assert run["status"] == "ok", run["reason"]
    extra = run["extra"]
    assert extra["torch_threads"] == 2 and extra["torch_threads_from"] == "--threads"
    probe = extra["thread_probe"]
    assert probe["threads"] == 2 and probe["pairs"] >= 1 and probe["ms_one_thread"] > 0
    assert "torch runs on 2 threads on the CPU (--threads; --threads N to change)" in notices


@pytest.fixture(autouse=True)
def _threads_put_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
