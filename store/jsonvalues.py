"""JSON in columns and on output.

`json_column` decodes a JSON column that may already be decoded (`json_object` when only an object will
do); `json_safe` makes data strict JSON, and `strict_json_text` writes it (decisions' details, lock files):
NaN and infinities as null, never the `NaN`/`Infinity` that Python's json writes by default and that SQLite's
JSON functions and other readers refuse. Every JSON column is decoded through these.
`json_output` gives every command's JSON one shape (docs/json.md):
- JSON text columns (`options`, `extra`, `details`, `detail`, `op_mix`, `inputs`, `note`, `model_options`)
  become objects;
- 0/1 flag columns (`dynamic`, `compile_prefill`, `tokens_match`) become booleans;
- points in time (`*_at`, `at`, `t_start`, `t_end`, `since`, `start`, `end`) become ISO 8601 UTC text, with the epoch seconds
  kept beside them as `<name>_epoch`;
- NaN and infinities become null.
`row_from_json` undoes that for one table row, so a file written in that shape imports losslessly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from .timevalues import epoch_from_iso, iso_utc

JSON_TEXT_KEYS = frozenset({"options", "extra", "details", "detail", "op_mix", "inputs", "note", "model_options"})
FLAG_KEYS = frozenset({"dynamic", "compile_prefill", "tokens_match"})
TIME_KEYS = frozenset({"at", "t_start", "t_end", "since", "start", "end"})
EPOCH_SUFFIX = "_epoch"


def json_column(value: Any, default: Any = None) -> Any:
    """A JSON column's value: text is parsed (malformed or absurdly nested text gives `default`), anything
    else is kept."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return default
    return default if value is None else value


def json_object(value: Any) -> dict[str, Any]:
    """A JSON column that should hold an object, as a dict: {} when it is empty, malformed or not an object."""
    decoded = json_column(value, {})
    return dict(decoded) if isinstance(decoded, Mapping) else {}


def json_safe(value: Any) -> Any:
    """The same data with NaN and infinities as None, so `json.dumps` writes strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def strict_json_text(value: Any, **dumps_args: Any) -> str:
    """`value` as strict JSON text: NaN and infinities as null (`json_safe`), and `allow_nan=False` so
    nothing that escapes it (a non-finite float of another type) is ever written as `NaN`/`Infinity`.
    `dumps_args` go to `json.dumps` (sort_keys, indent, default...)."""
    return json.dumps(json_safe(value), allow_nan=False, **dumps_args)


def is_time_key(key: Any) -> bool:
    return isinstance(key, str) and (key in TIME_KEYS or key.endswith("_at"))


def _decoded_text(value: str) -> Any:
    """Text that holds a JSON object or array, decoded; any other text is kept as it is."""
    if value[:1] not in ("{", "["):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _epoch_of(value: Any) -> float | None:
    """Epoch seconds of a time given as a number or as ISO text; None when it is neither."""
    if isinstance(value, int | float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            return epoch_from_iso(value)
        except ValueError:
            return None
    return None


def json_output(value: Any) -> Any:
    """`value` in the shape every command prints (see the module docstring); strict JSON."""
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for key, item in value.items():
            if key in JSON_TEXT_KEYS and isinstance(item, str):
                item = _decoded_text(item)
            elif key in FLAG_KEYS and isinstance(item, int) and not isinstance(item, bool) and item in (0, 1):
                item = bool(item)
            elif is_time_key(key) and not isinstance(item, bool | Mapping | list | tuple):
                given = value.get(f"{key}{EPOCH_SUFFIX}")  # already shaped once: keep the exact epoch
                epoch = _epoch_of(given if isinstance(item, str) and _epoch_of(given) is not None else item)
                out[key] = iso_utc(epoch) if epoch is not None else (item if isinstance(item, str) else None)
                out[f"{key}{EPOCH_SUFFIX}"] = epoch
                continue
            if key not in out:  # an `_epoch` written above wins over the input's copy
                out[key] = json_output(item)
        return out
    if isinstance(value, list | tuple):
        return [json_output(v) for v in value]
    return json_safe(value)


def row_from_json(row: Mapping[str, Any], columns: Iterable[str] | None) -> dict[str, Any]:
    """One table row as stored, from its `json_output` shape or as stored already.

    Keeps only `columns` (None: the row's own keys, less the `_epoch` copies of its times); times come from `<name>_epoch` when present, else from the ISO text; objects in
    JSON text columns are encoded again (sorted keys, as the store writes them); booleans of flag columns
    become 0/1 (a boolean anywhere else is kept, for the importer's checks to refuse).
    Raises ValueError naming the field when a time cannot be read.
    """
    if columns is None:
        columns = [k for k in row if not (k.endswith(EPOCH_SUFFIX) and k[: -len(EPOCH_SUFFIX)] in row
                                          and is_time_key(k[: -len(EPOCH_SUFFIX)]))]
    out: dict[str, Any] = {}
    for key in columns:
        if key not in row:
            continue
        value = row[key]
        if is_time_key(key) and isinstance(value, str):
            epoch = row.get(f"{key}{EPOCH_SUFFIX}")
            if isinstance(epoch, int | float) and not isinstance(epoch, bool):
                value = epoch
            else:
                try:
                    value = epoch_from_iso(value)
                except ValueError:
                    raise ValueError(f"{key}: {value!r} is not an ISO 8601 time") from None
        elif key in JSON_TEXT_KEYS and isinstance(value, Mapping | list):
            value = json.dumps(value, sort_keys=True, default=str)
        elif key in FLAG_KEYS and isinstance(value, bool):
            value = int(value)
        out[key] = value
    return out
