"""Compile energy in a GPU part and a CPU part: the schema migration of an old database, export and import
(new files round trip, old files still import), and which runs count as a complete compile energy."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from joulepilot.store import (
    SCHEMA_VERSION,
    RunRow,
    compile_energy_text,
    complete_compile_energy_j,
    export_runs,
    import_runs,
    insert_run,
    list_runs,
    ok_runs,
    open_db,
    read_export,
    schema_version,
    upsert_config,
    upsert_host,
    upsert_workload,
    write_export,
)
from joulepilot.store.connection import Store
from joulepilot.store.schema import MIGRATIONS

H200_SWEEP = Path(__file__).parent / "data" / "gpu_sweep_h200.json"


def _old_database(path: Path, version: int) -> None:
    """A database as joulepilot left it at schema `version`, with a GPU run, a CPU run and a failed run."""
    conn = sqlite3.connect(path, isolation_level=None)
    for migration in MIGRATIONS[:version]:
        migration(Store(conn))
    conn.execute(f"PRAGMA user_version = {version}")
    conn.execute("INSERT INTO hosts VALUES ('h1', 'box', 'x86', 1.0)")
    conn.execute("INSERT INTO workloads (id, spec, batch_size, created_at) VALUES ('w1', 'mlp', 8, 1.0)")
    conn.execute("INSERT INTO configs VALUES ('c1', 'default', 'default', 'default', '{}', 'fp32', 0, 8)")
    for device, compile_j, source, status in (("cuda:0", 412.5, "nvml", "ok"), ("cpu", 96.0, "estimate", "ok"),
                                              ("cuda:0", None, None, "failed")):
        conn.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at, compile_s,"
                     " compile_energy_j, energy_j_per_inference, energy_source) VALUES"
                     " ('w1', 'c1', 'h1', ?, ?, 2.0, 3.0, ?, 0.25, ?)", [device, status, compile_j, source])
    conn.close()


def _by_device(db) -> dict[str, dict]:
    return {(r["device"], r["status"]): r for r in list_runs(db)}


def test_migrating_an_old_database_keeps_each_runs_figure_as_its_devices_part(tmp_path):
    path = tmp_path / "old.db"
    _old_database(path, 4)

    db = open_db(path)

    assert schema_version(db) == SCHEMA_VERSION
    runs = _by_device(db)
    gpu, cpu, failed = runs[("cuda:0", "ok")], runs[("cpu", "ok")], runs[("cuda:0", "failed")]
    # The GPU run's one figure was the GPU counter: the GPU part; its CPU part was never metered.
    assert (gpu["compile_energy_gpu_j"], gpu["compile_energy_gpu_source"]) == (412.5, "nvml")
    assert (gpu["compile_energy_cpu_j"], gpu["compile_energy_cpu_source"]) == (None, None)
    assert gpu["compile_energy_j"] == 412.5
    # A CPU run's figure was the CPU meter (here the estimate), and it keeps that label.
    assert (cpu["compile_energy_cpu_j"], cpu["compile_energy_cpu_source"]) == (96.0, "estimate")
    assert cpu["compile_energy_gpu_j"] is None
    assert all(failed[c] is None for c in ("compile_energy_gpu_j", "compile_energy_cpu_j"))
    # Only the CPU run has its whole compile energy; the old GPU run lacks its CPU part.
    complete = {r.device: r.complete_compile_energy_j for r in ok_runs(db)}
    assert complete == {"cuda:0": None, "cpu": 96.0}


def test_a_database_from_version_1_reaches_the_parts_too(tmp_path):
    path = tmp_path / "v1.db"
    _old_database(path, 1)
    db = open_db(path)
    assert _by_device(db)[("cuda:0", "ok")]["compile_energy_gpu_j"] == 412.5


def _seed_new(db) -> None:
    host = upsert_host(db, {"id": "h1", "hostname": "box", "cpu": "x86"})
    upsert_workload(db, {"id": "w1", "spec": "mlp", "batch_size": 8})
    upsert_config(db, {"id": "c1", "label": "default/fp32/b8", "mode": "default", "fusion": "default",
                       "options": {}, "precision": "fp32", "dynamic": False, "batch_size": 8})
    insert_run(db, {"workload_id": "w1", "config_id": "c1", "host_id": host, "device": "cuda:0", "status": "ok",
                    "started_at": 5.0, "compile_s": 14.0, "compile_energy_j": 1306.0,
                    "compile_energy_gpu_j": 1120.0, "compile_energy_gpu_source": "nvml",
                    "compile_energy_cpu_j": 186.0, "compile_energy_cpu_source": "estimate",
                    "energy_j_per_inference": 1.1, "energy_source": "nvml"})


def test_export_and_import_round_trip_the_parts_and_their_sources(tmp_path, db):
    _seed_new(db)
    path = tmp_path / "runs.json"
    write_export(path, export_runs(db))
    other = open_db(tmp_path / "other.db")

    assert len(import_runs(other, read_export(path))) == 1

    (run,) = list_runs(other)
    assert {k: run[k] for k in ("compile_energy_j", "compile_energy_gpu_j", "compile_energy_gpu_source",
                                "compile_energy_cpu_j", "compile_energy_cpu_source")} == {
        "compile_energy_j": 1306.0, "compile_energy_gpu_j": 1120.0, "compile_energy_gpu_source": "nvml",
        "compile_energy_cpu_j": 186.0, "compile_energy_cpu_source": "estimate"}
    assert complete_compile_energy_j(run) == pytest.approx(1306.0)


def test_a_part_exported_as_not_metered_stays_not_metered(tmp_path, db):
    """A new export whose CPU part is null is not an old export: the null is imported, not re-derived."""
    _seed_new(db)
    records = export_runs(db)
    records[0]["run"] = {**records[0]["run"], "compile_energy_cpu_j": None, "compile_energy_cpu_source": None,
                         "compile_energy_gpu_j": None, "compile_energy_gpu_source": None}
    other = open_db(tmp_path / "other.db")
    import_runs(other, records)
    (run,) = list_runs(other)
    assert run["compile_energy_gpu_j"] is None and run["compile_energy_cpu_j"] is None


def test_an_old_export_without_the_parts_still_imports_like_a_migrated_database(tmp_path):
    records = read_export(H200_SWEEP)
    assert not any("compile_energy_cpu_j" in r["run"] for r in records)  # written before the parts existed
    db = open_db(tmp_path / "a.db")

    assert len(import_runs(db, records)) == len(records)

    runs = list_runs(db)
    ok = [r for r in runs if r["status"] == "ok"]
    assert ok and all(r["compile_energy_gpu_j"] == r["compile_energy_j"] for r in ok)
    assert {r["compile_energy_gpu_source"] for r in ok} == {"nvml"}
    assert all(r["compile_energy_cpu_j"] is None for r in runs)
    assert all(RunRow.from_columns(r).complete_compile_energy_j is None for r in runs)


def test_compile_energy_text_names_each_part_and_its_source():
    assert compile_energy_text({"device": "cuda:0", "compile_energy_j": 1306.0, "compile_energy_gpu_j": 1120.0,
                                "compile_energy_gpu_source": "nvml", "compile_energy_cpu_j": 186.0,
                                "compile_energy_cpu_source": "estimate"}) == \
        "1,306 J (GPU 1,120 J nvml + CPU 186 J estimate)"
    assert compile_energy_text({"device": "cuda:0", "compile_energy_j": 412.5, "compile_energy_gpu_j": 412.5,
                                "compile_energy_gpu_source": "nvml"}) == "412 J (GPU 412 J nvml + CPU not metered)"
    assert compile_energy_text({"device": "cpu", "compile_energy_j": 96.0, "compile_energy_cpu_j": 96.0,
                                "compile_energy_cpu_source": "rapl"}) == "96 J (CPU 96 J rapl)"
