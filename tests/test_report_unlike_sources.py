"""A report does not claim a saving against a baseline metered by another source than the deployment (RAPL
benchmarks, an `estimate` deployment): the saving is null with the reason, in every format and in the summary."""

from __future__ import annotations

import csv
import io
import json
import re
import time

import pytest
from bill_factories import WID, store_run
from joulepilot.compiler import CompileConfig
from joulepilot.controller.report import build_report, build_summary, render
from joulepilot.store import open_db
from joulepilot.store.deployments import insert_samples, register_deployment

EAGER_J, STOCK_J = 0.02, 0.01  # benchmarked J per call
SERVED_J = 0.01  # J per call the deployment's windows report


def _store(path, *, baseline_source: str, deployment_source: str, precision: str = "fp32"):
    """Three benchmark runs each of eager and stock compile (fp32, batch 8), and a deployment serving compile
    default at `precision` (fp32: the stock-compile baseline's own configuration)."""
    db = open_db(path)
    for _ in range(3):
        store_run(db, "eager", "fp32", EAGER_J, source=baseline_source)
        store_run(db, "default", "fp32", STOCK_J, source=baseline_source)
    cfg = CompileConfig("default", precision=precision, batch_size=8)
    dep = register_deployment(db, "svc-dep", policy=None, workload_id=WID, config_id=cfg.id, host_id="test-host",
                              device="cpu", details={"device_kind": "cpu", "energy_source": deployment_source,
                                                     "batch_size": 8})
    t = time.time() - 100
    insert_samples(db, dep, [{"t_start": t + 5 * i, "t_end": t + 5 * (i + 1), "energy_j": 50.0,
                              "inferences": round(50.0 / SERVED_J), "avg_power_w": 10.0, "peak_power_w": 12.0,
                              "energy_source": deployment_source, "config_id": cfg.id, "other_processes": 0,
                              "share": 1.0} for i in range(4)])
    return db


def _without_images(html: str) -> str:
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


@pytest.fixture
def unlike(tmp_path):
    db = _store(tmp_path / "j.db", baseline_source="rapl", deployment_source="estimate")
    yield db
    db.close()


def test_no_saving_against_a_baseline_of_another_source(unlike):
    report = build_report(unlike, "svc-dep")
    eager = report["baselines"]["eager_fp32"]
    assert eager["measured"] and not eager["served_is_baseline"]
    assert eager["saving_fraction"] is None and eager["saving_j"] is None
    assert eager["like_for_like"] is False
    reason = eager["no_saving_reason"]
    assert "rapl" in reason and "estimate" in reason and "not like for like" in reason
    # The benchmark figure itself is still shown, with its own source.
    assert eager["j_per_inference"] == pytest.approx(EAGER_J) and eager["energy_source"] == "rapl"

    as_json = json.loads(render(report, "json"))["baselines"]["eager_fp32"]
    assert as_json["saving_fraction"] is None and as_json["saving_j"] is None
    assert as_json["no_saving_reason"] == reason and as_json["like_for_like"] is False


def test_the_text_report_says_why_instead_of_a_saving(unlike):
    md = render(build_report(unlike, "svc-dep"), "md")
    headline = _line(md, "| vs eager fp32 |")
    assert "%" not in headline and "not like for like" in headline
    row = _line(md, "| eager fp32 |")
    assert "%" not in row and "saved" not in row and "not like for like" in row
    assert "50.0% less" not in md and "200 J saved" not in md


def test_the_html_report_says_why_instead_of_a_saving(unlike):
    html = _without_images(render(build_report(unlike, "svc-dep"), "html"))
    card = re.search(r'<div class="label">vs eager fp32</div><div class="value">([^<]*)</div>', html)
    assert card and "not like for like" in card.group(1) and "%" not in card.group(1)
    assert "50.0% less" not in html and "200 J saved" not in html
    row = re.search(r"<tr><td>eager fp32</td>(.*?)</tr>", html, re.S).group(1)
    assert "not like for like" in row and "saved" not in row
    # The J/inference plot draws no line for a baseline that is not like for like, and says so.
    assert "Not drawn:\neager fp32 (rapl), torch.compile default fp32 (rapl)," in html


def test_the_summary_claims_no_saving(unlike):
    summary = build_summary(unlike)
    row = summary["deployments"][0]
    assert row["saving_vs_eager_fp32"] is None
    assert row["not_like_for_like"] == ["eager_fp32", "compile_default_fp32"]
    md_row = _line(render(summary, "md"), "| svc-dep |")
    assert "%" not in md_row and "not like for like" in md_row
    html = _without_images(render(summary, "html"))
    assert "not like for like" in html and "50.0% less" not in html
    csv_row = next(csv.DictReader(io.StringIO(render(summary, "csv"))))
    assert csv_row["saving_vs_eager_fp32"] == "" and csv_row["not_like_for_like"] == "eager_fp32+compile_default_fp32"
    assert json.loads(render(summary, "json"))["deployments"][0]["saving_vs_eager_fp32"] is None


def test_the_csv_report_carries_the_reason(unlike):
    rows = list(csv.DictReader(io.StringIO(render(build_report(unlike, "svc-dep"), "csv"))))
    figure = {(r["section"], r["metric"]): r for r in rows if r["section"].startswith("baseline.")}
    assert figure["baseline.eager_fp32", "saving_fraction"]["value"] == ""
    assert "not like for like" in figure["baseline.eager_fp32", "no_saving_reason"]["value"]


def test_a_baseline_of_the_same_source_still_gets_its_saving(tmp_path):
    db = _store(tmp_path / "j.db", baseline_source="rapl", deployment_source="rapl", precision="bf16")
    report = build_report(db, "svc-dep")
    for key, bench_j in (("eager_fp32", EAGER_J), ("compile_default_fp32", STOCK_J)):
        b = report["baselines"][key]
        assert b["like_for_like"] is True and b["no_saving_reason"] is None
        assert b["saving_fraction"] == pytest.approx(1 - SERVED_J / bench_j)
    assert build_summary(db)["deployments"][0]["not_like_for_like"] == []
    db.close()


def test_a_served_baseline_of_another_source_gives_both_reasons(unlike):
    stock = build_report(unlike, "svc-dep")["baselines"]["compile_default_fp32"]
    assert stock["served_is_baseline"] and stock["saving_fraction"] is None
    assert stock["like_for_like"] is False
    assert "own configuration" in stock["no_saving_reason"] and "not like for like" in stock["no_saving_reason"]
