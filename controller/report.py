"""Energy reports per deployment: what it spent, against what envelope, and what the policy saved.

The parts:
- `report_model`: the typed report (`build_report`, `build_summary`), read through `store.reports`
  and the store's deployment functions;
- `report_render`: `render(report, format)` for html (`report_html` with `report_template.html`),
  md (`report_markdown`), csv (`report_csv`) and json;
- `report_format`: numbers and phrases shared by every format; `report_plots`: the PNG plots;
- `gpu_datasheets`: peak FLOP/s and board power per GPU, from `gpu_datasheets.toml`.
"""

from __future__ import annotations

from .report_model import (
    DEFAULT_WINDOWS,
    GRID_ENV,
    GRID_OPTION,
    REPORT_KIND,
    SUMMARY_KIND,
    DeploymentReport,
    Summary,
    build_report,
    build_summary,
    device_peak,
    grid_intensity,
    parse_since,
)
from .report_render import FORMATS, render

__all__ = [
    "DEFAULT_WINDOWS",
    "FORMATS",
    "GRID_ENV",
    "GRID_OPTION",
    "REPORT_KIND",
    "SUMMARY_KIND",
    "DeploymentReport",
    "Summary",
    "build_report",
    "build_summary",
    "device_peak",
    "grid_intensity",
    "parse_since",
    "render",
]
