"""A configuration applied to a model: `torch.compile` (or nothing, for eager) under its precision scope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import inductor
from .config import CompileConfig


def apply_config(config: CompileConfig, model: Callable[..., Any], device: str | None = None,
                 compile_kwargs: dict[str, Any] | None = None, *, precompile: bool = False) -> Callable[..., Any]:
    """The callable to run: torch.compile(model) (or the model for eager) under no_grad in `config`'s
    precision scope. `device` (default: where the model's parameters are) picks the autocast device
    type and whether CUDA-only options apply. `compile_kwargs` replaces the configuration's own
    `inductor.torch_compile_kwargs(config, device)` (the hook merges a user's arguments this way).

    A regional configuration compiles the model's repeated blocks in place instead (`compiler.regional`);
    the callable's `.regional` is the block class and its instances (None for a whole-model one).
    `precompile`: compile with Dynamo's caching precompile on (`compiler.warmstart`), so compiled frames
    loaded from saved artifacts are installed instead of traced again."""
    import torch  # here, not at the top: `joulepilot.compiler` names this without loading torch

    from .precision import precision_scope
    from .regional import compile_blocks
    from .warmstart import precompile_scope

    if device is None:
        first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        device = str(first.device) if first is not None else "cpu"

    if compile_kwargs is None:
        compile_kwargs = inductor.torch_compile_kwargs(config, device)
    block = None
    with precompile_scope(precompile and config.compiles):
        if config.compiles and config.regional:
            block = compile_blocks(model, config.regional, compile_kwargs)
            target = model
        else:
            target = torch.compile(model, **compile_kwargs) if config.compiles else model
    precision = config.precision

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), precision_scope(precision, device):
            return target(*args, **kwargs)

    run.compiled = target  # type: ignore[attr-defined]
    run.config = config  # type: ignore[attr-defined]
    run.regional = block  # type: ignore[attr-defined]
    return run
