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
    spec = importlib.util.spec_from_file_location("generation_energy", ROOT / "benchmarks" / "generation_energy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["generation_energy"] = module
    spec.loader.exec_module(module)
    return module


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
                      "max-autotune-no-cudagraphs/static-cache/bf16/b8", "default/bf16/dynamic/b8"]


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
