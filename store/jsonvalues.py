"""JSON in columns and on output: decode a column that may already be decoded; make data strict JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def json_column(value: Any, default: Any = None) -> Any:
    """A JSON column's value: text is parsed (malformed text gives `default`), anything else is kept."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return default
    return default if value is None else value


def json_safe(value: Any) -> Any:
    """The same data with NaN and infinities as None, so `json.dumps` writes strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
