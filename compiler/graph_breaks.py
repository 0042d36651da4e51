"""Graph breaks as Dynamo reports them: where in the user's code, why, and what to change.

Dynamo writes one record per graph break to its `graph_breaks` log (the artifact `TORCH_LOGS=graph_breaks`
shows): the user-code location, Dynamo's reason and the user's traceback. `recording_graph_breaks()`
listens to that log while a compiled model runs, so every break is seen, including those that compile no
graph around them (a break at the very start of a function, a break inside a loop that makes Dynamo run
the whole function eagerly), which counting graphs misses. Breaks are kept once per place in the code
(`GraphBreak.occurrences` counts repeats), in the order first seen.

This module imports no torch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import linecache
import logging
import os
import re
import shlex
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from .log_listen import listening

GRAPH_BREAK_LOGGER_SUFFIX = ".__graph_breaks"
SUMMARY_LIMIT = 3  # places named in a one-line summary; the rest are counted

# The forms of Dynamo's graph-break records (torch 2.5 to 2.13 write these).
_AT_HEADER = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)\s*$", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>[^\n]+)\n(?P<source>[^\n]*)',
                    re.MULTILINE)
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")
_REASON_START = "Graph Break Reason:"
_TRACEBACK_START = ("User code traceback:", "The graph break occurred in the following user code:")
_SKIP_MARKERS = ("Skipping the function and falling back to eager", "results in a skip",
                 "graph break in loop", "skip tracing the frame")
# Lines of Dynamo's reason that wrap the cause rather than state it.
_WRAPPERS = ("Encountered graph break when attempting to trace", "Failed to handle graph break gracefully",
             "*** While handling this graph break", "Developer debug context", "For more details about this graph",
             "Stack variable source attribution", "Graph break: torch.compile cannot properly resume",
             "torch.compile will skip tracing the frame")


@dataclass(frozen=True)
class Cause:
    """A known cause of graph breaks: how to recognise it in Dynamo's reason, its short name, the fix."""

    kind: str
    label: str  # as the one-line summary names it: "print()", "data-dependent branch"
    patterns: tuple[str, ...]  # regular expressions matched against Dynamo's whole reason
    hint: str


CAUSES: tuple[Cause, ...] = (
    Cause("print", "print()", (r"`print`", r"builtin:? print\b", r"\bprint\b.*builtin"),
          "move the print() out of forward, or run it only outside compilation: "
          "`if not torch.compiler.is_compiling(): print(...)`"),
    Cause("logging", "logging call", (r"\blogging\.", r"`(warn|info|debug|warning|log)`", r"warnings\.warn"),
          "log outside forward, or add the function to torch._dynamo.config.reorderable_logging_functions"),
    Cause("data_dependent_branch", "data-dependent branch",
          (r"Data-dependent branching", r"generic_jump", r"data.dependent jump", r"attempted to jump with Tensor"),
          "a Python `if` on a tensor's value cannot be traced: make it branchless with "
          "torch.where(cond, a, b), or give both branches to torch.cond(pred, true_fn, false_fn, operands)"),
    Cause("item", ".item()", (r"Tensor\.item\(\)", r"\bitem\(\)", r"capture_scalar_outputs"),
          "keep the value a tensor instead of calling .item() (or float()/int() on a tensor) in forward; or set "
          "torch._dynamo.config.capture_scalar_outputs = True"),
    Cause("tolist", ".tolist() / .numpy()", (r"\btolist\b", r"\.numpy\(\)", r"`numpy`"),
          "stay in torch tensors inside forward: .tolist() and .numpy() leave the graph"),
    Cause("dynamic_shape_op", "data-dependent output shape",
          (r"dynamic shape operator", r"DynamicOutputShapeException", r"capture_dynamic_output_shape_ops",
           r"data-dependent output"),
          "an op whose output size depends on values (nonzero, unique, boolean-mask indexing) breaks the graph: "
          "use a fixed-size form (torch.where with the mask) or set "
          "torch._dynamo.config.capture_dynamic_output_shape_ops = True"),
    Cause("explicit", "torch._dynamo.graph_break()", (r"graph_break\(\)", r"Call to `torch\._dynamo\.graph_break",
                                                      r"explicit graph break"),
          "remove the explicit torch._dynamo.graph_break() call"),
    Cause("skipped_function", "function Dynamo does not trace",
          (r"marked as skipped", r"torch\._dynamo\.disable", r"skip_files", r"skipfiles"),
          "the call goes to code Dynamo is told not to trace (torch._dynamo.disable or a skipped library); "
          "move it out of forward or allow it with torch.compiler.allow_in_graph where that is safe"),
)


@dataclass
class GraphBreak:
    """One place in the user's code where Dynamo breaks the graph."""

    reason: str  # one line: Dynamo's kind of break and its explanation
    file: str | None
    line: int | None
    function: str | None
    source: str | None  # the line of code, stripped
    hint: str | None  # what to change
    kind: str  # a known cause (CAUSES) or "other"
    falls_back_to_eager: bool = False  # Dynamo gave up on the whole function (a break inside a loop)
    occurrences: int = 1

    @property
    def key(self) -> tuple[str | None, int | None, str]:
        return (self.file, self.line, self.kind if self.kind != "other" else self.reason)

    @property
    def where(self) -> str:
        """'model.py:14' (the file's base name)."""
        if self.file is None:
            return "unknown place"
        return f"{os.path.basename(self.file)}:{self.line}" if self.line is not None else os.path.basename(self.file)

    @property
    def label(self) -> str:
        known = next((c.label for c in CAUSES if c.kind == self.kind), None)
        return known or _shorten(self.reason, 60)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GraphBreak:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def classify(reason_text: str) -> Cause | None:
    """The known cause whose patterns match Dynamo's reason, or None."""
    for cause in CAUSES:
        if any(re.search(p, reason_text, re.IGNORECASE) for p in cause.patterns):
            return cause
    return None


def _dynamo_hint(reason_text: str) -> str | None:
    """Dynamo's own first hint, for causes this module does not know."""
    for line in reason_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("Hint:"):
            return stripped.removeprefix("Hint:").strip()
    return None


def one_line_reason(reason_text: str) -> str:
    """'Data-dependent branching: Detected data-dependent branching ...' from Dynamo's reason block."""
    lines = [line.strip() for line in reason_text.splitlines() if line.strip()]
    cause = next((line for line in lines if not line.startswith(("Explanation:", "Hint:")) and
                  not line.startswith(_WRAPPERS)), None)
    explanation = next((line.removeprefix("Explanation:").strip() for line in lines
                        if line.startswith("Explanation:")), None)
    if cause is None:
        return explanation or (lines[0] if lines else "unknown reason")
    cause = cause.rstrip(":")
    return f"{cause}: {explanation}" if explanation else cause


def function_name(name: str | None) -> str | None:
    """The user's function for a Dynamo resume function ('torch_dynamo_resume_in_forward_at_12' -> 'forward')."""
    if name is None:
        return None
    match = _RESUME.match(name.strip())
    return match.group("name") if match else name.strip()


@functools.cache
def torch_dir() -> str | None:
    """The installed torch package's folder (with a trailing separator), found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.realpath(spec.origin)) + os.sep


def user_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame outside torch's own code (the user's line that led to a break or an op)."""
    inside = torch_dir()
    for frame in reversed(frames):
        if inside is None or not os.path.realpath(frame["file"]).startswith(inside):
            return frame
    return frames[-1] if frames else None


def stack_frames(text: str) -> list[dict[str, Any]]:
    """The frames of a formatted Python traceback ('File "...", line N, in f' and the source line after)."""
    return [{"file": m.group("file"), "line": int(m.group("line")), "function": m.group("function").strip(),
             "source": m.group("source").strip()} for m in _FRAME.finditer(text)]


def _reason_block(message: str, exc: BaseException | None) -> str:
    if _REASON_START in message:
        block = message.split(_REASON_START, 1)[1]
        for end in _TRACEBACK_START:
            block = block.split(end, 1)[0]
        return block.strip()
    if exc is not None:
        return str(exc).strip()
    return message.strip()


def parse_record(message: str, exc: BaseException | None = None) -> GraphBreak | None:
    """A graph break from one record of Dynamo's graph-break log, or None for a record that names no place.

    `message` is the record's formatted text; `exc` the exception it carries (a frame Dynamo skipped)."""
    if "Graph break" not in message and "graph break" not in message:
        return None
    traceback_text = ""
    for start in _TRACEBACK_START:
        if start in message:
            traceback_text = message.split(start, 1)[1]
            break
    frames = stack_frames(traceback_text)
    if not frames and exc is not None and getattr(exc, "real_stack", None):
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name, "source": (f.line or "").strip()}
                  for f in exc.real_stack]
    frame = user_frame(frames)
    header = _AT_HEADER.search(message.split(_REASON_START, 1)[0])
    if frame is not None:
        file, line, function, source = frame["file"], frame["line"], frame["function"], frame["source"]
    elif header is not None:
        file, line, function, source = header.group("file"), int(header.group("line")), None, ""
    else:
        return None
    if not source and file and line:
        source = linecache.getline(file, line).strip()
    reason_text = _reason_block(message, exc)
    cause = classify(reason_text)
    falls_back = any(marker in message for marker in _SKIP_MARKERS)
    hint = cause.hint if cause else _dynamo_hint(reason_text)
    if falls_back:
        hint = ((hint + "; ") if hint else "") + ("this break is inside a loop, so Dynamo runs the whole function "
                                                  "eagerly: fixing it compiles the function again")
    return GraphBreak(reason=one_line_reason(reason_text), file=file, line=line, function=function_name(function),
                      source=source or None, hint=hint, kind=cause.kind if cause else "other",
                      falls_back_to_eager=falls_back)


class GraphBreakRecorder(logging.Handler):
    """A logging handler that keeps each graph break Dynamo logs, once per place (see the module doc)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self._breaks: dict[tuple[Any, ...], GraphBreak] = {}
        self._aliases: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._add(record)
        except Exception:  # a record this parser does not understand must never break the compile
            return

    def _add(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        found = parse_record(record.getMessage(), exc)
        if found is None:
            return
        # Dynamo names a break by where it stopped (maybe inside torch), and a repeat of a break only by that
        # place ("user stack suppressed"): remember which break each such place was.
        message = record.getMessage()
        header = _AT_HEADER.search(message.split(_REASON_START, 1)[0])
        at = (header.group("file"), int(header.group("line")), found.kind) if header else None
        key = self._aliases.get(at, found.key) if at is not None and found.function is None else found.key
        have = self._breaks.get(key)
        if have is None:
            self._breaks[key] = found
            if at is not None:
                self._aliases.setdefault(at, key)
        else:
            have.occurrences += 1
            have.falls_back_to_eager = have.falls_back_to_eager or found.falls_back_to_eager

    @property
    def breaks(self) -> list[GraphBreak]:
        return list(self._breaks.values())

    def to_list(self) -> list[dict[str, Any]]:
        return [b.to_dict() for b in self.breaks]


def _graph_break_loggers() -> list[logging.Logger]:
    if "torch._dynamo" not in sys.modules:  # nothing was compiled: no break to record, and no import to pay
        return []
    names = [name for name in list(logging.root.manager.loggerDict) if name.endswith(GRAPH_BREAK_LOGGER_SUFFIX)]
    return [logging.getLogger(name) for name in sorted(names)]


@contextmanager
def recording_graph_breaks() -> Iterator[GraphBreakRecorder]:
    """Record the graph breaks of what runs inside the block. Dynamo's graph-break log is switched on for
    the block only, and kept off the console unless TORCH_LOGS had switched it on already. Call
    `torch.compile` before the block (it loads Dynamo, whose loggers this listens to); without Dynamo
    loaded nothing is recorded."""
    recorder = GraphBreakRecorder()
    with listening([(logger, recorder) for logger in _graph_break_loggers()], logging.DEBUG):
        yield recorder


# -- summaries ------------------------------------------------------------------------------------------
def doctor_command(spec: str, batch_size: int | None = None, seq_len: int | None = None,
                   image_size: int | None = None) -> str:
    """The `joulepilot doctor ...` command line for a workload."""
    parts = ["joulepilot", "doctor", shlex.quote(spec)]
    if batch_size and batch_size != 1:
        parts += ["--batch-size", str(batch_size)]
    if seq_len:
        parts += ["--seq-len", str(seq_len)]
    if image_size:
        parts += ["--image-size", str(image_size)]
    return " ".join(parts)


def as_breaks(items: Iterable[Mapping[str, Any] | GraphBreak] | None) -> list[GraphBreak]:
    """GraphBreaks from the dicts a run stores in `extra.graph_breaks` (anything else is left out)."""
    found = []
    for item in items or []:
        if isinstance(item, GraphBreak):
            found.append(item)
        elif isinstance(item, Mapping) and item.get("reason") is not None:
            try:
                found.append(GraphBreak.from_dict(item))
            except TypeError:
                continue
    return found


def break_summary(breaks: Iterable[Mapping[str, Any] | GraphBreak] | None, count: int | None = None,
                  command: str | None = None) -> str | None:
    """'2 graph breaks: print() at model.py:14; data-dependent branch at model.py:17 — run `joulepilot doctor
    SPEC`', or None without breaks. `count` (a run's graph_breaks column) counts breaks a run stored without
    their places (runs measured before places were recorded)."""
    listed = as_breaks(breaks)
    total = max(len(listed), int(count or 0))
    if total == 0:
        return None
    text = f"{total} graph break{'s' if total != 1 else ''}"
    if listed:
        named = [f"{b.label} at {b.where}" for b in listed[:SUMMARY_LIMIT]]
        if total > len(named):
            named.append(f"{total - len(named)} more")
        text += ": " + "; ".join(named)
    if command:
        text += f" — run `{command}`"
    return text


def run_breaks(run: Any) -> tuple[list[GraphBreak], int]:
    """(the breaks a run stored in `extra.graph_breaks`, its `graph_breaks` count) for a run given as a
    dict (bench's, `list_runs`') or a store RunRow (both answer `.get`)."""
    extra = run.get("extra")
    if isinstance(extra, str):  # a row as stored: JSON text
        try:
            extra = json.loads(extra)
        except ValueError:
            extra = None
    listed = extra.get("graph_breaks") if isinstance(extra, Mapping) else None
    count = run.get("graph_breaks")
    breaks = as_breaks(listed if isinstance(listed, list) else None)
    return breaks, max(len(breaks), int(count or 0))


def graph_break_notes(runs: Iterable[Any], command: str | None = None) -> list[dict[str, Any]]:
    """One note per distinct set of graph breaks among `runs` (the compiled configurations of one workload
    usually share theirs): `{labels, config_ids, run_ids, graph_breaks, summary}`, in the runs' order.
    Runs without breaks are left out."""
    notes: dict[str, dict[str, Any]] = {}
    for run in runs:
        breaks, count = run_breaks(run)
        summary = break_summary(breaks, count, command)
        if summary is None:
            continue
        note = notes.setdefault(summary, {"labels": [], "config_ids": [], "run_ids": [], "graph_breaks": count,
                                          "summary": summary})
        label = run.get("config_label") or run.get("config_id")
        if label not in note["labels"]:
            note["labels"].append(label)
            note["config_ids"].append(run.get("config_id"))
        run_id = run.get("run_id") or run.get("id")
        if run_id is not None:
            note["run_ids"].append(run_id)
    return list(notes.values())


def note_line(note: Mapping[str, Any]) -> str:
    """'default/fp32/b1, default/bf16/b1: 2 graph breaks: print() at model.py:14; ... — run `...`'."""
    return f"{', '.join(str(label) for label in note['labels'])}: {note['summary']}"
