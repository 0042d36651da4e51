"""Regional compilation: compile a model's repeated blocks instead of the whole model.

A transformer is a stack of identical layers. Compiling each layer instance (`Module.compile`) rather
than the whole model lets Dynamo trace one layer and reuse that compiled code for every other instance
of the class (their parameters are graph inputs, so the guards pass), which cuts the cold compile and
the warm start roughly by the number of layers, for a small cost in speed: nothing is fused across
block boundaries and the code between blocks runs eagerly.

Which blocks: with `regional='auto'`, the module class with the most instances among the classes that
have a forward of their own and children (leaves such as Linear repeat more, but compiling them one by
one buys nothing); ties go to the class whose instances hold more parameters (the outer of two nested
classes that repeat alike). An instance that contains another instance of its class is left out (only
the innermost are compiled). A class name (`EncoderLayer`, or qualified by its module) picks that class,
leaves included. Instances that differ in structure or parameter shapes are `variants`: each one costs a
compile of its own, and past Dynamo's recompile limit the remaining ones run eagerly.

The blocks are compiled in place (`Module.compile` sets each instance's compiled call), as torch's own
regional-compilation recipe does: the model passed in is the model that runs.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

from .options import REGIONAL_AUTO, ConfigError
from .shapes import recompile_limit


class RegionalError(ConfigError):
    """The model has no block to compile regionally, or none of the class the configuration names."""


@dataclass(frozen=True)
class BlockClass:
    """One module class of a model and its instances, as regional compilation sees them."""

    name: str  # the class's __name__
    qualname: str  # module.QualName
    instances: int  # instances compiled (nested instances of the same class left out)
    variants: int  # distinct structures and parameter shapes among them: compiles needed
    params_per_instance: int  # parameters of the largest instance
    paths: tuple[str, ...]  # where the instances are in the model (named_modules paths)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["paths"] = list(self.paths[:8]) + ([f"... {len(self.paths) - 8} more"] if len(self.paths) > 8 else [])
        return out


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_own_forward(module: Any) -> bool:
    from torch import nn

    return type(module).forward is not nn.Module.forward  # ModuleList / ModuleDict have none


def _signature(module: Any) -> tuple:
    """What makes two instances share one compiled code: their structure and tensor shapes."""
    children = tuple((name, type(child).__qualname__) for name, child in module.named_children())
    tensors = tuple((name, tuple(t.shape), str(t.dtype), str(t.device))
                    for name, t in (*module.named_parameters(), *module.named_buffers()))
    return children, tensors


def _innermost(paths: list[str]) -> list[str]:
    """Leave out every path that has another path of the list below it."""
    return [p for p in paths if not any(q != p and q.startswith(p + ".") for q in paths)]


def block_classes(model: Any, *, blocks_only: bool = True) -> list[BlockClass]:
    """Every module class below the root with a forward of its own, most instances first (then more
    parameters per instance, then by name). `blocks_only` leaves out leaf classes (no children)."""
    by_class: dict[type, list[tuple[str, Any]]] = {}
    for path, module in model.named_modules():
        if not path or not _has_own_forward(module):
            continue
        if blocks_only and next(module.children(), None) is None:
            continue
        by_class.setdefault(type(module), []).append((path, module))
    found: list[BlockClass] = []
    for cls, members in by_class.items():
        modules = dict(members)
        paths = _innermost(list(modules))
        found.append(BlockClass(
            name=cls.__name__, qualname=_qualname(cls), instances=len(paths),
            variants=len({_signature(modules[p]) for p in paths}),
            params_per_instance=max(sum(p.numel() for p in modules[path].parameters()) for path in paths),
            paths=tuple(paths),
        ))
    found.sort(key=lambda b: (-b.instances, -b.params_per_instance, b.qualname))
    return found


def _names_class(regional: str, block: BlockClass) -> bool:
    """Whether `regional` names the block's class: its name, its qualified name, or a dotted name the class is
    exported under (`torch.nn.Linear` for torch.nn.modules.linear.Linear), looked up in the modules imported."""
    if regional in (block.name, block.qualname):
        return True
    module_name, _, name = regional.rpartition(".")
    if name != block.name or not module_name:
        return False
    module = sys.modules.get(module_name)
    found = getattr(module, name, None) if module is not None else None
    return isinstance(found, type) and _qualname(found) == block.qualname


def _listing(classes: list[BlockClass], limit: int = 5) -> str:
    shown = [f"{b.name} ({b.instances})" for b in classes[:limit]]
    return ", ".join(shown) if shown else "none"


def choose_block(model: Any, regional: str = REGIONAL_AUTO) -> BlockClass:
    """The block class `regional` ('auto' or a class name) selects in `model`; RegionalError says why
    there is none and what there is."""
    if regional == REGIONAL_AUTO:
        repeated = [b for b in block_classes(model) if b.instances >= 2]
        if not repeated:
            raise RegionalError(
                f"regional compilation found no repeated block in {type(model).__name__}: no module class with "
                "children and a forward appears twice; compile the whole model (regional = false) or name a "
                "block class")
        return repeated[0]
    every = block_classes(model, blocks_only=False)
    named = [b for b in every if _names_class(regional, b)]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        raise RegionalError(
            f"regional compilation: {regional!r} names {len(named)} classes of {type(model).__name__} "
            f"({', '.join(b.qualname for b in named)}); name one of them by its qualified name")
    repeated = [b for b in block_classes(model) if b.instances >= 2]
    model_class = type(model)
    if regional in (model_class.__name__, _qualname(model_class)):
        raise RegionalError(
            f"regional compilation: {regional!r} is the class of the whole model, not of a block inside it; "
            f"compile the whole model (regional = false) or name a block class: {_listing(repeated)}")
    short = regional.rpartition(".")[2]
    alike = [b for b in every if b.name == short]
    hint = f" (did you mean {' or '.join(repr(b.qualname) for b in alike)}?)" if alike else ""
    raise RegionalError(
        f"regional compilation: {type(model).__name__} has no submodule of class {regional!r}{hint}; its "
        f"repeated block classes are {_listing(repeated)}")


def compile_blocks(model: Any, regional: str, compile_kwargs: dict[str, Any]) -> BlockClass:
    """Compile, in place, every (innermost) instance of the block class `regional` selects, each with
    `torch.compile(**compile_kwargs)` semantics (`Module.compile`). Returns the class and its instances."""
    block = choose_block(model, regional)
    modules = dict(model.named_modules())
    for path in block.paths:
        modules[path].compile(**compile_kwargs)
    return block


def describe_regional(block: BlockClass) -> dict[str, Any]:
    """What a run records about its regional compilation (`extra.regional`)."""
    out = block.to_dict()
    limit = recompile_limit()
    out["recompile_limit"] = limit
    if limit is not None and block.variants > limit:
        out["warning"] = (f"{block.variants} distinct {block.name} variants exceed Dynamo's recompile limit of "
                          f"{limit}: the instances past it run eagerly; name another block class")
    return out
