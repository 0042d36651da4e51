"""Small helpers shared by the CLI modules: the --db option, JSON and table output."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import click

from joulepilot.store.jsonvalues import json_safe

db_option = click.option(
    "--db",
    type=click.Path(dir_okay=False),
    envvar="JOULEPILOT_DB",
    help="SQLite database (default: $JOULEPILOT_DB, else joulepilot.db under $JOULEPILOT_HOME).",
)


def echo_json(data: Any) -> None:
    """Print strict JSON (NaN and infinities become null)."""
    click.echo(json.dumps(json_safe(data), indent=2, default=str))


def format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.4g}"
    return str(value)


def echo_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None) -> None:
    rows = list(rows)
    headers = list(headers or columns)
    cells = [[format_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        click.echo("(none)")
