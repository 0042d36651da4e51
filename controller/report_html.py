"""Reports as one self-contained HTML page: `report_template.html` (Jinja2, autoescaped) with the plots
inline as base64 PNG."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import jinja2
from joulepilot.policies.bill import calls_text

from . import report_format as f
from .report_model import DeploymentReport, Summary, iso, partly_estimate_text

TEMPLATE = "report_template.html"


def _load(name: str) -> str:
    return files("joulepilot.controller").joinpath(name).read_text(encoding="utf-8")


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FunctionLoader(_load), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(
        energy=f.energy, kwh=f.kwh, kwh_if_readable=f.kwh_if_readable, fmt=f.fmt, number=f.number, si=f.si,
        percent=f.percent, human_time=f.human_time, iso=iso, versus=f.versus_baseline, saved=f.energy_saved,
        payback_headline=f.payback_headline, search_cost=f.search_cost, calls=calls_text,
        baseline_energy=f.baseline_energy, deployment_energy=f.deployment_energy, power_reading=f.power_reading,
        estimate_part=f.estimate_part, summary_source=f.summary_source)
    return env


def render_html(report: DeploymentReport | Summary) -> str:
    from joulepilot.compiler.provenance import package_version

    common = {"version": package_version("joulepilot") or "unknown", "generated_at": report.generated_at}
    template = environment().get_template(TEMPLATE)
    if isinstance(report, Summary):
        return template.render(
            summary=report, title="joulepilot: energy of every deployment", summary_versus=f.summary_versus,
            any_estimate=any(f.estimate_part(r.energy_source) == "whole" for r in report.deployments),
            any_partly_estimate=any(f.estimate_part(r.energy_source) == "part" for r in report.deployments), **common)
    from .report_plots import report_plots

    return template.render(summary=None, report=report, plots=report_plots(report), partly_estimate=partly_estimate_text,
                           title=f"joulepilot energy report: {report.deployment.name}", **common)
