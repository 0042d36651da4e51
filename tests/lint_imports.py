"""Run import-linter over joulepilot as it is installed: one package whose parts are top-level folders.

import-linter finds a package's modules by walking the package's folder, and an editable install maps
`joulepilot.<part>` onto the repository's top-level folders (pyproject's `package-dir`), which that
walk cannot see. So this lays the installed package out in a temporary folder (links to the front
door's modules and to each part's folder, or copies) and runs `lint-imports` there with the contracts
in pyproject.toml.

    python3 tests/lint_imports.py [lint-imports options]     # exits with lint-imports' status
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
RUN_LINTER = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def stage(into: Path, *, copy: bool = False) -> Path:
    """The installed layout under `into` (`into/joulepilot/...`), as links or (`copy`) as copies."""
    package_dirs: dict[str, str] = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    package = into / "joulepilot"
    package.mkdir(parents=True)
    for module in sorted((ROOT / package_dirs["joulepilot"]).glob("*.py")):
        if copy:
            shutil.copy2(module, package / module.name)
        else:
            (package / module.name).symlink_to(module)
    for name, folder in package_dirs.items():
        if name == "joulepilot":
            continue
        target = package / name.removeprefix("joulepilot.")
        if copy:
            shutil.copytree(ROOT / folder, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.symlink_to(ROOT / folder, target_is_directory=True)
    return into


def lint(staged: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over a staged layout (it puts its working folder first on sys.path)."""
    return subprocess.run([sys.executable, "-c", RUN_LINTER, "--config", str(PYPROJECT), "--no-cache", *args],
                          cwd=staged, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(staged)})


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="joulepilot-layers-") as tmp:
        result = lint(stage(Path(tmp)), *args)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
