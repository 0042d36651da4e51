"""A generation in the store: schema 8 (an older database migrates, its rows read as forward passes with the
default cache), the generation's columns in `runs --json`, and `runs export` / `runs import` carrying them."""

from __future__ import annotations

import json

from click.testing import CliRunner
from joulepilot.compiler import CompileConfig
from joulepilot.compiler.generation_workloads import Generation, workload_columns
from joulepilot.compiler.workloads import workload_id
from joulepilot.store import commit_run, list_runs, open_db, schema_version, workload_runs
from joulepilot.store.schema import GENERATION_RUN_COLUMNS, SCHEMA_VERSION
from store_factories import database_at

from joulepilot.cli import main

GENERATION_FIGURES = {"energy_j_per_token": 0.0125, "ttft_ms_p50": 8.5, "tpot_ms_p50": 1.25, "tpot_ms_p95": 1.5,
                      "tokens_per_s": 640.0, "tokens_match": 1}


def test_a_version_7_database_migrates_and_its_runs_read_as_forward_passes(tmp_path):
    path = database_at(tmp_path / "v7.db", 7)
    db = open_db(path)
    assert schema_version(db) == SCHEMA_VERSION
    (run,) = list_runs(db)
    assert (run["cache"], run["compile_prefill"], run["task"], run["prompt_len"], run["model_options"]) == \
        ("dynamic", 0, None, None, None)
    assert set(GENERATION_FIGURES) == set(GENERATION_RUN_COLUMNS)
    assert all(run[name] is None for name in GENERATION_RUN_COLUMNS)
    assert CompileConfig.from_row(run) == CompileConfig("eager", batch_size=8)
    (typed,) = workload_runs(db, "w1")
    assert typed.task is None and typed.model_options == {} and typed.energy_j_per_token is None


def _generation_db(path):
    db = open_db(path)
    generation = Generation(64, 16)
    options = {"num_hidden_layers": 1}
    wid = workload_id("tiny-llama", 2, generation=generation, model_options=options)
    config = CompileConfig("default", cache="static", compile_prefill=True, batch_size=2)
    commit_run(db, {"workload_id": wid, "config_id": config.id, "host_id": "h1", "device": "cpu", "status": "ok",
                    "started_at": 1795000000.0, "finished_at": 1795000030.0, "energy_j_per_inference": 0.4,
                    "energy_source": "estimate", "extra": {"generation": {"prefill_j": 0.05}}, **GENERATION_FIGURES},
               host={"id": "h1", "hostname": "box", "cpu": "x86_64"},
               workload={"id": wid, "spec": "tiny-llama", "batch_size": 2, **workload_columns(generation, options)},
               config=config.to_row())
    return db, config


def test_runs_json_prints_a_generations_figures_and_knobs(tmp_path):
    db, config = _generation_db(tmp_path / "g.db")
    db.close()
    result = CliRunner().invoke(main, ["runs", "--db", str(tmp_path / "g.db"), "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    assert {k: run[k] for k in GENERATION_FIGURES} == {**GENERATION_FIGURES, "tokens_match": True}
    assert (run["task"], run["prompt_len"], run["new_tokens"]) == ("generate", 64, 16)
    assert run["model_options"] == {"num_hidden_layers": 1}
    assert (run["cache"], run["compile_prefill"], run["config_label"]) == ("static", True, config.label)
    assert run["extra"]["generation"]["prefill_j"] == 0.05


def test_export_and_import_carry_a_generation(tmp_path):
    db, config = _generation_db(tmp_path / "g.db")
    db.close()
    runner = CliRunner()
    exported = tmp_path / "runs.json"
    assert runner.invoke(main, ["runs", "export", str(exported), "--db", str(tmp_path / "g.db")]).exit_code == 0
    record = json.loads(exported.read_text())[0]
    assert record["run"]["tokens_match"] is True and record["workload"]["model_options"] == {"num_hidden_layers": 1}
    assert record["config"]["cache"] == "static" and record["config"]["compile_prefill"] is True
    result = runner.invoke(main, ["runs", "import", str(exported), "--db", str(tmp_path / "other.db")])
    assert result.exit_code == 0, result.output
    other = open_db(tmp_path / "other.db")
    (run,) = list_runs(other)
    assert {k: run[k] for k in GENERATION_FIGURES} == GENERATION_FIGURES
    assert (run["task"], run["prompt_len"], run["new_tokens"], json.loads(run["model_options"])) == \
        ("generate", 64, 16, {"num_hidden_layers": 1})
    assert CompileConfig.from_row(run) == config


def test_an_export_with_a_bad_tokens_match_is_refused_in_one_line(tmp_path):
    db, _ = _generation_db(tmp_path / "g.db")
    db.close()
    exported = tmp_path / "runs.json"
    CliRunner().invoke(main, ["runs", "export", str(exported), "--db", str(tmp_path / "g.db")])
    records = json.loads(exported.read_text())
    records[0]["run"]["tokens_match"] = 2
    exported.write_text(json.dumps(records))
    result = CliRunner().invoke(main, ["runs", "import", str(exported), "--db", str(tmp_path / "other.db")])
    assert result.exit_code == 1 and "run.tokens_match: 2 is not true or false" in result.stderr
