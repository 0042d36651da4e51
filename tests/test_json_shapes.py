"""One JSON shape in every command (docs/json.md): JSON columns as objects, flags as booleans, times as
ISO 8601 UTC text with the epoch seconds beside them."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.store import (
    import_runs,
    iso_utc,
    json_output,
    list_runs,
    open_db,
    read_export,
    row_from_json,
    upsert_host,
)
from joulepilot.store.daemon_state import write_heartbeat
from joulepilot.store.deployments import insert_samples, insert_violation, register_deployment

from joulepilot.cli import main

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "tests" / "data" / "gpu_sweep_h200.json"
H200 = ["--device-name", "NVIDIA H200", "--torch-version", "2.11"]
JSON_TEXT = ("options", "extra", "details", "detail", "op_mix", "inputs")


def assert_shaped(value, where="$"):
    """Every object of the output follows the shape: no JSON inside strings, no 0/1 flags, ISO times."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{where}.{key}"
            if key in JSON_TEXT:
                assert not (isinstance(item, str) and item[:1] in "{["), f"{here} is JSON text: {item[:40]}"
            if key == "dynamic":
                assert isinstance(item, bool), f"{here} = {item!r}"
            if key.endswith("_at") or key in ("at", "t_start", "t_end", "since", "start", "end"):
                assert f"{key}_epoch" in value, f"{here} has no {key}_epoch beside it"
                epoch = value[f"{key}_epoch"]
                if item is None:
                    assert epoch is None
                else:
                    assert isinstance(item, str), f"{here} = {item!r}"
                    assert datetime.fromisoformat(item).utcoffset().total_seconds() == 0, here
                    assert abs(datetime.fromisoformat(item).timestamp() - epoch) < 1, here
            assert_shaped(item, here)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            assert_shaped(item, f"{where}[{i}]")


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "jp.db"
    db = open_db(path)
    import_runs(db, read_export(SWEEP))
    host = upsert_host(db)
    dep = register_deployment(db, "svc", device="cpu", host_id=host)
    t0 = time.time() - 60
    insert_samples(db, dep, [{"t_start": t0 + i, "t_end": t0 + i + 1, "energy_j": 5.0, "inferences": 10,
                              "avg_power_w": 5.0, "peak_power_w": 6.0, "energy_source": "rapl"} for i in range(3)])
    insert_violation(db, policy="resnet50", deployment="svc", limit_name="max_avg_power_w", limit_value=4.0,
                     measured_value=5.0, at=t0 + 2)
    write_heartbeat(db, "idle", {"doing": "waiting", "hostname": os.uname().nodename,
                                 "last_pass": {"started_at": t0, "finished_at": t0 + 5}})
    db.close()
    shutil.copy(REPO / "examples" / "policies" / "resnet50.toml", tmp_path / "resnet50.toml")
    return tmp_path


def _json(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_runs_json_has_objects_booleans_and_iso_times(store):
    rows = _json("runs", "--db", str(store / "jp.db"), "--json", "--limit", "0")
    assert len(rows) == len(read_export(SWEEP))
    stored = {r["id"]: r for r in list_runs(open_db(store / "jp.db", read_only=True))}
    for row in rows:
        assert isinstance(row["options"], dict) and isinstance(row["extra"], dict)
        assert row["dynamic"] is False
        assert row["started_at_epoch"] == stored[row["id"]]["started_at"]
        assert row["started_at"] == iso_utc(stored[row["id"]]["started_at"])
    assert_shaped(rows)


def test_every_command_prints_the_same_shape(store):
    db = ["--db", str(store / "jp.db")]
    policy = str(store / "resnet50.toml")
    outputs = {
        "runs": _json("runs", *db, "--json"),
        "status": _json("status", *db, "--json"),
        "explain": _json("policy", "explain", policy, *db, *H200, "--json"),
        "lock": _json("policy", "lock", policy, *db, *H200, "--json"),
        "frontier": _json("frontier", "torchvision:resnet50", *db, "--json"),
        "fit": _json("fit", *db, "--json"),
        "report": _json("report", *db, "-d", "svc", "--json"),
        "report-all": _json("report", *db, "--all", "--json"),
        "measure": _json("measure", "--json", "--", sys.executable, "-c", "pass"),
    }
    for name, data in outputs.items():
        assert_shaped(data, name)
    explain = outputs["explain"]
    assert isinstance(explain["config"]["options"], dict) and explain["config"]["dynamic"] is False
    assert all(isinstance(c["config"]["dynamic"], bool) for c in explain["candidates"])
    assert explain["decided_at"] == iso_utc(explain["decided_at_epoch"])
    status = outputs["status"]
    assert status["daemon"]["last_heartbeat_at"] == iso_utc(status["daemon"]["last_heartbeat_at_epoch"])
    assert status["last_pass"]["finished_at_epoch"] - status["last_pass"]["started_at_epoch"] == pytest.approx(5)
    sample = outputs["report"]["samples"][0]
    assert sample["t_end_epoch"] - sample["t_start_epoch"] == pytest.approx(1)
    assert outputs["report"]["envelope"]["violations"][0]["at"].endswith("+00:00")
    assert outputs["fit"]["model"]["fitted_at_epoch"] > 0
    assert outputs["measure"]["started_at"] == iso_utc(outputs["measure"]["started_at_epoch"])


def test_the_shape_is_idempotent_and_reversible(store):
    db = open_db(store / "jp.db", read_only=True)
    for table in ("runs", "configs", "workloads", "hosts"):
        columns = db.column_names(table)
        for row in db.query(f"SELECT * FROM {table}"):
            shaped = json.loads(json.dumps(json_output(row)))
            assert json_output(shaped) == shaped  # shaping shaped data changes nothing
            assert row_from_json(shaped, columns) == row  # and the stored row comes back exactly
            assert row_from_json(row, columns) == row


def test_non_finite_figures_and_plain_text_are_kept_safe():
    out = json_output({"energy_j": float("nan"), "note": "reduce-overhead ran like default", "at": None,
                       "options": "not json {", "dynamic": 2, "started_at": float("inf")})
    assert out == {"energy_j": None, "note": "reduce-overhead ran like default", "at": None, "at_epoch": None,
                   "options": "not json {", "dynamic": 2, "started_at": None, "started_at_epoch": None}
