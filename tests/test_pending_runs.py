"""A COMMIT that fails after a measurement (the database is full) loses nothing: the run waits in a side
file beside the database and the next bench or daemon start imports it, once. The database is made
full for real with SQLite's `max_page_count`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from daemon_factories import query
from joulepilot.compiler import CompileConfig, bench
from joulepilot.store import (
    RunNotStored,
    claim_job,
    commit_run,
    commit_run_or_set_aside,
    enqueue_job,
    host_identity,
    import_pending_runs,
    list_runs,
    open_db,
    pending_dir,
    power_samples,
)

FILLER_WORKLOAD = {"id": "filler-workload", "spec": "filler", "batch_size": 1}
FILLER_CONFIG = CompileConfig(mode="eager", precision="fp16").to_row()


def _make_full(db) -> None:
    """Leave the runs table's only page nearly full, then forbid the file to grow: the next run does not fit."""
    host = host_identity()
    filler = {"workload_id": FILLER_WORKLOAD["id"], "config_id": FILLER_CONFIG["id"], "host_id": host["id"],
              "device": "cpu", "status": "failed", "reason": "filler", "started_at": time.time(),
              "extra": {"filler": "x" * 3600}}
    commit_run(db, filler, host=host, workload=FILLER_WORKLOAD, config=FILLER_CONFIG)
    db.execute("VACUUM")  # no free pages left to reuse
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    assert db.execute(f"PRAGMA max_page_count = {pages}").fetchone()[0] == pages


def _sample_run(status: str = "ok") -> dict:
    return {"workload_id": FILLER_WORKLOAD["id"], "config_id": FILLER_CONFIG["id"], "host_id": host_identity()["id"],
            "device": "cpu", "status": status, "started_at": time.time(), "finished_at": time.time(),
            "energy_j_per_inference": 0.5, "energy_source": "estimate", "extra": {"note": "y" * 600}}


def test_disk_full_commit_keeps_the_run_and_the_next_bench_imports_it(tmp_path, flow_worker):
    path = tmp_path / "full.db"
    db = open_db(path)
    _make_full(db)
    notes: list[str] = []
    (run,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db, idle_s=0,
                   notice=notes.append)
    db.close()
    assert run["status"] == "ok" and run["run_id"] is None and run["energy_j_per_inference"] > 0
    side_file = pending_dir_of(path) / run["pending_path"].split("/")[-1]
    assert side_file.is_file()
    assert any(f"could not be stored: the disk holding {path} is full (SQLite: database or disk is full)" in n
               and str(side_file) in n for n in notes), notes
    check = open_db(path)
    assert [r["reason"] for r in list_runs(check)] == ["filler"]  # the measurement is not in the database
    check.close()
    kept_samples = json.loads(side_file.read_text())["samples"]

    # The next bench start imports it, then finds the configuration measured.
    notes.clear()
    (again,) = bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=path, idle_s=0,
                     notice=notes.append)
    assert again["skipped"] is True
    assert any(n.startswith(f"imported run {again['run_id']} kept in {side_file}") for n in notes), notes
    assert not side_file.exists()
    check = open_db(path)
    stored = next(check.query("SELECT * FROM runs WHERE id = ?", [again["run_id"]]))
    assert stored["energy_j_per_inference"] == pytest.approx(run["energy_j_per_inference"])
    assert stored["latency_ms_p50"] == pytest.approx(run["latency_ms_p50"])
    assert [s["power_w"] for s in power_samples(check, again["run_id"])] == [s[2] for s in kept_samples]
    assert len(list_runs(check)) == 2
    check.close()


def pending_dir_of(db_path):
    return db_path.with_name(db_path.name + ".pending")


def test_when_no_side_file_can_be_written_bench_says_what_was_lost(tmp_path, flow_worker):
    path = tmp_path / "full.db"
    db = open_db(path)
    _make_full(db)
    pending_dir_of(path).write_text("a file where the side folder would go")
    notes: list[str] = []
    with pytest.raises(RunNotStored) as err:
        bench("mlp", [CompileConfig(mode="eager")], device="cpu", min_seconds=0.2, db=db, idle_s=0,
              notice=notes.append)
    db.close()
    assert "database or disk is full" in str(err.value) and str(pending_dir_of(path)) in str(err.value)
    (lost,) = [n for n in notes if n.startswith("lost run of eager/fp32/b1: ")]
    figures = json.loads(lost.split(": ", 1)[1])
    assert figures["status"] == "ok" and figures["energy_j_per_inference"] > 0 and figures["energy_source"]


def test_daemon_start_imports_a_set_aside_run_and_finishes_its_job(tmp_path):
    path = tmp_path / "full.db"
    db = open_db(path)
    job_id, _ = enqueue_job(db, policy="p", workload_id=FILLER_WORKLOAD["id"], config_id=FILLER_CONFIG["id"],
                            provenance_key="k")
    assert claim_job(db, job_id)
    _make_full(db)
    outcome = commit_run_or_set_aside(db, _sample_run(), [(0.0, "cpu:0", 12.5), (0.1, "cpu:0", 13.0)],
                                      host=host_identity(), workload=FILLER_WORKLOAD, config=FILLER_CONFIG,
                                      job_id=job_id)
    db.close()
    assert outcome.run_id is None and "database or disk is full" in outcome.error
    assert outcome.pending_path.parent == pending_dir_of(path)
    assert query(path, "SELECT state FROM jobs") == [{"state": "running"}]
    kept = tmp_path / "copy.json"
    shutil.copy(outcome.pending_path, kept)

    policies = tmp_path / "policies"
    policies.mkdir()
    proc = subprocess.run([sys.executable, "-m", "joulepilot", "daemon", "--db", str(path), "--policies", str(policies),
                           "--once", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (job,) = query(path, "SELECT * FROM jobs")
    assert job["state"] == "done" and job["run_id"] is not None  # finished, not re-queued as an orphan
    assert f"imported run {job['run_id']} (job {job_id})" in proc.stderr
    assert "re-queued" not in proc.stderr
    assert not outcome.pending_path.exists()
    samples = query(path, "SELECT power_w FROM power_samples WHERE run_id = ?", [job["run_id"]])
    assert [s["power_w"] for s in samples] == [12.5, 13.0]

    # Killed between the import's commit and the file's removal: the next import stores nothing twice.
    shutil.copy(kept, outcome.pending_path)
    again = open_db(path)
    (item,) = import_pending_runs(again)
    assert item.already_stored and item.run_id == job["run_id"]
    assert again.execute("SELECT COUNT(*) FROM runs WHERE status = 'ok'").fetchone()[0] == 1
    assert pending_dir(again) == pending_dir_of(path) and not outcome.pending_path.exists()
    again.close()
