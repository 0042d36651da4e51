"""Which kind of device a stored run, deployment or device row is about.

Decisions, predictions and measurements are grouped by device kind: the GPU's name for a CUDA device
(runs on two cards of one model are comparable), and 'cpu' for every CPU (CPU models vary too
little to matter for the choice of a compile configuration).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def device_kind(row: Mapping[str, Any] | Any) -> str:
    """'cpu', or the GPU's name, for a row with `device` ('cuda:0', 'cpu') and `device_name` (a mapping
    or an object with those attributes). A CUDA device whose name was not recorded is its device string."""
    if isinstance(row, Mapping):
        device, name = row.get("device"), row.get("device_name")
    else:
        device, name = getattr(row, "device", None), getattr(row, "device_name", None)
    device = str(device or "")
    if device.startswith("cuda"):
        return str(name or device)
    return "cpu"

