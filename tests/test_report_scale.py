"""Reports scale with a deployment's age: every figure is summed by the store, and only the newest windows are listed.

The figures must stay what the per-window computation gave (the report loaded every window and summed them in
Python): `reference_*` below is that computation, run over `read_samples` on a few hundred windows with mixed
sources, windows stored out of time order, stamps stepped back by the wall clock (overlapping, and one ending
before it starts), idle windows, shared windows with and without a recorded share, and a fallback swap.
"""

from __future__ import annotations

import csv
import io
import json
import random
import re
import statistics

import pytest
from bill_factories import WID, store_run, write_policy
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig
from joulepilot.controller.report import build_report, build_summary, render
from joulepilot.policies import decide, load_policy
from joulepilot.policies.bill import PAYS_BACK, deployment_payback
from joulepilot.store import open_db, upsert_host
from joulepilot.store.deployments import get_deployment, insert_samples, read_samples, register_deployment

from joulepilot.cli import main

T0 = 1_700_000_000.0
WINDOW_S = 5.0
CHOSEN = CompileConfig("default", precision="bf16", batch_size=8)
FALLBACK = CompileConfig("eager", batch_size=8)
REL = 1e-12  # the store sums in its own order: the same figures to the last few bits


def decided(db, tmp_path):
    """Benchmark runs (the factories' MLP on this CPU, RAPL) and a real decision of policy `svc` with its bill."""
    store_run(db, "eager", "fp32", 0.5)
    store_run(db, "default", "fp32", 0.4)
    store_run(db, "default", "bf16", 0.2)
    decision = decide(db, load_policy(write_policy(tmp_path)), "cpu", record=True, lock=False).decision
    assert decision.config_id == CHOSEN.id and decision.bill["verdict"] == PAYS_BACK
    return decision


def awkward_windows(calls_per_window: int, count: int = 300, seed: int = 7) -> list[dict]:
    """`count` windows as old and new deployments left them, in a shuffled order (ids not in time order)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        t_start = T0 + WINDOW_S * i
        t_end = t_start + WINDOW_S
        if i >= 150:  # the wall clock stepped back 2 s: these overlap the windows before them
            t_start, t_end = t_start - 2.0, t_end - 2.0
        if i == 200:  # a step back inside the window: it ends before it starts
            t_end = t_start - 0.5
        source = "estimate" if 90 <= i < 120 else "nvml+estimate" if i in (40, 41) else "rapl"
        config = FALLBACK.id if 60 <= i < 75 else None if i in (10, 11) else "" if i == 12 else CHOSEN.id
        watts = 15.0 + 15.0 * rng.random()
        rows.append({
            "t_start": t_start, "t_end": t_end, "energy_j": watts * WINDOW_S + rng.random(),
            "inferences": 0 if i % 17 == 0 else calls_per_window + rng.randrange(calls_per_window // 5 + 1),
            "avg_power_w": None if i == 33 else watts, "peak_power_w": None if i % 29 == 0 else watts * 1.2,
            "energy_source": source, "config_id": config,
            "other_processes": 2 if i % 11 == 0 else 0, "share": (0.6 if i % 22 == 0 else None) if i % 11 == 0 else 1.0})
    rows.append(dict(rows[5], energy_j=3.0))  # a second window with the same start: time order breaks the tie by id
    rng.shuffle(rows)
    return rows


# -- the per-window computation reports made before the store summed the figures --------------------------------
def reference_windows(samples):
    rows, cumulative = [], 0.0
    for s in samples:
        cumulative += s["energy_j"]
        rows.append({"t_start": s["t_start"], "t_end": s["t_end"], "duration_s": s["t_end"] - s["t_start"],
                     "energy_j": s["energy_j"], "cumulative_energy_j": cumulative, "inferences": s["inferences"],
                     "j_per_inference": s["energy_j"] / s["inferences"] if s["inferences"] else None,
                     "avg_power_w": s["avg_power_w"], "peak_power_w": s["peak_power_w"],
                     "energy_source": s["energy_source"], "config_id": s.get("config_id"),
                     "other_processes": s.get("other_processes") or 0, "share": s.get("share"),
                     "tokens": s.get("tokens"),
                     "j_per_token": s["energy_j"] / s["tokens"] if s.get("tokens") else None})
    return rows


def reference_figures(windows, avg_limit, peak_limit):
    energy_j = sum(w["energy_j"] for w in windows)
    inferences = sum(w["inferences"] for w in windows)
    metered_s = sum(w["duration_s"] for w in windows)
    sources = sorted({w["energy_source"] for w in windows})
    peaks = [w["peak_power_w"] for w in windows if w["peak_power_w"] is not None]
    shared = [w for w in windows if w["other_processes"]]
    estimated = [w for w in windows if "estimate" in w["energy_source"]]
    shares = [w["share"] for w in shared if w["share"] is not None]
    configs = sorted({w["config_id"] for w in windows if w["config_id"]})
    return {
        "totals": {
            "energy_j": energy_j, "energy_kwh": energy_j / 3.6e6, "inferences": inferences,
            "j_per_inference": energy_j / inferences if inferences else None,
            "busy_j_per_inference": sum(w["energy_j"] for w in windows if w["inferences"]) / inferences
            if inferences else None,
            "avg_power_w": energy_j / metered_s if metered_s > 0 else None,
            "peak_power_w": max(peaks) if peaks else None, "metered_s": metered_s,
            "energy_source": "+".join(sources) if sources else None, "is_estimate": "estimate" in sources,
            "attributed_energy_j": sum(w["energy_j"] * (w["share"] if w["share"] is not None else 1.0)
                                       for w in windows) if shared else None,
            "estimated_energy_j": sum(w["energy_j"] for w in estimated), "estimated_windows": len(estimated)},
        "period": {"start_t": windows[0]["t_start"] if windows else None,
                   "end_t": windows[-1]["t_end"] if windows else None, "samples": len(windows)},
        "envelope": {
            "windows_above_avg_limit": sum(1 for w in windows
                                           if avg_limit is not None and (w["avg_power_w"] or 0) > avg_limit),
            "windows_above_peak_limit": sum(1 for w in windows
                                            if peak_limit is not None and (w["peak_power_w"] or 0) > peak_limit)},
        "sharing": {"windows": len(windows), "windows_shared": len(shared),
                    "max_other_processes": max((w["other_processes"] for w in windows), default=0),
                    "mean_share": statistics.fmean(shares) if shares else None},
        "history": [(c, sum(1 for w in windows if w["config_id"] == c),
                     sum(w["energy_j"] for w in windows if w["config_id"] == c),
                     sum(w["inferences"] for w in windows if w["config_id"] == c)) for c in configs],
    }


def reference_payback(all_samples, served, payback_inferences):
    windows = [(s["t_start"], s["t_end"], int(s["inferences"] or 0)) for s in all_samples
               if (s.get("config_id") or served) == served]
    return deployment_payback(payback_inferences, windows)


def assert_same(actual, expected, where):
    if isinstance(expected, float):
        assert actual == pytest.approx(expected, rel=REL, abs=1e-9), where
    else:
        assert actual == expected, where


@pytest.fixture(params=["crossed", "not_yet"])
def awkward(request, db, tmp_path):
    decision = decided(db, tmp_path)
    needed = decision.bill["payback_inferences"]
    # "crossed": the calls reach the payback about half-way through; "not_yet": they reach a fraction of it
    per_window = max(1, round(needed / 140)) if request.param == "crossed" else max(1, round(needed / 1000))
    host = upsert_host(db, {"id": "test-host", "hostname": "test", "cpu": "x86"})
    dep = register_deployment(db, "svc-prod", policy="svc", workload_id=WID, config_id=CHOSEN.id, host_id=host,
                              device="cpu", details={"device_kind": "cpu", "energy_source": "rapl",
                                                     "limits": {"max_avg_power_w": 25.0, "max_peak_power_w": 30.0}})
    insert_samples(db, dep, awkward_windows(per_window))
    return db, request.param, needed


@pytest.mark.parametrize("since", [None, T0 + 700.0], ids=["whole", "since"])
def test_the_stores_sums_give_the_figures_of_the_per_window_computation(awkward, since):
    db, case, needed = awkward
    samples = read_samples(db, get_deployment(db, "svc-prod")["id"], since=since)
    expected = reference_figures(reference_windows(samples), 25.0, 30.0)
    report = build_report(db, "svc-prod", since, windows=10_000)
    assert report.envelope.max_avg_power_w == 25.0 and report.envelope.max_peak_power_w == 30.0
    assert expected["envelope"]["windows_above_avg_limit"] > 0 and expected["sharing"]["mean_share"] is not None
    for section in ("totals", "period", "envelope", "sharing"):
        for key, value in expected[section].items():
            assert_same(report[section][key], value, f"{section}.{key}")
    history = [(h.config_id, h.samples, h.energy_j, h.inferences) for h in report.configuration.history]
    assert len(history) == len(expected["history"])
    for got, want in zip(history, expected["history"], strict=True):
        for a, b in zip(got, want, strict=True):
            assert_same(a, b, f"history {want[0]}")
    assert report.configuration.served_config_ids == sorted({h[0] for h in expected["history"]} | {CHOSEN.id})
    # Every window listed when the limit allows, exactly as the per-window computation listed them.
    assert [w.to_dict() for w in report.samples] == reference_windows(samples)
    assert report.period.samples_left_out == 0 and report.timeline is None

    # The payback counts every window of the served configuration, whatever `since` says.
    all_samples = read_samples(db, get_deployment(db, "svc-prod")["id"])
    reached = reference_payback(all_samples, CHOSEN.id, needed)
    assert reached.verdict == ("paid_back" if case == "crossed" else "not_yet")
    pb = report.payback
    assert (pb.verdict, pb.calls) == (reached.verdict, reached.calls)
    for key in ("fraction", "calls_per_s", "paid_back_at", "paid_back_after_s", "remaining_s"):
        assert_same(getattr(pb, key), getattr(reached, key), f"payback.{key}")

    # Listing fewer windows changes no figure; the listed ones are the newest, their cumulative energy the same.
    short = build_report(db, "svc-prod", since, windows=7)
    for section in ("totals", "envelope", "sharing", "payback"):
        assert short[section].to_dict() == report[section].to_dict(), section
    assert [w.t_start for w in short.samples] == [w.t_start for w in report.samples[-7:]]
    for got, want in zip(short.samples, report.samples[-7:], strict=True):
        assert got.cumulative_energy_j == pytest.approx(want.cumulative_energy_j, rel=REL)


@pytest.fixture
def long_store(tmp_path):
    path = tmp_path / "jp.db"
    db = open_db(path)
    dep = register_deployment(db, "long", device="cpu", host_id=upsert_host(db))
    insert_samples(db, dep, [{"t_start": T0 + WINDOW_S * i, "t_end": T0 + WINDOW_S * (i + 1),
                              "energy_j": 100.0 + i % 7, "inferences": 40, "avg_power_w": 20.0 + i % 7 / 5,
                              "peak_power_w": 30.0, "energy_source": "rapl"} for i in range(1200)])
    yield db, str(path)
    db.close()


def test_a_report_lists_the_newest_windows_and_says_how_many_it_left_out(long_store):
    db, _path = long_store
    report = build_report(db, "long")
    assert report.period.samples == 1200
    assert report.period.samples_listed == len(report.samples) == 500 and report.period.samples_left_out == 700
    assert [w.t_start for w in report.samples] == [T0 + WINDOW_S * i for i in range(700, 1200)]
    assert report.samples[-1].cumulative_energy_j == pytest.approx(report.totals.energy_j)
    said = "Showing the last 500 of 1,200 windows"
    assert said in render(report, "md") and said in render(report, "html")
    data = json.loads(render(report, "json"))
    assert len(data["samples"]) == 500 and data["period"]["samples_left_out"] == 700
    rows = list(csv.reader(io.StringIO(render(report, "csv"))))
    assert sum(1 for r in rows if r[1:3] == ["sample", "energy_j"]) == 500
    assert ["long", "period", "samples_left_out", "700", "windows", "", "", "", ""] in rows
    # The plots still cover the whole period: spans of it, summing every window.
    spans = report.timeline
    assert 0 < len(spans) <= 500 and sum(s.windows for s in spans) == 1200
    assert sum(s.energy_j for s in spans) == pytest.approx(report.totals.energy_j)
    assert spans[0].t_start == T0 and spans[-1].t_end == T0 + WINDOW_S * 1200
    assert len(data["timeline"]) == len(spans)
    html = render(report, "html")
    assert html.count("data:image/png;base64,") == 3 and "spans of time, each summing the" in html


def test_the_windows_option(long_store):
    _db, path = long_store
    runner = CliRunner()
    few = runner.invoke(main, ["report", "--db", path, "-d", "long", "--windows", "20", "--json"])
    assert few.exit_code == 0, few.output
    data = json.loads(few.output)
    assert len(data["samples"]) == 20 and data["period"]["samples_left_out"] == 1180
    assert data["totals"]["inferences"] == 1200 * 40
    none = runner.invoke(main, ["report", "--db", path, "-d", "long", "--windows", "0"])
    assert none.exit_code == 0 and "No windows listed of 1,200 (--windows N lists the last N)" in none.output
    every = runner.invoke(main, ["report", "--db", path, "-d", "long", "--windows", "5000", "--json"])
    assert len(json.loads(every.output)["samples"]) == 1200 and "Showing the last" not in every.output
    assert "timeline" in json.loads(every.output) and json.loads(every.output)["timeline"] is None
    refused = runner.invoke(main, ["report", "--db", path, "--all", "--windows", "3"])
    assert refused.exit_code == 2 and "--windows lists one deployment's windows" in refused.output
    negative = runner.invoke(main, ["report", "--db", path, "-d", "long", "--windows", "-1"])
    assert negative.exit_code == 2 and "--windows" in negative.output


def test_the_summary_lists_no_window_and_keeps_the_figures(long_store):
    db, _path = long_store
    row = build_summary(db)["deployments"][0]
    report = build_report(db, "long")
    assert row["samples"] == 1200 and row["energy_j"] == pytest.approx(report.totals.energy_j)
    assert row["avg_power_w"] == pytest.approx(report.totals.avg_power_w)
    assert re.search(r"\| long \|", render(build_summary(db), "md"))
