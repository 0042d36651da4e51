"""`joulepilot report`: one deployment in each format, --json, --all, -o, and clear errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from joulepilot.store import open_db, upsert_host
from joulepilot.store.deployments import insert_samples, register_deployment

from joulepilot.cli import main

T0 = 1_700_000_000.0


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "jp.db"
    db = open_db(path)
    host = upsert_host(db)
    for name, watts in (("svc-a", 300.0), ("svc-b", 120.0)):
        dep = register_deployment(db, name, device="cpu", host_id=host)
        insert_samples(db, dep, [{"t_start": T0 + i, "t_end": T0 + i + 1, "energy_j": watts, "inferences": 100,
                                  "avg_power_w": watts, "peak_power_w": watts, "energy_source": "rapl"}
                                 for i in range(4)])
    db.close()
    return str(path)


def test_report_json(store):
    result = CliRunner().invoke(main, ["report", "--db", store, "--deployment", "svc-a", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["totals"]["energy_j"] == pytest.approx(1200.0)
    assert data["totals"]["inferences"] == 400
    assert data["totals"]["j_per_inference"] == pytest.approx(3.0)


def test_report_all(store):
    result = CliRunner().invoke(main, ["report", "--db", store, "--all", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)["deployments"]}
    assert rows["svc-b"]["energy_j"] == pytest.approx(480.0)
    md = CliRunner().invoke(main, ["report", "--db", store, "--all"])
    assert md.exit_code == 0 and "| svc-a |" in md.output


def test_report_output_file_format_from_suffix_and_co2(store, tmp_path, monkeypatch):
    out = tmp_path / "r.html"
    monkeypatch.setenv("JOULEPILOT_GRID_GCO2_PER_KWH", "360")
    result = CliRunner().invoke(main, ["report", "--db", store, "-d", "svc-a", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("<!DOCTYPE html>") and "CO₂" in out.read_text()
    csv_out = CliRunner().invoke(main, ["report", "--db", store, "-d", "svc-a", "--format", "csv", "--since",
                                        "2023-11-14T22:13:22+00:00"])
    assert csv_out.exit_code == 0
    # two windows end after 22:13:22 UTC: 600 J = 1/6000 kWh, x 360 g/kWh = 0.06 g
    assert "svc-a,totals,energy_j,600.0,J,rapl" in csv_out.output
    co2_row = next(line for line in csv_out.output.splitlines() if line.startswith("svc-a,co2,co2_g,"))
    assert float(co2_row.split(",")[3]) == pytest.approx(0.06)
    assert csv_out.output.count("svc-a,sample,energy_j,") == 2  # windows ending after 22:13:22 UTC


def test_report_errors(store):
    runner = CliRunner()
    missing = runner.invoke(main, ["report", "--db", store, "-d", "nope"])
    assert missing.exit_code == 1 and "no deployment named 'nope'" in missing.output and "svc-a" in missing.output
    both = runner.invoke(main, ["report", "--db", store, "-d", "svc-a", "--all"])
    assert both.exit_code == 2 and "either --deployment NAME or --all" in both.output
    bad_since = runner.invoke(main, ["report", "--db", store, "-d", "svc-a", "--since", "last week"])
    assert bad_since.exit_code == 1 and "--since 'last week'" in bad_since.output


@pytest.mark.parametrize("how", ["default", "env", "flag"])
def test_an_unknown_deployment_names_the_database_it_was_looked_up_in(tmp_path, monkeypatch, how):
    from joulepilot.store import default_db_path

    path = default_db_path() if how == "default" else tmp_path / "elsewhere.db"
    open_db(path).close()
    if how == "env":
        monkeypatch.setenv("JOULEPILOT_DB", str(path))
    args = ["--db", str(path)] if how == "flag" else []
    result = CliRunner().invoke(main, ["report", *args, "-d", "nope"])
    assert result.exit_code == 1
    assert f"(database {path}; list them with `joulepilot report --all`)" in result.output
