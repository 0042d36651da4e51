"""Live metering: a model served through `attach` writes samples that add up to an independent window."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from joulepilot.runtime import attach
from joulepilot.runtime.metered import _shared_gpu
from joulepilot.store import open_db
from joulepilot.store.deployments import get_deployment, list_deployments, read_samples
from joulepilot.telemetry import EnergyMeter, GpuActivity

# The estimate meter counts CPU time in clock ticks (10 ms) x 10 W per core, so one reading can be off
# by 0.1 J per core; over the sum of windows the error is one quantum at each end.
QUANTUM_J = 0.2


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).eval()


def _serve(dep, seconds: float, x: torch.Tensor, pause_s: float = 0.0) -> int:
    """Calls for `seconds`: flat out, or `pause_s` apart where the windows are the point, not the load."""
    calls, t_end = 0, time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < t_end:
            dep(x)
            calls += 1
            if pause_s:
                time.sleep(pause_s)
    return calls


class ThreadRecordingMeter:
    """The real EnergyMeter, noting which thread reads it (the hot path must never read it)."""

    def __init__(self, inner: EnergyMeter) -> None:
        self.inner = inner
        self.reader_threads: set[str] = set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_energy_j(self):
        self.reader_threads.add(threading.current_thread().name)
        return self.inner.read_energy_j()

    def read_power_w(self):
        self.reader_threads.add(threading.current_thread().name)
        return self.inner.read_power_w()


def test_samples_add_up_to_an_independent_window(tmp_path):
    db_path = tmp_path / "jp.db"
    x = torch.randn(32, 128)
    independent = EnergyMeter(device="cpu", sampler=False)
    assert independent.primary_source == "estimate"  # this machine: same process-tree accounting as the deployment
    independent.begin("span")
    dep = attach(_model(), "svc", db=db_path, device="cpu", interval_s=0.5)
    calls = _serve(dep, 3.0, x)
    dep.close()
    window = independent.end("span")

    db = open_db(db_path)
    samples = read_samples(db, get_deployment(db, "svc")["id"])
    assert len(samples) >= 5
    total_j = sum(s["energy_j"] for s in samples)
    assert window.energy_j > 5.0  # the loop kept a core busy for 3 s
    assert abs(total_j - window.energy_j) <= max(0.05 * window.energy_j, QUANTUM_J)
    assert sum(s["inferences"] for s in samples) == calls == dep.inferences
    for a, b in zip(samples, samples[1:], strict=False):
        assert b["t_start"] == pytest.approx(a["t_end"])  # windows tile the span without gaps
    for s in samples:
        assert s["energy_source"] == "estimate"
        assert s["other_processes"] == 0 and s["share"] == 1.0
        if s["avg_power_w"] is not None and s["peak_power_w"] is not None:
            assert s["peak_power_w"] >= s["avg_power_w"] - 1e-9


def test_hot_path_never_reads_the_meter(tmp_path):
    meter = ThreadRecordingMeter(EnergyMeter(device="cpu", sampler=False))
    dep = attach(_model(), "hot", db=tmp_path / "jp.db", device="cpu", interval_s=0.2, meter=meter)
    caller = threading.current_thread().name
    meter.reader_threads.clear()  # attach itself reads the starting point once
    _serve(dep, 1.0, torch.randn(8, 128), pause_s=0.002)
    dep.close()
    assert meter.reader_threads == {f"joulepilot-meter:{dep.name}"}
    assert caller not in meter.reader_threads


def test_batched_writes_and_flush_on_close(tmp_path):
    db_path = tmp_path / "jp.db"
    dep = attach(_model(), "batched", db=db_path, device="cpu", interval_s=0.2, flush_interval_s=3600)
    _serve(dep, 1.2, torch.randn(8, 128), pause_s=0.002)
    db = open_db(db_path)
    dep_id = get_deployment(db, "batched")["id"]
    assert read_samples(db, dep_id) == []  # nothing written until a batch is due
    served = dep.inferences
    dep.close()
    samples = read_samples(db, dep_id)
    assert len(samples) >= 5
    assert sum(s["inferences"] for s in samples) == served  # the last, partial window is kept too
    dep.close()  # idempotent
    assert len(read_samples(db, dep_id)) == len(samples)


def test_periodic_flush_while_serving(tmp_path):
    db_path = tmp_path / "jp.db"
    dep = attach(_model(), "periodic", db=db_path, device="cpu", interval_s=0.2, flush_interval_s=0.4)
    _serve(dep, 1.5, torch.randn(8, 128), pause_s=0.002)
    db = open_db(db_path)
    assert len(read_samples(db, get_deployment(db, "periodic")["id"])) >= 2
    dep.close()


def test_registration_and_wrapper_behaviour(tmp_path):
    db_path = tmp_path / "jp.db"
    model = _model()
    dep = attach(model, "reg", db=db_path, interval_s=1.0)
    x = torch.randn(4, 128)
    with torch.no_grad():
        assert torch.equal(dep(x), model(x))
    assert dep.training is False  # attribute access falls through to the model
    dep.close()
    db = open_db(db_path)
    row = get_deployment(db, "reg")
    assert row["device"] == "cpu" and row["host_id"]
    assert db.execute("SELECT COUNT(*) FROM devices WHERE host_id = ?", [row["host_id"]]).fetchone()[0] >= 1
    again = attach(model, "reg", db=db_path, interval_s=1.0)  # a restart appends to the same deployment
    again.close()
    assert [d["name"] for d in list_deployments(db)] == ["reg"]
    with pytest.raises(ValueError):
        attach(model, "bad", db=db_path, interval_s=0)


SERVE_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from joulepilot.runtime import attach
    dep = attach(torch.nn.Linear(64, 64), "child", db=sys.argv[1], device="cpu", interval_s=0.2,
                 flush_interval_s=3600, flush_on_sigterm=sys.argv[3] == "sigterm")
    x = torch.randn(8, 64)
    print("serving", flush=True)
    t_end = time.monotonic() + float(sys.argv[2])
    with torch.no_grad():
        while time.monotonic() < t_end:
            dep(x)
            time.sleep(0.005)  # served at a steady pace rather than flat out: the windows are the point, not the load
    print(dep.inferences, flush=True)
""")


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_unflushed_samples_survive_sigterm_and_normal_exit(tmp_path, how):
    db_path = tmp_path / "jp.db"
    script = tmp_path / "serve.py"
    script.write_text(SERVE_SCRIPT)
    seconds = "60" if how == "sigterm" else "1.0"
    proc = subprocess.Popen([sys.executable, str(script), str(db_path), seconds, how], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.readline().strip() == "serving"
    if how == "sigterm":
        time.sleep(3.0)  # at least a few 0.2-s windows, even when other test processes share the cores
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    if how == "sigterm":
        assert proc.returncode == -signal.SIGTERM  # the previous (default) handler still ran
    else:
        assert proc.returncode == 0
    db = open_db(db_path)
    samples = read_samples(db, get_deployment(db, "child")["id"])
    assert len(samples) >= 3
    assert sum(s["inferences"] for s in samples) > 0
    if how == "exit":
        assert sum(s["inferences"] for s in samples) == int(out.split()[-1])


def test_shared_gpu_attribution(monkeypatch):
    # No GPU here: the activity record is what telemetry.gpu_activity returns on a shared card.
    me, other = os.getpid(), 999_999
    import joulepilot.telemetry as telemetry

    monkeypatch.setattr(telemetry, "gpu_activity", lambda index: GpuActivity(
        utilization_pct=90.0, compute_pids=[me, other], process_utilization={me: 30.0, other: 60.0}))
    assert _shared_gpu(0) == (1, pytest.approx(1 / 3))
    monkeypatch.setattr(telemetry, "gpu_activity", lambda index: GpuActivity(
        utilization_pct=90.0, compute_pids=[me, other], process_utilization=None))
    assert _shared_gpu(0) == (1, None)
    monkeypatch.setattr(telemetry, "gpu_activity", lambda index: GpuActivity(
        utilization_pct=50.0, compute_pids=[me], process_utilization={me: 50.0}))
    assert _shared_gpu(0) == (0, 1.0)
