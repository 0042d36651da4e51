"""One point of the configuration space: mode, fusion preset, raw Inductor options, precision, dynamic
shapes, padding to shape buckets, batch, and whether the whole model or its repeated blocks are compiled
(regional compilation).

Part of the torch-free vocabulary (an import-linter contract keeps torch out): building, naming and
storing a configuration needs no torch. What the installed torch makes of it (option checks, mode
expansion, torch.compile kwargs) is `compiler.inductor`; running a model under it is
`compiler.apply.apply_config`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from joulepilot.store import stable_id

from .options import (
    CACHES,
    DEFAULT_CACHE,
    FUSION_PRESETS,
    MODES,
    PADDINGS,
    PRECISIONS,
    ConfigError,
    check_choice,
    check_regional,
)

OptionItems = tuple[tuple[str, Any], ...]


def _as_items(options: Mapping[str, Any] | OptionItems | None) -> OptionItems:
    """Sorted (name, value) pairs; dashes in names read as underscores (as torch reads them), lists
    as tuples (so a configuration stays hashable)."""
    if not options:
        return ()
    pairs = options.items() if isinstance(options, Mapping) else options
    named = {str(k).replace("-", "_"): tuple(v) if isinstance(v, list) else v for k, v in pairs}
    return tuple(sorted(named.items()))


@dataclass(frozen=True)
class CompileConfig:
    """A torch.compile configuration. `options` may be given as a dict; it is kept as sorted pairs.

    Mode, fusion preset, precision and batch size are checked here; raw options are checked against
    the installed torch by `compiler.inductor.checked_config` (planning does it; applying does it too).

    `regional`: '' compiles the whole model; 'auto' compiles each instance of the model's most repeated
    block class instead (see `compiler.regional`), a class name compiles that class's instances. True
    and False are read as 'auto' and ''. A whole-model configuration's id is what it was before the
    field existed, so stored runs keep their configuration.

    Generation (a workload with `task = "generate"`, see `compiler.generation`): `cache` is the KV cache
    ('dynamic', the default, or 'static'); `compile_prefill` compiles the prompt's forward pass too (by default
    only the decode steps run compiled, the prompt eagerly). Both enter the id and label only when not at their
    default, so no configuration named before them changes; a forward pass keeps the defaults.
    """

    mode: str
    fusion: str = "default"
    options: OptionItems = field(default=())
    precision: str = "fp32"
    dynamic: bool = False
    batch_size: int = 1
    # "buckets": inputs of a shape set are padded up to their bucket before each call (compiler.shape_set).
    padding: str = "none"
    regional: str = ""
    cache: str = DEFAULT_CACHE
    compile_prefill: bool = False

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("fusion preset", self.fusion, FUSION_PRESETS)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("padding", self.padding, PADDINGS)
        check_choice("cache", self.cache, CACHES)
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        object.__setattr__(self, "dynamic", bool(self.dynamic))
        object.__setattr__(self, "compile_prefill", bool(self.compile_prefill))
        object.__setattr__(self, "regional", check_regional(self.regional))
        options = _as_items(self.options)
        if self.mode == "eager" and (options or self.fusion != "default"):
            raise ConfigError("mode 'eager' does not compile, so fusion presets and Inductor options do not apply")
        if self.mode == "eager" and self.regional:
            raise ConfigError("mode 'eager' does not compile, so regional compilation does not apply")
        if self.mode == "eager" and self.compile_prefill:
            raise ConfigError("mode 'eager' does not compile, so compiling the prefill does not apply")
        object.__setattr__(self, "options", options)

    # --- identity -----------------------------------------------------------------------------
    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @cached_property  # worked out once per configuration: grids, judges and store writes ask it over and over
    def id(self) -> str:
        parts: list[Any] = ["config", self.mode, self.fusion, [list(p) for p in self.options], self.precision,
                            self.dynamic, self.batch_size]
        # Each appended only when set, so every configuration named before it existed keeps its id.
        if self.padding != "none":
            parts.append(f"padding={self.padding}")
        if self.regional:
            parts.append(["regional", self.regional])
        if self.cache != DEFAULT_CACHE:
            parts.append(["cache", self.cache])
        if self.compile_prefill:
            parts.append("compile_prefill")
        return stable_id(*parts)

    @property
    def label(self) -> str:
        parts = [self.mode]
        if self.fusion != "default":
            parts.append(self.fusion)
        parts.extend(f"{k}={v}" for k, v in self.options)
        if self.cache != DEFAULT_CACHE:
            parts.append(f"{self.cache}-cache")
        if self.compile_prefill:
            parts.append("compiled-prefill")
        parts.append(self.precision)
        if self.dynamic:
            parts.append("dynamic")
        if self.padding != "none":
            parts.append("pad")
        if self.regional:
            parts.append("regional" if self.regional == "auto" else f"regional={self.regional}")
        parts.append(f"b{self.batch_size}")
        return "/".join(parts)

    @property
    def compiles(self) -> bool:
        return self.mode != "eager"

    def to_row(self) -> dict[str, Any]:
        """The configs-table row. `padding`, `regional`, `cache` and `compile_prefill` only when set (their
        columns default to 'none', '', 'dynamic' and 0), so the rows of every configuration named before them,
        in decisions, lock files and exports, are unchanged."""
        row = {
            "id": self.id,
            "label": self.label,
            "mode": self.mode,
            "fusion": self.fusion,
            "options": json.dumps(self.options_dict, sort_keys=True),
            "precision": self.precision,
            "dynamic": int(self.dynamic),
            "batch_size": self.batch_size,
        }
        if self.padding != "none":
            row["padding"] = self.padding
        if self.regional:
            row["regional"] = self.regional
        if self.cache != DEFAULT_CACHE:
            row["cache"] = self.cache
        if self.compile_prefill:
            row["compile_prefill"] = 1
        return row

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
            padding=row.get("padding") or "none",
            regional=row.get("regional") or "",
            cache=row.get("cache") or DEFAULT_CACHE,
            compile_prefill=bool(row.get("compile_prefill")),
        )

    def replace(self, **changes: Any) -> CompileConfig:
        values = {"mode": self.mode, "fusion": self.fusion, "options": self.options, "precision": self.precision,
                  "dynamic": self.dynamic, "batch_size": self.batch_size, "padding": self.padding,
                  "regional": self.regional, "cache": self.cache, "compile_prefill": self.compile_prefill}
        values.update(changes)
        return CompileConfig(**values)
