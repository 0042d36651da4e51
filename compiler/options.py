"""The vocabulary of the configuration space: modes, fusion presets, precisions, option syntax.

This module and `config` never import torch (an import-linter contract checks it), so policies, the
CLI and reports can name configurations without loading it. Raw Inductor options are whatever the
installed `torch._inductor.config` knows: they are checked in `compiler.inductor`, before a worker is
started, so a typo costs an error message rather than a sweep.
"""

from __future__ import annotations

import difflib
import re
from typing import Any


class ConfigError(ValueError):
    """A configuration names a mode, preset, precision or Inductor knob that this torch does not have."""


MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")

# Named groups of Inductor overrides. Each name is checked against torch._inductor.config on use, so a
# preset that a future torch drops fails with the knob's name instead of silently doing nothing.
FUSION_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-epilogue-fusion": {"epilogue_fusion": False},
    "aggressive-fusion": {"aggressive_fusion": True},
    "coordinate-descent": {"coordinate_descent_tuning": True},
    "benchmark-fusion": {"benchmark_fusion": True},
}

# The raw Inductor options a decision read back from a lock file or the store may carry: the knobs the fusion
# presets set, as true or false. Nothing else, so no decision can name a program, a path or a module for
# Inductor to run or import (`cpp.cxx`, `cuda.cutlass_dir`, ...): a decision is data, not code.
SEARCHED_OPTIONS: frozenset[str] = frozenset(knob for overrides in FUSION_PRESETS.values() for knob in overrides)

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

# How a configuration meets a set of input shapes (see `compiler.shape_set`): "none" runs each shape as it
# is; "buckets" pads each input up to its bucket first, so a static compile sees fewer distinct shapes.
PADDINGS = ("none", "buckets")

# The KV cache of a generation (a `task = "generate"` workload): "dynamic" grows with every token (transformers'
# default, what eager decoding uses), "static" is allocated once for prompt + new tokens, so every decode step
# has the same shapes and a compiled step can be replayed as a CUDA graph. A forward pass has no cache: its
# configurations keep the default.
CACHES = ("dynamic", "static")
DEFAULT_CACHE = "dynamic"

# Options that only mean something on a CUDA device; Inductor ignores them for CPU graphs.
CUDA_ONLY_OPTIONS = frozenset({"triton.cudagraphs"})


# `CompileConfig.regional`: '' (the whole model), REGIONAL_AUTO (the most repeated block class) or a class
# name, plain (`EncoderLayer`) or qualified by its module (`transformers.models.bert.modeling_bert.BertLayer`).
REGIONAL_AUTO = "auto"
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def check_regional(value: Any) -> str:
    """The regional setting as stored: True -> 'auto', False/None -> '', a class name as given."""
    if value is None or value is False:
        return ""
    if value is True:
        return REGIONAL_AUTO
    text = str(value).strip() if isinstance(value, str) else None
    if text is None or (text and not _CLASS_NAME.fullmatch(text)):
        raise ConfigError(f"regional must be true, false, {REGIONAL_AUTO!r} or a module class name such as "
                          f"'EncoderLayer', got {value!r}")
    return text


def closest(name: str, candidates: Any) -> str | None:
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Any) -> str:
    guess = closest(name, candidates)
    return f"; did you mean {guess!r}?" if guess else ""


def check_choice(kind: str, value: str, choices: Any) -> str:
    if value not in choices:
        raise ConfigError(
            f"unknown {kind} {value!r}{did_you_mean(value, choices)} (valid: {', '.join(choices)})"
        )
    return value


def parse_option_value(text: str) -> Any:
    """A command-line value: true/false, int, float, else the string itself."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


def parse_option_assignments(items: Any, *, what: str = "option", example: str = "epilogue_fusion=false"
                             ) -> dict[str, Any]:
    """['max_fusion_size=32', 'epilogue_fusion=false'] -> {'max_fusion_size': 32, 'epilogue_fusion': False}.
    `what` and `example` name the option in the error for an item that is not NAME=VALUE."""
    options: dict[str, Any] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{what} {item!r} must look like NAME=VALUE, e.g. {example}")
        options[name.strip()] = parse_option_value(value)
    return options
