"""Whether a worker takes its next energy window: asked of its parent between windows.

A job may ask for several windows in one worker process (`windows`); with `window_gate` set, the worker asks
its parent before each further window, giving the runs-table fields of the windows measured so far, and the
parent answers with what its caller's gate says (the daemon's: whether the judge still asks to measure the
configuration again, `controller.search.GuidedSearch.wants_more`). A configuration its first window leaves out
of the running then costs that window alone. Files in the worker's scratch folder carry the question and the
answer, each written whole (temp file, then rename); a parent that does not answer within `WAIT_S` is taken
as a no, so a worker never waits on a parent that is gone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ASK_NAME = "window-gate-ask.json"
ANSWER_NAME = "window-gate-answer.json"
log = logging.getLogger(__name__)

WAIT_S = 30.0
POLL_S = 0.02

Gate = Callable[[Sequence[Mapping[str, Any]]], bool]


def _write(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=str, allow_nan=True))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ask(folder: str | os.PathLike, window: int, runs: Sequence[Mapping[str, Any]], *,
        wait_s: float = WAIT_S) -> bool:
    """In the worker: whether to take window `window` (2 or more), given `runs` (the windows so far, as
    runs-table fields); False when the parent does not answer within `wait_s`."""
    folder = Path(folder)
    _write(folder / ASK_NAME, {"window": window, "runs": list(runs)})
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        answer = _read(folder / ANSWER_NAME)
        if answer is not None and answer.get("window") == window:
            return bool(answer.get("more"))
        time.sleep(POLL_S)
    return False


def answer(folder: str | os.PathLike, gate: Gate, answered: int) -> tuple[int, bool | None]:
    """In the parent: answer the worker's question when it asks one after window `answered`; (the window
    answered now or `answered`, the answer or None when there was no new question). A gate that raises is
    a no: the run stands with the windows it has."""
    folder = Path(folder)
    question = _read(folder / ASK_NAME)
    window = question.get("window") if question else None
    if not isinstance(window, int) or window <= answered:
        return answered, None
    runs = question.get("runs") if isinstance(question.get("runs"), list) else []
    try:
        more = bool(gate(runs))
    except Exception as exc:  # the gate is the caller's judgement; its failure must not fail the measurement
        log.warning("window gate failed (%s: %s): the worker takes no further window", type(exc).__name__, exc)
        more = False
    _write(folder / ANSWER_NAME, {"window": window, "more": more})
    return window, more
