"""Small helpers shared by the CLI modules: the --db and --since options, opening the store, JSON and
table output, and the one-line messages of the CLI's error boundary."""

from __future__ import annotations

import errno
import json
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import click
import sqlite_utils

from joulepilot.store import StoreError, database_error, default_db_path, open_for_reading, parse_since
from joulepilot.store.jsonvalues import json_output
from joulepilot.store.timevalues import SINCE_HELP

DB_META_KEY = "joulepilot.db"


def _remember_db(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    # The error boundary names this file when SQLite fails in the middle of a command.
    ctx.meta[DB_META_KEY] = value or str(default_db_path())
    return value


db_option = click.option(
    "--db",
    type=click.Path(dir_okay=False),
    envvar="JOULEPILOT_DB",
    callback=_remember_db,
    help="SQLite database (default: $JOULEPILOT_DB, else joulepilot.db under $JOULEPILOT_HOME).",
)


def _since(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    try:
        return parse_since(value)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def since_option(what: str) -> Any:
    """`--since WHEN`, given to the command as epoch seconds (None without it)."""
    return click.option("--since", metavar="WHEN", callback=_since, help=f"Only {what} after WHEN: {SINCE_HELP}.")


@contextmanager
def reading_store(db: str | None) -> Iterator[sqlite_utils.Database]:
    """The database for a command that only reads: a missing file is refused, read-only files are read."""
    database = open_for_reading(db)
    try:
        yield database
    finally:
        database.close()


def echo_json(data: Any) -> None:
    """Print `data` in the shape every command uses (docs/json.md): strict JSON, objects, booleans, ISO times."""
    click.echo(json.dumps(json_output(data), indent=2, default=str))


_OS_HINTS = {
    errno.ENOSPC: "no space left on its disk; free some and retry",
    errno.EDQUOT: "disk quota exceeded; free some space and retry",
    errno.EFBIG: "file too large (a file size limit was reached); free space or raise the limit (ulimit -f)",
    errno.EACCES: "permission denied; fix its permissions or choose another path",
    errno.EPERM: "operation not permitted; fix its permissions or choose another path",
    errno.EROFS: "read-only file system; choose a path on a writable one",
    errno.ENOENT: "no such file or folder; check the path",
}


def os_error_message(exc: OSError) -> str:
    """One line for an OSError: the file, what went wrong, and what to do."""
    what = _OS_HINTS.get(exc.errno) or (exc.strerror or str(exc))
    name = exc.filename if exc.filename is not None else None
    return f"{name}: {what}" if name is not None else what


def known_error_message(exc: BaseException, db_path: str | None) -> str | None:
    """One line for an error that a user can fix, or None for a bug (which keeps its traceback)."""
    if isinstance(exc, StoreError):
        return str(exc)
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.ProgrammingError):
        return str(database_error(db_path or str(default_db_path()), exc))
    if isinstance(exc, OSError):
        return os_error_message(exc)
    from joulepilot.policies import PolicyError

    if isinstance(exc, PolicyError):
        return str(exc)
    return None


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
