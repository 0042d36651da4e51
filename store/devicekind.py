"""The device kind a run, deployment or decision is filed under."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def device_kind(row: Mapping[str, Any]) -> str:
    """The GPU's name for a CUDA device (its `device` string when the name is unknown), else 'cpu':
    CPU models vary too little to matter. `row` has `device` ('cpu', 'cuda:0') and `device_name`."""
    device = str(row.get("device") or "")
    if device.startswith("cuda"):
        return str(row.get("device_name") or device)
    return "cpu"
