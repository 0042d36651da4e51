"""What reports say in the awkward cases: the deployment *is* the baseline, it spent more than the
baseline, tiny and huge energies, no limits, a violation, names with Markdown or formula characters,
and a bad grid carbon intensity."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig
from joulepilot.controller.report import build_report, build_summary, render
from joulepilot.store import insert_run, open_db, upsert_config, upsert_devices, upsert_host, upsert_workload
from joulepilot.store.deployments import insert_samples, insert_violation, register_deployment

from joulepilot.cli import main

GPU = "NVIDIA H200"
EAGER = CompileConfig(mode="eager", batch_size=8)
STOCK = CompileConfig(mode="default", batch_size=8)
BF16 = CompileConfig(mode="default", precision="bf16", batch_size=8)
T0 = 1_700_000_000.0
EAGER_BENCH_J = 0.05  # J per inference the eager benchmark measured


def _store(db, *, name: str, config: CompileConfig, watts: float, calls: int, windows: int = 4,
           window_s: float = 5.0, policy: str | None = "svc-policy"):
    """A GPU host with eager and stock-compile benchmark runs of one workload, and one deployment of it."""
    host = upsert_host(db)
    upsert_devices(db, host, [{"id": "gpu:0", "kind": "gpu", "name": GPU, "source": "nvml"}])
    wl = upsert_workload(db, {"id": "wl-mlp", "spec": "mlp", "batch_size": 8, "flops_per_inference": 1e9})
    for cfg, j in ((EAGER, EAGER_BENCH_J), (STOCK, EAGER_BENCH_J * 0.7), (BF16, EAGER_BENCH_J * 0.4)):
        upsert_config(db, cfg.to_row())
        insert_run(db, {"workload_id": wl, "config_id": cfg.id, "host_id": host, "device": "cuda:0",
                        "device_name": GPU, "status": "ok", "started_at": T0, "energy_j_per_inference": j,
                        "energy_source": "nvml"})
    dep = register_deployment(db, name, policy=policy, workload_id=wl, config_id=config.id, host_id=host,
                              device="cuda:0", details={"device_kind": GPU})
    insert_samples(db, dep, [{"t_start": T0 + window_s * i, "t_end": T0 + window_s * (i + 1),
                              "energy_j": watts * window_s, "inferences": calls, "avg_power_w": watts,
                              "peak_power_w": watts * 1.1, "energy_source": "nvml", "config_id": config.id}
                             for i in range(windows)])
    return db


def _without_images(html: str) -> str:
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


# -- the deployment is the baseline --------------------------------------------------------------
def test_a_deployment_serving_the_baseline_says_so_instead_of_a_percentage(db):
    # Serving eager fp32 with idle time: live J/inference is 20x the back-to-back benchmark.
    _store(db, name="eager-svc", config=EAGER, watts=100.0, calls=500)
    report = build_report(db, "eager-svc")
    eager = report["baselines"]["eager_fp32"]
    assert eager["measured"] and eager["served_is_baseline"]
    assert eager["saving_fraction"] is None and eager["saving_j"] is None
    stock = report["baselines"]["compile_default_fp32"]
    assert not stock["served_is_baseline"] and stock["saving_fraction"] < 0  # still compared with the other one

    md = render(report, "md")
    assert _line(md, "| vs eager fp32 |") == "| vs eager fp32 | this deployment is the baseline |"
    eager_row = _line(md, "| eager fp32 |")
    assert "this deployment is the baseline" in eager_row and "%" not in eager_row
    html = _without_images(render(report, "html"))
    card = re.search(r'<div class="label">vs eager fp32</div><div class="value">([^<]*)</div>', html)
    assert card and card.group(1) == "this deployment is the baseline"
    assert json.loads(render(report, "json"))["baselines"]["eager_fp32"]["served_is_baseline"] is True

    row = _line(render(build_summary(db), "md"), "| eager-svc |")
    assert "is the baseline" in row
    summary_row = next(csv.DictReader(io.StringIO(render(build_summary(db), "csv"))))
    assert summary_row["serves_baseline"] == "eager_fp32" and summary_row["saving_vs_eager_fp32"] == ""


def test_spending_more_than_a_baseline_reads_as_more_not_as_negative_savings(db):
    # bf16 served at a J/inference above even the eager benchmark (mostly idle).
    _store(db, name="idle-svc", config=BF16, watts=60.0, calls=1000)
    report = build_report(db, "idle-svc")
    assert report["baselines"]["eager_fp32"]["saving_j"] < 0
    md = render(report, "md")
    html = _without_images(render(report, "html"))
    for text in (md, html):
        assert not re.search(r"-\d[\d.,]*\s*\w*J saved", text)
        assert "more than the baseline" in text
    assert re.search(r"\| \d[\d.,]* (k?J) more than the baseline \|", _line(md, "| eager fp32 |"))


# -- energy units ---------------------------------------------------------------------------------
def test_small_energies_read_in_joules_and_large_ones_add_kwh(db, tmp_path):
    _store(db, name="tiny", config=BF16, watts=2.5, calls=100, windows=2, window_s=2.0)  # 10 J in all
    small = build_report(db, "tiny")
    md = render(small, "md")
    assert _line(md, "| total energy |") == "| total energy | 10 J |"
    for text in (md, _without_images(render(small, "html")), render(build_summary(db), "md")):
        assert not re.search(r"\d[eE][-+]\d", text)  # never scientific notation
    assert "2.778e-06" not in md and "kWh |" not in _line(md, "| total energy |")
    assert small["totals"]["energy_kwh"] == pytest.approx(10 / 3.6e6)  # the exact figure stays in the data

    big_db = open_db(tmp_path / "big.db")
    _store(big_db, name="big", config=BF16, watts=500.0, calls=10_000, windows=20, window_s=5000.0)  # 50 MJ
    big_md = render(build_report(big_db, "big"), "md")
    assert _line(big_md, "| total energy |") == "| total energy | 50 MJ (13.89 kWh) |"


# -- envelope -------------------------------------------------------------------------------------
def test_the_limit_lines_caption_appears_only_when_there_are_limits(db):
    _store(db, name="free", config=BF16, watts=300.0, calls=1000, policy=None)
    html = _without_images(render(build_report(db, "free"), "html"))
    assert "Red: the policy" not in html and "No power limits are known" in html
    insert_violation(db, policy="p", deployment="free", limit_name="max_avg_power_w", limit_value=250.0,
                     measured_value=300.0, config_id=BF16.id, at=T0 + 12)
    limited = _without_images(render(build_report(db, "free"), "html"))
    assert "Red: the policy's limits (from recorded violations)" in limited


def test_the_violation_banner_names_the_configuration_by_its_label(db):
    _store(db, name="hot", config=BF16, watts=480.0, calls=1000)
    insert_violation(db, policy="svc-policy", deployment="hot", limit_name="max_avg_power_w", limit_value=450.0,
                     measured_value=480.0, config_id=BF16.id, at=T0 + 12)
    report = build_report(db, "hot")
    banner = re.search(r'<div class="banner bad">(.*?)</div>', render(report, "html"), re.S).group(1)
    assert BF16.label in banner and BF16.id not in banner
    assert report["envelope"]["violations"][0]["config_label"] == BF16.label
    assert BF16.label in _line(render(report, "md"), "  - ")


# -- names with special characters ----------------------------------------------------------------
def _cells(row: str) -> list[str]:
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_markdown_escapes_names(db):
    name = "a|b *prod* <i>x</i>"
    _store(db, name=name, config=BF16, watts=300.0, calls=1000, policy="team_a|b")
    md = render(build_report(db, name), "md")
    assert _line(md, "# ") == r"# Energy report: deployment a\|b \*prod\* \<i\>x\</i\>"
    assert r"team\_a\|b" in md
    summary = render(build_summary(db), "md")
    header, row = _line(summary, "| deployment |"), _line(summary, r"| a\|b")
    assert len(_cells(row)) == len(_cells(header))


def test_html_escapes_names(db):
    name = "<script>alert(1)</script>"
    _store(db, name=name, config=BF16, watts=300.0, calls=1000)
    html = render(build_report(db, name), "html")
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_csv_cells_are_never_formulas(db):
    name, policy = '=HYPERLINK("http://example.invalid","click")', "@SUM(A1)"
    _store(db, name=name, config=BF16, watts=60.0, calls=1000, policy=policy)
    for text in (render(build_report(db, name), "csv"), render(build_summary(db), "csv")):
        rows = list(csv.reader(io.StringIO(text)))
        cells = [c for r in rows for c in r]
        assert "'" + name in cells
        for c in cells:
            if c[:1] in ("=", "+", "-", "@", "\t", "\r"):
                float(c)  # only numbers may start with a sign
    summary = list(csv.DictReader(io.StringIO(render(build_summary(db), "csv"))))
    assert summary[0]["policy"] == "'" + policy
    report_rows = list(csv.DictReader(io.StringIO(render(build_report(db, name), "csv"))))
    saving = next(r for r in report_rows if (r["section"], r["metric"]) == ("baseline.eager_fp32", "saving_j"))
    assert float(saving["value"]) < 0  # negative numbers stay numbers


# -- grid carbon intensity ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["-5", "nan", "inf", "-inf", "lots"])
def test_a_bad_grid_intensity_is_refused_in_one_line(tmp_path, bad):
    path = tmp_path / "jp.db"
    store = open_db(path)
    _store(store, name="svc", config=BF16, watts=300.0, calls=1000)
    store.close()
    runner = CliRunner()
    option = runner.invoke(main, ["report", "--db", str(path), "-d", "svc", "--grid-gco2-per-kwh", bad])
    assert option.exit_code == 1
    assert option.output.count("\n") == 1 and "--grid-gco2-per-kwh" in option.output
    assert "Traceback" not in option.output
    env = runner.invoke(main, ["report", "--db", str(path), "--all"], env={"JOULEPILOT_GRID_GCO2_PER_KWH": bad})
    assert env.exit_code == 1
    assert env.output.count("\n") == 1 and "JOULEPILOT_GRID_GCO2_PER_KWH" in env.output


@pytest.mark.parametrize("bad", [-5.0, float("nan"), float("inf")])
def test_build_report_refuses_a_bad_grid_intensity(db, bad):
    _store(db, name="svc", config=BF16, watts=300.0, calls=1000)
    with pytest.raises(ValueError, match="--grid-gco2-per-kwh"):
        build_report(db, "svc", grid_gco2_per_kwh=bad)


def test_zero_grid_intensity_is_accepted(tmp_path):
    path = tmp_path / "jp.db"
    store = open_db(path)
    _store(store, name="svc", config=BF16, watts=300.0, calls=1000)
    store.close()
    result = CliRunner().invoke(main, ["report", "--db", str(path), "-d", "svc", "--json",
                                       "--grid-gco2-per-kwh", "0"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["co2"]["co2_g"] == 0


@pytest.mark.parametrize(("joules", "text"), [
    (0.0353, "35.3 mJ"), (6.892e-05, "68.92 µJ"), (248.1, "248.1 J"), (999.99, "1 kJ"), (12_345.0, "12.35 kJ"),
    (5e7, "50 MJ"), (0.0, "0 J"), (-208.7, "-208.7 J"), (None, "–"), (float("nan"), "–"),
])
def test_energy_reads_in_a_unit_that_suits_it(joules, text):
    from joulepilot.controller.report_format import energy

    assert energy(joules) == text


def test_kwh_is_added_only_where_it_reads_well():
    from joulepilot.controller.report_format import energy_with_kwh, kwh

    assert energy_with_kwh(0.0099 * 3.6e6) == "35.64 kJ"
    assert energy_with_kwh(0.01 * 3.6e6) == "36 kJ (0.01 kWh)"
    assert kwh(248.1) == "0.00006892 kWh"  # the tooltip's figure: plain decimals, never 6.892e-05
