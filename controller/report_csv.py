"""Reports as CSV: tidy (long) rows for one deployment, one row per deployment for the summary.

Text that a spreadsheet would run as a formula (a cell starting with =, +, -, @, a tab or a carriage
return) is written with a leading apostrophe, so a deployment or policy named `=HYPERLINK(...)` stays
text. Numbers are written as numbers.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from typing import Any

from .report_model import DeploymentReport, Summary, iso

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
SAMPLE_METRICS = (("energy_j", "J"), ("inferences", "calls"), ("j_per_inference", "J/call"), ("tokens", "tokens"),
                  ("j_per_token", "J/token"),
                  ("avg_power_w", "W"), ("peak_power_w", "W"), ("other_processes", "count"),
                  ("share", "fraction"))
SUMMARY_COLUMNS = ("name", "policy", "device_kind", "config", "decision_state", "start", "end", "samples",
                   "energy_j", "energy_kwh", "inferences", "j_per_inference", "tokens", "j_per_token", "avg_power_w",
                   "peak_power_w",
                   "max_avg_power_w", "violations", "saving_vs_eager_fp32", "saving_vs_compile_default_fp32",
                   "co2_g", "energy_source", "shared_windows", "serves_baseline", "payback", "paid_back_after_s",
                   "per_sample", "not_like_for_like")


def cell(value: Any) -> Any:
    """A value safe to put in a CSV cell: None as empty, formula-looking text defused."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def _write(rows: Iterable[Iterable[Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([cell(v) for v in row])
    return out.getvalue()


def headline_figures(report: DeploymentReport) -> list[tuple[str, str, Any, str, str | None]]:
    """(section, metric, value, unit, source) for every summary figure of a report."""
    t, e, c = report.totals, report.envelope, report.configuration
    src = t.energy_source
    rows: list[tuple[str, str, Any, str, str | None]] = [
        ("totals", "energy_j", t.energy_j, "J", src),
        ("totals", "energy_kwh", t.energy_kwh, "kWh", src),
        ("totals", "inferences", t.inferences, "calls", None),
        ("totals", "j_per_inference", t.j_per_inference, "J/call", src),
        ("totals", "busy_j_per_inference", t.busy_j_per_inference, "J/call", src),
        ("totals", "tokens", t.tokens, "tokens", None),
        ("totals", "j_per_token", t.j_per_token, "J/token", src),
        ("totals", "avg_power_w", t.avg_power_w, "W", src),
        ("totals", "peak_power_w", t.peak_power_w, "W", src),
        ("totals", "metered_s", t.metered_s, "s", None),
        ("totals", "attributed_energy_j", t.attributed_energy_j, "J", src),
        ("totals", "estimated_energy_j", t.estimated_energy_j, "J", "estimate"),
        ("totals", "estimated_windows", t.estimated_windows, "windows", "estimate"),
        ("period", "samples", report.period.samples, "windows", None),
        ("period", "samples_listed", report.period.samples_listed, "windows", None),
        ("period", "samples_left_out", report.period.samples_left_out, "windows", None),
        ("envelope", "max_avg_power_w", e.max_avg_power_w, "W", e.limits_from),
        ("envelope", "max_peak_power_w", e.max_peak_power_w, "W", e.limits_from),
        ("envelope", "windows_above_avg_limit", e.windows_above_avg_limit, "windows", src),
        ("envelope", "windows_above_peak_limit", e.windows_above_peak_limit, "windows", src),
        ("envelope", "violations", len(e.violations), "count", None),
        ("configuration", "config", c.label or c.config_id, "", None),
        ("configuration", "decision_state", c.decision_state, "", None),
        ("configuration", "decision_reason", c.decision_reason, "", None),
    ]
    for key, b in report.baselines.items():
        # Compared per sample when the deployment serves another batch size than the baseline's (the note says so).
        fraction_unit = "fraction per sample" if b.per_sample else "fraction per token" if b.per_token else "fraction"
        saved_unit = f"J (over calls x {b.served_batch_size} samples)" if b.per_sample else \
            "J (over the tokens generated)" if b.per_token else "J"
        rows += [
            (f"baseline.{key}", "j_per_inference", b.j_per_inference, "J/call", b.energy_source),
            (f"baseline.{key}", "batch_size", b.batch_size, "samples/call", None),
            (f"baseline.{key}", "served_batch_size", b.served_batch_size, "samples/call", None),
            (f"baseline.{key}", "j_per_sample", b.j_per_sample, "J/sample", b.energy_source),
            (f"baseline.{key}", "deployment_j_per_sample", b.deployment_j_per_sample, "J/sample", src),
            (f"baseline.{key}", "j_per_token", b.j_per_token, "J/token", b.energy_source),
            (f"baseline.{key}", "deployment_j_per_token", b.deployment_j_per_token, "J/token", src),
            (f"baseline.{key}", "served_is_baseline", b.served_is_baseline, "", None),
            (f"baseline.{key}", "saving_fraction", b.saving_fraction, fraction_unit, src),
            (f"baseline.{key}", "saving_j", b.saving_j, saved_unit, src),
            (f"baseline.{key}", "like_for_like", b.like_for_like, "", None),
            (f"baseline.{key}", "no_saving_reason", b.no_saving_reason, "", None),
            (f"baseline.{key}", "note", b.note, "", None),
        ]
    pb = report.payback
    if pb is not None:
        rows += [
            ("payback", "verdict", pb.verdict, "", None),
            ("payback", "search_energy_j", pb.search_energy_j, "J", pb.search_source),
            ("payback", "search_seconds", pb.search_seconds, "s", None),
            ("payback", "saving_j_per_inference", pb.saving_j_per_inference, "J/call", pb.saving_source),
            ("payback", "payback_inferences", pb.payback_inferences, "calls", pb.payback_source),
            ("payback", "calls", pb.calls, "calls", None),
            ("payback", "fraction", pb.fraction, "fraction", pb.payback_source),
            ("payback", "paid_back_after_s", pb.paid_back_after_s, "s", pb.payback_source),
            ("payback", "remaining_s", pb.remaining_s, "s", pb.payback_source),
            ("payback", "text", pb.text, "", None),
        ]
    sb = report.served_vs_benchmarked
    if sb is not None:
        rows += [
            ("served_vs_benchmarked", "verdict", sb.verdict, "", None),
            ("served_vs_benchmarked", "config", sb.config_label or sb.config_id, "", None),
            ("served_vs_benchmarked", "served_j_per_call", sb.served_j_per_call, sb.unit, sb.energy_source),
            ("served_vs_benchmarked", "benchmarked_j_per_call", sb.benchmarked_j_per_call, sb.unit, sb.energy_source),
            ("served_vs_benchmarked", "benchmark_low_j", sb.benchmark_low_j, sb.unit, sb.energy_source),
            ("served_vs_benchmarked", "benchmark_high_j", sb.benchmark_high_j, sb.unit, sb.energy_source),
            ("served_vs_benchmarked", "benchmark_runs", sb.benchmark_runs, "runs", None),
            ("served_vs_benchmarked", "ratio", sb.ratio, "served / benchmarked", sb.energy_source),
            ("served_vs_benchmarked", "text", sb.text, "", None),
            ("served_vs_benchmarked", "hint", sb.hint, "", None),
        ]
    if report.co2:
        rows += [("co2", "grid_gco2_per_kwh", report.co2.grid_gco2_per_kwh, "gCO2/kWh", "configured"),
                 ("co2", "co2_g", report.co2.co2_g, "g", src)]
    eff = report.efficiency
    peak = eff.device_peak
    rows += [
        ("efficiency", "flops_per_inference", eff.flops_per_inference, "FLOP", "torch flop counter"),
        ("efficiency", "flops_per_j", eff.flops_per_j, "FLOP/J", src),
        ("efficiency", "device_peak_flops_per_j", peak.peak_flops_per_j if peak else None, "FLOP/J",
         f"{peak.source} ({peak.source_url})" if peak else None),
        ("efficiency", "fraction_of_peak_flops_per_j", eff.fraction_of_peak_flops_per_j, "fraction", src),
        ("sharing", "windows_shared", report.sharing.windows_shared, "windows", None),
        ("sharing", "mean_share", report.sharing.mean_share, "fraction", "nvml process utilisation"),
    ]
    return rows


def report_csv(report: DeploymentReport) -> str:
    """One figure per row; samples (the windows the report lists: `period.samples_listed` of
    `period.samples`) carry their window in t_start/t_end."""
    name = report.deployment.name
    rows: list[list[Any]] = [["deployment", "section", "metric", "value", "unit", "source", "t_start", "t_end",
                              "config_id"]]
    rows += [[name, section, metric, value, unit, source, None, None, None]
             for section, metric, value, unit, source in headline_figures(report)]
    for w in report.samples:
        for metric, unit in SAMPLE_METRICS:
            rows.append([name, "sample", metric, w[metric], unit,
                         w.energy_source if unit in ("J", "J/call", "W") else None,
                         iso(w.t_start), iso(w.t_end), w.config_id])
    return _write(rows)


def summary_csv(summary: Summary) -> str:
    rows: list[list[Any]] = [list(SUMMARY_COLUMNS)]
    for row in summary.deployments:
        values = {**row.to_dict(), "serves_baseline": "+".join(row.serves_baseline),
                  "per_sample": "+".join(row.per_sample), "not_like_for_like": "+".join(row.not_like_for_like)}
        rows.append([values[column] for column in SUMMARY_COLUMNS])
    return _write(rows)
