"""The policy file's shape: every key, its type and its default, and the `Policy` it validates into.

A policy file is TOML written by a model's owner. `validate(raw, file)` checks a parsed document
against `SCHEMA` and returns a `Policy`, or raises `PolicyError` listing every problem at once, each
naming the file, the dotted key, what was expected and what was found (and, for an unknown key, the
closest valid one).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from joulepilot.store.safeio import shorten

from .noise import MAX_REPEATS, MIN_REPEATS

OBJECTIVES = ("energy", "latency", "edp")
# What a policy's workload does per request: one forward call ("forward") or a generation ("generate": a prompt,
# then new tokens against a KV cache, `compiler.generation_workloads`).
TASKS = ("forward", "generate")
GENERATE = "generate"
SEARCH_STRATEGIES = ("guided", "exhaustive")
GUARD_ACTIONS = ("warn", "fallback")
DEFAULT_EXPECTED_INFERENCES = 1_000_000
# A generation policy amortises compile energy over generated tokens: 100 million by default (about 400,000
# generations of 256 tokens).
DEFAULT_EXPECTED_TOKENS = 100_000_000
# [search] tolerance_pct: the regret a policy accepts, in percent of the objective (`policies.judge`).
DEFAULT_TOLERANCE_PCT = 2.0
MAX_TOLERANCE_PCT = 50.0
# What a problem may quote: a policy file is written by someone else and may hold a megabyte in one
# value, which must not be echoed whole into every error, log line and heartbeat.
QUOTED_VALUE_CHARS = 200
QUOTED_TEXT_CHARS = 500
MAX_PROBLEMS = 20
# Upper bounds of the integer (and second) fields. Every stored integer must fit SQLite's signed 64 bits;
# each bound below is far tighter, at the point where a value can only be a typo (an extra digit or ten).
MAX_BATCH_SIZE = 1 << 20  # batch_size and [search] batch_sizes: 1,048,576 samples in one call
MAX_SHAPE_SIZE = 1 << 20  # seq_len, image_size and [shapes] sizes and buckets: 1,048,576
MAX_EXPECTED_INFERENCES = 10**15  # about a million calls a second for 30 years
MAX_EXPECTED_TOKENS = 10**18  # about a billion tokens a second for 30 years
MAX_MEASUREMENTS = 100_000  # [search] max_measurements: months of measuring at a run a minute
MAX_BUDGET_S = 366 * 24 * 3600  # [search] budget_s: a year of measuring
MAX_GUARD_WINDOWS = 100_000  # [guard] windows: days of consecutive metered windows
# Policy and deployment names become lock file names, Prometheus label values, log lines and table cells: short,
# one line, and nothing a file system, a shell or an exposition format reads specially.
MAX_NAME_CHARS = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
NAME_RULE = (f"1 to {MAX_NAME_CHARS} characters: letters, digits, '.', '_' and '-' (ASCII), starting with a letter "
             "or a digit")


def name_problem(name: Any, what: str = "policy") -> str | None:
    """Why `name` cannot name a policy (or a deployment: `what`), in one line with what is allowed; None when
    it can. The one rule for names, wherever one is given: a policy file, `--policy`, `policy="..."`,
    `deployment="..."`."""
    if isinstance(name, str) and len(name) <= MAX_NAME_CHARS and _NAME.fullmatch(name):
        return None
    return f"{_found(name)} is not a {what} name: use {NAME_RULE}"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy file. A `warning` (a workload's library missing on this host) does
    not make the file invalid; the daemon, which must run the workload, treats it as an error."""

    file: str
    key: str
    expected: str
    found: str
    hint: str = ""
    severity: str = "error"

    def __post_init__(self) -> None:
        for name, limit in (("file", QUOTED_TEXT_CHARS), ("key", QUOTED_VALUE_CHARS),
                            ("expected", QUOTED_TEXT_CHARS), ("found", QUOTED_TEXT_CHARS),
                            ("hint", QUOTED_TEXT_CHARS)):
            object.__setattr__(self, name, shorten(getattr(self, name), limit))

    def __str__(self) -> str:
        text = f"{self.file}: {self.key}: expected {self.expected}, found {self.found}"
        return text + (f" ({self.hint})" if self.hint else "")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class PolicyError(ValueError):
    """A policy file cannot be read or is invalid; `problems` lists every issue found."""

    def __init__(self, problems: list[Problem]) -> None:
        total = len(problems)
        if total > MAX_PROBLEMS:  # a file of ten thousand bad keys gets a readable error, not a megabyte
            problems = [*problems[:MAX_PROBLEMS],
                        Problem(problems[0].file, "(file)", f"at most {MAX_PROBLEMS} problems listed",
                                f"{total - MAX_PROBLEMS} more", "fix these first, then check again")]
        self.problems = problems
        lines = [str(p) for p in problems]
        super().__init__("\n".join(lines) if total == 1 else f"{total} problems:\n  " + "\n  ".join(lines))


@dataclass(frozen=True)
class Objective:
    minimize: str = "energy"
    expected_inferences: int = DEFAULT_EXPECTED_INFERENCES
    # A generation policy's amortisation count (generated tokens; None for a forward pass, which counts calls).
    expected_tokens: int | None = None


@dataclass(frozen=True)
class Limits:
    """Hard limits; None means unlimited. Checked only against measurements."""

    max_avg_power_w: float | None = None
    max_peak_power_w: float | None = None
    max_p95_latency_ms: float | None = None
    max_compile_s: float | None = None
    max_rel_error: float | None = None
    # A generation's: the p95 time per output token and the median time to first token (`policies.judge.LIMITS`).
    max_tpot_ms: float | None = None
    max_ttft_ms: float | None = None
    # Every limit but max_rel_error is held this many percent below its value (a safety margin).
    margin_pct: float = 0.0

    def items(self) -> list[tuple[str, float]]:
        """The limits set, (name, value); the margin is not a limit."""
        return [(k, v) for k, v in asdict(self).items() if v is not None and k != "margin_pct"]

    def bound(self, limit: str, value: float) -> float:
        """What a measurement is held to for `limit`: its value less the margin (not for max_rel_error)."""
        return value if limit == "max_rel_error" else value * (1.0 - self.margin_pct / 100.0)


@dataclass(frozen=True)
class Search:
    modes: tuple[str, ...] = ("eager", "default")
    precisions: tuple[str, ...] = ("fp32",)
    fusion: tuple[str, ...] = ("default",)
    dynamic: tuple[bool, ...] = (False,)  # (False, True) by default when the policy gives [shapes]
    padding: tuple[str, ...] = ("none",)  # ("none", "buckets") by default when the policy gives [shapes]
    # How the daemon measures the grid: "guided" (the controller's search: baselines, then what the
    # trade-off model says may win, until nothing can) or "exhaustive" (every configuration).
    strategy: str = "guided"
    budget_s: float | None = None  # seconds of measuring per policy and device kind
    max_measurements: int | None = None  # runs the search may make per policy and device kind
    # Counted runs (from MIN_FRESH_PROCESSES worker processes) the chosen configuration needs for a
    # `verified` decision (policies.noise.confirmation); fewer make it `provisional`.
    min_repeats: int = MIN_REPEATS
    # The regret the policy accepts, in percent: configurations that cannot differ by more are a tie settled
    # by the tie-break, and the search measures nothing that could not beat its choice by more.
    tolerance_pct: float = DEFAULT_TOLERANCE_PCT
    # The batch-size lever: batch sizes the grid covers besides `batch_size`, compared in J per sample
    # (policies.batches); None: the policy's batch_size only.
    batch_sizes: tuple[int, ...] | None = None
    # Regional compilation: compile the repeated blocks instead of the whole model (true), or not (false).
    regional: tuple[bool, ...] = (False,)
    # The block class regional compilation compiles; None: the model's most repeated block class.
    regional_block: str | None = None
    # A generation's KV caches: None plans as bench does (eager with the dynamic cache, compiled modes with the
    # static one); given, every configuration is searched with each. And whether the prompt's forward pass is
    # compiled too (compiled modes only).
    caches: tuple[str, ...] | None = None
    compile_prefill: tuple[bool, ...] = (False,)

    def regional_settings(self) -> tuple[str, ...]:
        """`CompileConfig.regional` values the grid covers: '' (whole model), 'auto' or the named class."""
        return tuple("" if not on else (self.regional_block or "auto") for on in self.regional)


@dataclass(frozen=True)
class Fallback:
    mode: str = "eager"
    precision: str = "fp32"
    fusion: str = "default"


@dataclass(frozen=True)
class Guard:
    """Read by the deployment guard: act after `windows` consecutive metered windows over a limit."""

    windows: int = 3
    action: str = "warn"


@dataclass(frozen=True)
class Policy:
    name: str
    workload: str
    batch_size: int
    objective: Objective = field(default_factory=Objective)
    limits: Limits = field(default_factory=Limits)
    search: Search = field(default_factory=Search)
    fallback: Fallback = field(default_factory=Fallback)
    guard: Guard = field(default_factory=Guard)
    seq_len: int | None = None
    image_size: int | None = None
    shapes: Any = None  # a compiler ShapeSet: the input sizes the model is served with, and their shares
    description: str = ""
    path: str | None = None  # where it was loaded from
    hash: str = ""  # content hash, see load.policy_hash
    task: str = "forward"  # or GENERATE
    prompt_len: int | None = None  # a generation's (set, with defaults, exactly when task is GENERATE)
    new_tokens: int | None = None
    # [model_options]: overrides of the transformers config the workload is built from, as sorted (name, value)
    # pairs (a policy is hashable: its grid is cached per policy)
    model_options: tuple[tuple[str, Any], ...] = ()

    def shape_args(self) -> dict[str, int]:
        """The workload's input-shape arguments the policy sets (seq_len, image_size)."""
        return {k: v for k, v in (("seq_len", self.seq_len), ("image_size", self.image_size)) if v is not None}

    @property
    def generates(self) -> bool:
        return self.task == GENERATE

    @property
    def generation(self) -> Any:
        """The compiler's `Generation` (prompt and new tokens) of a generation policy; None for a forward pass."""
        if not self.generates:
            return None
        from joulepilot.compiler.generation_workloads import Generation

        return Generation(int(self.prompt_len or 0), int(self.new_tokens or 0))

    @property
    def model_options_dict(self) -> dict[str, Any] | None:
        """[model_options] as a dict; None when the policy has none."""
        return dict(self.model_options) if self.model_options else None

    def workload_args(self) -> dict[str, Any]:
        """Everything but the spec and the batch size that names the policy's workload (`compiler.workload_id`,
        `measure_config`): input shapes, the shape set, model options and the generation."""
        return {"seq_len": self.seq_len, "image_size": self.image_size, "shapes": self.shapes,
                "model_options": self.model_options_dict, "generation": self.generation}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the schema: key -> checker. A checker returns (value, None) or (None, (expected, found, hint)).

Check = Callable[[Any], tuple[Any, tuple[str, str, str] | None]]


def _found(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "table"}
    return f"{kind.get(type(value), type(value).__name__)} {shorten(repr(value), QUOTED_VALUE_CHARS)}"


def _string(value: Any):
    if isinstance(value, str) and value.strip():
        return value, None
    return None, ("a non-empty string", _found(value), "")


def _name(value: Any):
    if name_problem(value) is None:
        return value, None
    return None, (NAME_RULE, _found(value), 'e.g. name = "resnet50-prod"')


def _optional_string(value: Any):
    if isinstance(value, str):
        return value, None
    return None, ("a string", _found(value), "")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(value: Any) -> float | None:
    """A TOML number as a finite float; None for anything else, an integer too large for a float included."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _bounded_int(maximum: int, example: str) -> Check:
    """An integer from 1 to `maximum`; the problem names the range and an example (`key = value`)."""
    def check(value: Any):
        if _is_int(value) and 1 <= value <= maximum:
            return value, None
        return None, (f"an integer from 1 to {maximum:,}", _found(value), f"e.g. {example}")

    return check


def _positive_number(value: Any):
    number = _as_float(value)
    if number is not None and number > 0:
        return number, None
    return None, ("a positive number", _found(value), "")


def _budget_s(value: Any):
    number = _as_float(value)
    if number is not None and 0 < number <= MAX_BUDGET_S:
        return number, None
    return None, (f"a positive number of seconds, at most {MAX_BUDGET_S:,} (a year)", _found(value),
                  "e.g. budget_s = 1800")


def _min_repeats(value: Any):
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_REPEATS:
        return value, None
    return None, (f"an integer from 1 to {MAX_REPEATS} (runs a verified decision needs)", _found(value),
                  f"e.g. min_repeats = {MIN_REPEATS}")


def _tolerance_pct(value: Any):
    number = _as_float(value)
    if number is not None and 0 <= number <= MAX_TOLERANCE_PCT:
        return number, None
    return None, (f"a percentage from 0 to {MAX_TOLERANCE_PCT:g} (the regret the policy accepts)", _found(value),
                  f"e.g. tolerance_pct = {DEFAULT_TOLERANCE_PCT:g}")


def _choice(choices: tuple[str, ...]) -> Check:
    def check(value: Any):
        if isinstance(value, str) and value in choices:
            return value, None
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, choices, n=1)
            hint = f"did you mean {close[0]!r}?" if close else ""
        return None, ("one of " + ", ".join(repr(c) for c in choices), _found(value), hint)

    return check


def _margin_pct(value: Any):
    number = _as_float(value)
    if number is not None and 0 <= number <= 50:
        return number, None
    return None, ("a number from 0 to 50 (percent below each limit)", _found(value), "e.g. margin_pct = 5")


def _choices(choices: tuple[str, ...]) -> Check:
    one = _choice(choices)

    def check(value: Any):
        if not isinstance(value, list) or not value:
            return None, ("a non-empty array of " + ", ".join(repr(c) for c in choices), _found(value), "")
        for item in value:
            _, err = one(item)
            if err:
                return None, (err[0], f"{_found(item)} in the array", err[2])
        return tuple(dict.fromkeys(value)), None

    return check


def _batch_sizes(value: Any):
    if isinstance(value, list) and value and all(_is_int(v) and 1 <= v <= MAX_BATCH_SIZE for v in value):
        return tuple(dict.fromkeys(value)), None
    return None, (f"a non-empty array of positive integers, each at most {MAX_BATCH_SIZE:,}", _found(value),
                  "e.g. batch_sizes = [1, 8, 32]")


_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _class_name(value: Any):
    if isinstance(value, str) and _CLASS_NAME.fullmatch(value.strip()) and value.strip() != "auto":
        return value.strip(), None
    return None, ("a module class name, e.g. \"BertLayer\" or \"mypkg.model.Block\"", _found(value),
                  "leave regional_block out to compile the most repeated block class")
def _sizes(value: Any):
    if isinstance(value, list) and value and all(_is_int(v) and 1 <= v <= MAX_SHAPE_SIZE for v in value) \
            and len(set(value)) == len(value):
        return tuple(value), None
    return None, (f"a non-empty array of distinct positive integers, each at most {MAX_SHAPE_SIZE:,}", _found(value),
                  "e.g. [64, 128, 256, 512]")


def _weights(value: Any):
    numbers = [_as_float(v) for v in value] if isinstance(value, list) else []
    if numbers and all(n is not None and n > 0 for n in numbers):
        return tuple(numbers), None
    return None, ("a non-empty array of positive numbers, one per size, e.g. [4, 3, 2, 1]", _found(value),
                  "weights are relative: each size's share of the calls")


def _model_options(value: Any):
    """[model_options]: config attribute -> a boolean, a number or a string (the values `--model-option` takes)."""
    if not isinstance(value, dict):
        return None, ("a table [model_options] of config attributes", _found(value),
                      "e.g. [model_options] with num_hidden_layers = 2 under it")
    for name, item in value.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            return None, ("config attribute names (letters, digits, '_')", f"key {shorten(repr(name), 60)}", "")
        if not isinstance(item, bool | int | float | str) or (isinstance(item, float) and not math.isfinite(item)):
            return None, ("a boolean, a number or a string for each config attribute",
                          f"{_found(item)} for {name}", f"e.g. {name} = 2")
    return tuple(sorted(value.items())), None


def _bools(value: Any):
    if isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        return tuple(dict.fromkeys(value)), None
    return None, ("a non-empty array of booleans, e.g. [false] or [false, true]", _found(value), "")


def compiler_vocabulary() -> dict[str, tuple[str, ...]]:
    """Valid modes, precisions and fusion presets, as the compiler core defines them."""
    from joulepilot.compiler import FUSION_PRESETS, MODES, PADDINGS, PRECISIONS
    from joulepilot.compiler.options import CACHES

    return {"modes": tuple(MODES), "precisions": tuple(PRECISIONS), "fusion": tuple(FUSION_PRESETS),
            "padding": tuple(PADDINGS), "caches": tuple(CACHES)}


def schema() -> dict[str, Any]:
    """Top-level keys and tables: a checker per key, and for tables a (checker map, required keys)."""
    vocab = compiler_vocabulary()
    return {
        "name": _name,
        "workload": _string,
        "task": _choice(TASKS),
        "prompt_len": _bounded_int(MAX_SHAPE_SIZE, "prompt_len = 512"),
        "new_tokens": _bounded_int(MAX_SHAPE_SIZE, "new_tokens = 256"),
        "model_options": _model_options,
        "batch_size": _bounded_int(MAX_BATCH_SIZE, "batch_size = 32"),
        "seq_len": _bounded_int(MAX_SHAPE_SIZE, "seq_len = 128"),
        "image_size": _bounded_int(MAX_SHAPE_SIZE, "image_size = 224"),
        "description": _optional_string,
        "shapes": {"seq_len": _sizes, "image_size": _sizes, "weights": _weights, "buckets": _sizes},
        "objective": {"minimize": _choice(OBJECTIVES),
                      "expected_inferences": _bounded_int(MAX_EXPECTED_INFERENCES, "expected_inferences = 10_000_000"),
                      "expected_tokens": _bounded_int(MAX_EXPECTED_TOKENS, "expected_tokens = 100_000_000")},
        "limits": {
            "max_avg_power_w": _positive_number,
            "max_peak_power_w": _positive_number,
            "max_p95_latency_ms": _positive_number,
            "max_compile_s": _positive_number,
            "max_rel_error": _positive_number,
            "max_tpot_ms": _positive_number,
            "max_ttft_ms": _positive_number,
            "margin_pct": _margin_pct,
        },
        "search": {
            "modes": _choices(vocab["modes"]),
            "precisions": _choices(vocab["precisions"]),
            "fusion": _choices(vocab["fusion"]),
            "dynamic": _bools,
            "padding": _choices(vocab["padding"]),
            "strategy": _choice(SEARCH_STRATEGIES),
            "budget_s": _budget_s,
            "max_measurements": _bounded_int(MAX_MEASUREMENTS, "max_measurements = 12"),
            "min_repeats": _min_repeats,
            "tolerance_pct": _tolerance_pct,
            "batch_sizes": _batch_sizes,
            "regional": _bools,
            "regional_block": _class_name,
            "caches": _choices(vocab["caches"]),
            "compile_prefill": _bools,
        },
        "fallback": {
            "mode": _choice(vocab["modes"]),
            "precision": _choice(vocab["precisions"]),
            "fusion": _choice(vocab["fusion"]),
        },
        "guard": {"windows": _bounded_int(MAX_GUARD_WINDOWS, "windows = 3"), "action": _choice(GUARD_ACTIONS)},
    }


REQUIRED = ("name", "workload", "batch_size")
REQUIRED_IN_TABLE = {"fallback": ("mode",)}


def _unknown(file: str, key: str, known: list[str], value: Any, spec: Mapping[str, Any]) -> Problem:
    """An unknown key, with the closest valid key here; or, for a key that belongs elsewhere (TOML puts every key
    below a [table] header into that table, so a key written after the wrong header lands there), where it goes."""
    leaf = key.rsplit(".", 1)[-1]
    prefix = key[: -len(leaf)]
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.5)
    if close and difflib.SequenceMatcher(None, leaf, close[0]).ratio() >= 0.8:  # a typo of a key here
        hint = f"did you mean '{prefix}{close[0]}'?"
    elif prefix and leaf in spec and not isinstance(spec[leaf], dict):
        hint = f"'{leaf}' is a top-level key: move it above the first [table] header"
    elif (table := next((t for t, keys in spec.items() if isinstance(keys, dict) and leaf in keys
                         and f"{t}." != prefix), None)) is not None:
        hint = f"did you mean '{table}.{leaf}'? move it under the [{table}] header"
    elif close:
        hint = f"did you mean '{prefix}{close[0]}'?"
    else:
        hint = "valid keys here: " + ", ".join(known)
    return Problem(file, key, "a known key", f"unknown key with {_found(value)}", hint)


def validate(raw: Mapping[str, Any], file: str = "<policy>") -> Policy:
    """Check a parsed policy document and build the `Policy`; raises PolicyError with every problem."""
    spec = schema()
    problems: list[Problem] = []
    values: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {}

    for key, value in raw.items():
        checker = spec.get(key)
        if checker is None:
            problems.append(_unknown(file, key, list(spec), value, spec))
        elif isinstance(checker, dict):
            if not isinstance(value, dict):
                problems.append(Problem(file, key, f"a table [{key}]", _found(value)))
                continue
            table = tables.setdefault(key, {})
            for sub, sub_value in value.items():
                sub_checker = checker.get(sub)
                if sub_checker is None:
                    problems.append(_unknown(file, f"{key}.{sub}", list(checker), sub_value, spec))
                    continue
                checked, err = sub_checker(sub_value)
                if err:
                    problems.append(Problem(file, f"{key}.{sub}", *err))
                else:
                    table[sub] = checked
        else:
            checked, err = checker(value)
            if err:
                problems.append(Problem(file, key, *err))
            else:
                values[key] = checked

    for key in REQUIRED:
        if key not in raw:
            problems.append(Problem(file, key, f"a value for required key '{key}'", "nothing",
                                    f"add `{key} = ...` at the top of the file"))
    for table, keys in REQUIRED_IN_TABLE.items():
        for key in keys:
            if table in raw and isinstance(raw[table], dict) and key not in raw[table]:
                problems.append(Problem(file, f"{table}.{key}", f"a value for required key '{key}'",
                                        "nothing", f"add `{key} = ...` under [{table}]"))

    limits = tables.get("limits", {})
    search = tables.get("search", {})
    objective = tables.get("objective", {})
    if limits.get("max_peak_power_w") is not None and limits.get("max_avg_power_w") is not None:
        if limits["max_peak_power_w"] < limits["max_avg_power_w"]:
            problems.append(Problem(file, "limits.max_peak_power_w",
                                    f"a value >= limits.max_avg_power_w ({limits['max_avg_power_w']:g})",
                                    _found(limits["max_peak_power_w"]), "peak power cannot be below the average"))
    if search.get("regional_block") is not None and True not in search.get("regional", (False,)):
        problems.append(Problem(file, "search.regional_block", "search.regional to include true",
                                f"regional = {str(list(search.get('regional', (False,)))).lower()}",
                                "set regional = [false, true] under [search], or remove regional_block"))
    generates = values.get("task") == GENERATE
    _task_problems(file, raw, values, tables, problems, spec)
    shape_set = None if generates else _shape_set(file, raw, values, tables, problems)
    if shape_set is not None:
        search.setdefault("dynamic", (False, True))
        search.setdefault("padding", ("none", "buckets"))
    if problems:
        raise PolicyError(problems)
    if generates:
        from joulepilot.compiler.generation_workloads import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT_LEN

        values.setdefault("prompt_len", DEFAULT_PROMPT_LEN)
        values.setdefault("new_tokens", DEFAULT_NEW_TOKENS)
        objective.setdefault("expected_tokens", DEFAULT_EXPECTED_TOKENS)

    return Policy(
        name=values["name"],
        workload=values["workload"],
        batch_size=values["batch_size"],
        seq_len=values.get("seq_len"),
        image_size=values.get("image_size"),
        shapes=shape_set,
        task=values.get("task", "forward"),
        prompt_len=values.get("prompt_len"),
        new_tokens=values.get("new_tokens"),
        model_options=values.get("model_options", ()),
        description=values.get("description", ""),
        objective=Objective(**objective),
        limits=Limits(**limits),
        search=Search(**search),
        fallback=Fallback(**tables.get("fallback", {})),
        guard=Guard(**tables.get("guard", {})),
        path=file if file != "<policy>" else None,
    )


# What only a forward pass has, and what only a generation has: (dotted key, how it is found in the parsed tables).
_GENERATION_ONLY = ("prompt_len", "new_tokens", "objective.expected_tokens", "limits.max_tpot_ms",
                    "limits.max_ttft_ms", "search.caches", "search.compile_prefill")
_TASK_FIX = 'add task = "generate" at the top of the file, or remove it'


def _given(raw: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """(whether the document sets the dotted `key`, its value)."""
    table, _, leaf = key.rpartition(".")
    holder = raw.get(table) if table else raw
    if not isinstance(holder, Mapping) or leaf not in holder:
        return False, None
    return True, holder[leaf]


def _task_problems(file: str, raw: Mapping[str, Any], values: Mapping[str, Any],
                   tables: Mapping[str, dict[str, Any]], problems: list[Problem], spec: Mapping[str, Any]) -> None:
    """One problem per field that the policy's task does not have: a generation field in a forward-pass policy,
    a forward-pass field (input shapes, regional compilation, padding, expected_inferences) in a generation
    policy; and a [model_options] key that is a top-level policy key written below that header."""
    for name, _ in values.get("model_options", ()):
        if name in spec and not isinstance(spec[name], dict):
            problems.append(Problem(file, f"model_options.{name}", "config attributes of the model", f"key {name!r}",
                                    f"'{name}' is a top-level key: move it above the first [table] header"))
    if "task" in raw and "task" not in values:
        return  # the task itself is wrong: said where it was checked
    if values.get("task") != GENERATE:
        for key in _GENERATION_ONLY:
            given, value = _given(raw, key)
            if given:
                problems.append(Problem(file, key, "no generation setting in a forward-pass policy", _found(value),
                                        _TASK_FIX))
        return
    forward_only = [("seq_len", "a generation's input is prompt_len tokens per sequence: use prompt_len"),
                    ("image_size", "a generation's input is prompt_len tokens per sequence: use prompt_len"),
                    ("shapes", "a generation is measured at one prompt_len and new_tokens: remove [shapes]"),
                    ("objective.expected_inferences", "a generation amortises compile energy over generated "
                                                      "tokens: write expected_tokens instead"),
                    ("search.regional_block", "regional compilation is not applied to a generation: remove it")]
    for key, hint in forward_only:
        given, value = _given(raw, key)
        if given:
            problems.append(Problem(file, key, 'no forward-pass setting in a generation policy (task = "generate")',
                                    _found(value), hint))
    search = tables.get("search", {})
    if True in search.get("regional", ()):
        problems.append(Problem(file, "search.regional", "[false] in a generation policy", _found(list(search["regional"])),
                                "regional compilation is not applied to a generation: remove regional"))
    if "buckets" in search.get("padding", ()):
        problems.append(Problem(file, "search.padding", '["none"] in a generation policy', _found(list(search["padding"])),
                                "padding to shape buckets is a forward pass's: remove padding"))


def setting_warnings(policy: Policy, file: str) -> list[Problem]:
    """Settings that load but do nothing (`policy check` warns of them; the file stays valid: refusing it would
    turn a policy that served before into one the hook cannot use): `budget_s` and `max_measurements` bound
    the guided search only, so an exhaustive policy measures its whole grid whatever they say."""
    search = policy.search
    if search.strategy != "exhaustive":
        return []
    return [Problem(file, f"search.{key}", "no bound under strategy = \"exhaustive\"",
                    f"{key} = {getattr(search, key):g} is ignored: the exhaustive strategy measures every allowed "
                    f"configuration", "remove it, or set strategy = \"guided\" for a search it bounds", "warning")
            for key in ("budget_s", "max_measurements") if getattr(search, key) is not None]


def _shape_set(file: str, raw: Mapping[str, Any], values: Mapping[str, Any], tables: Mapping[str, dict[str, Any]],
               problems: list[Problem]) -> Any:
    """The [shapes] table as a compiler ShapeSet (None without one), after the checks that span its keys; a
    problem is appended for each thing wrong. `search.padding = ["buckets"]` needs a shape set to pad."""
    from joulepilot.compiler import ConfigError, ShapeSet
    from joulepilot.compiler.shape_set import MAX_SHAPES

    padding = tables.get("search", {}).get("padding", ())
    if "shapes" not in raw:
        if "buckets" in padding:
            problems.append(Problem(file, "search.padding", "'none' only, as the policy has no [shapes] to pad",
                                    _found(list(padding)), "add a [shapes] table, e.g. seq_len = [64, 128, 256], "
                                    "or remove 'buckets'"))
        return None
    table, given = tables.get("shapes", {}), raw.get("shapes")
    if not isinstance(given, dict) or any(p.key.startswith("shapes.") for p in problems):
        return None  # reported where the table or its keys were checked
    dims = [d for d in ("seq_len", "image_size") if d in table]
    if len(dims) != 1:
        problems.append(Problem(file, "shapes", "exactly one of seq_len or image_size, the workload argument "
                                "that varies", "both" if dims else "neither",
                                "e.g. [shapes] seq_len = [64, 128, 256, 512]"))
        return None
    dim = dims[0]
    sizes = table[dim]
    if values.get(dim) is not None:
        problems.append(Problem(file, dim, f"no top-level {dim} beside [shapes] {dim}", _found(values[dim]),
                                f"remove the top-level {dim}: the shape set gives the sizes"))
    if len(sizes) > MAX_SHAPES:
        problems.append(Problem(file, f"shapes.{dim}", f"at most {MAX_SHAPES} sizes", f"{len(sizes)} sizes",
                                "each size is measured on its own; keep the sizes that carry most of the calls"))
    weights = table.get("weights", ())
    if weights and len(weights) != len(sizes):
        problems.append(Problem(file, "shapes.weights", f"one weight per size ({len(sizes)})",
                                f"{len(weights)} weight(s)", f"give as many weights as shapes.{dim} has sizes"))
    buckets = table.get("buckets", ())
    if buckets and max(buckets) < max(sizes):
        problems.append(Problem(file, "shapes.buckets", f"a largest bucket of at least the largest size ({max(sizes)})",
                                _found(list(buckets)), f"add a bucket of {max(sizes)} or more"))
    if any(p.key.startswith("shapes") or p.key == dim for p in problems):
        return None
    try:
        return ShapeSet(dim=dim, sizes=tuple(sizes), weights=tuple(weights), buckets=tuple(buckets))
    except ConfigError as exc:  # every rule above should have caught it; never let one through as a traceback
        problems.append(Problem(file, "shapes", "a valid shape set", str(exc)))
        return None
