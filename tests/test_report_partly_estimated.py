"""A deployment whose meter failed for a while (some windows metered, some estimated) is reported as partly an
estimate: every format says which windows and how much energy are estimated, none claims that no counter could
be read at all, and the Markdown windows carry their source as the other formats do."""

from __future__ import annotations

import json

import pytest
from joulepilot.controller.report import build_report, render
from joulepilot.store import open_db, upsert_host
from joulepilot.store.deployments import insert_samples, register_deployment

T0 = 1_700_000_000.0
NO_COUNTER_AT_ALL = ("no energy counter was readable on this host", "no energy counter could be read on this host",
                     "No energy counter (NVML or RAPL) was readable on this host")


def windows(sources):
    return [{"t_start": T0 + 5 * i, "t_end": T0 + 5 * i + 5, "energy_j": 100.0 + 10 * i, "inferences": 50,
             "avg_power_w": 20.0 + 2 * i, "peak_power_w": 30.0, "energy_source": source}
            for i, source in enumerate(sources)]


@pytest.fixture
def db(tmp_path):
    db = open_db(tmp_path / "jp.db")
    host = upsert_host(db)
    for name, sources in (("svc", ["nvml", "estimate", "estimate", "nvml"]), ("cpu-only", ["estimate"] * 3)):
        dep = register_deployment(db, name, device="cpu", host_id=host)
        insert_samples(db, dep, windows(sources))
    yield db
    db.close()


def test_a_partly_estimated_deployment_says_which_part_is_an_estimate(db):
    report = build_report(db, "svc")
    estimated = [w for w in windows(["nvml", "estimate", "estimate", "nvml"]) if w["energy_source"] == "estimate"]
    assert report.totals.estimated_windows == len(estimated)
    assert report.totals.estimated_energy_j == pytest.approx(sum(w["energy_j"] for w in estimated))
    data = json.loads(render(report, "json"))
    assert data["totals"]["estimated_windows"] == len(estimated)
    for text in (render(report, "md"), render(report, "html"), " ".join(data["notes"])):
        assert not any(claim in text for claim in NO_COUNTER_AT_ALL), text
        assert f"{len(estimated)} of 4 windows" in text and "measured by nvml" in text
    csv_rows = render(report, "csv").splitlines()
    assert f"svc,totals,estimated_windows,{len(estimated)},windows,estimate,,," in csv_rows


def test_markdown_windows_carry_their_source(db):
    rows = [line for line in render(build_report(db, "svc"), "md").splitlines() if line.startswith("| 2023-")]
    assert [row.split(" | ")[7] for row in rows] == ["nvml", "estimate", "estimate", "nvml"]


def test_a_wholly_estimated_deployment_still_reads_as_an_estimate(db):
    report = build_report(db, "cpu-only")
    assert not report.totals.partly_estimate and report.totals.estimated_windows == 3
    assert "**ESTIMATE**" in render(report, "md")
    assert "Estimate, not a measurement." in render(report, "html")
