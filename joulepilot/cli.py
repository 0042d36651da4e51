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

# Each module defines a list `commands` of click commands; they are thin layers over public functions. A
# command's module is imported only when that command runs (or help lists them all), so `joulepilot bench`
# does not pay for the daemon's and the reports' imports.
COMMAND_MODULES = {
    "telemetry": "joulepilot.cli_telemetry",
    "measure": "joulepilot.cli_telemetry",
    "runs": "joulepilot.cli_store",
    "bench": "joulepilot.cli_bench",
    "doctor": "joulepilot.cli_doctor",
    "fit": "joulepilot.cli_policy",
    "frontier": "joulepilot.cli_policy",
    "policy": "joulepilot.cli_policy",
    "daemon": "joulepilot.cli_daemon",
    "status": "joulepilot.cli_daemon",
    "report": "joulepilot.cli_report",
    "exporter": "joulepilot.cli_exporter",
}
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
    """A click group that turns errors escaping a subcommand into one line and exit code 1, and imports a
    command's module when the command is looked up (COMMAND_MODULES)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMAND_MODULES) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            _load_commands(self, COMMAND_MODULES[cmd_name])
        return self.commands.get(cmd_name)

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



def _load_commands(group: click.Group, module_name: str) -> None:
    """Add the commands of `module_name` to `group`; a module that is not installed adds none."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return
    for command in module.commands:
        group.add_command(command)
