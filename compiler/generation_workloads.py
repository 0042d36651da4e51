"""Generation workloads: a causal language model, a batch of prompts, and how many tokens each generates.

A workload is a forward pass (one call of one batch: every spec of `compiler.workloads`) or a generation
(`task = "generate"`): B prompts of `prompt_len` tokens each, then `new_tokens` greedy decoding steps against
a KV cache, every sequence generating exactly `new_tokens` tokens. Specs of a generation:

  tiny-llama                           built in: a 2-layer LlamaConfig with a hidden size of 64 (a CPU
                                       generates with it in milliseconds; for examples and tests)
  transformers:<ConfigClass>           AutoModelForCausalLM.from_config(ConfigClass(**model_options))
  package.module:factory, path.py:f    your own: called with whichever of batch_size, prompt_len, new_tokens
                                       and device it accepts, it returns (model, input_ids), the model having
                                       transformers' generate()

Model options (`--model-option NAME=VALUE`) override attributes of a transformers config, for a generation or
a forward pass (`transformers:BertConfig --model-option num_hidden_layers=2`), so small models are built
without writing a file. Weights are random from the workload's seed; nothing is downloaded.

This module imports neither torch nor transformers at import time: naming a generation (its id, its checks
before a sweep) needs neither. The checks that need transformers' config classes import it (a library, never
the user's code); a factory is only ever imported in the benchmark worker.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .options import DEFAULT_CACHE, ConfigError, closest, parse_option_assignments

TASKS = ("forward", "generate")
GENERATE = "generate"
GENERATE_INSTALL = "pip install 'joulepilot[generate]'"

# The built-in generation spec: small enough that a CPU compiles it in seconds and generates in milliseconds.
TINY_LLAMA = "tiny-llama"
GENERATION_BUILTINS: dict[str, tuple[str, dict[str, Any]]] = {
    TINY_LLAMA: ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                                 "max_position_embeddings": 1024}),
}
CAUSAL_LM_EXAMPLES = "a causal LM config such as transformers:LlamaConfig, transformers:Qwen2Config or " \
                     "transformers:GPT2Config, the built-in tiny-llama, or a factory returning (model, input_ids)"


@dataclass(frozen=True)
class Generation:
    """What a generation workload generates: `prompt_len` prompt tokens per sequence, then exactly `new_tokens`
    new ones (greedy, no stop at an end-of-sequence token). The batch size is the workload's own."""

    prompt_len: int
    new_tokens: int

    def __post_init__(self) -> None:
        for name, value in (("prompt_len", self.prompt_len), ("new_tokens", self.new_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a whole number of 1 or more (every sequence has a prompt and "
                                  f"generates at least one token), got {value!r}")

    def key(self) -> dict[str, Any]:
        """What a generation adds to its workload's id (`compiler.workloads.workload_id`)."""
        return {"task": GENERATE, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens}

    def to_dict(self) -> dict[str, int]:
        return {"prompt_len": self.prompt_len, "new_tokens": self.new_tokens}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | None) -> Generation | None:
        if not value:
            return None
        return cls(int(value["prompt_len"]), int(value["new_tokens"]))

    @property
    def max_len(self) -> int:
        """Positions one sequence occupies at the end: its prompt and every new token."""
        return self.prompt_len + self.new_tokens

    @property
    def cache_len(self) -> int:
        """Positions its KV cache holds: the prompt and every new token but the last, which no step reads back
        (transformers sizes a static cache so: `max_length - 1`)."""
        return self.max_len - 1


DEFAULT_PROMPT_LEN = 128
DEFAULT_NEW_TOKENS = 128


def generation_of(task: str, prompt_len: int | None = None, new_tokens: int | None = None,
                  caches: Sequence[str] = (), compile_prefill: bool = False) -> Generation | None:
    """The generation a command asks for (`--task generate`, prompt and new tokens defaulting to 128 each), or
    None for a forward pass; ConfigError when generation options come without `--task generate`."""
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r} (valid: {', '.join(TASKS)})")
    if task == GENERATE:
        return Generation(prompt_len or DEFAULT_PROMPT_LEN, new_tokens or DEFAULT_NEW_TOKENS)
    given = [name for name, value in (("--prompt-len", prompt_len), ("--new-tokens", new_tokens),
                                      ("--cache", caches), ("--compile-prefill", compile_prefill)) if value]
    if given:
        raise ConfigError(f"{', '.join(given)} shape a generation: add --task generate")
    return None


def parse_model_options(items: Iterable[str] | None) -> dict[str, Any]:
    """['num_hidden_layers=2', 'hidden_size=128'] -> {'num_hidden_layers': 2, 'hidden_size': 128}; values are
    read as booleans, whole numbers, numbers or else text. ConfigError for an item without '='."""
    return parse_option_assignments(items, what="--model-option", example="num_hidden_layers=2")


def model_options_key(model_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The options as stored and as they enter a workload's id: sorted by name; None when there are none."""
    return dict(sorted(model_options.items())) if model_options else None


def workload_columns(generation: Generation | None, model_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The workloads-table columns a generation and model options fill (none for a plain forward pass)."""
    columns: dict[str, Any] = {}
    options = model_options_key(model_options)
    if options:
        columns["model_options"] = json.dumps(options, sort_keys=True)
    if generation is not None:
        columns.update(task=GENERATE, prompt_len=generation.prompt_len, new_tokens=generation.new_tokens)
    return columns


def job_fields(generation: Generation | None, model_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a worker job (and the zygote that preloads its workload) carries of them."""
    fields: dict[str, Any] = {}
    if model_options:
        fields["model_options"] = model_options_key(model_options)
    if generation is not None:
        fields["generation"] = generation.to_dict()
    return fields


def from_job(job: Mapping[str, Any]) -> tuple[Generation | None, dict[str, Any] | None]:
    """(generation, model options) of a worker job or zygote setup written with `job_fields`."""
    return Generation.from_dict(job.get("generation")), dict(job["model_options"]) if job.get("model_options") else None


# --- checks before anything runs ------------------------------------------------------------------------
def not_a_causal_lm(spec: str, why: str = "") -> Exception:
    """The one-line error for a spec that cannot generate (`why`: how that was told)."""
    from .workloads import WorkloadError, quote_spec

    return WorkloadError(f"workload {quote_spec(spec)} is not a causal language model{why}",
                         f"--task generate needs {CAUSAL_LM_EXAMPLES}")


def generation_only(spec: str) -> Exception:
    """The one-line error for a generation spec asked for a forward pass."""
    from .workloads import WorkloadError, quote_spec

    return WorkloadError(f"workload {quote_spec(spec)} is a generation workload", "add --task generate")


def model_options_refused(spec: str) -> Exception:
    """The one-line error for model options given to a spec built from no transformers config."""
    from .workloads import WorkloadError, quote_spec

    return WorkloadError(f"--model-option applies to transformers:<ConfigClass> specs, not to {quote_spec(spec)}",
                         "drop --model-option, or build the model in your factory")


def _transformers() -> Any:
    """The transformers package; LibraryMissing naming the extra to install when it is not importable."""
    from .workloads import LibraryMissing

    if importlib.util.find_spec("transformers") is None:
        raise LibraryMissing("generation and model options need the 'transformers' package, which is not "
                             "installed in this Python", GENERATE_INSTALL)
    return importlib.import_module("transformers")


def config_source(spec: str) -> tuple[str, dict[str, Any]] | None:
    """(transformers config class name, its built-in overrides) for a spec built from a transformers config
    (`transformers:<ConfigClass>` or a built-in generation spec); None for any other spec."""
    from .workloads import split_spec

    if spec in GENERATION_BUILTINS:
        return GENERATION_BUILTINS[spec]
    kind, name = split_spec(spec)
    return (name, {}) if kind == "transformers" else None


def transformers_config(spec: str, model_options: Mapping[str, Any] | None) -> Any:
    """The transformers config the spec builds, with the built-in overrides and then `model_options` applied.
    WorkloadError naming an option the config class does not have (and the closest it has), or a value it
    refuses."""
    from .workloads import WorkloadError, quote_spec

    source = config_source(spec)
    assert source is not None, spec
    class_name, builtin = source
    transformers = _transformers()
    config_class = getattr(transformers, class_name, None)
    if config_class is None or not isinstance(config_class, type):
        raise WorkloadError(f"workload {quote_spec(spec)}: transformers has no class {class_name!r}",
                            "use a config class such as LlamaConfig, Qwen2Config, GPT2Config, BertConfig")
    defaults = config_class()
    for name in model_options or {}:
        if not hasattr(defaults, name):
            known = list(defaults.to_dict()) + list(getattr(defaults, "attribute_map", {}) or {})
            guess = closest(name, known)
            raise WorkloadError(f"--model-option {name}: {class_name} has no attribute {name!r}",
                                f"did you mean {guess!r}?" if guess else f"see {class_name}().to_dict() for its names")
    try:
        return config_class(**{**builtin, **(model_options or {})})
    except Exception as exc:
        detail = " ".join(str(exc).split())
        raise WorkloadError(f"--model-option: {class_name} refused the options "
                            f"{json.dumps(dict(model_options or {}), sort_keys=True)}: {detail}") from exc


def max_positions(config: Any) -> int | None:
    """The most positions a transformers config's model can attend over, when the config says."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_causal_lm(spec: str, config: Any) -> None:
    """WorkloadError when transformers has no causal language model for the spec's config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise not_a_causal_lm(spec, f" (AutoModelForCausalLM has no model for {type(config).__name__})")


def check_positions(spec: str, config: Any, generation: Generation) -> None:
    """WorkloadError when prompt and new tokens together need more positions than the model has."""
    from .workloads import WorkloadError, quote_spec

    limit = max_positions(config)
    if limit is not None and generation.max_len > limit:
        raise WorkloadError(
            f"workload {quote_spec(spec)}: prompt_len {generation.prompt_len} + new_tokens {generation.new_tokens} = "
            f"{generation.max_len} positions, more than the model's {limit}",
            f"shorten --prompt-len or --new-tokens, or give the model more with --model-option "
            f"max_position_embeddings={generation.max_len}")


def check_workload_request(spec: str, *, generation: Generation | None, model_options: Mapping[str, Any] | None,
                           configs: Sequence[Any] = (), seq_len: int | None = None, image_size: int | None = None,
                           shapes: Any = None) -> None:
    """Everything about a generation or model options that can be refused before a worker starts, each as one
    line naming the fix (ConfigError or WorkloadError): a spec that is not a causal LM, an option its config
    does not have, a prompt longer than its positions, forward-pass arguments given to a generation, and
    generation knobs (a cache, a compiled prefill) given to a forward pass. A factory is not imported: the
    worker checks what it returns."""
    from .workloads import split_spec

    source = config_source(spec)
    if generation is None:
        knobs = [c.label for c in configs if c.cache != DEFAULT_CACHE or c.compile_prefill]
        if knobs:
            raise ConfigError(f"configuration {knobs[0]} sets a KV cache or a compiled prefill, which only "
                              "a generation has: add --task generate (with --prompt-len and --new-tokens)")
        if spec in GENERATION_BUILTINS:
            raise generation_only(spec)
        if model_options:
            if source is None:
                raise model_options_refused(spec)
            transformers_config(spec, model_options)
        return
    if seq_len is not None or image_size is not None:
        given = "--seq-len" if seq_len is not None else "--image-size"
        raise ConfigError(f"{given} shapes a forward pass; a generation's input is --prompt-len tokens per sequence")
    if shapes is not None:
        raise ConfigError("--shapes measures a forward pass over input sizes; a generation measures one "
                          "--prompt-len and --new-tokens: drop --shapes")
    regional = [c.label for c in configs if c.regional]
    if regional:
        raise ConfigError(f"configuration {regional[0]} compiles regionally, which is not measured for a "
                          "generation yet: drop --regional")
    kind, _ = split_spec(spec)
    if source is None and kind != "factory":
        raise not_a_causal_lm(spec)
    if source is None:
        if model_options:
            raise model_options_refused(spec)
        return
    config = transformers_config(spec, model_options)
    check_causal_lm(spec, config)
    check_positions(spec, config, generation)


# --- planning -------------------------------------------------------------------------------------------
def plan_generation_configs(modes: Iterable[str], fusions: Iterable[str] = ("default",),
                            precisions: Iterable[str] = ("fp32",), *, batch_size: int = 1, dynamic: bool = False,
                            options: dict[str, Any] | None = None, caches: Iterable[str] = (),
                            compile_prefill: Iterable[bool] = (False,)) -> list[Any]:
    """The configurations of a generation sweep: modes x fusion presets x precisions as `plan_configs` plans
    them, each with its KV cache and prefill setting. Without `caches`, eager runs with the dynamic cache
    (the baseline, as transformers generates by default) and every compiled mode with the static cache (the
    standard recipe: fixed shapes, so a decode step compiles once and replays as a CUDA graph); given, each
    configuration is measured with each cache. `compile_prefill` applies to compiled modes only."""
    from .bench import plan_configs

    planned: list[Any] = []
    for base in plan_configs(modes, fusions, precisions, batch_size=batch_size, dynamic=dynamic, options=options):
        for config in generation_variants(base, caches, compile_prefill):
            if config not in planned:
                planned.append(config)
    return planned


def generation_variants(base: Any, caches: Iterable[str] | None = (),
                        compile_prefill: Iterable[bool] = (False,)) -> list[Any]:
    """The generation configurations of one configuration (a CompileConfig): with each of `caches`, or, when
    none are given, eager with the dynamic cache and a compiled mode with the static one; each compiled one
    with each `compile_prefill` setting. The one rule of `bench --task generate` and of a generation policy's
    grid (`policies.resolve.candidate_configs`)."""
    from .options import CACHES, check_choice

    chosen = [check_choice("cache", c, CACHES) for c in caches or ()]
    prefills = list(dict.fromkeys(bool(p) for p in compile_prefill)) or [False]
    out: list[Any] = []
    for cache in chosen or ([DEFAULT_CACHE] if not base.compiles else ["static"]):
        for prefill in prefills if base.compiles else [False]:
            config = base.replace(cache=cache, compile_prefill=prefill)
            if config not in out:
                out.append(config)
    return out


# --- building (in the worker) -----------------------------------------------------------------------------
def build_generation(spec: str, batch_size: int, generation: Generation, model_options: Mapping[str, Any] | None,
                     device: str, generator: Any) -> tuple[Any, tuple, dict[str, Any]]:
    """(causal LM in fp32, (input_ids,), notes) for a generation workload; random weights (the caller seeded
    torch) and random prompt tokens from `generator`. WorkloadError for what cannot be a generation."""
    import torch

    from .workloads import WorkloadError, call_factory, quote_spec, resolve_factory, split_spec

    source = config_source(spec)
    if source is not None:
        config = transformers_config(spec, model_options)
        check_causal_lm(spec, config)
        check_positions(spec, config, generation)
        transformers = _transformers()
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except Exception as exc:
            raise WorkloadError(f"workload {quote_spec(spec)}: AutoModelForCausalLM.from_config({source[0]}) raised "
                                f"{type(exc).__name__}: {exc}") from exc
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab < 1:
            raise WorkloadError(f"workload {quote_spec(spec)}: {source[0]} has no vocab_size to draw prompt tokens from")
        input_ids = torch.randint(0, vocab, (batch_size, generation.prompt_len), generator=generator)
        notes = {"config_class": source[0], "vocab_size": vocab, "max_positions": max_positions(config)}
        return model, (input_ids,), notes
    kind, name = split_spec(spec)
    if kind != "factory":
        raise not_a_causal_lm(spec)
    produced, _ = call_factory(resolve_factory(name), spec,
                               offered={"batch_size": batch_size, "prompt_len": generation.prompt_len,
                                        "new_tokens": generation.new_tokens, "device": device})
    if not (isinstance(produced, tuple) and len(produced) == 2):
        raise WorkloadError(f"workload {quote_spec(spec)}: the factory returned a {type(produced).__name__}; a "
                            "generation factory returns (model, input_ids)")
    model, input_ids = produced
    if not callable(getattr(model, "generate", None)):
        raise WorkloadError(f"workload {quote_spec(spec)}: the factory's model ({type(model).__name__}) has no "
                            "generate()", f"--task generate needs {CAUSAL_LM_EXAMPLES}")
    expected = (batch_size, generation.prompt_len)
    if not isinstance(input_ids, torch.Tensor) or tuple(input_ids.shape) != expected or input_ids.is_floating_point():
        found = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise WorkloadError(f"workload {quote_spec(spec)}: the factory's input_ids are {found}; return token ids "
                            f"shaped (batch_size, prompt_len) = {expected}")
    return model, (input_ids,), {}


def describe_generation(workload: Any) -> dict[str, Any]:
    """A workloads row for a generation: parameters, FLOPs of one whole generate call of the batch (prefill
    and every decode step, as torch.utils.flop_counter counts them), its inputs and its generation columns."""
    from .describe import count_params
    from .generation import fixed_length_generate

    input_ids = workload.example_inputs[0]
    row: dict[str, Any] = {
        "id": workload.id, "spec": workload.spec, "batch_size": workload.batch_size,
        "params": count_params(workload.model), "flops_per_inference": None, "graph_nodes": None, "op_mix": None,
        "inputs": [{"dtype": str(input_ids.dtype).replace("torch.", ""), "shape": list(input_ids.shape)}],
        **workload_columns(workload.generation, workload.model_options),
    }
    details: dict[str, Any] = {}
    try:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:
            fixed_length_generate(workload.model, input_ids, workload.generation.new_tokens)
        row["flops_per_inference"] = float(counter.get_total_flops())
    except Exception as exc:  # a description never stops a benchmark
        details["flops_error"] = f"{type(exc).__name__}: {exc}"
    row["details"] = details
    return row

