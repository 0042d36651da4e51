"""A generation's vocabulary without torch: the KV cache and compiled-prefill knobs of a configuration, the
generation and model options of a workload's id, the plan of a generation sweep, and that every id named
before them is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from joulepilot.compiler import CompileConfig, ConfigError, workload_id
from joulepilot.compiler.generation_workloads import (
    Generation,
    generation_of,
    parse_model_options,
    plan_generation_configs,
    workload_columns,
)
from joulepilot.compiler.inductor import effective_key

DATA = Path(__file__).parent / "data"
STORED_SWEEPS = sorted(DATA.glob("*.json"))


def _records():
    for path in STORED_SWEEPS:
        yield from json.loads(path.read_text())


def test_every_stored_configuration_keeps_its_id_and_label():
    configs = {rec["config"]["id"]: rec["config"] for rec in _records()}
    assert len(configs) > 20
    for stored_id, row in configs.items():
        config = CompileConfig.from_row(row)
        assert (config.id, config.label) == (stored_id, row["label"])
        assert (config.cache, config.compile_prefill) == ("dynamic", False)
        assert "cache" not in config.to_row() and "compile_prefill" not in config.to_row()


def test_every_stored_forward_workload_keeps_its_id():
    workloads = {rec["workload"]["id"]: rec["workload"] for rec in _records()}
    assert len(workloads) >= 5
    for stored_id, row in workloads.items():
        inputs = row["inputs"] if not isinstance(row["inputs"], str) else json.loads(row["inputs"])
        if isinstance(inputs, list):
            shape = inputs[0]["shape"]
            seq_len = shape[1] if len(shape) == 2 else None
        else:
            seq_len = inputs.get("seq_len")
        assert workload_id(row["spec"], row["batch_size"], seq_len) == stored_id, row["spec"]
        assert workload_id(row["spec"], row["batch_size"], seq_len, model_options={}) == stored_id


def test_cache_and_compiled_prefill_name_new_configurations():
    plain = CompileConfig("reduce-overhead", precision="bf16", batch_size=8)
    static = plain.replace(cache="static")
    both = static.replace(compile_prefill=True)
    assert len({plain.id, static.id, both.id}) == 3
    assert static.label == "reduce-overhead/static-cache/bf16/b8"
    assert both.label == "reduce-overhead/static-cache/compiled-prefill/bf16/b8"
    assert CompileConfig("eager", cache="static").label == "eager/static-cache/fp32/b1"
    for config in (static, both):
        row = config.to_row()
        assert row["cache"] == "static" and CompileConfig.from_row(row) == config
        assert CompileConfig.from_row(json.loads(json.dumps(row))).id == config.id
    assert len({effective_key(plain), effective_key(static), effective_key(both)}) == 3


def test_cache_and_compiled_prefill_are_checked():
    with pytest.raises(ConfigError, match="unknown cache 'statc'; did you mean 'static'"):
        CompileConfig("default", cache="statc")
    with pytest.raises(ConfigError, match="does not compile, so compiling the prefill does not apply"):
        CompileConfig("eager", compile_prefill=True)


def test_a_generation_and_model_options_each_make_another_workload():
    forward = workload_id("transformers:LlamaConfig", 8)
    options = workload_id("transformers:LlamaConfig", 8, model_options={"num_hidden_layers": 2})
    generate = workload_id("transformers:LlamaConfig", 8, generation=Generation(512, 256))
    longer = workload_id("transformers:LlamaConfig", 8, generation=Generation(512, 128))
    both = workload_id("transformers:LlamaConfig", 8, model_options={"num_hidden_layers": 2},
                       generation=Generation(512, 256))
    assert len({forward, options, generate, longer, both}) == 5
    # the options' order does not matter; their values do
    assert workload_id("x:f", 1, model_options={"a": 1, "b": 2}) == workload_id("x:f", 1, model_options={"b": 2, "a": 1})
    assert workload_id("x:f", 1, model_options={"a": 1}) != workload_id("x:f", 1, model_options={"a": 2})


def test_a_generation_is_stored_with_its_columns():
    assert workload_columns(None, None) == {}
    assert workload_columns(Generation(16, 4), {"b": True, "a": 1.5}) == {
        "task": "generate", "prompt_len": 16, "new_tokens": 4, "model_options": '{"a": 1.5, "b": true}'}


@pytest.mark.parametrize("prompt_len, new_tokens, field", [(16, 0, "new_tokens"), (0, 4, "prompt_len"),
                                                          (16, True, "new_tokens")])
def test_a_generation_needs_a_prompt_and_a_token(prompt_len, new_tokens, field):
    with pytest.raises(ConfigError, match=f"{field} must be a whole number of 1 or more"):
        Generation(prompt_len, new_tokens)


def test_model_options_are_parsed_as_bool_int_float_or_text():
    assert parse_model_options(["num_hidden_layers=2", "rope_theta=1e4", "tie_word_embeddings=false",
                                "hidden_act=silu"]) == {"num_hidden_layers": 2, "rope_theta": 10000.0,
                                                        "tie_word_embeddings": False, "hidden_act": "silu"}
    for bad in ("num_hidden_layers", "=2"):
        with pytest.raises(ConfigError, match=r"--model-option '.*' must look like NAME=VALUE, e\.g\. num_hidden_"):
            parse_model_options([bad])


def test_generation_options_without_the_task_are_refused():
    assert generation_of("forward") is None
    assert generation_of("generate") == Generation(128, 128)
    assert generation_of("generate", 32, 8) == Generation(32, 8)
    with pytest.raises(ConfigError, match="--new-tokens, --cache shape a generation: add --task generate"):
        generation_of("forward", new_tokens=8, caches=("static",))


def test_the_default_generation_plan_is_eager_dynamic_and_compiled_static():
    planned = plan_generation_configs(["eager", "default", "reduce-overhead"], precisions=["fp32", "bf16"],
                                      batch_size=4)
    pairs = [(c.mode, c.precision, c.cache, c.compile_prefill) for c in planned]
    assert ("eager", "fp32", "dynamic", False) in pairs and ("eager", "bf16", "dynamic", False) in pairs
    assert all(cache == "static" for mode, _, cache, _ in pairs if mode != "eager")
    assert {mode for mode, *_ in pairs} == {"eager", "default", "reduce-overhead"}
    assert all(c.batch_size == 4 for c in planned)


def test_a_generation_plan_with_caches_and_compiled_prefills():
    planned = plan_generation_configs(["eager", "default"], caches=["dynamic", "static"], compile_prefill=(False, True))
    labels = sorted(c.label for c in planned)
    assert labels == sorted(["eager/fp32/b1", "eager/static-cache/fp32/b1", "default/fp32/b1",
                             "default/compiled-prefill/fp32/b1", "default/static-cache/fp32/b1",
                             "default/static-cache/compiled-prefill/fp32/b1"])
    with pytest.raises(ConfigError, match="unknown cache 'paged'"):
        plan_generation_configs(["eager"], caches=["paged"])
