"""`joulepilot bench mlp` end to end on the CPU: real workers, one real cold Inductor compile (plus its warm
start from saved artifacts), every stored field checked in the database and in the JSON."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from cache_checks import assert_compiled_from_caches
from click.testing import CliRunner
from joulepilot.store import GENERATION_RUN_COLUMNS, json_object, list_runs, open_db, power_samples
from joulepilot.store.schema import RUN_INDEX_COLUMNS

from joulepilot.cli import main

# One sweep (a real cold compile and its warm start) serves every test here (a module fixture: the suite runs each
# file's tests on one xdist process).

REQUIRED_JSON_FIELDS = ("run_id", "workload", "mode", "fusion", "precision", "batch_size", "status", "compile_s",
                        "latency_ms_p50", "latency_ms_p95", "throughput_per_s", "energy_j_per_inference",
                        "avg_power_w", "peak_power_w", "energy_source", "max_rel_error", "graph_breaks",
                        "recompiles")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    home = tmp_path_factory.mktemp("bench-home")
    db_path = home / "bench.db"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JOULEPILOT_HOME", str(home))
        result = CliRunner().invoke(main, ["bench", "mlp", "--device", "cpu", "--batch-size", "4",
                                           "--min-seconds", "0.5", "--warm-start", "--db", str(db_path), "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    return {"runs": json.loads(result.stdout), "stderr": result.stderr, "db_path": db_path, "home": home}


def test_default_cpu_plan_is_eager_and_default_fp32(sweep):
    labels = sorted(r["config_label"] for r in sweep["runs"])
    assert labels == ["default/fp32/b4", "eager/fp32/b4"]
    assert "[1/2] eager/fp32/b4: compiling and measuring" in sweep["stderr"]
    assert "[2/2] default/fp32/b4: ok, compile" in sweep["stderr"]


def test_json_runs_carry_every_required_field(sweep):
    runs = sweep["runs"]
    energies = [r["energy_j_per_inference"] for r in runs]
    assert energies == sorted(energies)  # sorted by joules per inference
    for run in runs:
        for field in REQUIRED_JSON_FIELDS:
            assert run[field] is not None, field
        assert run["workload"] == "mlp" and run["batch_size"] == 4 and run["precision"] == "fp32"
        assert run["fusion"] == "default" and run["status"] == "ok" and run["reason"] is None
        assert run["energy_source"] == "estimate"
        assert 0 < run["latency_ms_p50"] <= run["latency_ms_p95"]
        assert run["inferences"] >= 3 and run["window_s"] >= 0.5
        assert run["throughput_per_s"] == pytest.approx(4 * run["inferences"] / run["window_s"])
        assert run["energy_j_per_inference"] == pytest.approx(run["energy_j"] / run["inferences"])
        assert run["avg_power_w"] == pytest.approx(run["energy_j"] / run["window_s"])
        assert run["graph_breaks"] == 0 and run["recompiles"] == 0


def test_compiled_run_is_cold_checked_and_warm_started(sweep):
    by_mode = {r["mode"]: r for r in sweep["runs"]}
    eager, compiled = by_mode["eager"], by_mode["default"]
    assert eager["max_rel_error"] == 0.0  # eager fp32 is the reference itself
    assert 0 <= compiled["max_rel_error"] < 1e-4
    assert compiled["compile_s"] > 1.0 > eager["compile_s"]  # a cold Inductor compile takes seconds here
    assert compiled["compile_energy_j"] > 0
    assert compiled["extra"]["compile_caches"] == {"fxgraph_cache_miss": 1, "autograd_cache_miss": 1}
    assert compiled["extra"]["torch_compile_kwargs"] == {"dynamic": False}
    assert compiled["extra"]["dynamo_frames_first_call"] == 1
    artifacts = Path(compiled["artifacts_path"])
    assert artifacts.is_file() and artifacts.parent == sweep["home"] / "artifacts"
    assert compiled["warm_start_s"] > 0
    warm = compiled["extra"]["warm_start"]
    assert warm["artifacts"]["kernels"] > 0 and warm["kernels_built"] == 0  # the C++ kernels came packed
    if warm["artifacts"]["precompile"]:  # Dynamo's precompiled frames installed: nothing traced again
        assert warm["dynamo_frames"] == 0
    else:
        assert_compiled_from_caches(compiled["extra"]["warm_start_caches"],
                                    compiled["extra"].get("warm_start_cache_bypasses"), 1)
    assert eager["artifacts_path"] is None and eager["warm_start_s"] is None


def test_every_stored_field(sweep):
    db = open_db(sweep["db_path"])
    rows = {r["id"]: r for r in list_runs(db)}
    assert sorted(rows) == sorted(r["run_id"] for r in sweep["runs"])
    # A CPU run's compile has no GPU part: its compile energy is all CPU (`compile_energy_cpu_*`).
    may_be_null = {"reason", "driver_version", "triton_version", "artifacts_path", "warm_start_s",
                   "compile_energy_gpu_j", "compile_energy_gpu_source"}
    for run in sweep["runs"]:
        row = rows[run["run_id"]]
        for column in db.column_names("runs"):
            if column in GENERATION_RUN_COLUMNS:  # a generation's figures: none for a forward pass
                assert row[column] is None, column
            elif column in RUN_INDEX_COLUMNS:  # `extra`'s, indexed (none of them in a bench run's)
                assert row[column] == json_object(row["extra"]).get(column), column
            elif column not in may_be_null:
                assert row[column] is not None, column
        assert row["device"] == "cpu" and row["device_name"]
        assert row["compile_energy_gpu_j"] is None and row["compile_energy_cpu_source"] == "estimate"
        assert row["compile_energy_j"] == pytest.approx(row["compile_energy_cpu_j"])
        assert row["torch_version"].startswith("2.") and row["joulepilot_version"]
        assert len(row["provenance_key"]) == 16
        assert row["finished_at"] > row["started_at"]
        assert row["idle_power_w"] >= 0 and row["energy_above_idle_j"] <= row["energy_j"]
        assert row["energy_above_idle_j_per_inference"] == pytest.approx(row["energy_above_idle_j"] / row["inferences"])
        assert row["peak_memory_bytes"] > 10_000_000  # RSS of a process with torch loaded
        assert row["warmup_s"] >= 0
        assert row["peak_power_w"] > 0 and math.isfinite(row["peak_power_w"])
        for column in ("latency_ms_p50", "throughput_per_s", "energy_j_per_inference", "compile_s", "max_rel_error"):
            assert row[column] == pytest.approx(run[column])
        samples = power_samples(db, run["run_id"])
        assert samples and all(s["device"] == "cpu:0" and s["power_w"] >= 0 for s in samples)
        assert all(0 <= s["t_s"] <= row["window_s"] + 0.5 for s in samples)
        extra = json.loads(row["extra"])
        assert extra["metered_devices"] == ["cpu:0"] and extra["latency_calls"] >= 10

    (workload,) = list(db.query("SELECT * FROM workloads"))
    assert workload["spec"] == "mlp" and workload["batch_size"] == 4
    assert workload["params"] == 399_370
    assert workload["flops_per_inference"] == 2 * 4 * (256 * 512 + 512 * 512 + 512 * 10)
    assert workload["graph_nodes"] == 5 and json.loads(workload["op_mix"]) == {"linear": 3, "gelu": 2}
    assert json.loads(workload["inputs"]) == [{"shape": [4, 256], "dtype": "float32"}]
    configs = {c["label"]: c for c in db.query("SELECT * FROM configs")}
    assert set(configs) == {"eager/fp32/b4", "default/fp32/b4"}
    assert {c["id"] for c in configs.values()} == {r["config_id"] for r in sweep["runs"]}
    assert db.execute("SELECT count(*) FROM hosts").fetchone()[0] == 1
    assert [d["device"] for d in db.query("SELECT device FROM devices")] == ["cpu:0"]
    db.close()


def test_summary_table_and_a_second_sweep_into_the_same_db(sweep, flow_worker, tmp_path):
    # into a copy of the sweep's store, so the module's other tests see the sweep's runs alone in any order
    db_path = tmp_path / "bench.db"
    shutil.copyfile(sweep["db_path"], db_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JOULEPILOT_HOME", str(sweep["home"]))
        result = CliRunner().invoke(main, ["bench", "mlp", "--modes", "eager", "--device", "cpu", "--batch-size", "4",
                                           "--min-seconds", "0.2", "--db", str(db_path)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    row = next(line for line in lines if "eager/fp32/b4" in line)
    header = lines[:lines.index(row)]  # headers may wrap onto two lines to fit the width
    assert header[-1].split()[:3] == ["run", "config", "status"] and "J/inference" in header[-1]
    assert " ok " in row and max(len(line) for line in lines) <= 120
    assert "source 'estimate'" in result.stdout
    # measured ok under the same provenance by the first sweep: not measured again
    eager_id = next(r["run_id"] for r in sweep["runs"] if r["mode"] == "eager")
    assert f"not measured again (runs {eager_id}); --force redoes them" in result.stdout
    db = open_db(db_path)
    assert len(list_runs(db)) == 2
    db.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JOULEPILOT_HOME", str(sweep["home"]))
        forced = CliRunner().invoke(main, ["bench", "mlp", "--modes", "eager", "--device", "cpu", "--batch-size", "4",
                                           "--min-seconds", "0.2", "--db", str(db_path), "--force"])
    assert forced.exit_code == 0, forced.output
    assert "[1/1] eager/fp32/b4: ok" in forced.stderr
    db = open_db(db_path)
    assert len(list_runs(db)) == 3  # the earlier sweep's runs are kept
    assert db.execute("SELECT count(*) FROM workloads").fetchone()[0] == 1
    db.close()


@pytest.mark.parametrize("option, value", [("--batch-size", "0"), ("--seq-len", "99999999999999999999"),
                                           ("--image-size", "2097152")])
def test_sizes_out_of_range_are_refused_naming_the_option_before_anything_runs(tmp_path, option, value):
    result = CliRunner().invoke(main, ["bench", "mlp", "--device", "cpu", "--db", str(tmp_path / "b.db"),
                                       option, value])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert not (tmp_path / "b.db").exists()  # refused before the database was opened
    assert result.stderr.strip().splitlines() == [
        f"Error: {option}: {value} is not in the range 1<=x<=1048576; give a whole number from 1 to 1,048,576"]


def test_the_clis_size_bound_is_the_shape_sets():
    from joulepilot.compiler.shape_set import MAX_SHAPE_SIZE

    from joulepilot.clikit import MAX_SIZE

    assert MAX_SIZE == MAX_SHAPE_SIZE


@pytest.mark.parametrize("spec, message", [
    ("mlpp", "workload 'mlpp' is not a built-in (mlp, convnet, transformer) and has no ':'; did you mean 'mlp'?"),
    ("no/such/file.py:build", "workload 'no/such/file.py:build': file no/such/file.py does not exist"),
])
def test_a_bad_spec_is_refused_before_torch_is_imported(tmp_path, monkeypatch, spec, message):
    import sys
    import tempfile

    # From here on `import torch` fails: the refusal must come first (importing torch took seconds of a typo's 4 s)
    monkeypatch.setitem(sys.modules, "torch", None)
    # bench first sweeps the scratch folders of killed runs; other tests' kills must not add lines to this stderr
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    result = CliRunner().invoke(main, ["bench", spec, "--db", str(tmp_path / "b.db")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.stderr.startswith(f"Error: {message}") and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (tmp_path / "b.db").exists()
