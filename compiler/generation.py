"""A causal LM generating under a compile configuration, and what its generation costs per token.

**Preparing** (`prepare_generation`, the one way joulepilot sets a model up to generate under a configuration,
in a benchmark worker and, later, in a serving process):
- precision: bf16 and fp16 are the model's own dtype (its weights are cast, so the KV cache is allocated in it
  too), not autocast. Decoding reads every weight once per token; autocast would keep fp32 weights, read twice
  the bytes and cast each weight at every step, which no deployed LLM does. tf32 switches TF32 on around each
  forward call (`precision.tf32_enabled`), fp32 leaves torch's defaults.
- cache: 'static' has transformers allocate the KV cache once for prompt + new tokens
  (`generation_config.cache_implementation = "static"`), so every decode step has the same shapes; 'dynamic'
  (the default) grows it with every token, as transformers does by default.
- compile: joulepilot compiles the model's forward itself, with exactly the keyword arguments the configuration
  gives (`inductor.torch_compile_kwargs`: mode, fusion preset and raw Inductor options, CUDA graphs left out on
  a CPU), and turns transformers' own compile off (`generation_config.disable_compile = True`). transformers'
  automatic compile takes effect only when its own criteria hold (a CUDA device, a compilable cache, no
  offloading), skips itself with a warning otherwise, and always runs the prefill uncompiled; compiling here
  means the configuration measured is the one applied, on any device, and the prefill is a knob of its own.
  The forward is replaced by a dispatcher that runs the compiled forward for decode steps (one new token per
  sequence) and, when `compile_prefill` is set, for the prompt's forward pass too; otherwise the prompt runs
  eagerly. That default is what transformers does, and why: a prompt's length changes from request to request,
  so a compiled prefill recompiles (and records another CUDA graph) for each new length, while a decode step's
  shapes never change; whether compiling the prefill pays for a fixed length is measured, never assumed
  (`--compile-prefill`). `reduce-overhead` with the static cache and an eager prefill is transformers' own
  recipe (its automatic compile's default mode; it passes `dynamic=None`, joulepilot `dynamic=False` unless the
  configuration is dynamic, the same graph for a decode step, whose shapes never change). A prompt of one token is shaped like a decode step and runs
  the compiled forward.
The model is prepared in place: afterwards `model.generate(...)` generates under the configuration.

**Measuring** (`run_generation`, the worker's job for a generation; the meters, idle baseline, phases and
budgets of a forward run, `compiler/worker.py`): the eager fp32 reference generation with the dynamic cache
(its greedy tokens and the logits of its first steps); for a compiled configuration in another precision or with
the static cache, eager's generation in that precision with that cache (the same-precision reference); the
configuration applied; the first generate call, metered as the compile (compile seconds and energy), whose
greedy tokens and logits are checked: `max_rel_error` is the largest relative error of the logits against eager
fp32's over the first steps whose inputs still equal that reference's (the first step's always), and
`tokens_match` says whether every sequence's tokens equal the same-precision reference's for all new tokens,
which isolates what compiling changed (an eager configuration is its own reference). Against eager fp32 a bf16
model's greedy tokens part within a few steps on random weights, whatever compiles it, so that comparison
(`fp32_tokens_match_steps`) says nothing about compiling; warm-up with whole generate calls past compilation and CUDA-graph recording; a latency pass
whose streamer times each token with a device synchronisation (time to first token from the call's start,
time per output token between tokens, and each whole call); then two metered windows of back-to-back calls,
each at least `min_seconds` long: whole generations of the batch, and prefills alone. A prefill call is
`generate` with one new token: preparing the inputs and the KV cache, the forward pass over the prompt and
the choice of the first token, which is what a request costs before its second token. Decoding is the rest:
a whole generation's joules less a prefill's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import CompileConfig
from .options import ConfigError

# The logits of this many first steps are kept for the numerical check (each is batch x vocabulary floats).
LOGITS_CHECK_STEPS = 8
MIN_TOKEN_PASS_CALLS = 3


class GenerationError(ValueError):
    """A model that cannot generate under joulepilot: no transformers `generate`, or a generation that does not
    produce what was asked."""


@dataclass
class PreparedGeneration:
    """A causal LM prepared in place by `prepare_generation`; `model.generate` now runs under `config`."""

    model: Any
    config: CompileConfig
    device: str
    compiled: Callable[..., Any] | None  # the compiled forward; None for eager
    original_forward: Callable[..., Any]

    def generation_config(self, new_tokens: int) -> Any:
        """A copy of the model's generation config for exactly `new_tokens` greedy tokens per sequence."""
        return fixed_length_config(self.model.generation_config, new_tokens)

    def run_eagerly(self) -> None:
        """From now on every forward pass runs the model's own forward, uncompiled, with the dynamic cache (the
        eager baseline), in the precision the model has now: a cast to a lower precision is not undone, since
        the weights it rounded are gone. What a deployment's envelope guard swaps a generation to."""
        self.model.forward = self.original_forward
        self.model.generation_config.cache_implementation = None
        self.compiled = None


def has_generate(model: Any) -> bool:
    """Whether `model` generates as a transformers causal LM does (`generate` and a `generation_config`)."""
    return callable(getattr(model, "generate", None)) and getattr(model, "generation_config", None) is not None


_has_generate = has_generate


def generated_tokens(model: Any, output: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    """The tokens a `model.generate(*args, **kwargs)` call that returned `output` generated, over the whole batch:
    for each returned sequence, its positions after the prompt up to and including its first end-of-sequence
    token (the padding after a sequence that stopped early was computed, but is no token of it); every new
    position when no end-of-sequence token is set. 0 when the output is not a batch of sequences."""
    import torch

    sequences = getattr(output, "sequences", output)
    prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2:
        return 0
    prompt_len = prompt.shape[-1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 else 0
    new = sequences[:, prompt_len:]
    if new.shape[1] == 0:
        return 0
    settings = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    eos = kwargs.get("eos_token_id", getattr(settings, "eos_token_id", None))
    eos = [eos] if isinstance(eos, int) else list(eos or ())
    if not eos:
        return int(new.numel())
    stops = torch.isin(new, torch.tensor(eos, device=new.device))
    stopped = stops.any(dim=1)
    first = stops.int().argmax(dim=1) + 1  # positions up to and including the first end-of-sequence token
    lengths = torch.where(stopped, first, torch.full_like(first, new.shape[1]))
    return int(lengths.sum())


def _is_prefill(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a forward call carries more than one token per sequence (a prompt), not one (a decode step)."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    shape = getattr(tokens, "shape", None)
    return shape is not None and len(shape) >= 2 and shape[1] > 1


def _dispatching_forward(original: Callable[..., Any], compiled: Callable[..., Any] | None, compile_prefill: bool,
                         tf32: bool) -> Callable[..., Any]:
    from .precision import tf32_enabled

    # functools.wraps keeps the forward's signature (transformers reads it: logits_to_keep, cache names)
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        target = original
        if compiled is not None and (compile_prefill or not _is_prefill(args, kwargs)):
            target = compiled
        if tf32:
            with tf32_enabled(True):
                return target(*args, **kwargs)
        return target(*args, **kwargs)

    return forward


def prepare_generation(model: Any, config: CompileConfig, device: str | None = None, *,
                       max_cache_len: int | None = None,
                       compile_kwargs: dict[str, Any] | None = None) -> PreparedGeneration:
    """Prepare a causal LM (a transformers model with `generate`) in place to generate under `config`: its
    precision as the model's dtype, its KV cache, and its forward compiled for decode steps (and the prompt,
    with `compile_prefill`), transformers' own automatic compile turned off; see the module docstring.
    `max_cache_len`: positions a static cache is allocated for (`Generation.cache_len` of the longest request:
    its prompt and new tokens but the last, as transformers sizes it), so that every call reuses one cache size
    and compiled graph. `compile_kwargs` replaces the configuration's own
    torch.compile arguments. GenerationError for a model without transformers' `generate`; ConfigError for a
    regional configuration."""
    import torch

    from . import inductor
    from .precision import AUTOCAST_DTYPES

    if not _has_generate(model):
        raise GenerationError(f"the model ({type(model).__name__}) has no transformers generate() and "
                              "generation_config: a generation needs a causal language model")
    if getattr(model, "_joulepilot_generation", None) is not None:
        raise GenerationError("the model was already prepared for generation; prepare a fresh model")
    if config.regional:
        raise ConfigError(f"configuration {config.label} compiles regionally, which is not applied to a generation")
    if device is None:
        first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        device = str(first.device) if first is not None else "cpu"
    dtype = AUTOCAST_DTYPES.get(config.precision)
    if dtype is not None:
        model.to(dtype)
    settings = model.generation_config
    settings.cache_implementation = "static" if config.cache == "static" else None
    settings.disable_compile = True
    if config.cache == "static" and max_cache_len:
        settings.max_cache_len = int(max_cache_len)  # read by transformers 5.x; older ones size it per call
    if settings.pad_token_id is None:  # or every call warns that it picked one
        eos = settings.eos_token_id
        settings.pad_token_id = (eos[0] if isinstance(eos, list | tuple) and eos else eos) if eos is not None else 0
    original = model.forward
    compiled = None
    if config.compiles:
        kwargs = inductor.torch_compile_kwargs(config, device) if compile_kwargs is None else compile_kwargs
        compiled = torch.compile(original, **kwargs)
    tf32 = config.precision == "tf32"
    if compiled is not None or tf32:
        model.forward = _dispatching_forward(original, compiled, config.compile_prefill, tf32)
    prepared = PreparedGeneration(model, config, str(device), compiled, original)
    model._joulepilot_generation = prepared
    return prepared


def fixed_length_config(generation_config: Any, new_tokens: int) -> Any:
    """A copy of `generation_config` that makes every sequence generate exactly `new_tokens` greedy tokens: min
    and max new tokens both `new_tokens`, no end-of-sequence token to stop at (so no logits are masked to hold
    one back either), one beam, no sampling."""
    config = copy.deepcopy(generation_config)
    config.max_new_tokens = config.min_new_tokens = int(new_tokens)
    config.eos_token_id = None
    config.do_sample = False
    config.num_beams = 1
    if config.pad_token_id is None:
        config.pad_token_id = 0
    return config


def fixed_length_generate(model: Any, input_ids: Any, new_tokens: int, **kwargs: Any) -> Any:
    """`model.generate` of exactly `new_tokens` greedy tokens per sequence (every prompt token attended)."""
    import torch

    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                          generation_config=fixed_length_config(model.generation_config, new_tokens), **kwargs)


# --- the numerical check --------------------------------------------------------------------------------
def _greedy(model: Any, input_ids: Any, mask: Any, generation_config: Any, steps: int) -> tuple[Any, list[Any]]:
    """(the new tokens, batch x new_tokens, on the CPU; the logits of the first `steps` steps, float32 on the
    CPU) of one generate call. GenerationError when the call did not generate what was asked."""
    from transformers import LogitsProcessor, LogitsProcessorList

    kept: list[Any] = []

    class Keep(LogitsProcessor):
        def __call__(self, ids: Any, scores: Any) -> Any:
            if len(kept) < steps:
                kept.append(scores.detach().float().cpu())
            return scores

    out = model.generate(input_ids, attention_mask=mask, generation_config=generation_config,
                         logits_processor=LogitsProcessorList([Keep()]))
    batch, prompt = input_ids.shape
    expected = (batch, prompt + generation_config.max_new_tokens)
    if tuple(out.shape) != expected:
        raise GenerationError(f"generate() returned sequences shaped {tuple(out.shape)}, not {expected}: every "
                              "sequence must generate exactly new_tokens tokens")
    return out[:, prompt:].cpu(), kept


@dataclass(frozen=True)
class GreedyCheck:
    """A configuration's greedy generation against the eager fp32 reference's."""

    tokens_match: bool  # every sequence's tokens equal the reference's, for every new token
    matching_steps: int  # leading steps at which every sequence's token equals the reference's
    checked_steps: int  # steps whose logits were compared: those whose inputs equal the reference's (kept ones)
    max_rel_error: float | None
    note: str | None = None


def compare_greedy(tokens: Any, logits: list[Any], ref_tokens: Any, ref_logits: list[Any]) -> GreedyCheck:
    """Tokens and logits against the reference. The logits are compared over the first steps whose inputs
    equal the reference's: every leading step whose tokens agree, and the step where they first differ (its
    input did not), as far as logits were kept; the first step is always one of them."""
    from .numerics import numeric_check

    if tuple(tokens.shape) != tuple(ref_tokens.shape):
        return GreedyCheck(False, 0, 0, math.inf, f"tokens shaped {tuple(tokens.shape)}, the reference's "
                                                  f"{tuple(ref_tokens.shape)}")
    agree = (tokens == ref_tokens).all(dim=0)
    matching = int(agree.long().cumprod(0).sum())
    checked = min(len(logits), len(ref_logits), matching + 1)
    errors = [numeric_check(logits[i], ref_logits[i]) for i in range(checked)]
    values = [e.max_rel_error for e in errors if e.max_rel_error is not None]
    note = next((e.note for e in errors if e.note), None)
    return GreedyCheck(matching == tokens.shape[1], matching, checked, max(values) if values else None, note)


def same_precision_reference(model: Any, input_ids: Any, mask: Any, config: CompileConfig, generation: Any,
                             fp32_tokens: Any) -> tuple[Any, str]:
    """(the greedy tokens of eager in the configuration's precision with its cache, or None for an eager
    configuration, which is its own reference; what that reference is, in words). Called before the model is
    prepared: it casts the model to a bf16 or fp16 configuration's dtype, as `prepare_generation` would. A
    compiled fp32 configuration with the dynamic cache has the fp32 reference (`fp32_tokens`) for its own."""
    import torch

    from .precision import AUTOCAST_DTYPES, strict_fp32, tf32_enabled

    cache = "static cache" if config.cache == "static" else "dynamic cache"
    words = f"eager {config.precision}, {cache}"
    if not config.compiles:
        return None, f"{words} (the configuration itself)"
    if config.precision == "fp32" and config.cache != "static":
        return fp32_tokens, words
    dtype = AUTOCAST_DTYPES.get(config.precision)
    if dtype is not None:
        model.to(dtype)
    settings = fixed_length_config(model.generation_config, generation.new_tokens)
    settings.disable_compile = True
    if config.cache == "static":
        settings.cache_implementation = "static"
        settings.max_cache_len = generation.cache_len
    scope = tf32_enabled(True) if config.precision == "tf32" else strict_fp32() if dtype is None else \
        contextlib.nullcontext()
    with torch.no_grad(), scope:
        tokens, _ = _greedy(model, input_ids, mask, settings, 0)
    return tokens, words


# --- the latency pass -------------------------------------------------------------------------------------
@dataclass
class TokenTimes:
    """Per call of the latency pass: the whole call, the first token and the gaps between tokens, in ms."""

    call_ms: list[float]
    ttft_ms: list[float]
    tpot_ms: list[float]


def token_pass(generate: Callable[[Any], Any], sync: Callable[[], None], *, seconds: float,
               min_calls: int = MIN_TOKEN_PASS_CALLS) -> TokenTimes:
    """Generate calls, each given a streamer that synchronises the device and notes the time as each token
    arrives, until `seconds` have passed and at least `min_calls` calls were made. transformers hands the
    streamer the prompt first, then every new token: the time to first token runs from the call's start to the
    first new token, the time per output token between successive new tokens."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            sync()
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    times = TokenTimes([], [], [])
    started = time.perf_counter()
    while len(times.call_ms) < min_calls or time.perf_counter() - started < seconds:
        clock = Clock()
        sync()
        begun = time.perf_counter()
        generate(clock)
        sync()
        times.call_ms.append((time.perf_counter() - begun) * 1000.0)
        arrived = clock.times[1:]  # the first put is the prompt
        if arrived:
            times.ttft_ms.append((arrived[0] - begun) * 1000.0)
            times.tpot_ms.extend((b - a) * 1000.0 for a, b in zip(arrived, arrived[1:], strict=False))
    return times


# --- the worker's job -------------------------------------------------------------------------------------
def _per(value: float | None, count: float) -> float | None:
    return None if value is None or count <= 0 else value / count


def generation_figures(*, batch_size: int, prompt_len: int, new_tokens: int, window: Any, calls: int,
                       prefill_window: Any, prefill_calls: int, idle: dict[str, float]) -> tuple[dict[str, Any],
                                                                                                 dict[str, Any]]:
    """(the run's columns, its `extra.generation`) from the window of whole generations (`calls` generate calls
    of the batch) and the window of prefills. J per token counts prefill and decode of the whole batch over
    every generated token; decode is a whole generation less a prefill, per token it made (the first token of
    each sequence is the prefill's), and None when there is no decode step or it measured below the prefill."""
    from .worker import _above_idle_j, _peak_power

    tokens = batch_size * new_tokens
    generate_j = window.energy_j / calls
    prefill_j = prefill_window.energy_j / prefill_calls
    decode_j = generate_j - prefill_j
    decode_tokens = batch_size * (new_tokens - 1)
    columns = {"energy_j_per_token": generate_j / tokens,
               "tokens_per_s": tokens * calls / window.duration_s if window.duration_s > 0 else None}
    prefill_above = _above_idle_j(prefill_window, idle)
    details = {
        "prompt_len": prompt_len, "new_tokens": new_tokens, "tokens_per_call": tokens,
        "prefill_j": prefill_j, "prefill_j_per_prompt_token": prefill_j / (batch_size * prompt_len),
        "prefill_above_idle_j": _per(prefill_above, prefill_calls),
        "prefill_calls": prefill_calls, "prefill_window_s": prefill_window.duration_s,
        "prefill_ms_per_call": prefill_window.duration_s * 1000.0 / prefill_calls,
        "prefill_avg_power_w": _per(prefill_window.energy_j, prefill_window.duration_s),
        "prefill_peak_power_w": _peak_power(prefill_window),
        "prefill_energy_source": "+".join(prefill_window.sources) if prefill_window.sources else None,
        "prefill_window": {"devices": [d.to_dict() for d in prefill_window.devices]},
        "decode_j": decode_j if decode_tokens > 0 and decode_j > 0 else None,
        "decode_j_per_token": decode_j / decode_tokens if decode_tokens > 0 and decode_j > 0 else None,
    }
    if decode_tokens > 0 and decode_j <= 0:
        details["decode_note"] = (f"a whole generation ({generate_j:.4g} J) measured no more than a prefill "
                                  f"({prefill_j:.4g} J): the decode steps are below the windows' noise")
    return columns, details


def run_generation(job: dict[str, Any], phases: Any) -> dict[str, Any]:
    """A generation measured under one configuration (see the module docstring); the result has the runs
    columns of a forward run (`energy_j_per_inference` is J per generate call of the batch, `throughput_per_s`
    sequences per second, the latencies whole calls') and a generation's own."""
    import torch

    from .compile_meter import CompileWindow
    from .generation_workloads import from_job
    from .graph_breaks import recording_graph_breaks
    from .measure import metered_window, percentile, synchronizer, timed_call, warm_up
    from .precision import strict_fp32
    from .worker import (
        _check_window_pace,
        _dynamo_counts,
        _open_meter,
        _peak_memory_bytes,
        _window_fields,
        origin_fields,
        record_compile_facts,
        take_idle_baseline,
        untraced,
    )
    from .workloads import load_workload

    device = job["device"]
    config = CompileConfig.from_row(job["config"])
    generation, model_options = from_job(job)
    assert generation is not None
    min_seconds = float(job["min_seconds"])
    result: dict[str, Any] = {"extra": {}}
    extra = result["extra"]
    columns, extra["provenance"] = origin_fields(job, device)
    result.update(columns)
    batch, prompt, new = config.batch_size, generation.prompt_len, generation.new_tokens

    phases.enter("load")
    workload = load_workload(job["spec"], batch_size=batch, device=device, seed=int(job.get("seed", 1234)),
                             model_options=model_options, generation=generation)
    model, input_ids = workload.model, workload.example_inputs[0]
    mask = torch.ones_like(input_ids)
    sync = synchronizer(device)
    steps = min(new, LOGITS_CHECK_STEPS)

    phases.enter("reference")
    with torch.no_grad(), strict_fp32():
        ref_tokens, ref_logits = _greedy(model, input_ids, mask, fixed_length_config(model.generation_config, new),
                                         steps)
    sync()
    own_tokens, own_reference = same_precision_reference(model, input_ids, mask, config, generation, ref_tokens)
    sync()
    if job.get("describe"):  # before the configuration changes the model's dtype and forward
        phases.enter("describe")
        try:
            described = workload.describe(with_details=True)
            extra["describe"] = described.pop("details", {})
            result["workload"] = described
        except Exception as exc:
            extra["describe_error"] = f"{type(exc).__name__}: {exc}"

    meter = _open_meter(device, float(job.get("sample_hz", 10.0)))
    try:
        idle = take_idle_baseline(meter, job, phases, extra)
        if str(device).startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(torch.device(device))
        prepare_generation(model, config, device, max_cache_len=generation.cache_len)
        whole = fixed_length_config(model.generation_config, new)
        first = fixed_length_config(model.generation_config, 1)
        generate = untraced(lambda: model.generate(input_ids, attention_mask=mask, generation_config=whole))
        prefill = untraced(lambda: model.generate(input_ids, attention_mask=mask, generation_config=first))

        phases.enter("compile")
        with CompileWindow(meter) as compile_metered, recording_graph_breaks() as breaks:
            (tokens, logits), compile_s = timed_call(untraced(lambda: _greedy(model, input_ids, mask, whole, steps)),
                                                     sync)
        phases.enter("compiled")
        result["compile_s"] = compile_s
        result.update(compile_metered.columns)
        check = compare_greedy(tokens, logits, ref_tokens, ref_logits)
        own = compare_greedy(tokens, [], own_tokens, []) if own_tokens is not None else None
        result["tokens_match"] = int(own.tokens_match) if own is not None else 1
        result["max_rel_error"] = check.max_rel_error
        if check.note:
            extra["numeric_check"] = check.note
        _, frames_after_first = _dynamo_counts()

        phases.enter("warmup")
        warm_max_s = float(job.get("warmup_max_s") or max(2.0, min_seconds))
        warm_calls, warmup_s = warm_up(generate, sync, max_s=warm_max_s)
        prefill_warm_calls, _ = warm_up(prefill, sync, max_s=min(warm_max_s, 2.0))
        result["warmup_s"] = warmup_s
        extra["warmup_calls"] = warm_calls
        extra["prefill_warmup_calls"] = prefill_warm_calls

        phases.enter("latency")
        latency_s = float(job.get("latency_s") or max(0.25, min(min_seconds / 2.0, 3.0)))
        started = time.perf_counter()
        times = token_pass(untraced_streaming(model, input_ids, mask, whole), sync, seconds=latency_s)
        pass_s = time.perf_counter() - started

        phases.enter("window")
        peak_before_window = _peak_memory_bytes(device)
        if str(device).startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(torch.device(device))
        calls, _, window = metered_window(generate, sync, meter, device=device, min_seconds=min_seconds)
        prefill_calls, _, prefill_window = metered_window(prefill, sync, meter, device=device,
                                                          min_seconds=min_seconds, name="prefill")
        peak_window = _peak_memory_bytes(device)
    finally:
        meter.close()

    record_compile_facts(result, config, device, breaks, frames_after_first, threads_from=job.get("threads_from"))
    result.update(_window_fields(window, calls, batch, idle))
    result["latency_ms_p50"] = percentile(times.call_ms, 50)
    result["latency_ms_p95"] = percentile(times.call_ms, 95)
    result["ttft_ms_p50"] = percentile(times.ttft_ms, 50) if times.ttft_ms else None
    result["tpot_ms_p50"] = percentile(times.tpot_ms, 50) if times.tpot_ms else None
    result["tpot_ms_p95"] = percentile(times.tpot_ms, 95) if times.tpot_ms else None
    extra.update({"latency_s": pass_s, "latency_source": "token_pass", "latency_calls": len(times.call_ms),
                  "latency_ms_mean": sum(times.call_ms) / len(times.call_ms), "latency_ms_min": min(times.call_ms),
                  "ttft_ms_p95": percentile(times.ttft_ms, 95) if times.ttft_ms else None})
    figures, details = generation_figures(batch_size=batch, prompt_len=prompt, new_tokens=new, window=window,
                                          calls=calls, prefill_window=prefill_window, prefill_calls=prefill_calls,
                                          idle=idle)
    result.update(figures)
    details.update(cache=config.cache, prefill="compiled" if config.compile_prefill else "eager",
                   tokens_match_steps=own.matching_steps if own is not None else new,
                   tokens_match_reference=own_reference, fp32_tokens_match_steps=check.matching_steps,
                   logits_checked_steps=check.checked_steps)
    extra["generation"] = details
    result["peak_memory_bytes"] = max(peak_before_window, peak_window)
    _check_window_pace(window.duration_s * 1000.0 / calls, result["latency_ms_p50"], extra, "token_pass")
    extra["peak_memory_window_bytes"] = peak_window
    extra["window"] = {"devices": [d.to_dict() for d in window.devices]}
    extra["compile_window"] = compile_metered.record
    result["power_samples"] = [list(s) for s in getattr(window, "samples", [])]
    result["status"] = "ok"
    return result


def untraced_streaming(model: Any, input_ids: Any, mask: Any, generation_config: Any) -> Callable[[Any], Any]:
    """A generate call with a streamer, for the latency pass (untraced, as every timed call)."""
    from .worker import untraced

    def call(streamer: Any) -> Any:
        return untraced(lambda: model.generate(input_ids, attention_mask=mask, generation_config=generation_config,
                                               streamer=streamer))()

    return call
