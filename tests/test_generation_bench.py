"""A generation prepared and measured: `prepare_generation` (precision as the model's dtype, the static cache,
decode steps to the compiled forward, the prefill by its knob) and `bench --task generate` end to end on the
CPU with the built-in tiny-llama (real workers). The bench of a compiled (static-cache) configuration is checked in
test_generation_acceptance.py, whose hook then applies it."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig, load_workload
from joulepilot.compiler.generation import (
    GenerationError,
    fixed_length_config,
    fixed_length_generate,
    prepare_generation,
)
from joulepilot.compiler.generation_workloads import Generation
from joulepilot.store import list_runs, open_db

from joulepilot.cli import main

PROMPT, NEW, BATCH = 12, 6, 2
BENCH = ["bench", "tiny-llama", "--task", "generate", "--prompt-len", str(PROMPT), "--new-tokens", str(NEW),
         "--batch-size", str(BATCH), "--device", "cpu", "--min-seconds", "0.3"]


def _tiny():
    workload = load_workload("tiny-llama", BATCH, generation=Generation(PROMPT, NEW),
                             model_options={"num_hidden_layers": 1})  # one layer: less for Dynamo to trace
    return workload.model, workload.example_inputs[0]


@pytest.fixture
def dynamo_reset():
    """Dynamo's compiled frames are kept on the code objects they compiled: dropped after the test."""
    yield
    torch._dynamo.reset()


def _graph_recorder(seen):
    def backend(gm, example_inputs):
        seen.append(next(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)
                         and not t.is_floating_point()))
        return gm.forward

    return backend


@pytest.mark.parametrize("compile_prefill", [False, True])
def test_decode_steps_run_compiled_and_the_prefill_by_its_knob(dynamo_reset, compile_prefill):
    model, input_ids = _tiny()
    reference = fixed_length_generate(model, input_ids, NEW)
    seen = []
    config = CompileConfig("default", cache="static", compile_prefill=compile_prefill, batch_size=BATCH)
    prepared = prepare_generation(model, config, "cpu", max_cache_len=PROMPT + NEW,
                                  compile_kwargs={"backend": _graph_recorder(seen), "dynamic": False})
    out = fixed_length_generate(model, input_ids, NEW)
    assert torch.equal(out, reference)  # fp32, eager backend: the very same tokens
    assert (BATCH, 1) in seen  # the decode step was compiled
    assert ((BATCH, PROMPT) in seen) == compile_prefill
    assert model.generation_config.cache_implementation == "static" and model.generation_config.disable_compile
    assert prepared.compiled is not None and model.forward is not prepared.original_forward
    # transformers reads the forward's signature (logits_to_keep, the cache's name): the dispatcher keeps it
    import inspect

    assert inspect.signature(model.forward) == inspect.signature(prepared.original_forward)


def test_the_decode_step_joulepilot_compiles_is_the_graph_transformers_own_compile_gets(dynamo_reset, monkeypatch):
    """Prepared as a worker prepares it (the static cache for the workload's prompt and new tokens, decode steps
    compiled, the prompt eager), a decode step hands the compiler the very FX graph, on inputs of the very shapes,
    that transformers' own static-cache compile hands it: what differs on a GPU is not what is compiled."""
    from transformers.generation.configuration_utils import CompileConfig as TransformersCompileConfig

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "0")  # what transformers sets when it compiles

    def recorded(prepare):
        model, input_ids = _tiny()
        graphs = []

        def backend(gm, inputs, **_):
            graphs.append((gm.code, [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)]))
            return gm.forward

        settings = prepare(model, backend)
        for _ in range(2):
            model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=settings)
        torch._dynamo.reset()
        return graphs

    def ours(model, backend):
        config = CompileConfig("reduce-overhead", cache="static", batch_size=BATCH)
        prepare_generation(model, config, "cpu", max_cache_len=Generation(PROMPT, NEW).cache_len,
                           compile_kwargs={"backend": backend, "dynamic": False})
        return fixed_length_config(model.generation_config, NEW)

    def transformers_recipe(model, backend):
        settings = fixed_length_config(model.generation_config, NEW)
        settings.cache_implementation = "static"
        settings.compile_config = TransformersCompileConfig(backend=backend, mode=None)
        settings.compile_config._compile_all_devices = True  # transformers compiles off CUDA only when told to
        return settings

    mine, theirs = recorded(ours), recorded(transformers_recipe)
    assert len(mine) == len(theirs) == 1  # one graph each, no recompile over two calls
    assert mine == theirs


def test_the_same_precision_reference_is_eager_in_the_configurations_precision_and_cache():
    from joulepilot.compiler.generation import same_precision_reference

    model, input_ids = _tiny()
    mask = torch.ones_like(input_ids)
    fp32 = fixed_length_generate(model, input_ids, NEW)[:, PROMPT:]
    generation = Generation(PROMPT, NEW)
    eager = CompileConfig("eager", precision="bf16", batch_size=BATCH)
    assert same_precision_reference(model, input_ids, mask, eager, generation, fp32) == (
        None, "eager bf16, dynamic cache (the configuration itself)")
    assert next(model.parameters()).dtype == torch.float32  # an eager configuration's reference costs nothing
    dynamic = CompileConfig("default", precision="fp32", batch_size=BATCH)
    assert same_precision_reference(model, input_ids, mask, dynamic, generation, fp32)[0] is fp32
    static = CompileConfig("reduce-overhead", precision="bf16", cache="static", batch_size=BATCH)
    tokens, words = same_precision_reference(model, input_ids, mask, static, generation, fp32)
    assert words == "eager bf16, static cache" and next(model.parameters()).dtype == torch.bfloat16
    # what eager bf16 generates with the static cache, nothing compiled
    assert model.generation_config.cache_implementation is None and not hasattr(model, "_compiled_call")
    settings = model.generation_config
    settings.cache_implementation = "static"
    assert torch.equal(tokens, fixed_length_generate(model, input_ids, NEW)[:, PROMPT:])


def test_eager_precision_is_the_models_dtype_and_the_static_cache_generates_the_same():
    model, input_ids = _tiny()
    reference = fixed_length_generate(model, input_ids, NEW)
    prepare_generation(model, CompileConfig("eager", cache="static", batch_size=BATCH), max_cache_len=PROMPT + NEW)
    assert "forward" not in vars(model)  # eager fp32: nothing to dispatch, the forward is the class's own
    assert torch.equal(fixed_length_generate(model, input_ids, NEW), reference)
    half, ids = _tiny()
    prepare_generation(half, CompileConfig("eager", precision="bf16", batch_size=BATCH))
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert tuple(fixed_length_generate(half, ids, NEW).shape) == (BATCH, PROMPT + NEW)


def test_prepare_refuses_what_cannot_generate():
    with pytest.raises(GenerationError, match=r"the model \(Linear\) has no transformers generate\(\)"):
        prepare_generation(torch.nn.Linear(2, 2), CompileConfig("eager"))
    model, _ = _tiny()
    prepare_generation(model, CompileConfig("eager"))
    with pytest.raises(GenerationError, match="already prepared"):
        prepare_generation(model, CompileConfig("eager"))


# --- bench --task generate, end to end --------------------------------------------------------------------
GENERATION_FIELDS = ("energy_j_per_token", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p95", "tokens_per_s",
                     "tokens_match", "max_rel_error", "energy_j_per_inference", "latency_ms_p50", "avg_power_w",
                     "peak_power_w", "compile_s", "compile_energy_j")


def _check_generation_run(run):
    for field in GENERATION_FIELDS:
        assert run[field] is not None, field
    assert run["task"] == "generate" and (run["prompt_len"], run["new_tokens"]) == (PROMPT, NEW)
    assert run["energy_source"] == "estimate" and run["tokens_match"] is True
    tokens = BATCH * NEW
    assert run["energy_j_per_token"] == pytest.approx(run["energy_j_per_inference"] / tokens)
    assert run["energy_j_per_inference"] == pytest.approx(run["energy_j"] / run["inferences"])
    assert run["tokens_per_s"] == pytest.approx(tokens * run["inferences"] / run["window_s"])
    assert run["window_s"] >= 0.3 and run["inferences"] >= 3
    assert 0 < run["ttft_ms_p50"] <= run["latency_ms_p50"] and 0 < run["tpot_ms_p50"] <= run["tpot_ms_p95"]
    generation = run["extra"]["generation"]
    assert generation["prefill_j_per_prompt_token"] == pytest.approx(generation["prefill_j"] / (BATCH * PROMPT))
    assert generation["prefill_calls"] >= 3 and generation["prefill_window_s"] >= 0.3
    assert generation["prefill_energy_source"] == "estimate" and generation["tokens_match_steps"] == NEW
    if generation["decode_j_per_token"] is not None:
        assert generation["decode_j_per_token"] == pytest.approx(
            (run["energy_j_per_inference"] - generation["prefill_j"]) / (BATCH * (NEW - 1)))
    else:
        assert "below the windows' noise" in generation["decode_note"]
    assert run["extra"]["latency_source"] == "token_pass"


def test_bench_generate_eager_stores_and_prints_a_generation(tmp_path):
    db_path = tmp_path / "gen.db"
    result = CliRunner().invoke(main, [*BENCH, "--modes", "eager", "--db", str(db_path), "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    (run,) = json.loads(result.stdout)
    assert run["config_label"] == "eager/fp32/b2" and run["cache"] == "dynamic"
    _check_generation_run(run)
    assert run["max_rel_error"] == 0 and run["compile_energy_j"] >= 0
    assert "J/token (estimate)" in result.stderr and "TTFT" in result.stderr
    stored = list_runs(open_db(db_path))[0]
    assert stored["tokens_match"] == 1 and stored["energy_j_per_token"] == run["energy_j_per_token"]
    described = open_db(db_path).execute("SELECT params, flops_per_inference, task FROM workloads").fetchone()
    assert described[0] > 0 and described[1] > 0 and described[2] == "generate"
    table = CliRunner(env={"COLUMNS": "200"}).invoke(main, [*BENCH, "--modes", "eager", "--db", str(db_path)])
    assert table.exit_code == 0, table.output
    header = table.stdout.splitlines()[0].split()
    assert "J/token" in header and "TTFT" in header and "TPOT" in header and "source" in header
    assert "eager/fp32/b2" in table.stdout and "estimate" in table.stdout
