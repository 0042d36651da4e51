"""The base of the typed rows the store hands to other parts.

A row is a dataclass whose fields are its table's columns (plus, where a read joins other tables,
the joined columns it names). JSON columns arrive decoded. `to_dict()` gives the row for JSON output.

Rows also answer `row["column"]`, `row.get("column")`, `"column" in row` and `dict(row)`, so code
written against the plain dict rows these replaced keeps working while it moves to attributes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import Any, TypeVar

R = TypeVar("R", bound="StoredRow")

# A row class's column names, in field order and as a set, worked out once per class: every store read builds
# rows through them, and `row["column"]` asks them on every lookup.
_NAMES: dict[type, tuple[tuple[str, ...], frozenset[str]]] = {}


def _names_of(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    names = _NAMES.get(cls)
    if names is None:
        ordered = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
        names = _NAMES[cls] = (ordered, frozenset(ordered))
    return names


class StoredRow:
    """Mixin for the row dataclasses (see the module docstring)."""

    @classmethod
    def column_names(cls) -> tuple[str, ...]:
        return _names_of(cls)[0]

    @classmethod
    def from_columns(cls: type[R], row: Mapping[str, Any]) -> R:
        """The row from a column -> value mapping; columns the dataclass does not name are left out."""
        known = _names_of(cls)[1]
        return cls(**{k: v for k, v in row.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.column_names()}

    def keys(self) -> tuple[str, ...]:
        return self.column_names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.column_names())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in _names_of(type(self))[1]

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self else default
