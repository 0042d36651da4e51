"""Reports as Markdown. Every name and free text from the store goes through `md()`, so a deployment
called `a|b` or `*prod*` cannot break a table or turn into emphasis."""

from __future__ import annotations

import re

from joulepilot.policies.bill import calls_text

from . import report_format as f
from .report_model import DeploymentReport, Summary, iso, partly_estimate_text

_SPECIAL = re.compile(r"([\\`*_\[\]<>|~&])")


def md(value: object) -> str:
    """Text as literal Markdown: punctuation that means something is backslash-escaped, line breaks
    become spaces. None reads as a dash."""
    if value is None or value == "":
        return f.DASH
    return _SPECIAL.sub(r"\\\1", " ".join(str(value).splitlines()))


def _limit(value: float | None) -> str:
    return f"limit {f.fmt(value, 'W')}" if value is not None else "no limit in the policy"


def report_md(r: DeploymentReport) -> str:
    d, t, e, c, p = r.deployment, r.totals, r.envelope, r.configuration, r.period
    lines = [f"# Energy report: deployment {md(d.name)}", ""]
    if t.partly_estimate:
        lines += [f"> **PARTLY ESTIMATE** — {md(partly_estimate_text(t, p.samples))}.", ""]
    elif t.is_estimate:
        lines += ["> **ESTIMATE** — no energy counter was readable on this host. Energy here is CPU time × "
                  "watts per core, not a measurement.", ""]
    lines += [
        f"- Policy: {md(d.policy)} · device {md(d.device)} ({md(d.device_kind)}) · host {md(d.hostname)}",
        f"- Workload: {md(d.workload)}" + (f" (batch {d.batch_size})" if d.batch_size else ""),
        f"- Period: {p.start or f.DASH} → {p.end or f.DASH} ({f.number(p.samples)} windows, "
        f"{f.fmt(t.metered_s, 's')} metered)" + (f", since {p.since}" if p.since else ""),
        f"- Energy source: {md(f.source_label(t.energy_source))}",
        "",
        "## Headline",
        "",
        "| figure | value |",
        "|---|---|",
        f"| total energy | {f.energy_with_kwh(t.energy_j)} |",
        *([f"| generate calls | {f.number(t.inferences)} |",
           f"| generated tokens | {f.number(t.tokens)} |",
           f"| energy per generated token | {f.energy(t.j_per_token)} |"] if t.generates else
          [f"| inferences (forward calls) | {f.number(t.inferences)} |",
           f"| energy per inference | {f.energy(t.j_per_inference)} |"]),
        f"| average power | {f.fmt(t.avg_power_w, 'W')} ({_limit(e.max_avg_power_w)}) |",
        f"| peak power | {f.fmt(t.peak_power_w, 'W')} ({_limit(e.max_peak_power_w)}) |",
    ]
    for b in r.baselines.values():
        lines.append(f"| vs {md(b.label)} | {f.versus_baseline(b)} |")
    if r.co2:
        lines.append(f"| CO2 | {f.fmt(r.co2.co2_g, 'g')} at {f.fmt(r.co2.grid_gco2_per_kwh, 'g/kWh')} |")
    if r.payback:
        lines.append(f"| tuning paid back | {f.payback_headline(r.payback)} |")
    if r.served_vs_benchmarked:
        lines.append(f"| served vs benchmarked | {md(f.served_versus(r.served_vs_benchmarked))} |")
    lines += ["", "## Configuration", "",
              f"- In use: {md(c.label or c.config_id or 'unknown')}",
              f"- Decision: {md(c.decision_state)}" + (f" ({c.decided_at})" if c.decided_at else ""),
              f"- Why: {md(c.decision_reason)}", ""]
    if len(c.history) > 1:
        lines += ["Configurations served in this period:", ""]
        lines += [f"- {md(h.label or h.config_id)}: {h.samples} windows, {f.energy(h.energy_j)}, "
                  f"{f.number(h.inferences)} inferences"
                  + (f", {f.number(h.tokens)} tokens" if h.tokens is not None else "") for h in c.history]
        lines.append("")
    if r.payback:
        lines += _payback_md(r)
    sb = r.served_vs_benchmarked
    if sb:
        lines += ["## Served against benchmarked", "", f"- {md(sb.text)}"]
        lines += [f"- Hint: {md(sb.hint)}"] if sb.hint else []
        lines.append("")
    lines += ["## Savings against baselines measured on the same device kind", "",
              "| baseline | J/inference | source | this deployment per inference | energy saved | note |",
              "|---|---|---|---|---|---|"]
    for b in r.baselines.values():
        if b.measured:
            versus = f.versus_baseline(b) + (f" ({f.deployment_energy(b)})" if b.per_sample or b.per_token else "")
            lines.append(f"| {md(b.label)} | {md(f.baseline_energy(b))} | {md(b.energy_source)} | "
                         f"{md(versus)} | {f.energy_saved(b)} | {md(b.note) if b.note else ''} |")
        else:
            lines.append(f"| {md(b.label)} | – | – | – | – | {md(b.note)} |")
    lines += ["", "## Envelope", "",
              f"- Limits from: {md(e.limits_from or 'no envelope known')}",
              *([f"- **{md(e.cannot_be_met)}**"] if e.cannot_be_met else []),
              f"- Windows above the average-power limit: {e.windows_above_avg_limit}",
              f"- Windows above the peak-power limit: {e.windows_above_peak_limit}",
              f"- Violations: {len(e.violations)}"]
    lines += [f"  - {v.at_iso}: {md(v.limit_name)} {f.fmt(v.limit_value, 'W')} exceeded, "
              f"{md(f.power_reading(v.measured_value, v.energy_source))} (configuration "
              f"{md(v.config_label or v.config_id)})" for v in e.violations]
    eff = r.efficiency
    peak = eff.device_peak
    lines += ["", "## Efficiency", "",
              f"- Workload FLOPs per inference: {f.si(eff.flops_per_inference, 'FLOP')}",
              f"- Achieved: {f.si(eff.flops_per_j, 'FLOP/J')} ({md(f.source_label(eff.energy_source))})",
              "- Device peak: " + (f"{f.si(peak.peak_flops_per_j, 'FLOP/J')} ({md(peak.device)}, "
                                   f"{peak.precision_basis}, {f.si(peak.peak_flops_per_s, 'FLOP/s')} / "
                                   f"{f.number(peak.tdp_w)} W; [{md(peak.source)}]({peak.source_url}))"
                                   if peak else md(eff.note or "unknown")),
              f"- Fraction of peak: {f.percent(eff.fraction_of_peak_flops_per_j)}"]
    if r.notes:
        lines += ["", "## Notes", ""] + [f"- {md(n)}" for n in r.notes]
    lines += ["", "## Windows", ""]
    if p.listing_text:
        lines += [f"{md(p.listing_text)}; every figure above counts all of them.", ""]
    tokens = t.generates
    lines += ["| end (UTC) | s | J | inferences | J/inference | " + ("tokens | J/token | " if tokens else "")
              + "avg W | peak W | source | shared |", "|---" * (11 if tokens else 9) + "|"]
    for w in r.samples:
        shared = f"{w.other_processes} other(s)" if w.other_processes else "no"
        lines.append(f"| {iso(w.t_end)} | {f.number(w.duration_s, 3)} | {f.number(w.energy_j)} | "
                     f"{w.inferences} | {f.number(w.j_per_inference)} | "
                     + (f"{f.number(w.tokens)} | {f.number(w.j_per_token)} | " if tokens else "")
                     + f"{f.number(w.avg_power_w)} | {f.number(w.peak_power_w)} | {md(w.energy_source)} | {shared} |")
    return "\n".join(lines) + "\n"


def _payback_md(r: DeploymentReport) -> list[str]:
    pb = r.payback
    assert pb is not None
    lines = ["## Tuning bill", "", f"- {md(pb.text)}", f"- Search: {md(f.search_cost(pb))}"]
    if pb.saving_j_per_inference is not None:
        lines.append(f"- Saving per call against {md(pb.baseline)}: {f.energy(pb.saving_j_per_inference)} "
                     f"({md(pb.saving_source)})")
    if pb.payback_inferences is not None:
        lines.append(f"- Pays back after: {calls_text(pb.payback_inferences)} calls ({md(pb.payback_source)})")
    rate = f" at {f.number(pb.calls_per_s)} calls/s" if pb.calls_per_s else ""
    lines += [f"- This deployment: {f.number(pb.calls)} calls of {md(pb.config_label)} since its first window{rate}",
              ""]
    return lines


def summary_md(summary: Summary) -> str:
    lines = ["# Energy of every deployment", ""]
    if summary.since:
        lines += [f"Since {summary.since}.", ""]
    lines += ["| deployment | policy | device | config | energy | inferences | J/inference | J/token | avg W "
              "| peak W | limit W | violations | vs eager fp32 | vs compile fp32 | tuning paid back | source |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary.deployments:
        lines.append(
            f"| {md(r.name)} | {md(r.policy)} | {md(r.device_kind)} | {md(r.config)} | "
            f"{f.energy_with_kwh(r.energy_j)} | {f.number(r.inferences)} | {f.energy(r.j_per_inference)} | "
            f"{f.energy(r.j_per_token) if r.tokens is not None else f.DASH} | "
            f"{f.number(r.avg_power_w)} | {f.number(r.peak_power_w)} | {f.number(r.max_avg_power_w)} | "
            f"{r.violations} | {f.summary_versus(r, 'eager_fp32')} | {f.summary_versus(r, 'compile_default_fp32')} | "
            f"{md(r.payback)} | {md(f.summary_source(r))} |")
    if not summary.deployments:
        lines.append("| (no deployments recorded) |" + " |" * 15)
    return "\n".join(lines) + "\n"
