"""The `joulepilot` command: a click group whose commands live in one module per part.

The group is the CLI's error boundary: an error a user can fix (a damaged, missing, too-new or
read-only database, a full disk, a file that cannot be read or written, an invalid policy) ends the
command with one line `Error: ...` on stderr and exit code 1. Anything else is a bug: one line too,
unless `--debug` or JOULEPILOT_DEBUG=1 asks for the traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from . import __version__
from .clikit import DB_META_KEY, known_error_message

# Each module defines a list `commands` of click commands; they are thin layers over public functions.
COMMAND_MODULES = (
    "joulepilot.cli_telemetry",
    "joulepilot.cli_store",
    "joulepilot.cli_bench",
    "joulepilot.cli_doctor",
    "joulepilot.cli_policy",
    "joulepilot.cli_daemon",
    "joulepilot.cli_report",
    "joulepilot.cli_exporter",
)
DEBUG_ENV = "JOULEPILOT_DEBUG"
DEBUG_META_KEY = "joulepilot.debug"
_PASS_THROUGH = (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort)


def debug_enabled(ctx: click.Context | None = None) -> bool:
    if ctx is not None and ctx.meta.get(DEBUG_META_KEY):
        return True
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


class BoundaryGroup(click.Group):
    """A click group that turns errors escaping a subcommand into one line and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _PASS_THROUGH:
            raise
        except BrokenPipeError:
            # The reader went away (`joulepilot runs | head`): stop quietly, as other Unix tools do.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            ctx.exit(1)
        except Exception as exc:
            if debug_enabled(ctx):
                raise
            message = known_error_message(exc, ctx.meta.get(DB_META_KEY))
            if message is None:
                detail = _first_line(str(exc))
                message = (f"unexpected {type(exc).__name__}" + (f": {detail}" if detail else "")
                           + f"; run with {DEBUG_ENV}=1 for the traceback")
            raise click.ClickException(message) from exc


@click.group(cls=BoundaryGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="joulepilot")
@click.option("--debug", is_flag=True, help=f"Show the traceback of an unexpected error (or set {DEBUG_ENV}=1).")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Energy-aware torch.compile policies: measure joules per inference, decide, apply."""
    ctx.meta[DEBUG_META_KEY] = debug


for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as exc:
        if exc.name != _name:
            raise
        continue
    for _command in _module.commands:
        main.add_command(_command)
