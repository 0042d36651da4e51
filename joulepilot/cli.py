"""The `joulepilot` command: a click group whose commands live in one module per part."""

from __future__ import annotations

import importlib

import click

from . import __version__

# Each module defines a list `commands` of click commands; they are thin layers over public functions.
COMMAND_MODULES = (
    "joulepilot.cli_telemetry",
    "joulepilot.cli_store",
    "joulepilot.cli_bench",
    "joulepilot.cli_policy",
    "joulepilot.cli_daemon",
    "joulepilot.cli_report",
    "joulepilot.cli_exporter",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="joulepilot")
def main() -> None:
    """Energy-aware torch.compile policies: measure joules per inference, decide, apply."""


for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(_name)
    except ModuleNotFoundError as exc:
        if exc.name != _name:
            raise
        continue
    for _command in _module.commands:
        main.add_command(_command)
