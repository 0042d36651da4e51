"""Small helpers shared by the CLI modules: the --db and --since options, the parsers of names and lists
(`text_value`, `list_values`: an empty value is refused, never taken for the default), opening the store, JSON
and table output, progress on stderr, and the one-line messages of the CLI's error boundary."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import shutil
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import click

from joulepilot.store import (
    Store,
    as_store_error,
    default_db_path,
    has_password,
    is_postgres_url,
    open_for_reading,
    parse_since,
    redacted,
)
from joulepilot.store.jsonvalues import json_output
from joulepilot.store.timevalues import SINCE_HELP

DB_META_KEY = "joulepilot.db"

# Past this, a batch size, sequence length or image side can only be a typo (a policy and a shape set bound them
# alike: compiler.shape_set.MAX_SHAPE_SIZE, not imported here to keep the CLI's start light); a worker would
# fail on it with a tensor constructor's overflow or allocation error instead of naming the option.
MAX_SIZE = 1 << 20


class Size(click.IntRange):
    """The type of every size option (a batch size, sequence length, image side, prompt or new tokens): a whole
    number from 1 to MAX_SIZE. A value outside that is one line naming the option and what it takes, exit 1, as
    every other value a command refuses (`--new-tokens 0` is a value to correct, not a misuse of the command)."""

    name = "integer"

    def __init__(self) -> None:
        super().__init__(min=1, max=MAX_SIZE)

    def fail(self, message: str, param: click.Parameter | None = None, ctx: click.Context | None = None) -> Any:
        name = _label(param) if param is not None else "the value"
        raise click.ClickException(f"{name}: {message.rstrip('.')}; give a whole number from 1 to {MAX_SIZE:,}")


SIZE = Size()


DB_ENV = "JOULEPILOT_DB"
HOME_ENV = "JOULEPILOT_HOME"


def db_setting(value: str | None) -> tuple[Path, str]:
    """The database file a command uses given --db's `value`, and the setting it came from: '--db',
    'JOULEPILOT_DB', 'JOULEPILOT_HOME', or 'default' (the platform's user data folder)."""
    if value:
        return Path(value).expanduser(), "--db"
    if os.environ.get(DB_ENV):
        return default_db_path(), DB_ENV
    return default_db_path(), HOME_ENV if os.environ.get(HOME_ENV) else "default"


def db_folder_message(path: Path, setting: str) -> str:
    """One line for a database path that is a folder: the path, the setting it came from, and the fix."""
    example = path / "joulepilot.db"
    if setting == "--db":
        return f"--db {path} is a folder, not a database file; pass --db with a file's path, e.g. --db {example}"
    if setting == DB_ENV:
        raw = os.environ.get(DB_ENV, "")
        shown = raw if raw == str(path) else f"{raw} ({path})"
        return (f"{DB_ENV}={shown} is a folder, not a database file; set {DB_ENV} to a file's path, e.g. "
                f"{example}, or unset it")
    origin = (f"joulepilot.db under {HOME_ENV}={os.environ.get(HOME_ENV)}" if setting == HOME_ENV
              else f"the default database, as neither --db, {DB_ENV} nor {HOME_ENV} is set")
    return (f"database {path} ({origin}) is a folder, not a file; move it aside, set {HOME_ENV} to another "
            f"folder, or pass --db with a file's path")


def _resolve_db(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--db's callback: --db, else $JOULEPILOT_DB, else None (the default under $JOULEPILOT_HOME). A folder
    where the database file should be is refused in one line naming the setting it came from, and so is an empty
    --db. The file is remembered for the error boundary, which names it when SQLite fails in the middle of a
    command."""
    text_value(ctx, param, value)
    given = value or os.environ.get(DB_ENV)
    if value and is_postgres_url(value) and has_password(value):
        raise click.ClickException(f"--db {redacted(value)} holds a password, which every user of this host can read "
                                   f"in its process list; leave it out of the URL and give it in ~/.pgpass or "
                                   f"PGPASSWORD, or pass the whole URL in {DB_ENV}")
    if is_postgres_url(given):
        ctx.meta[DB_META_KEY] = redacted(given)
        return given
    path, setting = db_setting(value)
    # A config file given to the command (the daemon's --config) may name the database in place of the default.
    # click processes the options given on the command line before those left out, so it is known here.
    configured = ctx.params.get("config_path") is not None
    if path.is_dir() and not (setting in (HOME_ENV, "default") and configured):
        raise click.ClickException(db_folder_message(path, setting))
    ctx.meta[DB_META_KEY] = str(path)
    return value or os.environ.get(DB_ENV) or None


db_option = click.option(
    "--db",
    type=click.Path(),
    callback=_resolve_db,
    help="SQLite database file, or a postgresql:// URL (default: $JOULEPILOT_DB, else joulepilot.db under "
         "$JOULEPILOT_HOME).",
)


def _label(param: click.Parameter) -> str:
    """How the user names a parameter: its longest option ('--modes' of --modes/--mode), or an argument's name."""
    if isinstance(param, click.Option) and param.opts:
        return max(param.opts, key=len)
    return param.human_readable_name.rstrip(".")


def _empty(param: click.Parameter, what: str, fix: str) -> click.ClickException:
    name = _label(param)
    leave_out = f", or leave {name} out for its default" if isinstance(param, click.Option) else ""
    return click.ClickException(f"{name} {what}; {fix}{leave_out}")


def text_value(_ctx: click.Context | None, param: click.Parameter, value: Any) -> Any:
    """The callback of every option or argument that takes a name or a path (given once or repeated): an empty or
    blank value is refused in one line naming it. Passed on, most commands took '' for "not given" and quietly
    used the default (`--device ''` measured on the default device, `--db ''` used the default database)."""
    for item in value if isinstance(value, tuple) else (value,):
        if item is not None and not str(item).strip():
            raise _empty(param, "is empty", "give a value")
    return value


def list_values(example: str) -> Callable[[click.Context, click.Parameter, Any], list[str] | None]:
    """The callback of an option that takes a list, given as comma lists or repeated (`--modes eager,default
    --modes max-autotune`): the values as one list, None when the option is not given. An empty value or item
    ('', 'eager,,default') is refused in one line naming the option, with `example` of what to give."""

    def parse(_ctx: click.Context, param: click.Parameter, value: Any) -> list[str] | None:
        texts = value if isinstance(value, tuple) else (() if value is None else (value,))
        if not texts:
            return None
        items = [item.strip() for text in texts for item in str(text).split(",")]
        if not all(items):
            shown = " ".join(repr(text) for text in texts)
            raise _empty(param, f"{shown} has an empty value", f"give values separated by commas, e.g. "
                                                               f"{_label(param)} {example}")
        return items

    return parse


class FiniteFloat(click.FloatRange):
    """A float option's type: a finite number, optionally within bounds as click.FloatRange takes them.

    click.FloatRange alone lets 'nan' and 'inf' through ('nan' compares false with every bound), which
    turned a time limit off or made a window never end; here they get click's usual usage error."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self) -> str:
        if self.min is None and self.max is None:
            return "finite"
        return super()._describe_range()


class FilePath(click.Path):
    """A file argument or option (never a folder; with `exists`, one that exists). Unlike click.Path, a bad
    path is one line, `Error: <what> <path> is a folder, not a file; <fix>`, not a usage block."""

    def __init__(self, what: str, fix: str, *, exists: bool = False, allow_dash: bool = False) -> None:
        super().__init__(exists=exists, dir_okay=False, allow_dash=allow_dash)
        self.what = what
        self.fix = fix

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            raise click.ClickException(f"{self.what} is empty; {self.fix}")
        if not (self.allow_dash and value == "-"):
            if os.path.isdir(value):
                raise click.ClickException(f"{self.what} {value} is a folder, not a file; {self.fix}")
            if self.exists and not os.path.exists(value):
                raise click.ClickException(f"{self.what} {value} does not exist; {self.fix}")
        return super().convert(value, param, ctx)


def _since(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    try:
        return parse_since(value)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


def since_option(what: str) -> Any:
    """`--since WHEN`, given to the command as epoch seconds (None without it)."""
    return click.option("--since", metavar="WHEN", callback=_since, help=f"Only {what} after WHEN: {SINCE_HELP}.")


@contextmanager
def reading_store(db: str | None) -> Iterator[Store]:
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
    store_error = as_store_error(exc, db_path or str(default_db_path()))
    if store_error is not None:
        return str(store_error)
    if isinstance(exc, OSError):
        return os_error_message(exc)
    from joulepilot.policies import PolicyError

    if isinstance(exc, PolicyError):
        return str(exc)
    from joulepilot.telemetry import TelemetryError

    if isinstance(exc, TelemetryError):  # a meter or its setting (e.g. JOULEPILOT_ESTIMATE_W_PER_CORE)
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


# --- tables -------------------------------------------------------------------------------------------

PLAIN_TABLE_WIDTH = 120  # stdout that is not a terminal (a pipe, a file, CI), unless COLUMNS says otherwise
COLUMN_GAP = 2
# A text column of several words (reasons, sources) is wrapped down to this, or to its longest word where that is
# shorter; a column of single words (a configuration label such as eager/fp32/b8, a policy name) is never wrapped.
TEXT_MIN_WIDTH = 12


def table_width(stream: TextIO | None = None) -> int:
    """COLUMNS when set; else the terminal's width; else PLAIN_TABLE_WIDTH (a pipe or a file)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return max(20, int(columns))
    stream = stream if stream is not None else sys.stdout
    if _isatty(stream):
        return max(20, shutil.get_terminal_size((PLAIN_TABLE_WIDTH, 24)).columns)
    return PLAIN_TABLE_WIDTH


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _header_pieces(header: str) -> list[str]:
    """Where a header may break: at spaces and after underscores ('energy_j_per_inference')."""
    return re.findall(r"[^\s_]+_*|_+", header)


def _wrap_header(header: str, width: int) -> str:
    lines: list[str] = []
    for piece in _header_pieces(header):
        joined = (lines[-1] + ("" if lines[-1].endswith("_") else " ") + piece) if lines else piece
        if lines and len(joined) <= width:
            lines[-1] = joined
        else:
            lines.append(piece)
    return "\n".join(lines)


def _header_width(header: str, max_lines: int | None = None) -> int:
    """The narrowest width at which `header` wraps into at most `max_lines` lines (any number: its
    longest piece)."""
    width = max([1, *(len(p) for p in _header_pieces(header))])
    if max_lines is None:
        return width
    while width < len(header) and _wrap_header(header, width).count("\n") >= max_lines:
        width += 1
    return width


def _longest_word(cell: str) -> int:
    return max((len(word) for word in cell.split()), default=0)


def _column_widths(headers: list[str], cells: list[list[str]], texts: list[bool], width: int) -> list[int] | None:
    """Widths that fit `width`, or None when even wrapped headers and text columns do not fit.

    In order: natural widths; then headers wrapped (at spaces and underscores), the column saving most
    first; then text columns of several words (reasons, sources) wrapped, widest first, down to TEXT_MIN_WIDTH
    (or their longest word, when shorter: 'measured (nvml)' wraps to 8). A column of single words (a
    configuration label such as eager/fp32/b8, a name) is never narrowed, and numbers are never cut."""
    room = width - COLUMN_GAP * (len(headers) - 1)
    cell_w = [max((len(row[i]) for row in cells), default=0) for i in range(len(headers))]
    natural = [max(len(h), cell_w[i]) for i, h in enumerate(headers)]
    widths = list(natural)
    if sum(widths) <= room:
        return widths
    # Headers on two lines first, then on as many as their words need.
    two_lines = [max(cell_w[i], _header_width(h, max_lines=2)) for i, h in enumerate(headers)]
    narrowest = [max(cell_w[i], _header_width(h)) for i, h in enumerate(headers)]
    for target in (two_lines, narrowest):
        for i in sorted(range(len(headers)), key=lambda i: widths[i] - target[i], reverse=True):
            widths[i] = min(widths[i], target[i])
            if sum(widths) <= room:
                if target is narrowest:  # give the room left back to headers that could be on two lines
                    for j in sorted(range(len(headers)), key=lambda j: two_lines[j] - widths[j]):
                        if widths[j] < two_lines[j] and sum(widths) - widths[j] + two_lines[j] <= room:
                            widths[j] = two_lines[j]
                return widths
    # A column of single words (configuration labels, names, numbers) is never narrowed: a label is not broken.
    floors = [min(widths[i], TEXT_MIN_WIDTH, max(_header_width(headers[i]), *(_longest_word(row[i]) for row in cells)))
              if texts[i] and any(" " in row[i] for row in cells) else widths[i] for i in range(len(headers))]
    if sum(floors) > room:
        return None
    while sum(widths) > room:  # take one character at a time from the widest text column still above its floor
        i = max((i for i in range(len(headers)) if widths[i] > floors[i]), key=lambda i: widths[i])
        widths[i] -= 1
    return widths


def _render(renderable: Any, width: int, color: bool) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=color, no_color=not color, color_system="standard"
                      if color else None, highlight=False, markup=False, emoji=False, soft_wrap=False)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def _grid(headers: list[str], widths: list[int], header_style: str, no_wrap: Sequence[bool] | None = None) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_header=True, header_style=header_style, show_edge=False, pad_edge=False,
                  padding=(0, COLUMN_GAP // 2), collapse_padding=False, expand=False)
    for i, (header, w) in enumerate(zip(headers, widths, strict=True)):
        # a column of single words (labels, numbers) is as wide as its widest cell and never wraps
        table.add_column(Text(_wrap_header(header, w)), width=w, min_width=w, max_width=w,
                         no_wrap=bool(no_wrap and no_wrap[i]), overflow="fold")
    return table


def _fitting_columns(headers: list[str], cells: list[list[str]], texts: list[bool], width: int,
                     drop_order: list[int]) -> tuple[list[int], list[int]] | None:
    """The columns shown (indexes) and their widths: every column where they fit (`_column_widths`), else without
    the columns of `drop_order`, one at a time in that order, until they do; None when even the columns left
    never fit."""
    kept = list(range(len(headers)))
    for drop in [None, *drop_order]:
        if drop is not None:
            kept.remove(drop)
        widths = _column_widths([headers[i] for i in kept], [[row[i] for i in kept] for row in cells],
                                [texts[i] for i in kept], width)
        if widths is not None:
            return kept, widths
    return None


def echo_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None, *,
               drop_first: Sequence[str] = (), below: tuple[str, str] | None = None) -> None:
    """Print `rows` as a table on stdout that fits the terminal (or PLAIN_TABLE_WIDTH / COLUMNS off a
    terminal): headers wrap first, then text columns of several words wrap; numbers and labels are never cut.
    Where that does not fit, columns are left out, those with no value in any row first, then the columns of
    `drop_first` in its order (the least needed first), and a line under the table names them. Only when even
    the rest does not fit is each row printed as a block of `header  value` lines.

    `below` = (key column, text column): a long text (a reason) that is printed under the table instead, one
    `key: text` paragraph a row, where the table would not fit with it as a column at its full width."""
    rows = list(rows)
    columns, headers = list(columns), list(headers or columns)
    width = table_width(sys.stdout)
    if below is not None and rows and below[1] in columns:
        key, text = below
        natural = sum(max(len(h), *(len(format_cell(r.get(c))) for r in rows)) for c, h in zip(columns, headers,
                                                                                                   strict=True))
        if natural + COLUMN_GAP * (len(columns) - 1) > width:
            at = columns.index(text)
            _echo_fitted_table(rows, columns[:at] + columns[at + 1:], headers[:at] + headers[at + 1:], drop_first, width)
            click.echo("")
            for row in rows:
                click.echo(textwrap.fill(f"{format_cell(row.get(key))}: {format_cell(row.get(text))}", width,
                                         subsequent_indent="    ", break_long_words=False, break_on_hyphens=False))
            return
    _echo_fitted_table(rows, columns, headers, drop_first, width)


def _echo_fitted_table(rows: list[Mapping[str, Any]], columns: list[str], headers: list[str], drop_first: Sequence[str],
                       width: int) -> None:
    from rich.text import Text

    cells = [[format_cell(r.get(c)) for c in columns] for r in rows]
    texts = [any(isinstance(r.get(c), str) for r in rows) for c in columns]
    color = _isatty(sys.stdout)
    style = "bold" if color else ""
    empty = [i for i in range(len(columns)) if rows and all(row[i] == "-" for row in cells)]
    order = list(dict.fromkeys([*empty, *(columns.index(c) for c in drop_first if c in columns)]))
    fitting = _fitting_columns(headers, cells, texts, width, order) if rows else \
        (list(range(len(headers))), [len(h) for h in headers])
    if fitting is not None:
        kept, widths = fitting
        single_words = [not any(" " in row[i] for row in cells) for i in kept]
        table = _grid([headers[i] for i in kept], widths, style, single_words)
        for row in cells:
            table.add_row(*(Text(row[i]) for i in kept))
        click.echo(_render(table, width, color))
        if not rows:
            click.echo("(none)")
        left_out = [headers[i] or columns[i] for i in range(len(columns)) if i not in kept]
        if left_out:
            click.echo(textwrap.fill(f"(left out to fit {width} columns: {', '.join(left_out)}; --json has every "
                                     "field)", width))
        return
    # Each row as `header  value` lines: a value wraps at its spaces; a word too long for the room beside its
    # header (a label) goes whole on the line under it.
    key_w = max(len(h) for h in headers)
    indent = " " * (key_w + COLUMN_GAP)
    blocks = []
    for row in cells:
        lines = []
        for header, cell in zip(headers, row, strict=True):
            key = f"{header:<{key_w}}{' ' * COLUMN_GAP}"
            if " " not in cell and len(key) + len(cell) > width:
                lines += [header, " " * COLUMN_GAP + cell]
                continue
            lines.append(textwrap.fill(cell, max(1, width), initial_indent=key, subsequent_indent=indent,
                                       break_long_words=False, break_on_hyphens=False).rstrip())
        blocks.append("\n".join(lines))
    click.echo("\n\n".join(blocks))


# --- progress ----------------------------------------------------------------------------------------

HEARTBEAT_S = 30.0  # off a terminal: a "still ..." line at most this often, while one phase lasts this long


def format_duration(seconds: float) -> str:
    """'4.2 s', '95 s', '3 min 05 s', '1 h 02 min'."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        minutes, secs = divmod(int(round(seconds)), 60)
        return f"{minutes} min {secs:02d} s"
    hours, rest = divmod(int(round(seconds)), 3600)
    return f"{hours} h {rest // 60:02d} min"


class ProgressReport:
    """Progress of a sequence of long items (configurations, jobs) on stderr.

    On a terminal: one live line (spinner, item i/n, what it is doing and for how long, elapsed, ETA) with
    each finished item's line printed above it. Elsewhere: plain lines, a start line per item, a "still
    <doing>, N s" heartbeat while one phase lasts (at most every `heartbeat_s`), its end line, and a last
    line for the whole. The ETA is the mean time of the finished items times the items left, divided by
    `parallel` (how many items run at once: one per GPU of a sweep over several).

    Items may overlap (several GPUs): `finish` and `phase` then name the item by its number; the live line
    and the heartbeat follow the most recently started item still running."""

    def __init__(self, total: int | None, label: str, *, noun: str, tag: str, stream: TextIO, live: bool,
                 heartbeat_s: float, parallel: int = 1) -> None:
        self.total = total
        self.label = label
        self.noun = noun
        self.tag = tag
        self.stream = stream
        self.heartbeat_s = heartbeat_s
        self.parallel = max(1, parallel)
        self.started = time.monotonic()
        self.durations: list[float] = []
        self.stopped_early = False  # the work ended before its last item (the summing-up line says so)
        self.open_ended = False  # more items than `total` may come
        self.number = 0
        self.name = ""
        self.doing = ""
        self.item_started: float | None = None
        self.phase_started = 0.0
        self.last_line = 0.0
        self._running: dict[int, tuple[str, float]] = {}  # number -> (name, started), items not finished
        self._names: dict[int, str] = {}  # number -> name, every item started
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._live: Any = None
        self._task: Any = None
        self._ticker: threading.Thread | None = None
        if live:
            self._start_live()
        else:
            self._ticker = threading.Thread(target=self._tick, name="joulepilot-progress", daemon=True)
            self._ticker.start()

    # -- what callers use --
    def set_total(self, total: int, *, open_ended: bool = False) -> None:
        """`total` items known so far; `open_ended`: more may come (the prefix reads "i of n so far")."""
        with self._lock:
            self.total = total
            self.open_ended = open_ended
            if self._live is not None:
                self._live.update(self._task, total=total)

    def start(self, number: int, name: str, doing: str) -> None:
        """Item `number` (1-based) begins; `doing` is its first phase, e.g. 'compiling and measuring'."""
        with self._lock:
            now = time.monotonic()
            self.number, self.name, self.doing = number, name, doing
            self.item_started = self.phase_started = self.last_line = now
            self._running[number] = (name, now)
            self._names[number] = name
            if self._live is not None:
                self._live.update(self._task, description=f"{self._prefix()} {name}")
            else:
                self._line(f"{self._prefix()} {name}: {doing} ...")

    def phase(self, doing: str, number: int | None = None) -> None:
        """The running item (or item `number`) moved on to `doing` ('compiling', 'warming up', 'measuring');
        shown for the item the live line follows."""
        with self._lock:
            if number is not None and number != self.number:
                return
            if doing != self.doing:
                self.doing = doing
                self.phase_started = time.monotonic()

    def finish(self, message: str, number: int | None = None) -> None:
        """The running item (or item `number`) ended; `message` says how (its end line)."""
        with self._lock:
            now = time.monotonic()
            number = self.number if number is None or number not in self._running else number
            name, item_started = self._running.pop(number, (self.name, self.item_started))
            took = now - item_started if item_started is not None else 0.0
            self.durations.append(took)
            if number == self.number:
                self._follow_another()
            eta = self.eta_s()
            about = "at least" if self.open_ended else "about"
            tail = format_duration(took) + (f", {about} {format_duration(eta)} left" if eta else "")
            self._line(f"{self._prefix(number)} {name}: {message} [{tail}]")
            if self._live is not None:
                self._live.update(self._task, completed=len(self.durations))

    def note(self, message: str, number: int | None = None) -> None:
        """An extra line (a warning) about the current or last item, or item `number`."""
        with self._lock:
            number = self.number if number is None or number not in self._names else number
            self._line(f"{self._prefix(number)} {self._names.get(number, self.name)}: {message}")

    def eta_s(self) -> float | None:
        """Seconds left: the finished items' mean time for each item not finished (shared among `parallel`
        at once), less the running item's time so far; once that item has run longer than the mean, what
        the items after it need (None for the last: nothing to estimate from)."""
        if not self.durations or self.total is None:
            return None
        left = self.total - len(self.durations)
        if left <= 0:
            return None
        mean = sum(self.durations) / len(self.durations) / self.parallel
        running = time.monotonic() - self.item_started if self.item_started is not None else 0.0
        if running < mean:
            return mean * left - running
        return mean * (left - 1) if left > 1 else None

    def close(self, error: BaseException | None = None) -> None:
        """Stop the display; the last line sums up, unless nothing had started (a bad argument)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None
            if self.number == 0:
                return
            done = len(self.durations)
            count = f"{done}/{self.total}" if self.total is not None else str(done)
            plural = self.noun if (self.total if self.total is not None else done) == 1 else self.noun + "s"
            how = "stopped after" if error is not None or self.stopped_early else "done,"
            self._line(f"{self.label}: {how} {count} {plural} in {format_duration(time.monotonic() - self.started)}")

    # -- inside --
    def _follow_another(self) -> None:
        """The followed item ended: follow the newest one still running, if any."""
        if not self._running:
            self.item_started = None
            return
        self.number = max(self._running, key=lambda n: self._running[n][1])
        self.name, self.item_started = self._running[self.number]
        self.phase_started = time.monotonic()
        self.doing = "running"
        if self._live is not None:
            self._live.update(self._task, description=f"{self._prefix()} {self.name}")

    def _prefix(self, number: int | None = None) -> str:
        number = self.number if number is None else number
        tag = f"{self.tag} " if self.tag else ""
        if self.total is None:
            return f"[{tag}{number}]"
        return f"[{tag}{number} of {self.total} so far]" if self.open_ended else f"[{tag}{number}/{self.total}]"

    def _line(self, text: str) -> None:
        self.last_line = time.monotonic()
        if self._live is not None:
            from rich.text import Text

            self._live.console.print(Text(text))
            return
        print(text, file=self.stream, flush=True)

    def _tick(self) -> None:
        interval = max(0.05, min(1.0, self.heartbeat_s / 5))
        while not self._stop.wait(interval):
            with self._lock:
                now = time.monotonic()
                # Long phases only: a line when this phase and the silence have both lasted heartbeat_s.
                quiet = min(now - self.last_line, now - self.phase_started)
                if self.item_started is not None and quiet >= self.heartbeat_s:
                    self._line(f"{self._prefix()} {self.name}: still {self.doing}, "
                               f"{format_duration(now - self.phase_started)}")

    def _start_live(self) -> None:
        from rich.console import Console
        from rich.progress import Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        report = self

        class Doing(ProgressColumn):
            def render(self, task: Any) -> Text:
                if report.item_started is None:
                    return Text("")
                return Text(f"{report.doing} {format_duration(time.monotonic() - report.phase_started)}",
                            style="cyan")

        class Eta(ProgressColumn):
            def render(self, task: Any) -> Text:
                eta = report.eta_s()
                at_least = "at least " if report.open_ended else ""
                return Text(f"ETA {at_least}{format_duration(eta)}" if eta is not None else "ETA -", style="dim")

        console = Console(file=self.stream, highlight=False, markup=False, emoji=False)
        self._live = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), Doing(),
                              TimeElapsedColumn(), Eta(), console=console, transient=True,
                              redirect_stdout=False, redirect_stderr=True)
        self._task = self._live.add_task(self.label, total=self.total)
        self._live.start()


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C does (SystemExit 143): a running worker is killed and its scratch folder
    removed on the way out, instead of the process dying where it stands."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def progress(total: int | None, label: str, *, noun: str = "item", tag: str = "",
             heartbeat_s: float | None = None, parallel: int = 1) -> Iterator[ProgressReport]:
    """A ProgressReport on stderr for `total` items (None while unknown): live on a terminal, plain
    lines elsewhere. Nothing is written to stdout, so `--json` output stays clean."""
    stream = sys.stderr
    live = _isatty(stream) and os.environ.get("TERM") != "dumb"
    report = ProgressReport(total, label, noun=noun, tag=tag, stream=stream, live=live,
                            heartbeat_s=HEARTBEAT_S if heartbeat_s is None else heartbeat_s, parallel=parallel)
    try:
        yield report
    except BaseException as exc:
        report.close(exc)
        raise
    report.close()
