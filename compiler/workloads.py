"""Workloads: a model plus example inputs, named by a spec string.

Specs:
  mlp | convnet | transformer          built in, plain torch (compiler/builtin_models.py)
  torchvision:<name>                   torchvision.models.get_model(name, weights=None)
  timm:<name>                          timm.create_model(name, pretrained=False)
  transformers:<ConfigClass>           AutoModel.from_config(ConfigClass()), random weights, returns
                                       last_hidden_state; token ids of seq_len, or pixel_values for
                                       vision configs
  package.module:factory               your own model; also path/to/file.py:factory

A generation (`task = "generate"`: a prompt, then new tokens against a KV cache) is built by
`compiler.generation_workloads` (also `tiny-llama`, its built-in spec); `model_options` override attributes
of a transformers config, for either task.

A factory is called with batch_size and device where it accepts them, and with the sizes the user gave
(seq_len, image_size; one left out is not passed, so the factory's default holds); a size given that it does
not accept is refused. It returns either (model, example_inputs) or a model that has an
`example_inputs(batch_size)` method. Nothing is
ever downloaded: all weights are random, built from a fixed seed.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from joulepilot.store import stable_id
from joulepilot.store.safeio import shorten

from .generation_workloads import (
    GENERATION_BUILTINS,
    Generation,
    generation_only,
    model_options_key,
    model_options_refused,
)
from .shape_set import ShapeSet

ADAPTERS = ("torchvision", "timm", "transformers")
# The keys of builtin_models.BUILTIN, named here so that checking a spec does not import torch.
BUILTIN_NAMES = ("mlp", "convnet", "transformer")
DEFAULT_SEED = 1234


class WorkloadError(ValueError):
    """A workload spec that cannot be resolved or built; the message names the spec and the cause,
    `hint` the fix or the closest valid name (also appended to the message)."""

    def __init__(self, message: str, hint: str = "") -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message}; {hint}" if hint else message)


class LibraryMissing(WorkloadError):
    """An adapter spec whose library is not installed in this Python (it may be on the host that runs it)."""


def quote_spec(spec: str) -> str:
    """The spec as quoted in messages: a spec can be any string a policy file holds, so it is shortened."""
    return repr(shorten(spec, 120))


def workload_id(spec: str, batch_size: int, seq_len: int | None = None, image_size: int | None = None,
                shapes: ShapeSet | None = None, *, model_options: Mapping[str, Any] | None = None,
                generation: Generation | None = None) -> str:
    """Stable id of a workload; a shape set (measured as a weighted mix of its sizes), model options and a
    generation (its prompt and new tokens) each make another one. Each enters only when given, so the id of
    every forward-pass workload named before them is unchanged."""
    parts: list[Any] = ["workload", spec, int(batch_size), seq_len, image_size]
    if shapes is not None:
        parts.append({"shapes": shapes.key()})
    options = model_options_key(model_options)
    if options:
        parts.append({"model_options": options})
    if generation is not None:
        parts.append(generation.key())
    return stable_id(*parts)


@dataclass
class Workload:
    spec: str
    batch_size: int
    device: str
    model: Any
    example_inputs: tuple
    seq_len: int | None = None
    image_size: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] | None = None
    generation: Generation | None = None  # set for a generation: example_inputs is then (input_ids,)

    @property
    def id(self) -> str:
        return workload_id(self.spec, self.batch_size, self.seq_len, self.image_size,
                           model_options=self.model_options, generation=self.generation)

    def describe(self, graph: bool = True, with_details: bool = False) -> dict[str, Any]:
        """A row for the workloads table: id, spec, batch_size, params, flops_per_inference (one forward
        call of one batch; for a generation, one generate call), graph_nodes, op_mix, inputs."""
        if self.generation is not None:
            from .generation_workloads import describe_generation

            row = describe_generation(self)
            details = row.pop("details")
            return {**row, "details": details} if with_details else row
        from .describe import describe_workload

        row = describe_workload(self, graph=graph, with_details=with_details)
        if self.model_options:
            from .generation_workloads import workload_columns

            row.update(workload_columns(None, self.model_options))
        return row


def split_spec(spec: str) -> tuple[str, str]:
    """('builtin', 'mlp') | ('torchvision', 'resnet50') | ... | ('factory', 'pkg.mod:fn')."""
    spec = spec.strip()
    if not spec:
        raise WorkloadError("empty workload spec; use mlp, convnet, transformer, torchvision:<name>, "
                            "timm:<name>, transformers:<ConfigClass> or package.module:factory")
    if spec in BUILTIN_NAMES or spec in GENERATION_BUILTINS:
        return "builtin", spec
    prefix, sep, rest = spec.partition(":")
    if not sep:
        guess = difflib.get_close_matches(spec, list(BUILTIN_NAMES), n=1, cutoff=0.5)
        raise WorkloadError(
            f"workload {quote_spec(spec)} is not a built-in ({', '.join(BUILTIN_NAMES)}) and has no ':'",
            f"did you mean {guess[0]!r}?" if guess else
            "write torchvision:<name>, timm:<name>, transformers:<ConfigClass> or package.module:factory",
        )
    if not rest:
        raise WorkloadError(f"workload {quote_spec(spec)} names nothing after ':'")
    if prefix in ADAPTERS:
        return prefix, rest
    module = spec.rpartition(":")[0]
    standard = standard_library_module(module)
    if standard is not None:
        raise WorkloadError(f"workload {quote_spec(spec)} names {shorten(standard, 200)}, part of Python's standard "
                            "library, which builds no model",
                            "name the function of your own code that builds it: package.module:factory, or "
                            "path/to/file.py:factory for a file whose name a standard module also has")
    return "factory", spec


def anchored_spec(spec: str, folder: str | Path) -> str:
    """`spec` with a relative `path/to/file.py` of a factory spec made absolute against `folder` (a policy's
    workload is relative to the policy file's folder, wherever the command or the daemon runs); any other spec,
    or one that does not parse (checked where it is used), unchanged."""
    try:
        kind, _ = split_spec(spec)
    except WorkloadError:
        return spec
    module, _, factory = spec.strip().rpartition(":")
    if kind != "factory" or not module.endswith(".py") or Path(module).expanduser().is_absolute():
        return spec
    return f"{os.path.normpath(Path(folder) / module)}:{factory}"


def standard_library_module(module: str) -> str | None:
    """What of Python's standard library a factory spec's module part names (None: nothing). A module name is
    standard when its top-level package is one of `sys.stdlib_module_names` (os, subprocess, builtins, ...); a
    file when it lies in the standard library's folder, outside any site-packages folder in it."""
    if not module.endswith(".py"):
        top = module.split(".")[0]
        standard = top in sys.stdlib_module_names or top in sys.builtin_module_names
        return f"module {top!r}" if standard else None
    try:
        real = Path(module).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a loop of links, a NUL: the check of the file itself says so
        return None
    for root in _standard_library_folders():
        if real.is_relative_to(root) and not {"site-packages", "dist-packages"} & set(real.relative_to(root).parts):
            return f"file {str(real)!r}"
    return None


@functools.cache
def _standard_library_folders() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys(Path(paths[key]).resolve() for key in ("stdlib", "platstdlib") if paths.get(key)))


def _import_library(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise WorkloadError(f"workload {quote_spec(spec)} needs the {name!r} package, which is not importable here "
                            f"({exc}); pip install {name}") from exc


def _import_module(module_name: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise WorkloadError(f"workload {quote_spec(spec)}: file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
        try:
            mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise WorkloadError(f"workload {quote_spec(spec)}: importing {path} raised {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: module {module_name!r} is not importable ({exc}); "
                            f"check the name and that its folder is on PYTHONPATH") from exc
    except Exception as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: importing {module_name!r} raised {type(exc).__name__}: {exc}") \
            from exc


def resolve_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.rpartition(":")
    module = _import_module(module_name, spec)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
            raise WorkloadError(f"workload {quote_spec(spec)}: module {module_name!r} has no attribute {attr!r} "
                                f"(callables there: {', '.join(public[:12]) or 'none'})")
        target = getattr(target, part)
    if not callable(target):
        raise WorkloadError(f"workload {quote_spec(spec)}: {attr!r} in {module_name!r} is not callable")
    return target


def check_spec(spec: str) -> None:
    """Fail fast (WorkloadError) on a spec that cannot be built, without building the model and without
    executing any code the spec names (see `spec_check`): safe in the CLI's and the daemon's process."""
    from .spec_check import check_spec_statically

    check_spec_statically(spec)


def _check_adapter_name(kind: str, name: str, spec: str, library: Any) -> None:
    """Whether the imported adapter library knows `name` (in the worker, which may import libraries)."""
    if kind == "torchvision":
        available = library.models.list_models()
        if name not in available:
            from .options import closest

            guess = closest(name, available)
            raise WorkloadError(f"workload {quote_spec(spec)}: torchvision has no model {name!r}",
                                f"did you mean {guess!r}?" if guess else "see torchvision.models.list_models()")
    elif kind == "timm":
        if not library.is_model(name):
            raise WorkloadError(f"workload {quote_spec(spec)}: timm has no model {name!r}", "see timm.list_models()")
    elif kind == "transformers":
        if not hasattr(library, name):
            raise WorkloadError(f"workload {quote_spec(spec)}: transformers has no class {name!r}",
                                "use a config class such as BertConfig, GPT2Config, ViTConfig")


# --- builders --------------------------------------------------------------------------------------
# What a size is called where a user sets it, for the message that names one a factory does not take.
_SIZE_OPTIONS = {"batch_size": "--batch-size", "seq_len": "--seq-len", "image_size": "--image-size"}


def call_factory(factory: Callable[..., Any], spec: str, *, offered: Mapping[str, Any],
                 given: Mapping[str, int | None] | None = None) -> tuple[Any, dict[str, Any]]:
    """What a user's factory returns, and the arguments it was called with: each of `offered` (batch size,
    device, a generation's prompt and new tokens) where it takes it, and the sizes the user gave (`given`; a size
    left out (None) is not passed, so the factory's own default holds, never None). A size the user gave that
    the factory does not take is refused: the run would be labelled with a size its inputs do not have.
    WorkloadError when it raises."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {k: v for k, v in (given or {}).items() if v is not None}
    name = getattr(factory, "__name__", "the factory")
    for key, value in given.items():
        if not takes_any and key not in params:
            raise WorkloadError(
                f"workload {quote_spec(spec)}: {key} {value} was given ({_SIZE_OPTIONS[key]}, or {key} in a policy), "
                f"but {name}() takes no {key} parameter",
                f"drop it, or give {name}() a {key} parameter that sizes the example inputs")
    kwargs = {k: v for k, v in {**offered, **given}.items() if takes_any or k in params}
    try:
        return factory(**kwargs), kwargs
    except Exception as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: the factory raised {type(exc).__name__}: {exc}") from exc


def _call_factory(factory: Callable[..., Any], spec: str, *, batch_size: int, device: str,
                  **sizes: int | None) -> tuple[Any, tuple]:
    produced, kwargs = call_factory(factory, spec, offered={"batch_size": batch_size, "device": device},
                                    given=sizes)
    if isinstance(produced, tuple) and len(produced) == 2:
        model, inputs = produced
        if batch_size != 1 and "batch_size" not in kwargs:
            name = getattr(factory, "__name__", "the factory")
            raise WorkloadError(
                f"workload {quote_spec(spec)}: batch_size {batch_size} was given (--batch-size, or batch_size in a "
                f"policy), but {name}() takes no batch_size parameter and returns its own example inputs",
                f"give {name}() a batch_size parameter, or leave the batch size at 1")
    else:
        model = produced
        make_inputs = getattr(model, "example_inputs", None)
        if not callable(make_inputs):
            raise WorkloadError(f"workload {quote_spec(spec)}: the factory returned a {type(model).__name__}; return "
                                f"(model, example_inputs) or give the model an example_inputs(batch_size) method")
        inputs = make_inputs(batch_size)
    if not callable(model):
        raise WorkloadError(f"workload {quote_spec(spec)}: the factory's model ({type(model).__name__}) is not callable")
    return model, inputs


def _transformers_model(name: str, spec: str, batch_size: int, seq_len: int | None, image_size: int | None,
                        generator: Any, model_options: Mapping[str, Any] | None = None) -> tuple[Any, tuple, dict[str, Any]]:
    import torch

    from .hf_adapter import HiddenStates

    transformers = _import_library("transformers", spec)
    config_class = getattr(transformers, name, None)
    if config_class is None:
        raise WorkloadError(f"workload {quote_spec(spec)}: transformers has no class {name!r}")
    if model_options:
        from .generation_workloads import transformers_config

        config = transformers_config(spec, model_options)
    else:
        config = config_class()
    if hasattr(config, "use_cache"):
        config.use_cache = False  # outputs must be one tensor, without a KV cache
    try:
        hf_model = transformers.AutoModel.from_config(config)
    except Exception as exc:
        raise WorkloadError(f"workload {quote_spec(spec)}: AutoModel.from_config({name}()) raised "
                            f"{type(exc).__name__}: {exc}") from exc
    input_name = getattr(hf_model, "main_input_name", "input_ids")

    notes = {"input_name": input_name, "config_class": name}
    if input_name == "pixel_values":
        size = image_size or getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        inputs = (torch.randn(batch_size, channels, size, size, generator=generator),)
        notes["image_size"] = size
    else:
        length = seq_len or 128
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit and length > limit:
            raise WorkloadError(f"workload {quote_spec(spec)}: seq_len {length} exceeds the config's {limit} positions")
        vocab = getattr(config, "vocab_size", 1000)
        inputs = (torch.randint(0, vocab, (batch_size, length), generator=generator),)
        notes["seq_len"] = length
    return HiddenStates(hf_model, input_name), inputs, notes


def _reinit_zero_weights(model: Any, generator: Any) -> dict[str, Any]:
    """Give all-zero weight matrices small random values.

    Some libraries zero-initialise the last layer (torchvision's ViT head), so a randomly initialised
    model outputs exactly zero and the numerical check against eager compares nothing.
    """
    import torch

    names = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and not bool(param.ne(0).any()):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
                names.append(name)
    return {"reinitialised_zero_weights": names} if names else {}


def _build(kind: str, name: str, spec: str, batch_size: int, device: str, seq_len: int | None,
           image_size: int | None, generator: Any, model_options: Mapping[str, Any] | None = None,
           generation: Generation | None = None) -> tuple[Any, tuple, dict[str, Any]]:
    import torch

    if generation is not None:
        from .generation_workloads import build_generation

        return build_generation(spec, batch_size, generation, model_options, device, generator)
    if model_options and kind != "transformers":
        raise model_options_refused(spec)
    if name in GENERATION_BUILTINS:
        raise generation_only(spec)
    if kind == "builtin":
        from .builtin_models import BUILTIN  # torch models: loaded when one is built, not to name one

        model, inputs = BUILTIN[name](batch_size, generator, seq_len=seq_len, image_size=image_size)
        return model, inputs, {}
    if kind == "torchvision":
        tv = _import_library("torchvision", spec)
        _check_adapter_name(kind, name, spec, tv)
        size = image_size or 224
        model = tv.models.get_model(name, weights=None)
        notes = {"image_size": size, **_reinit_zero_weights(model, generator)}
        return model, (torch.randn(batch_size, 3, size, size, generator=generator),), notes
    if kind == "timm":
        timm = _import_library("timm", spec)
        _check_adapter_name(kind, name, spec, timm)
        try:
            model = timm.create_model(name, pretrained=False)
        except Exception as exc:
            raise WorkloadError(f"workload {quote_spec(spec)}: timm.create_model raised {type(exc).__name__}: {exc}") from exc
        _, height, width = model.default_cfg.get("input_size", (3, 224, 224))
        size = image_size or height
        return model, (torch.randn(batch_size, 3, size, image_size or width, generator=generator),), \
            {"image_size": size, **_reinit_zero_weights(model, generator)}
    if kind == "transformers":
        return _transformers_model(name, spec, batch_size, seq_len, image_size, generator, model_options)
    factory = resolve_factory(name)
    model, inputs = _call_factory(factory, spec, batch_size=batch_size, seq_len=seq_len,
                                  image_size=image_size, device=device)
    return model, inputs, {}


def _to_device(value: Any, device: str) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


# Workloads built ahead of time in this process (the worker zygote builds its workload once, on the CPU,
# before forking a worker per configuration); `load_workload` hands each out once, moved to its device.
_PREBUILT: dict[tuple[Any, ...], Workload] = {}


def _prebuilt_key(spec: str, batch_size: int, seq_len: int | None, image_size: int | None, seed: int,
                  model_options: Mapping[str, Any] | None = None, generation: Generation | None = None) -> tuple:
    return (spec, int(batch_size), seq_len, image_size, int(seed), repr(model_options_key(model_options)), generation)


def can_prebuild(spec: str, device: str) -> bool:
    """Whether building `spec` on the CPU and moving it to `device` gives what building it for `device`
    gives: always on a CPU; elsewhere not for a factory, which may build on the device it is given."""
    return str(device) == "cpu" or split_spec(spec)[0] != "factory"


def prebuild_workload(spec: str, batch_size: int = 1, seq_len: int | None = None, image_size: int | None = None,
                      seed: int = DEFAULT_SEED, *, model_options: Mapping[str, Any] | None = None,
                      generation: Generation | None = None) -> Workload:
    """Build the workload on the CPU now and keep it for the next matching `load_workload` of this process
    (or of a process forked from it, which then owns its copy)."""
    workload = load_workload(spec, batch_size, "cpu", seq_len, image_size, seed, model_options=model_options,
                             generation=generation)
    _PREBUILT[_prebuilt_key(spec, batch_size, seq_len, image_size, seed, model_options, generation)] = workload
    return workload


def load_workload(spec: str, batch_size: int = 1, device: str = "cpu", seq_len: int | None = None,
                  image_size: int | None = None, seed: int = DEFAULT_SEED, *,
                  model_options: Mapping[str, Any] | None = None, generation: Generation | None = None) -> Workload:
    """Build the model (eval mode, random weights from `seed`) and its example inputs on `device`; a
    workload prebuilt for these arguments (`prebuild_workload`) is handed out instead, moved to `device`.
    `model_options` override a transformers config's attributes; `generation` builds a causal LM and a batch
    of prompts instead of a forward pass (`compiler.generation_workloads`)."""
    import torch

    options = dict(model_options) if model_options else None
    prebuilt = _PREBUILT.pop(_prebuilt_key(spec, batch_size, seq_len, image_size, seed, options, generation), None)
    if prebuilt is not None:
        model = prebuilt.model.to(device) if hasattr(prebuilt.model, "to") else prebuilt.model
        return Workload(spec=spec, batch_size=batch_size, device=device, model=model,
                        example_inputs=tuple(_to_device(prebuilt.example_inputs, device)),
                        seq_len=seq_len, image_size=image_size, notes=dict(prebuilt.notes), model_options=options,
                        generation=generation)
    if batch_size < 1:
        raise WorkloadError(f"workload {quote_spec(spec)}: batch_size must be at least 1, got {batch_size}")
    kind, name = split_spec(spec)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model, inputs, notes = _build(kind, name, spec, batch_size, device, seq_len, image_size, generator, options,
                                  generation)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, Mapping):  # tuple() of it would pass the keys as the model's inputs
        raise WorkloadError(
            f"workload {quote_spec(spec)}: the factory returned its example inputs as a dict "
            f"({', '.join(map(str, inputs))}); every call passes them positionally: return a tuple in the order "
            "forward() takes them, or wrap the model in a module whose forward() takes them positionally")
    if hasattr(model, "eval"):
        model.eval()
    if hasattr(model, "to"):
        model = model.to(device)
    return Workload(spec=spec, batch_size=batch_size, device=device, model=model,
                    example_inputs=tuple(_to_device(tuple(inputs), device)),
                    seq_len=seq_len, image_size=image_size, notes=notes, model_options=options, generation=generation)
