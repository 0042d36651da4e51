"""`joulepilot runs` (date column, --since) and `runs export` / `runs import` between hosts' databases."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.store import (
    export_runs,
    insert_run,
    list_runs,
    open_db,
    read_export,
    upsert_config,
    upsert_host,
    upsert_workload,
)
from joulepilot.store.timevalues import local_minute

from joulepilot.cli import main

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "tests" / "data" / "gpu_sweep_h200.json"
DAY = 86400.0


def _host_db(path: Path, host: str, runs: list[tuple[str, float]]) -> Path:
    """A database of one host with runs of (workload spec, started_at)."""
    db = open_db(path)
    host_id = upsert_host(db, {"id": f"id-{host}", "hostname": host, "cpu": "x86_64"})
    cid = upsert_config(db, {"id": "c-default", "label": "default/fp32/b8", "mode": "default", "fusion": "default",
                             "options": {"max_fusion_size": 32}, "precision": "fp32", "dynamic": False,
                             "batch_size": 8})
    for spec, started in runs:
        wid = upsert_workload(db, {"id": f"w-{spec}", "spec": spec, "batch_size": 8, "op_mix": {"linear": 2}})
        insert_run(db, {"workload_id": wid, "config_id": cid, "host_id": host_id, "device": "cuda:0",
                        "device_name": "NVIDIA H200", "status": "ok", "started_at": started,
                        "finished_at": started + 3.25, "energy_j_per_inference": 1.5, "energy_source": "nvml",
                        "extra": {"host": host}})
    db.close()
    return path


def _ok(*args: str):
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, list(args))  # wide enough for one-line headers
    assert result.exit_code == 0, result.output
    return result


def test_runs_shows_the_date_and_filters_by_since(tmp_path):
    now = time.time()
    path = _host_db(tmp_path / "a.db", "a", [("mlp", now - 10 * DAY), ("mlp", now - DAY), ("convnet", now - 60)])
    table = _ok("runs", "--db", str(path)).stdout.splitlines()
    assert table[0].split()[:3] == ["id", "started", "workload"]
    assert local_minute(now - 60) in table[1] and local_minute(now - 10 * DAY) in table[3]
    assert [r["id"] for r in json.loads(_ok("runs", "--db", str(path), "--since", "7d", "--json").stdout)] == [3, 2]
    assert [r["id"] for r in json.loads(_ok("runs", "--db", str(path), "--since", "2h", "--json").stdout)] == [3]
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 2 * DAY))  # naive ISO: local time
    assert len(json.loads(_ok("runs", "--db", str(path), "--since", iso, "--json").stdout)) == 2
    bad = CliRunner().invoke(main, ["runs", "--db", str(path), "--since", "last week"])
    assert bad.exit_code == 1 and "--since 'last week': expected an ISO time" in bad.output


def test_export_filters_and_import_merges_hosts(tmp_path):
    now = time.time()
    a = _host_db(tmp_path / "a.db", "a", [("mlp", now - 10 * DAY), ("mlp", now - DAY), ("convnet", now - DAY)])
    b = _host_db(tmp_path / "b.db", "b", [("mlp", now - 2 * DAY)])
    out = tmp_path / "a-mlp.json"
    result = _ok("runs", "export", str(out), "--db", str(a), "--workload", "mlp", "--since", "7d")
    assert "exported 1 run(s) of 1 workload(s) from 1 host(s)" in result.stderr
    records = json.loads(out.read_text())
    assert [r["run"]["started_at_epoch"] for r in records] == [pytest.approx(now - DAY)]
    assert records[0]["config"]["options"] == {"max_fusion_size": 32} and records[0]["config"]["dynamic"] is False
    assert records[0]["run"]["extra"] == {"host": "a"}

    imported = _ok("runs", "import", str(out), "--db", str(b), "--json")
    assert [(r["imported"], r["skipped"]) for r in json.loads(imported.stdout)] == [(1, 0)]
    merged = list_runs(open_db(b, read_only=True))
    assert sorted(r["extra"] for r in merged) == ['{"host": "a"}', '{"host": "b"}']
    a_run = next(r for r in list_runs(open_db(a, read_only=True)) if r["started_at"] == pytest.approx(now - DAY)
                 and r["workload"] == "mlp")
    b_copy = next(r for r in merged if r["host_id"] == "id-a")
    for column in ("started_at", "finished_at", "energy_j_per_inference", "options", "dynamic", "workload",
                   "device_name", "extra"):
        assert b_copy[column] == a_run[column], column  # exactly as stored on host a

    again = _ok("runs", "import", str(out), "--db", str(b))
    assert f"{out}: 0 run(s) imported, 1 already present" in again.stdout
    assert len(list_runs(open_db(b, read_only=True))) == 2


def test_export_to_stdout_and_import_of_several_files(tmp_path):
    now = time.time()
    a = _host_db(tmp_path / "a.db", "a", [("mlp", now - 3 * DAY), ("convnet", now - DAY)])
    everything = tmp_path / "all.json"
    everything.write_text(_ok("runs", "export", "-", "--db", str(a)).stdout)
    recent = tmp_path / "recent.json"
    _ok("runs", "export", str(recent), "--db", str(a), "--since", "2d")
    target = tmp_path / "c.db"  # import creates the database
    result = _ok("runs", "import", str(everything), str(recent), "--db", str(target), "--json")
    assert [(r["file"], r["imported"], r["skipped"]) for r in json.loads(result.stdout)] == [
        (str(everything), 2, 0), (str(recent), 0, 1)]
    assert sorted(r["workload"] for r in list_runs(open_db(target, read_only=True))) == ["convnet", "mlp"]


def test_files_in_the_stored_row_shape_import_too(tmp_path):
    target = tmp_path / "t.db"
    _ok("runs", "import", str(SWEEP), "--db", str(target))  # the committed sweep has epoch floats and JSON text
    db = open_db(target, read_only=True)
    assert len(list_runs(db, limit=None)) == len(json.loads(SWEEP.read_text()))
    # and an export of it reads back to the same stored rows
    again = tmp_path / "again.json"
    _ok("runs", "export", str(again), "--db", str(target))
    assert read_export(again) == export_runs(db)


@pytest.mark.parametrize("content,needle", [
    ("{not json", "is not a joulepilot runs export: not JSON"),
    ('{"runs": []}', "expected a JSON list of records, found dict"),
    ('[{"run": {}}]', "record 0 lacks workload, config, host"),
])
def test_a_bad_file_is_one_line_and_nothing_is_imported(tmp_path, content, needle):
    now = time.time()
    good = tmp_path / "good.json"
    _ok("runs", "export", str(good), "--db", str(_host_db(tmp_path / "a.db", "a", [("mlp", now)])))
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    target = tmp_path / "t.db"
    open_db(target).close()
    result = CliRunner().invoke(main, ["runs", "import", str(good), str(bad), "--db", str(target)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {bad}") and needle in lines[0], result.output
    assert list_runs(open_db(target, read_only=True)) == []  # the good file was not imported either


def test_a_record_missing_a_field_names_the_file_record_and_field(tmp_path):
    now = time.time()
    out = tmp_path / "runs.json"
    _ok("runs", "export", str(out), "--db", str(_host_db(tmp_path / "a.db", "a", [("mlp", now), ("mlp", now + 1)])))
    records = json.loads(out.read_text())
    del records[1]["config"]["label"]
    records[0]["run"]["started_at"] = "yesterday"
    del records[0]["run"]["started_at_epoch"]
    out.write_text(json.dumps(records))
    target = tmp_path / "t.db"
    result = CliRunner().invoke(main, ["runs", "import", str(out), "--db", str(target)])
    assert result.exit_code == 1
    assert result.output.strip() == (f"Error: {out}: record 0 (run 1): run.started_at: 'yesterday' is not an ISO 8601 "
                                     f"time")
    records[0]["run"]["started_at"] = "2024-05-01T00:00:00+00:00"
    out.write_text(json.dumps(records))
    result = CliRunner().invoke(main, ["runs", "import", str(out), "--db", str(target)])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {out}: record 1 (run 2): config.label is missing")
    assert list_runs(open_db(target, read_only=True)) == []


@pytest.fixture
def db(backend_db):
    """Every test here on both backends (SQLite and PostgreSQL)."""
    return backend_db
