"""Typed rows from the store: one meaning of "the latest decision", one `latest_runs`, one device kind,
one JSON decoder, and row classes that name every column of their tables."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.controller import features
from joulepilot.controller.redecide import refused_request
from joulepilot.controller.status import daemon_status
from joulepilot.store import insert_run, open_db, upsert_config, upsert_host, upsert_workload
from joulepilot.store.daemon_state import (
    HeartbeatRow,
    JobRow,
    enqueue_job,
    latest_heartbeat,
    list_jobs,
    write_heartbeat,
)
from joulepilot.store.decisions import DecisionRow, latest_decision, latest_decisions, write_decision
from joulepilot.store.devicekind import device_kind
from joulepilot.store.jsonvalues import json_column, json_object
from joulepilot.store.runs import RunRow, latest_runs, workload_runs

DEEP = "[" * 200_000  # deeper than the JSON decoder can recurse


def _decision(db, *, decided_at: float, reason: str, config_id: str, state: str = "verified") -> int:
    return write_decision(db, {"policy": "svc", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                               "config_id": config_id, "state": state, "reason": reason, "decided_at": decided_at,
                               "details": {"workload_id": "w1"}})


def test_status_and_exporter_show_the_decision_the_hook_applies(tmp_path):
    """A decision stored later but made earlier (a slow `policy lock` finishing after the daemon) is not
    the latest: every reader orders by decided_at, then id."""
    path = tmp_path / "j.db"
    db = open_db(path)
    now = time.time()
    newest = _decision(db, decided_at=now, reason="made last", config_id="c-new")
    _decision(db, decided_at=now - 3600, reason="made an hour ago, stored after", config_id="c-old")

    assert latest_decision(db, "svc", "cpu").id == newest
    assert [(d.id, d.reason) for d in latest_decisions(db)] == [(newest, "made last")]
    shown = daemon_status(db, path)["decisions"]
    assert [(d["config"], d["reason"]) for d in shown] == [("c-new", "made last")]


def test_latest_decision_for_a_configuration_and_decoded_details(db):
    now = time.time()
    for_a = _decision(db, decided_at=now - 10, reason="a", config_id="c-a")
    _decision(db, decided_at=now, reason="b", config_id="c-b")
    row = latest_decision(db, "svc", "cpu", config_id="c-a")
    assert isinstance(row, DecisionRow) and row.id == for_a and row.details == {"workload_id": "w1"}
    assert latest_decision(db, "svc", "cpu", config_id="c-none") is None
    assert json.loads(json.dumps(row.to_dict()))["details"] == {"workload_id": "w1"}
    assert row["state"] == row.state and dict(row)["config_id"] == "c-a" and "details" in row
    # a row answers as the dict it replaced: unknown names are absent, not errors of another kind
    assert "nope" not in row and ["details"] not in row and row.get("nope", 7) == 7
    with pytest.raises(KeyError):
        row["nope"]
    assert list(row) == list(row.keys()) == [f.name for f in dataclasses.fields(DecisionRow)]


@pytest.mark.parametrize("table, row_class", [("decisions", DecisionRow), ("runs", RunRow), ("jobs", JobRow),
                                              ("heartbeats", HeartbeatRow)])
def test_row_classes_name_every_column_of_their_table(db, table, row_class):
    columns = db.column_names(table)
    missing = columns - set(row_class.column_names())
    assert not missing, f"{row_class.__name__} lacks fields for {sorted(missing)}: a migration added them"


def _runs_db(db):
    host = upsert_host(db, {"id": "h", "hostname": "h", "cpu": "x86"})
    wid = upsert_workload(db, {"id": workload_id("mlp", 8), "spec": "mlp", "batch_size": 8})
    ids = {}
    t = time.time() - 1000

    def run(name: str, mode: str, status: str, *, device="cpu", device_name=None, torch="2.13.0+cpu"):
        nonlocal t
        t += 1
        cfg = CompileConfig(mode, batch_size=8)
        upsert_config(db, cfg.to_row())
        ids[name] = insert_run(db, {"workload_id": wid, "config_id": cfg.id, "host_id": host, "device": device,
                                    "device_name": device_name, "status": status, "started_at": t,
                                    "torch_version": torch, "energy_j_per_inference": 1.0,
                                    "extra": {"window_warning": "slow"} if name == "eager-ok" else {}})
        return cfg.id

    eager = run("eager-ok", "eager", "ok")
    run("eager-failed-later", "eager", "failed")
    default = run("default-failed", "default", "failed")
    reduce = run("reduce-other-torch", "reduce-overhead", "ok", torch="2.11.0")
    run("eager-gpu", "eager", "ok", device="cuda:0", device_name="NVIDIA H200")
    return wid, ids, {"eager": eager, "default": default, "reduce": reduce}


def test_latest_runs_per_configuration_by_device_kind_and_torch(db):
    wid, ids, cfg = _runs_db(db)
    latest = latest_runs(db, wid, "cpu", "2.13")
    assert {k: r.id for k, r in latest.items()} == {cfg["eager"]: ids["eager-ok"]}  # a later failure is no news
    with_failed = latest_runs(db, wid, "cpu", "2.13", failed_if_no_ok=True)
    assert {k: r.id for k, r in with_failed.items()} == {cfg["eager"]: ids["eager-ok"],
                                                         cfg["default"]: ids["default-failed"]}
    any_torch = latest_runs(db, wid, "cpu")
    assert {k: r.id for k, r in any_torch.items()} == {cfg["eager"]: ids["eager-ok"],
                                                       cfg["reduce"]: ids["reduce-other-torch"]}
    on_gpu = latest_runs(db, wid, "NVIDIA H200", "2.13")
    assert [r.id for r in on_gpu.values()] == [ids["eager-gpu"]]
    run = latest[cfg["eager"]]
    assert run.extra == {"window_warning": "slow"} and run.options == {} and run.config_label == "eager/fp32/b8"
    newest_first = [ids["default-failed"], ids["eager-failed-later"], ids["eager-ok"]]
    assert [r.id for r in workload_runs(db, wid, "cpu", "2.13")] == newest_first


def test_one_device_kind_for_every_row_shape():
    assert device_kind({"device": "cpu", "device_name": "AMD EPYC"}) == "cpu"
    assert device_kind({"device": "cuda:1", "device_name": "NVIDIA H100"}) == "NVIDIA H100"
    assert device_kind({"device": "cuda:0", "device_name": None}) == "cuda:0"
    assert device_kind({}) == "cpu"

    class Row:
        device, device_name = "cuda:0", "NVIDIA H200"

    assert device_kind(Row()) == "NVIDIA H200"
    assert features.device_kind is device_kind  # the trade-off features group runs the same way


def test_json_columns_decode_without_raising():
    assert json_column(DEEP, "fallback") == "fallback"
    assert json_object('{"a": 1}') == {"a": 1}
    assert json_object("[1, 2]") == {} and json_object("not json") == {} and json_object(None) == {}
    refusal = refused_request({"id": 3, "policy": "p", "note": DEEP}, [])
    assert refusal["policy_path"] is None and "no policy named 'p'" in refusal["reason"]


def test_heartbeats_and_jobs_are_typed_rows(db):
    write_heartbeat(db, "idle", {"doing": "waiting"})
    beat = latest_heartbeat(db)
    assert isinstance(beat, HeartbeatRow) and beat.state == "idle" and beat.detail == {"doing": "waiting"}
    db.execute("UPDATE heartbeats SET detail = ? WHERE id = ?", ["{broken", beat.id])
    assert latest_heartbeat(db).detail == {"raw": "{broken"}

    upsert_workload(db, {"id": "w1", "spec": "mlp", "batch_size": 8})
    job_id, _ = enqueue_job(db, policy="svc", workload_id="w1", config_id="c1", provenance_key="k")
    [job] = list_jobs(db)
    assert isinstance(job, JobRow) and (job.id, job.state, job.workload, job.config_label) == (job_id, "queued",
                                                                                              "mlp", None)
    assert json.loads(json.dumps(job.to_dict()))["policy"] == "svc"



@pytest.fixture
def db(backend_db):
    """Every test here on both backends (SQLite and PostgreSQL)."""
    return backend_db
