"""A deployment's report shows the J per call it served with its configuration beside the median of that
configuration's benchmark runs on the same device kind and energy source, and says when the two differ by more than
the benchmark's noise (the interval of its median, `policies.noise`), with a hint; never across energy sources."""

from __future__ import annotations

import csv
import io
import json
import time

import pytest
from bill_factories import WID, store_run
from joulepilot.compiler import CompileConfig
from joulepilot.controller.report import build_report, render
from joulepilot.store import open_db
from joulepilot.store.deployments import insert_samples, register_deployment

SERVED = CompileConfig("default", precision="bf16", batch_size=8)
BENCHMARKED_J = (0.0420, 0.0429, 0.0438)  # three runs of the served configuration: median 42.9 mJ
CALLS = 1000  # per window


def _store(path, *, served_j: float, source: str = "rapl", bench_source: str = "rapl", other_processes: int = 0):
    db = open_db(path)
    for j in BENCHMARKED_J:
        store_run(db, "default", "bf16", j, source=bench_source)
    for j in (0.080, 0.084, 0.079):  # another configuration's repeats: the workload's typical spread
        store_run(db, "eager", "fp32", j, source=bench_source)
    store_run(db, "default", "bf16", 0.5, source=bench_source, device="cuda:0", device_name="NVIDIA H200")  # other kind
    dep = register_deployment(db, "svc-dep", workload_id=WID, config_id=SERVED.id, host_id="test-host", device="cpu",
                              details={"device_kind": "cpu", "energy_source": source, "batch_size": 8})
    t = time.time() - 100
    insert_samples(db, dep, [{"t_start": t + 5 * i, "t_end": t + 5 * (i + 1), "energy_j": served_j * CALLS,
                              "inferences": CALLS, "avg_power_w": served_j * CALLS / 5, "peak_power_w": 40.0,
                              "energy_source": source, "config_id": SERVED.id, "other_processes": other_processes}
                             for i in range(4)])
    return db


def test_a_deployment_served_far_above_its_benchmark_says_so_with_a_hint_in_every_format(tmp_path):
    db = _store(tmp_path / "j.db", served_j=0.1617, other_processes=1)
    report = build_report(db, "svc-dep")
    s = report.served_vs_benchmarked
    assert s.verdict == "above" and s.energy_source == "rapl" and s.config_label == SERVED.label
    assert s.served_j_per_call == pytest.approx(0.1617) and s.served_calls == 4 * CALLS and s.served_windows == 4
    assert s.benchmarked_j_per_call == pytest.approx(0.0429) and s.benchmark_runs == 3 and s.benchmark_batch_size == 8
    assert s.benchmark_low_j < 0.0429 < s.benchmark_high_j < 0.1617
    assert s.ratio == pytest.approx(0.1617 / 0.0429)
    assert "161.7 mJ/call" in s.text and "42.9 mJ benchmarked" in s.text and "more than its noise" in s.text
    assert "batch size and input sizes benchmarked (batch 8)" in s.hint and "other processes used the device" in s.hint

    md = render(report, "md")
    assert "## Served against benchmarked" in md and "161.7 mJ" in md and "(batch 8)" in md
    html = render(report, "html")
    assert "Served vs benchmarked" in html and "3.77x" in html and "input sizes" in html
    data = json.loads(render(report, "json"))["served_vs_benchmarked"]
    assert data["verdict"] == "above" and data["benchmark_run_ids"] == s.benchmark_run_ids
    rows = {r["metric"]: r for r in csv.DictReader(io.StringIO(render(report, "csv")))
            if r["section"] == "served_vs_benchmarked"}
    assert rows["verdict"]["value"] == "above" and rows["benchmarked_j_per_call"]["source"] == "rapl"
    assert float(rows["served_j_per_call"]["value"]) == pytest.approx(0.1617, rel=1e-3)
    db.close()


@pytest.mark.parametrize(("served_j", "verdict"), [(0.0433, "within_noise"), (0.0150, "below")])
def test_within_the_noise_is_said_so_and_below_gets_its_own_hint(tmp_path, served_j, verdict):
    db = _store(tmp_path / "j.db", served_j=served_j)
    s = build_report(db, "svc-dep").served_vs_benchmarked
    assert s.verdict == verdict
    if verdict == "within_noise":
        assert s.hint is None and s.text.endswith("within the benchmark's noise")
        assert "| served vs benchmarked | within the noise (43.3 mJ against 42.9 mJ) |" in render(
            build_report(db, "svc-dep"), "md")
    else:
        assert "cost less per call" in s.hint and "idle time" not in s.hint
    db.close()


def test_an_estimated_deployment_is_not_compared_with_measured_benchmarks(tmp_path):
    db = _store(tmp_path / "j.db", served_j=0.1617, source="estimate", bench_source="rapl")
    s = build_report(db, "svc-dep").served_vs_benchmarked
    assert s.verdict == "not_compared" and s.benchmarked_j_per_call is None and s.ratio is None
    assert "no benchmark run on cpu metered by estimate (only by rapl: not like for like)" in s.why
    md = render(build_report(db, "svc-dep"), "md")
    assert "not compared" in md and "42.9 mJ" not in md
    db.close()
