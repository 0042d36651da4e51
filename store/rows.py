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


class StoredRow:
    """Mixin for the row dataclasses (see the module docstring)."""

    @classmethod
    def column_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_columns(cls: type[R], row: Mapping[str, Any]) -> R:
        """The row from a column -> value mapping; columns the dataclass does not name are left out."""
        names = cls.column_names()
        return cls(**{k: v for k, v in row.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.column_names()}

    def keys(self) -> tuple[str, ...]:
        return self.column_names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.column_names())

    def __contains__(self, key: object) -> bool:
        return key in self.column_names()

    def __getitem__(self, key: str) -> Any:
        if key not in self.column_names():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.column_names() else default
