"""What a generation refuses before anything runs, each in one line naming the fix, and how a generation
workload is built: model options, the built-in tiny-llama, and a factory's calling convention."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig, ConfigError, WorkloadError, load_workload
from joulepilot.compiler.generation_workloads import GENERATE_INSTALL, Generation, check_workload_request
from joulepilot.compiler.workloads import LibraryMissing

from joulepilot.cli import main
from tests import generation_factories

SHORT = Generation(16, 4)


def _check(spec, generation=SHORT, model_options=None, **kwargs):
    check_workload_request(spec, generation=generation, model_options=model_options, **kwargs)


@pytest.mark.parametrize("spec", ["transformers:ViTConfig", "transformers:ResNetConfig"])
def test_a_config_without_a_causal_lm_is_refused(spec):
    with pytest.raises(WorkloadError, match=r"is not a causal language model \(AutoModelForCausalLM has no model for "
                                            r".*Config\); --task generate needs a causal LM config such as"):
        _check(spec)


@pytest.mark.parametrize("spec", ["mlp", "torchvision:resnet18"])
def test_a_forward_only_spec_is_refused(spec):
    with pytest.raises(WorkloadError, match="is not a causal language model; --task generate needs"):
        _check(spec)


def test_an_unknown_model_option_is_named_with_the_closest():
    with pytest.raises(WorkloadError, match=r"--model-option num_hiden_layers: LlamaConfig has no attribute "
                                            r"'num_hiden_layers'; did you mean 'num_hidden_layers'\?"):
        _check("transformers:LlamaConfig", model_options={"num_hiden_layers": 2})
    with pytest.raises(WorkloadError, match="--model-option n_layer: LlamaConfig has no attribute"):
        _check("tiny-llama", model_options={"n_layer": 2})
    # a forward pass of a transformers config is checked the same way
    with pytest.raises(WorkloadError, match="BertConfig has no attribute 'num_layers'"):
        _check("transformers:BertConfig", generation=None, model_options={"num_layers": 2})
    with pytest.raises(WorkloadError, match="LlamaConfig refused the options"):
        _check("tiny-llama", model_options={"num_hidden_layers": 2.5})


def test_model_options_of_a_spec_without_a_config_are_refused():
    with pytest.raises(WorkloadError, match="--model-option applies to transformers:<ConfigClass> specs, not to 'mlp'"):
        _check("mlp", generation=None, model_options={"layers": 2})
    with pytest.raises(WorkloadError, match="not to 'tests.generation_factories:tokens'"):
        _check("tests.generation_factories:tokens", model_options={"layers": 2})


def test_a_prompt_and_new_tokens_past_the_models_positions_are_refused():
    _check("tiny-llama", Generation(1000, 24))  # 1,024 positions: fits exactly
    with pytest.raises(WorkloadError, match=r"prompt_len 1000 \+ new_tokens 25 = 1025 positions, more than the "
                                            r"model's 1024; .* --model-option max_position_embeddings=1025"):
        _check("tiny-llama", Generation(1000, 25))
    with pytest.raises(WorkloadError, match="more than the model's 1024"):
        _check("transformers:GPT2Config", Generation(1020, 5))  # GPT-2 names them n_positions
    _check("tiny-llama", Generation(1000, 25), model_options={"max_position_embeddings": 1025})


def test_forward_arguments_and_generation_knobs_are_kept_apart():
    with pytest.raises(ConfigError, match="--seq-len shapes a forward pass; a generation's input is --prompt-len"):
        _check("tiny-llama", seq_len=64)
    with pytest.raises(ConfigError, match="drop --shapes"):
        _check("tiny-llama", shapes=object())
    with pytest.raises(ConfigError, match="compiles regionally, which is not measured for a generation yet"):
        _check("tiny-llama", configs=[CompileConfig("default", regional="auto")])
    with pytest.raises(ConfigError, match="sets a KV cache or a compiled prefill, which only a generation has: add "
                                          "--task generate"):
        _check("mlp", generation=None, configs=[CompileConfig("default", cache="static")])
    with pytest.raises(WorkloadError, match="'tiny-llama' is a generation workload; add --task generate"):
        _check("tiny-llama", generation=None)


def test_without_transformers_a_generation_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what find_spec and import see when it is missing
    with pytest.raises(LibraryMissing) as err:
        _check("tiny-llama")
    assert GENERATE_INSTALL in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("args, says", [
    (["transformers:ViTConfig", "--task", "generate"], "is not a causal language model"),
    (["tiny-llama", "--task", "generate", "--prompt-len", "1020", "--new-tokens", "8"],
     "more than the model's 1024"),
    (["tiny-llama", "--task", "generate", "--model-option", "num_layers=2"], "LlamaConfig has no attribute 'num_layers'"),
    (["tiny-llama", "--task", "generate", "--model-option", "num_hidden_layers"],
     "--model-option 'num_hidden_layers' must look like NAME=VALUE"),
    (["mlp", "--new-tokens", "8"], "--new-tokens shape a generation: add --task generate"),
    (["tiny-llama"], "'tiny-llama' is a generation workload; add --task generate"),
    (["tiny-llama", "--task", "generate", "--regional"], "which is not measured for a generation yet"),
    (["tiny-llama", "--task", "generate", "--seq-len", "8"], "--seq-len shapes a forward pass"),
    (["tiny-llama", "--task", "generate", "--shapes", "seq_len=8,16"], "drop --shapes"),
])
def test_bad_generation_input_is_one_line_and_exit_1(tmp_path, args, says):
    result = CliRunner().invoke(main, ["bench", *args, "--device", "cpu", "--db", str(tmp_path / "jp.db")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith("Error: ")
    assert "Traceback" not in result.output


@pytest.mark.parametrize("option", ["--new-tokens", "--prompt-len", "--batch-size"])
def test_zero_new_tokens_is_one_line_and_exit_1_as_every_size_option(option):
    result = CliRunner().invoke(main, ["bench", "tiny-llama", "--task", "generate", option, "0"])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: {option}: 0 is not in the range 1<=x<=1048576; give a whole number from 1 to 1,048,576"]


# --- building ---------------------------------------------------------------------------------------------
def test_tiny_llama_and_model_options_build_a_causal_lm_with_prompts():
    workload = load_workload("tiny-llama", 3, generation=Generation(12, 4), model_options={"num_hidden_layers": 1})
    (input_ids,) = workload.example_inputs
    assert tuple(input_ids.shape) == (3, 12) and not input_ids.is_floating_point()
    assert type(workload.model).__name__ == "LlamaForCausalLM" and workload.model.config.num_hidden_layers == 1
    assert workload.id == workload_id_of("tiny-llama", 3, Generation(12, 4), {"num_hidden_layers": 1})
    again = load_workload("tiny-llama", 3, generation=Generation(12, 4), model_options={"num_hidden_layers": 1})
    assert bool((again.example_inputs[0] == input_ids).all())  # prompts from the workload's seed


def workload_id_of(spec, batch, generation, options):
    from joulepilot.compiler import workload_id

    return workload_id(spec, batch, generation=generation, model_options=options)


def test_model_options_apply_to_a_forward_pass_of_a_transformers_config():
    workload = load_workload("transformers:BertConfig", 2, seq_len=8,
                             model_options={"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                                            "intermediate_size": 64})
    assert workload.model.inner.config.num_hidden_layers == 1
    assert tuple(workload.model(*workload.example_inputs).shape) == (2, 8, 32)
    assert workload.describe(graph=False)["model_options"] == (
        '{"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1}')


def test_a_factory_gets_the_arguments_it_accepts():
    generation_factories.CALLS.clear()
    workload = load_workload("tests.generation_factories:tokens", 2, generation=Generation(5, 3))
    assert generation_factories.CALLS == [{"batch_size": 2, "prompt_len": 5}]
    assert tuple(workload.example_inputs[0].shape) == (2, 5)
    generation_factories.CALLS.clear()
    load_workload("tests.generation_factories:everything", 2, generation=Generation(5, 3))
    assert generation_factories.CALLS == [{"batch_size": 2, "prompt_len": 5, "new_tokens": 3, "device": "cpu"}]


@pytest.mark.parametrize("factory, says", [
    ("no_generate", r"the factory's model \(Linear\) has no generate\(\)"),
    ("wrong_shape", r"the factory's input_ids are \(2, 6\); return token ids shaped \(batch_size, prompt_len\) = "
                    r"\(2, 5\)"),
    ("model_only", r"the factory returned a LlamaForCausalLM; a generation factory returns \(model, input_ids\)"),
])
def test_a_factory_that_cannot_generate_is_refused(factory, says):
    with pytest.raises(WorkloadError, match=says):
        load_workload(f"tests.generation_factories:{factory}", 2, generation=Generation(5, 3))


def test_bench_builds_a_forward_pass_with_model_options_in_the_worker(tmp_path):
    from joulepilot.compiler import bench, workload_id
    from joulepilot.store import open_db

    options = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    (run,) = bench("transformers:BertConfig", [CompileConfig("eager", batch_size=2)], device="cpu", seq_len=8,
                   min_seconds=0.2, db=tmp_path / "jp.db", model_options=options)
    assert run["status"] == "ok", run.get("reason")
    assert run["workload_id"] == workload_id("transformers:BertConfig", 2, 8, model_options=options)
    assert run["workload_id"] != workload_id("transformers:BertConfig", 2, 8)
    params, stored = open_db(tmp_path / "jp.db").execute("SELECT params, model_options FROM workloads").fetchone()
    assert params < 2_000_000 and stored == json.dumps(options, sort_keys=True)  # BERT-base has 110 M
