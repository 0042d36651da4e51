"""One point of the configuration space: mode, fusion preset, raw Inductor options, precision, shapes, batch."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from joulepilot.store import stable_id

from .options import (
    CUDA_ONLY_OPTIONS,
    FUSION_PRESETS,
    MODES,
    PRECISIONS,
    ConfigError,
    check_choice,
    mode_options,
    normalise_option,
    normalise_options,
)

OptionItems = tuple[tuple[str, Any], ...]


def _as_items(options: Mapping[str, Any] | OptionItems | None) -> OptionItems:
    if not options:
        return ()
    pairs = options.items() if isinstance(options, Mapping) else options
    return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in pairs))


@dataclass(frozen=True)
class CompileConfig:
    """A torch.compile configuration. `options` may be given as a dict; it is kept as sorted pairs."""

    mode: str
    fusion: str = "default"
    options: OptionItems = field(default=())
    precision: str = "fp32"
    dynamic: bool = False
    batch_size: int = 1

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("fusion preset", self.fusion, FUSION_PRESETS)
        check_choice("precision", self.precision, PRECISIONS)
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        object.__setattr__(self, "dynamic", bool(self.dynamic))
        options = _as_items(self.options)
        if self.mode == "eager" and (options or self.fusion != "default"):
            raise ConfigError("mode 'eager' does not compile, so fusion presets and Inductor options do not apply")
        object.__setattr__(self, "options", _as_items(normalise_options(dict(options))))
        for knob, value in FUSION_PRESETS[self.fusion].items():
            normalise_option(knob, value)  # the installed torch must still have the preset's knobs

    # --- identity -----------------------------------------------------------------------------
    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def id(self) -> str:
        return stable_id("config", self.mode, self.fusion, [list(p) for p in self.options], self.precision,
                         self.dynamic, self.batch_size)

    @property
    def label(self) -> str:
        parts = [self.mode]
        if self.fusion != "default":
            parts.append(self.fusion)
        parts.extend(f"{k}={v}" for k, v in self.options)
        parts.append(self.precision)
        if self.dynamic:
            parts.append("dynamic")
        parts.append(f"b{self.batch_size}")
        return "/".join(parts)

    @property
    def compiles(self) -> bool:
        return self.mode != "eager"

    def to_row(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "label": self.label,
            "mode": self.mode,
            "fusion": self.fusion,
            "options": json.dumps(self.options_dict, sort_keys=True),
            "precision": self.precision,
            "dynamic": int(self.dynamic),
            "batch_size": self.batch_size,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> CompileConfig:
        """From a configs row, a list_runs row or a to_row() dict."""
        options = row.get("options") or {}
        if isinstance(options, str):
            options = json.loads(options) if options.strip() else {}
        return cls(
            mode=row["mode"],
            fusion=row.get("fusion") or "default",
            options=options,
            precision=row.get("precision") or "fp32",
            dynamic=bool(row.get("dynamic")),
            batch_size=int(row.get("batch_size") or 1),
        )

    def replace(self, **changes: Any) -> CompileConfig:
        values = {"mode": self.mode, "fusion": self.fusion, "options": self.options, "precision": self.precision,
                  "dynamic": self.dynamic, "batch_size": self.batch_size}
        values.update(changes)
        return CompileConfig(**values)

    # --- torch.compile --------------------------------------------------------------------------
    def inductor_options(self, device: str | None = None) -> dict[str, Any]:
        """Mode expanded the way torch expands it, then the fusion preset, then raw options on top.

        On a CPU device the CUDA-only knobs (CUDA graphs) are dropped: Inductor would skip them anyway,
        and leaving them out keeps the effective options honest about what ran.
        """
        merged = {**mode_options(self.mode, self.dynamic), **FUSION_PRESETS[self.fusion], **self.options_dict}
        if device is not None and not str(device).startswith("cuda"):
            merged = {k: v for k, v in merged.items() if k not in CUDA_ONLY_OPTIONS}
        return merged

    def torch_compile_kwargs(self, device: str | None = None) -> dict[str, Any]:
        """Keyword arguments for torch.compile; {} for eager.

        torch refuses `mode` and `options` together, so with a non-default fusion preset or raw options
        the mode is expanded into options (torch._inductor.list_mode_options) and merged under them.
        """
        if not self.compiles:
            return {}
        kwargs: dict[str, Any] = {"dynamic": self.dynamic}
        plain_mode = self.fusion == "default" and not self.options
        on_cpu = device is not None and not str(device).startswith("cuda")
        if plain_mode and not (on_cpu and mode_options(self.mode, self.dynamic).keys() & CUDA_ONLY_OPTIONS):
            if self.mode != "default":
                kwargs["mode"] = self.mode
            return kwargs
        options = self.inductor_options(device)
        if options:
            kwargs["options"] = options
        return kwargs

    def effective_key(self, device: str | None = None) -> str:
        """Equal for configurations that run identically on `device` (used to skip duplicates)."""
        return stable_id(self.compiles, self.inductor_options(device) if self.compiles else {},
                         self.precision, self.dynamic, self.batch_size)

    def apply(self, model: Callable[..., Any], device: str | None = None,
              compile_kwargs: dict[str, Any] | None = None) -> Callable[..., Any]:
        """The callable to benchmark: torch.compile(model) (or the model for eager) run under no_grad in
        this configuration's precision scope. `device` (default: where the model's parameters are)
        picks the autocast device type and whether CUDA-only options apply. `compile_kwargs` replaces
        `torch_compile_kwargs(device)` (the hook merges a user's own arguments this way)."""
        import torch

        from .precision import precision_scope

        if device is None:
            first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
            device = str(first.device) if first is not None else "cpu"

        if compile_kwargs is None:
            compile_kwargs = self.torch_compile_kwargs(device)
        target = torch.compile(model, **compile_kwargs) if self.compiles else model
        precision = self.precision

        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.no_grad(), precision_scope(precision, device):
                return target(*args, **kwargs)

        run.compiled = target  # type: ignore[attr-defined]
        run.config = self  # type: ignore[attr-defined]
        return run
