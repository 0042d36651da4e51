"""Every ```python block of README.md and docs/*.md runs, as a reader of a clone would run it: from the repository's
root, on the CPU, in a JOULEPILOT_HOME of its own. All blocks run in one Python process (one torch import), each in
a namespace of its own.

What a block needs that the text around it gives in words (a model, a policy by name) is set up by a setup named in
an HTML comment on the line before its fence, `<!-- snippet: setup NAME -->` (SETUPS below). A block that cannot
run here is marked `<!-- snippet: not run here, REASON -->` (a GPU, a library this machine lacks): it is reported as
skipped with that reason, and no block is skipped otherwise."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")  # a line of its own
FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")

# What the text around a block supposes, as code run before the block in its namespace.
SETUPS = {
    # "Meter a live model by giving it a deployment name": a model, its input x, and the policy named resnet50 in
    # the policy folder (the example's, whose workload is not loaded by the hook). The model is a small stand-in.
    "served-model": """
import shutil
import torch
import joulepilot
from joulepilot.store import default_home
(default_home() / "policies").mkdir(parents=True, exist_ok=True)
shutil.copy("examples/policies/resnet50.toml", default_home() / "policies")
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten()).eval()
x = torch.randn(2, 3, 16, 16)
""",
}

RUNNER = """
import contextlib, io, json, sys, traceback
results = []
for block in json.load(open(sys.argv[1])):
    namespace = {"__name__": "__main__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block["setup"], "setup " + block["where"], "exec"), namespace)
            # padded so that a traceback names the block's own line in the document
            exec(compile("\\n" * (block["line"] + 1) + block["code"], block["path"], "exec"), namespace)
        results.append({"where": block["where"], "ok": True, "stdout": out.getvalue()})
    except BaseException:
        results.append({"where": block["where"], "ok": False, "error": traceback.format_exc(),
                        "stdout": out.getvalue()})
json.dump(results, open(sys.argv[2], "w"))
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the line of its first code line's fence, 0-based (its code starts on the next one)
    code: str
    setup: str | None
    not_run: str | None  # the reason, where marked not runnable here

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line + 1}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, with the snippet marker on the line before each (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
        if fence.group(2) in ("python", "py"):
            marker = MARKER.search(lines[i - 1]) if i > 0 else None
            setup = not_run = None
            if marker:
                text = marker.group(1)
                if text.startswith("setup "):
                    setup = text.removeprefix("setup ").strip()
                elif text.startswith("not run here"):
                    not_run = text.removeprefix("not run here").strip(" ,:")
                else:
                    raise ValueError(f"{path}:{i}: unknown snippet marker {text!r}")
            blocks.append(Block(path, i, "\n".join(lines[i + 1:end]) + "\n", setup, not_run))
        i = end + 1
    return blocks


BLOCKS = [block for document in DOCUMENTS for block in python_blocks(document)]


def test_the_documents_have_python_blocks_and_every_marker_is_understood():
    assert len(BLOCKS) >= 4  # the README's meter, bench, hook and deployment examples
    for block in BLOCKS:
        assert block.setup is None or block.setup in SETUPS, f"{block.where}: no setup named {block.setup!r}"
        assert block.not_run is None or len(block.not_run) > 5, f"{block.where}: say why it cannot run here"
    for document in DOCUMENTS:  # a marker not on the line before a python block would be ignored: refuse it
        lines = document.read_text(encoding="utf-8").splitlines()
        marked = {b.line - 1 for b in BLOCKS if b.path == document and (b.setup or b.not_run)}
        stray = [n + 1 for n, line in enumerate(lines) if MARKER.search(line) and n not in marked]
        assert stray == [], f"{document.name}: snippet markers not right before a python block at lines {stray}"


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    """Every runnable block, run once in one process: its result by `where`."""
    folder = tmp_path_factory.mktemp("snippets")
    runnable = [{"where": b.where, "path": str(b.path), "line": b.line, "code": b.code,
                 "setup": SETUPS[b.setup] if b.setup else ""} for b in BLOCKS if b.not_run is None]
    (folder / "blocks.json").write_text(json.dumps(runnable))
    env = {k: v for k, v in os.environ.items() if k not in ("JOULEPILOT_DB", "JOULEPILOT_POLICIES")}
    env.update(JOULEPILOT_HOME=str(folder / "home"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(folder / "blocks.json"), str(folder / "results.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {r["where"]: r for r in json.loads((folder / "results.json").read_text())}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_python_block_runs(block: Block, ran: dict):
    if block.not_run is not None:
        pytest.skip(f"{block.where} is marked not runnable here: {block.not_run}")
    result = ran[block.where]
    assert result["ok"], f"{block.where} failed:\n{result['error']}"
