"""The knobs of the configuration space, checked against the installed torch.

Modes, fusion presets and precisions are fixed vocabularies; raw Inductor options are whatever the
installed `torch._inductor.config` knows, with the types it declares. Everything is checked before a
worker is started, so a typo costs an error message rather than a sweep.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
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

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

# Options that only mean something on a CUDA device; Inductor ignores them for CPU graphs.
CUDA_ONLY_OPTIONS = frozenset({"triton.cudagraphs"})


def closest(name: str, candidates: Any) -> str | None:
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return matches[0] if matches else None


def _did_you_mean(name: str, candidates: Any) -> str:
    guess = closest(name, candidates)
    return f"; did you mean {guess!r}?" if guess else ""


def check_choice(kind: str, value: str, choices: Any) -> str:
    if value not in choices:
        raise ConfigError(
            f"unknown {kind} {value!r}{_did_you_mean(value, choices)} (valid: {', '.join(choices)})"
        )
    return value


def inductor_defaults() -> dict[str, Any]:
    """Every Inductor option of the installed torch with its current value."""
    from torch._inductor import config

    return config.get_config_copy()


def _declared_type(name: str) -> Any:
    from torch._inductor import config

    try:
        return config.get_type(name)
    except Exception:  # older torch without get_type, or a knob without a declared type
        return None


def normalise_option(name: str, value: Any, known: Mapping[str, Any] | None = None) -> tuple[str, Any]:
    """Check one Inductor option name and value the way torch.compile will; returns (name, value).

    Dashes are accepted for underscores as torch does. An int for a float knob is widened.
    """
    known = inductor_defaults() if known is None else known
    key = name.replace("-", "_")
    if key not in known:
        raise ConfigError(f"unknown Inductor option {name!r}{_did_you_mean(key, known)}")
    expected = _declared_type(key)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if expected is not None:
        try:
            ok = isinstance(value, expected)
        except TypeError:  # subscripted generics (list[str], ...) cannot be checked with isinstance
            ok = True
        if not ok:
            default = known[key]
            raise ConfigError(
                f"Inductor option {key!r} takes {getattr(expected, '__name__', expected)} "
                f"(default {default!r}), got {type(value).__name__} {value!r}"
            )
    if isinstance(value, list):
        value = tuple(value)
    return key, value


def normalise_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    known = inductor_defaults()
    return dict(normalise_option(k, v, known) for k, v in (options or {}).items())


def check_presets() -> dict[str, list[str]]:
    """Presets whose knobs the installed torch lacks: {preset: [missing knobs]} (empty when all fit)."""
    known = inductor_defaults()
    return {
        name: missing
        for name, overrides in FUSION_PRESETS.items()
        if (missing := [k for k in overrides if k not in known])
    }


def mode_options(mode: str, dynamic: bool | None = None) -> dict[str, Any]:
    """The Inductor options torch.compile turns `mode` into (empty for 'default' and 'eager')."""
    if mode in ("eager", "default"):
        return {}
    try:
        from torch._inductor import list_mode_options
    except ImportError:  # very old torch: the table as of torch 2.4-2.13
        table = {
            "reduce-overhead": {"triton.cudagraphs": True},
            "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
            "max-autotune": {"max_autotune": True, "triton.cudagraphs": True, "coordinate_descent_tuning": True},
        }
        return dict(table[mode])
    return dict(list_mode_options(mode, dynamic))


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


def parse_option_assignments(items: Any) -> dict[str, Any]:
    """['max_fusion_size=32', 'epilogue_fusion=false'] -> {'max_fusion_size': 32, 'epilogue_fusion': False}."""
    options: dict[str, Any] = {}
    for item in items or ():
        if "=" not in item:
            raise ConfigError(f"option {item!r} must look like NAME=VALUE, e.g. epilogue_fusion=false")
        name, _, value = item.partition("=")
        options[name.strip()] = parse_option_value(value)
    return options
