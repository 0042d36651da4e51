"""benchmarks/generation_energy.py on the CPU with the built-in tiny-llama: every run in the jsonl as it
finishes, an export `runs import` reads, and the J/token table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from joulepilot.store import open_db, read_export

ROOT = Path(__file__).resolve().parent.parent


def _script():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as when run as a script: its sibling sweep_log is importable
    try:
        spec = importlib.util.spec_from_file_location("generation_energy", ROOT / "benchmarks" / "generation_energy.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["generation_energy"] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_models_are_two_architectures_of_half_to_one_and_a_half_billion_parameters():
    script = _script()
    counts = {name: script.param_count(script.MODELS[name]["spec"], script.MODELS[name]["options"])
              for name in script.DEFAULT_MODELS.split(",")}
    assert {script.MODELS[name]["spec"] for name in counts} == {"transformers:LlamaConfig", "transformers:Qwen2Config"}
    assert all(0.5e9 <= count <= 1.5e9 for count in counts.values()), counts


def test_the_plan_puts_eager_first_and_names_the_compiled_forward_without_a_static_cache():
    script = _script()
    labels = [c.label for c in script.plan(list(script.CONFIGS), ["bf16"], 8)]
    assert labels == ["eager/bf16/b8", "default/static-cache/bf16/b8", "reduce-overhead/static-cache/bf16/b8",
                      "max-autotune-no-cudagraphs/static-cache/bf16/b8", "default/bf16/dynamic/b8",
                      "max-autotune/static-cache/bf16/b8"]


def test_transformers_recipe_is_the_same_model_and_prompts_generating_by_transformers_own_settings(monkeypatch):
    """The reference row: bench's tiny-llama, weights and prompts alike (the worker seeds torch before a factory),
    whose generate, once joulepilot prepared it with an eager configuration, asks transformers for the static cache
    and its automatic compile (transformers itself then compiles on CUDA and skips it elsewhere)."""
    import torch
    from joulepilot.compiler import CompileConfig, load_workload
    from joulepilot.compiler.generation import fixed_length_config, prepare_generation
    from joulepilot.compiler.generation_workloads import Generation
    from joulepilot.compiler.workloads import DEFAULT_SEED

    script = _script()
    spec = script.recipe_spec("tiny")
    assert spec.endswith("benchmarks/generation_energy.py:transformers_recipe_tiny")
    bench = load_workload("tiny-llama", 2, generation=Generation(8, 4))
    torch.manual_seed(DEFAULT_SEED)
    model, input_ids = script.transformers_recipe_tiny(batch_size=2, prompt_len=8, new_tokens=4, device="cpu")
    assert torch.equal(input_ids, bench.example_inputs[0])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bench.model.state_dict().values(),
                                                 strict=True))
    seen = []
    criteria = type(model).__mro__[1]._valid_auto_compile_criteria

    def spy(self, model_kwargs, generation_config):
        seen.append((type(model_kwargs.get("cache")).__name__, bool(generation_config.disable_compile)))
        return criteria(self, model_kwargs, generation_config)

    monkeypatch.setattr(type(model).__mro__[1], "_valid_auto_compile_criteria", spy)
    settings = fixed_length_config(model.generation_config, 4)
    mask = torch.ones_like(input_ids)
    model.generate(input_ids, attention_mask=mask, generation_config=settings)  # the fp32 reference: unprepared
    prepare_generation(model, CompileConfig("eager", batch_size=2), "cpu")
    model.generate(input_ids, attention_mask=mask, generation_config=fixed_length_config(model.generation_config, 4))
    assert seen == [("DynamicCache", False), ("StaticCache", False)]
    assert model.generation_config.disable_compile  # joulepilot's own setting, which the recipe overrides per call


def test_the_table_names_transformers_recipe_and_compares_with_it():
    script = _script()
    common = {"task": "generate", "batch_size": 1, "precision": "bf16", "status": "ok", "prompt_len": 512,
              "new_tokens": 256, "energy_source": "nvml", "device_name": "NVIDIA H200", "torch_version": "2.11"}
    runs = [{**common, "workload": "transformers:LlamaConfig", "model_options": script.MODELS["llama"]["options"],
             "config_label": "eager/bf16/b1", "energy_j_per_token": 2.4},
            {**common, "workload": script.recipe_spec("llama"), "model_options": None,
             "config_label": "eager/bf16/b1", "energy_j_per_token": 0.53, "tokens_match": 1},
            {**common, "workload": "transformers:LlamaConfig", "model_options": script.MODELS["llama"]["options"],
             "config_label": "reduce-overhead/static-cache/bf16/b1", "energy_j_per_token": 0.615}]
    table = script.summary_table(runs, {"llama": 800_000_000})
    assert "| llama (0.80 B) | 1 | transformers static-cache compile/bf16/b1 | 0.53 |" in table
    assert "| llama | 1 | bf16 | 2.4 | - | 0.53 | 0.615 | reduce-overhead/static-cache/bf16/b1 | 74 % | - | -16 % |" in table
    # the recipe measures as eager, its own reference: its tokens were not checked, whatever the run says
    (recipe_row,) = [line for line in table.splitlines() if "transformers static-cache compile/bf16/b1" in line]
    assert recipe_row.split("|")[12].strip() == "-"


def test_the_comparison_takes_the_median_of_each_configurations_runs():
    script = _script()
    common = {"task": "generate", "batch_size": 1, "precision": "bf16", "status": "ok", "prompt_len": 512,
              "new_tokens": 256, "energy_source": "nvml", "workload": "transformers:LlamaConfig",
              "model_options": script.MODELS["llama"]["options"]}
    runs = [{**common, "config_label": "eager/bf16/b1", "energy_j_per_token": j} for j in (1.6, 2.0, 1.9)] + \
           [{**common, "config_label": "reduce-overhead/static-cache/bf16/b1", "energy_j_per_token": j}
            for j in (0.5, 0.6)] + \
           [{**common, "config_label": "max-autotune/static-cache/bf16/b1", "energy_j_per_token": 0.56}]
    table = script.summary_table(runs, {"llama": 800_000_000})
    # eager's median 1.9 of three runs; reduce-overhead's 0.55 of two beats max-autotune's single 0.56
    assert "| llama | 1 | bf16 | 1.9 (3) | - | - | 0.55 (2) | reduce-overhead/static-cache/bf16/b1 | 71 % | - | - |" \
        in table


def test_a_smoke_sweep_stores_exports_and_prints_the_table(tmp_path, capsys):
    script = _script()
    code = script.main(["--models", "tiny", "--batches", "2", "--configs", "eager", "--precisions", "fp32",
                        "--prompt-len", "8", "--new-tokens", "4", "--device", "cpu", "--min-seconds", "0.2",
                        "--out", str(tmp_path)])
    assert code == 0
    (line,) = (tmp_path / "runs.jsonl").read_text().splitlines()
    run = json.loads(line)
    assert run["status"] == "ok" and run["config_label"] == "eager/fp32/b2" and run["energy_j_per_token"] > 0
    (record,) = read_export(tmp_path / "runs_export.json")
    assert record["run"]["energy_j_per_token"] == run["energy_j_per_token"]
    assert record["workload"]["task"] == "generate" and record["workload"]["new_tokens"] == 4
    printed = capsys.readouterr().out
    assert "| tiny (0.14 M) | 2 | eager/fp32/b2 |" in printed and "J/token" in printed
    assert "energy source: estimate (an estimate, not a measurement)" in printed
    assert (tmp_path / "summary.md").read_text() in printed
    assert open_db(tmp_path / "generation.db").execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1


def test_progress_lines_name_transformers_recipe_not_the_eager_configuration_it_is_measured_as():
    from joulepilot.compiler import CompileConfig

    script = _script()
    seen = []
    progress = script._recipe_progress(lambda index, total, config, run: seen.append((index, total, config.label, run)))
    progress(0, 2, CompileConfig("eager", precision="bf16", batch_size=8), None)
    assert seen == [(0, 2, "transformers static-cache compile/bf16/b8", None)]
