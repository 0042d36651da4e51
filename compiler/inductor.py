"""What the installed torch's Inductor makes of a configuration: option checks, mode expansion, kwargs.

Everything here reads `torch._inductor`, so it lives apart from the torch-free vocabulary (`options`,
`config`): checking raw options against the installed torch, expanding a mode the way torch expands
it, and the keyword arguments `torch.compile` gets for a `CompileConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from joulepilot.store import stable_id

from .config import CompileConfig
from .options import CUDA_ONLY_OPTIONS, DEFAULT_CACHE, FUSION_PRESETS, ConfigError, did_you_mean


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
        raise ConfigError(f"unknown Inductor option {name!r}{did_you_mean(key, known)}")
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


def checked_config(config: CompileConfig) -> CompileConfig:
    """`config` with its raw options checked and normalised against the installed torch (ConfigError
    names the closest knob or the expected type), after checking that its fusion preset's knobs still
    exist. Configurations read back from the store were checked when they were planned."""
    if not config.options and config.fusion == "default":
        return config
    known = inductor_defaults()
    for knob, value in FUSION_PRESETS[config.fusion].items():
        normalise_option(knob, value, known)  # a preset that a newer torch dropped fails with the knob's name
    options = dict(normalise_option(k, v, known) for k, v in config.options)
    return config if options == config.options_dict else config.replace(options=options)


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


def inductor_options(config: CompileConfig, device: str | None = None) -> dict[str, Any]:
    """Mode expanded the way torch expands it, then the fusion preset, then raw options on top.

    On a CPU device the CUDA-only knobs (CUDA graphs) are dropped: Inductor would skip them anyway,
    and leaving them out keeps the effective options honest about what ran.
    """
    config = checked_config(config)
    merged = {**mode_options(config.mode, config.dynamic), **FUSION_PRESETS[config.fusion], **config.options_dict}
    if device is not None and not str(device).startswith("cuda"):
        merged = {k: v for k, v in merged.items() if k not in CUDA_ONLY_OPTIONS}
    return merged


def torch_compile_kwargs(config: CompileConfig, device: str | None = None) -> dict[str, Any]:
    """Keyword arguments for torch.compile; {} for eager.

    torch refuses `mode` and `options` together, so with a non-default fusion preset or raw options
    the mode is expanded into options (torch._inductor.list_mode_options) and merged under them.
    """
    if not config.compiles:
        return {}
    kwargs: dict[str, Any] = {"dynamic": config.dynamic}
    plain_mode = config.fusion == "default" and not config.options
    on_cpu = device is not None and not str(device).startswith("cuda")
    if plain_mode and not (on_cpu and mode_options(config.mode, config.dynamic).keys() & CUDA_ONLY_OPTIONS):
        if config.mode != "default":
            kwargs["mode"] = config.mode
        return kwargs
    options = inductor_options(config, device)
    if options:
        kwargs["options"] = options
    return kwargs


def effective_key(config: CompileConfig, device: str | None = None) -> str:
    """Equal for configurations that run identically on `device` (used to skip duplicates)."""
    parts = [config.compiles, inductor_options(config, device) if config.compiles else {}, config.precision,
             config.dynamic, config.batch_size]
    if config.padding != "none":
        parts.append(config.padding)
    if config.regional:
        parts.append(["regional", config.regional])
    if config.cache != DEFAULT_CACHE:
        parts.append(["cache", config.cache])
    if config.compile_prefill:
        parts.append("compile_prefill")
    return stable_id(*parts)
