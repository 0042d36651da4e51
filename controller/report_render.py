"""One entry point for every report format: `render(report, "html" | "md" | "json" | "csv")`."""

from __future__ import annotations

import json

from joulepilot.store.jsonvalues import json_output

from .report_csv import report_csv, summary_csv
from .report_markdown import report_md, summary_md
from .report_model import DeploymentReport, Summary

FORMATS = ("html", "md", "json", "csv")


def render(report: DeploymentReport | Summary, format: str = "md") -> str:
    """A report from `build_report` or `build_summary` as html, md, json or csv text."""
    if format not in FORMATS:
        raise ValueError(f"unknown report format {format!r}; choose one of {', '.join(FORMATS)}")
    summary = isinstance(report, Summary)
    if format == "json":
        return json.dumps(json_output(report.to_dict()), indent=2, default=str) + "\n"
    if format == "csv":
        return summary_csv(report) if summary else report_csv(report)
    if format == "md":
        return summary_md(report) if summary else report_md(report)
    from .report_html import render_html

    return render_html(report)
