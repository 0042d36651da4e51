"""What an imported row may hold, checked before anything is written.

Each value must be of the type its column declares (REAL: a finite number, INTEGER: a whole number, TEXT:
text; NULL only where the column allows it), a 0/1 flag column true or false, a batch size 1 or more, a
configuration's `options` a JSON object, and a run's `status` one that joulepilot writes. SQLite itself would store text in a REAL column
without a word, and every later reader would trip over it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from .connection import Column
from .jsonvalues import FLAG_KEYS, JSON_TEXT_KEYS

RUN_STATUSES = ("ok", "failed")
# Columns holding a JSON object as text, by table.
_JSON_OBJECT_COLUMNS = {"configs": frozenset({"options"})}


def _number(name: str, value: Any, nullable: bool) -> float | int:
    fix = "write a finite number" + (" or null" if nullable else "")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: {value!r} is not a number; {fix}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: {value!r} is not a finite number; {fix}")
    return value


def _whole(name: str, value: Any, nullable: bool) -> int:
    if name in FLAG_KEYS:
        if value not in (0, 1) or isinstance(value, float):
            raise ValueError(f"{name}: {value!r} is not true or false; write true or false")
        return int(value)
    fix = "write a whole number" + (" or null" if nullable else "")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: {value!r} is not a whole number; {fix}")
    if name == "batch_size" and value < 1:
        raise ValueError(f"{name}: {value!r} is not a batch size; write a whole number of 1 or more")
    return value


def _text(name: str, value: Any, nullable: bool) -> str:
    if not isinstance(value, str):
        expected, fix = ("a JSON object", "an object") if name in JSON_TEXT_KEYS else ("text", "a string")
        raise ValueError(f"{name}: {value!r} is not {expected}; write {fix}" + (" or null" if nullable else ""))
    return value


_BY_TYPE = {"REAL": _number, "INTEGER": _whole, "TEXT": _text}


def checked_row(table: str, row: Mapping[str, Any], columns: Iterable[Column]) -> dict[str, Any]:
    """`row` (a `table` row as `row_from_json` gives it) with every value checked against its column; whole
    floats become integers, and a null in a column with a default is left out, so the default applies.
    Raises ValueError('<column>: <problem>; <fix>')."""
    out = dict(row)
    for column in columns:
        name = column.name
        if name not in out or (table == "runs" and name == "id"):  # a run gets a new id on import
            continue
        value = out[name]
        if value is None:
            if column.notnull and column.default_value is not None:
                del out[name]
            continue  # a null where the column needs a value is reported as missing by the caller
        if name in _JSON_OBJECT_COLUMNS.get(table, ()) and not isinstance(_decoded(value), dict):
            raise ValueError(f"{name}: {value!r} is not a JSON object; write an object such as {{}}")
        check = _BY_TYPE.get(column.type.upper())
        if check is not None:
            out[name] = check(name, value, not column.notnull)
    if table == "runs" and "status" in out and out["status"] not in RUN_STATUSES:
        raise ValueError(f"status: {out['status']!r} is not a run status; write one of {', '.join(RUN_STATUSES)}")
    return out


def _decoded(text: Any) -> Any:
    if not isinstance(text, str):
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
