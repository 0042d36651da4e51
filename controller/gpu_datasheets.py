"""GPU datasheet figures (peak FLOP/s, board power) read from `gpu_datasheets.toml` beside this module."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

DATA_FILE = "gpu_datasheets.toml"
FIELDS = {"name": str, "pattern": str, "dense_bf16_tflops": float, "fp32_tflops": float, "tdp_w": float,
          "source": str, "source_url": str}


@dataclass(frozen=True)
class Datasheet:
    name: str
    pattern: str
    dense_bf16_tflops: float
    fp32_tflops: float
    tdp_w: float
    source: str
    source_url: str

    def matches(self, device_name: str) -> bool:
        return re.search(self.pattern, device_name.strip(), re.IGNORECASE) is not None


def _row(entry: Any, index: int) -> Datasheet:
    where = f"{DATA_FILE}: [[gpu]] #{index + 1}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is not a table")
    values: dict[str, Any] = {}
    for key, kind in FIELDS.items():
        value = entry.get(key)
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            values[key] = float(value)
        elif kind is str and isinstance(value, str) and value.strip():
            values[key] = value
        else:
            raise ValueError(f"{where}: field {key!r} is missing or not a positive number / text; fix the row")
    return Datasheet(**values)


@cache
def datasheets() -> tuple[Datasheet, ...]:
    """Every row of the data file, in file order (the first match wins)."""
    raw = tomllib.loads(files("joulepilot.controller").joinpath(DATA_FILE).read_text(encoding="utf-8"))
    return tuple(_row(entry, i) for i, entry in enumerate(raw.get("gpu", [])))


def find_datasheet(device_name: str | None) -> Datasheet | None:
    if not device_name:
        return None
    return next((sheet for sheet in datasheets() if sheet.matches(device_name)), None)
