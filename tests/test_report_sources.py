"""Where report figures come from: GPU datasheet rows name their document, report code reads the store
only through store functions, and HTML comes from the template rather than Python strings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from joulepilot.controller import gpu_datasheets
from joulepilot.controller.report import device_peak

ROOT = Path(__file__).resolve().parents[1]
REPORT_MODULES = sorted((ROOT / "controller").glob("report*.py")) + [ROOT / "controller" / "gpu_datasheets.py"]


def test_every_datasheet_row_names_its_source_document():
    rows = gpu_datasheets.datasheets()
    assert len(rows) >= 8
    for row in rows:
        assert row.source.strip() and "datasheet" in row.source.lower()
        assert re.match(r"https://[\w.-]+\.\w+/", row.source_url), row
        assert 0 < row.fp32_tflops < row.dense_bf16_tflops and 0 < row.tdp_w <= 1000
    assert len({r.name for r in rows}) == len(rows)


@pytest.mark.parametrize(("device_name", "product", "bf16_tflops", "tdp_w"), [
    # The vendors' datasheets: 1,979 / 1,513 TFLOP/s BF16 with sparsity, i.e. 989 / 756 dense.
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989, 700),
    ("NVIDIA H200", "NVIDIA H200 SXM", 989, 700),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756, 350),
])
def test_hopper_rows_match_the_datasheets(device_name, product, bf16_tflops, tdp_w):
    peak = device_peak(device_name, "bf16")
    assert peak["device"] == product and peak["tdp_w"] == tdp_w
    assert bf16_tflops * 1e12 <= peak["peak_flops_per_s"] < (bf16_tflops + 1) * 1e12
    assert peak["peak_flops_per_j"] == pytest.approx(peak["peak_flops_per_s"] / tdp_w)
    assert peak["source"].startswith("NVIDIA H") and peak["source_url"].startswith("https://www.nvidia.com/")


def test_the_datasheet_file_ships_with_the_package():
    pyproject = (ROOT / "pyproject.toml").read_text()
    shipped = re.search(r'"joulepilot\.controller" = \[([^\]]*)\]', pyproject).group(1)
    assert '"*.toml"' in shipped and '"*.html"' in shipped
    assert re.search(r'"jinja2[>=<~\d.]*"', pyproject)


def test_a_broken_datasheet_row_is_named():
    with pytest.raises(ValueError, match=r"gpu_datasheets.toml: \[\[gpu\]\] #1: field 'tdp_w'"):
        gpu_datasheets._row({"name": "x", "pattern": "x", "dense_bf16_tflops": 1.0, "fp32_tflops": 1.0,
                             "tdp_w": -3, "source": "s", "source_url": "https://example.invalid/"}, 0)


@pytest.mark.parametrize("module", REPORT_MODULES, ids=lambda p: p.name)
def test_report_code_runs_no_sql_and_builds_no_html(module):
    source = module.read_text()
    assert not re.search(r"\.(execute|query|executemany)\(", source), f"{module.name}: SQL belongs in store/"
    assert not re.search(r"<(td|tr|th|table|div|span|h[1-6]|p|ul|li|figure|img)[\s>]", source), \
        f"{module.name}: HTML belongs in report_template.html"
