"""An estimate is never worded as a measurement: a violation's reading carries the source of the window that
tripped it ("estimated 10 W", never "measured 10 W", for an `estimate` deployment), and a deployment metered partly
by a counter and partly estimated reads PARTLY ESTIMATE in the summary of all deployments, not "ESTIMATE, not
measured" (part of it was measured)."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from joulepilot.controller.report import build_report, build_summary, render
from joulepilot.store import open_db, upsert_host
from joulepilot.store.deployments import insert_samples, insert_violation, register_deployment

T0 = 1_700_000_000.0
WATTS = {"estimate": 10.0, "rapl": 30.0}


def _without_images(html: str) -> str:
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)


def _deploy(db, name: str, sources: list[str], violations_at: list[int]) -> None:
    """A deployment with one 5-s window per source, and a guard trip at the end of each window index given."""
    dep = register_deployment(db, name, policy="svc", device="cpu", host_id=upsert_host(db),
                              details={"device_kind": "cpu", "limits": {"max_avg_power_w": 8.0}})
    insert_samples(db, dep, [{"t_start": T0 + 5 * i, "t_end": T0 + 5 * (i + 1), "energy_j": WATTS[src] * 5,
                              "inferences": 100, "avg_power_w": WATTS[src], "peak_power_w": WATTS[src] * 1.2,
                              "energy_source": src} for i, src in enumerate(sources)])
    for i in violations_at:
        insert_violation(db, policy="svc", deployment=name, limit_name="max_avg_power_w", limit_value=8.0,
                         measured_value=WATTS[sources[i]], at=T0 + 5 * (i + 1))


@pytest.fixture
def db(tmp_path):
    db = open_db(tmp_path / "jp.db")
    _deploy(db, "cpu-estimate", ["estimate"] * 4, [3])
    _deploy(db, "mixed", ["rapl", "rapl", "estimate", "estimate", "rapl", "rapl"], [3, 5])
    yield db
    db.close()


def test_a_violation_of_an_estimated_deployment_is_not_called_measured(db):
    report = build_report(db, "cpu-estimate")
    assert report.envelope.violations[0].energy_source == "estimate"
    md = render(report, "md")
    html = _without_images(render(report, "html"))
    for text in (md, html):
        assert "measured 10 W" not in text
        assert "estimated 10 W (ESTIMATE, not measured)" in text
    banner = re.search(r'<div class="banner bad">(.*?)</div>', html, re.S).group(1)
    assert "estimated 10 W (ESTIMATE, not measured)" in banner and "measured 10" not in banner
    assert json.loads(render(report, "json"))["envelope"]["violations"][0]["energy_source"] == "estimate"


def test_each_violation_of_a_partly_estimated_deployment_carries_its_own_windows_source(db):
    report = build_report(db, "mixed")
    assert [v.energy_source for v in report.envelope.violations] == ["estimate", "rapl"]
    md = render(report, "md")
    assert "estimated 10 W (ESTIMATE, not measured)" in md and "measured 30 W (rapl)" in md
    assert "measured 10 W" not in md
    # The report's own source line says which part was measured.
    assert "- Energy source: estimate+rapl (PARTLY ESTIMATE, the rest measured by rapl)" in md
    assert "estimate+rapl (ESTIMATE, not measured)" not in md


def test_the_summary_calls_a_partly_estimated_deployment_partly_estimate(db):
    summary = build_summary(db)
    rows = {r.name: r for r in summary.deployments}
    assert (rows["mixed"].estimated_windows, rows["mixed"].samples) == (2, 6)
    md_row = next(line for line in render(summary, "md").splitlines() if line.startswith("| mixed |"))
    assert "(ESTIMATE, not measured)" not in md_row
    assert "estimate+rapl (PARTLY ESTIMATE: 2 of 6 windows estimated, the rest measured by rapl)" in md_row
    estimate_row = next(line for line in render(summary, "md").splitlines() if line.startswith("| cpu-estimate |"))
    assert "estimate (ESTIMATE, not measured)" in estimate_row

    html = _without_images(render(summary, "html"))
    mixed_row = re.search(r"<tr><td>mixed</td>(.*?)</tr>", html, re.S).group(1)
    assert "partly ESTIMATE · estimate+rapl" in mixed_row and "ESTIMATE · not measured" not in mixed_row
    assert "Some figures are partly estimates" in html
    data = json.loads(render(summary, "json"))
    mixed = next(r for r in data["deployments"] if r["name"] == "mixed")
    assert mixed["estimated_windows"] == 2 and mixed["estimated_energy_j"] == pytest.approx(2 * 10.0 * 5)
    csv_row = next(r for r in csv.DictReader(io.StringIO(render(summary, "csv"))) if r["name"] == "mixed")
    assert csv_row["energy_source"] == "estimate+rapl"
