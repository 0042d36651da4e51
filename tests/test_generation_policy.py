"""Generation policies (issue 27 item 4): the fields, what each task refuses, the grid, the workload they name and
what a decision read back may apply."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.compiler.generation_workloads import Generation
from joulepilot.policies import PolicyError, validate
from joulepilot.policies.allowed import decision_refusal
from joulepilot.policies.batches import batch_workload_id
from joulepilot.policies.resolve import candidate_configs, fallback_config

from joulepilot.cli import main

BASE = {"name": "chat", "workload": "tiny-llama", "batch_size": 1, "task": "generate"}


def _problems(raw: dict) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        validate(raw, "chat.toml")
    return [str(p) for p in caught.value.problems]


def test_a_generation_policy_has_its_prompt_new_tokens_options_and_token_count():
    policy = validate({**BASE, "prompt_len": 32, "new_tokens": 16, "model_options": {"num_hidden_layers": 1},
                       "objective": {"expected_tokens": 5_000}, "limits": {"max_tpot_ms": 20, "max_ttft_ms": 50}})
    assert policy.generates and policy.generation == Generation(32, 16)
    assert policy.model_options_dict == {"num_hidden_layers": 1}
    assert policy.objective.expected_tokens == 5_000
    assert (policy.limits.max_tpot_ms, policy.limits.max_ttft_ms) == (20, 50)
    # the workload it names is bench's for the same generation and options
    assert batch_workload_id(policy) == workload_id("tiny-llama", 1, model_options={"num_hidden_layers": 1},
                                                    generation=Generation(32, 16))


def test_a_generation_policy_defaults_as_bench_plans():
    policy = validate(BASE)
    assert policy.generation == Generation(128, 128)
    assert policy.objective.expected_tokens == 100_000_000
    labels = [c.label for c in candidate_configs(policy)]
    # eager with the dynamic cache, a compiled mode with the static one (bench's plan)
    assert labels == ["eager/fp32/b1", "default/static-cache/fp32/b1"]
    assert fallback_config(policy).label == "eager/fp32/b1"


def test_search_caches_and_compile_prefill_widen_the_grid():
    policy = validate({**BASE, "search": {"modes": ["eager", "reduce-overhead"], "precisions": ["bf16"],
                                          "caches": ["dynamic", "static"], "compile_prefill": [False, True],
                                          "batch_sizes": [4]},
                       "fallback": {"mode": "reduce-overhead", "precision": "bf16"}})
    labels = {c.label for c in candidate_configs(policy)}
    assert "reduce-overhead/static-cache/compiled-prefill/bf16/b4" in labels
    assert "eager/static-cache/bf16/b1" in labels and "reduce-overhead/bf16/b1" in labels
    assert len(labels) == 2 * (2 + 2 * 2)
    assert fallback_config(policy).label == "reduce-overhead/static-cache/bf16/b1"


@pytest.mark.parametrize(("raw", "key", "fix"), [
    ({"prompt_len": 32}, "prompt_len", 'add task = "generate"'),
    ({"new_tokens": 8}, "new_tokens", 'add task = "generate"'),
    ({"objective": {"expected_tokens": 10}}, "objective.expected_tokens", 'add task = "generate"'),
    ({"limits": {"max_tpot_ms": 3}}, "limits.max_tpot_ms", 'add task = "generate"'),
    ({"limits": {"max_ttft_ms": 3}}, "limits.max_ttft_ms", 'add task = "generate"'),
    ({"search": {"caches": ["static"]}}, "search.caches", 'add task = "generate"'),
    ({"search": {"compile_prefill": [True]}}, "search.compile_prefill", 'add task = "generate"'),
])
def test_a_generation_field_without_the_task_is_one_line(raw, key, fix):
    problems = _problems({"name": "svc", "workload": "mlp", "batch_size": 8, **raw})
    assert len(problems) == 1 and problems[0].startswith(f"chat.toml: {key}: ") and fix in problems[0]


@pytest.mark.parametrize(("raw", "key", "fix"), [
    ({"seq_len": 128}, "seq_len", "use prompt_len"),
    ({"image_size": 224}, "image_size", "use prompt_len"),
    ({"shapes": {"seq_len": [64, 128]}}, "shapes", "remove [shapes]"),
    ({"objective": {"expected_inferences": 1000}}, "objective.expected_inferences", "write expected_tokens"),
    ({"search": {"regional": [False, True]}}, "search.regional", "remove regional"),
    ({"search": {"regional": [True], "regional_block": "LlamaDecoderLayer"}}, "search.regional_block", "remove it"),
    ({"search": {"padding": ["none", "buckets"]}}, "search.padding", "remove padding"),
])
def test_a_forward_field_in_a_generation_policy_is_one_line(raw, key, fix):
    problems = [p for p in _problems({**BASE, **raw}) if f": {key}: " in p]
    assert len(problems) == 1 and fix in problems[0]


def test_model_options_take_scalars_and_name_a_misplaced_top_level_key():
    assert "a boolean, a number or a string" in _problems({**BASE, "model_options": {"layers": [1, 2]}})[0]
    misplaced = _problems({**BASE, "model_options": {"task": "generate"}})
    assert misplaced == ["chat.toml: model_options.task: expected config attributes of the model, found key 'task' "
                         "('task' is a top-level key: move it above the first [table] header)"]


@pytest.mark.parametrize(("body", "needle"), [
    ('workload = "tiny-llama"', "workload: expected a workload that can do a forward pass, found workload "
                                "'tiny-llama' is a generation workload (add task = \"generate\")"),
    ('workload = "mlp"\ntask = "generate"', "workload 'mlp' is not a causal language model"),
    ('workload = "tiny-llama"\ntask = "generate"\nprompt_len = 1000\nnew_tokens = 100',
     "1100 positions, more than the model's 1024 (shorten prompt_len or new_tokens, or give the model more with "
     "[model_options] max_position_embeddings=1100)"),
    ('workload = "tiny-llama"\ntask = "generate"\n[model_options]\nnum_hiden_layers = 1',
     "model_options: expected attributes the model's config has, found [model_options] num_hiden_layers: "
     "LlamaConfig has no attribute 'num_hiden_layers' (did you mean 'num_hidden_layers'?)"),
])
def test_policy_check_refuses_a_task_the_workload_cannot_do(tmp_path: Path, body: str, needle: str):
    path = tmp_path / "chat.toml"
    path.write_text(f'name = "chat"\nbatch_size = 1\n{body}\n')
    out = CliRunner().invoke(main, ["policy", "check", str(path)])
    assert out.exit_code == 1 and needle in out.output, out.output
    assert "Traceback" not in out.output


def test_a_decided_static_cache_configuration_is_applied_and_one_outside_the_grid_is_refused():
    policy = validate({**BASE, "search": {"modes": ["eager", "reduce-overhead"], "precisions": ["bf16"]}})
    static = CompileConfig("reduce-overhead", precision="bf16", cache="static", batch_size=1)
    assert decision_refusal(policy, static.to_row()) is None
    dynamic = static.replace(cache="dynamic")
    refusal = decision_refusal(policy, dynamic.to_row())
    assert refusal is not None and "its KV cache 'dynamic' is not in [search] caches ('static')" in refusal.problem
