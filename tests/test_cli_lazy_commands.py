"""The CLI imports a command's module only when that command runs: `joulepilot bench` does not load the
daemon, the reports or the exporter; help still lists every command."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

from click.testing import CliRunner

from joulepilot.cli import COMMAND_MODULES, main

AGENT_ONLY = ("joulepilot.controller", "sklearn", "matplotlib", "prometheus_client", "schedule")


def test_the_map_names_every_command_each_module_defines():
    defined = {command.name: name for name in set(COMMAND_MODULES.values())
               for command in importlib.import_module(name).commands}
    assert defined == COMMAND_MODULES


def test_help_lists_every_command():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    listed = {line.split()[0] for line in result.output.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == set(COMMAND_MODULES)


def test_an_unknown_command_is_still_refused():
    result = CliRunner().invoke(main, ["benchh"])
    assert result.exit_code == 2 and "No such command 'benchh'" in result.output


def test_bench_loads_nothing_of_the_agent():
    probe = ("import json, sys\n"
             "from joulepilot.cli import main\n"
             "try:\n"
             "    main(['bench', '--help'], standalone_mode=False)\n"
             "finally:\n"
             f"    print(json.dumps(sorted(m for m in sys.modules if m.startswith({AGENT_ONLY!r}))), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--modes" in done.stdout
    assert json.loads(done.stderr.strip().splitlines()[-1]) == []
