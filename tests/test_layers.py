"""The layers of docs/architecture.md, checked by import-linter (contracts in pyproject.toml)."""

from __future__ import annotations

import lint_imports


def test_the_contracts_hold(tmp_path):
    result = lint_imports.lint(lint_imports.stage(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_a_sideways_or_upward_import_breaks_them(tmp_path):
    staged = lint_imports.stage(tmp_path, copy=True)
    package = staged / "joulepilot"
    (package / "runtime" / "probe.py").write_text("from joulepilot.controller import daemon\n")
    (package / "store" / "probe.py").write_text("from joulepilot.telemetry import EnergyMeter\n")
    config = package / "compiler" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _probe():\n    import torch  # even inside a function\n")
    result = lint_imports.lint(staged)
    assert result.returncode == 1
    assert "0 kept, 4 broken" in result.stdout
    for line in ("joulepilot.runtime.probe -> joulepilot.controller.daemon",
                 "joulepilot.store.probe -> joulepilot.telemetry",
                 "joulepilot.compiler.config -> torch"):
        assert line in result.stdout
