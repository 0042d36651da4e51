"""Copy a job's finished run from the child's scratch database into the real one, atomically.

The run, its power samples, the rows it references and the job's new state are written in one
transaction: after a crash the database holds either none of them or all of them, and a job is
never measured twice for one stored run.
"""

from __future__ import annotations

import json
import os
from typing import Any

import sqlite_utils
from joulepilot.store import insert_run, open_db, power_samples, transaction
from joulepilot.store.daemon_state import finish_job


def _row(db: sqlite_utils.Database, table: str, key: str) -> dict[str, Any] | None:
    rows = list(db.query(f"SELECT * FROM {table} WHERE id = ?", [key]))
    return rows[0] if rows else None


def store_job_result(db: sqlite_utils.Database, job: dict[str, Any], scratch_path: str | os.PathLike) -> int:
    """Store the single run in `scratch_path` for `job`; returns the new run id.

    The job ends `done` when the run is ok and `failed` otherwise (the failed run, with its reason,
    is kept: it is what the resolver reports for that configuration).
    """
    scratch = open_db(scratch_path)
    try:
        runs = list(scratch.query("SELECT * FROM runs ORDER BY id"))
        if len(runs) != 1:
            raise RuntimeError(f"job {job['id']}: expected one run in {scratch_path}, found {len(runs)}")
        run = runs[0]
        samples = [(s["t_s"], s["device"], s["power_w"]) for s in power_samples(scratch, run["id"])]
        host = _row(scratch, "hosts", run["host_id"])
        workload = _row(scratch, "workloads", run["workload_id"])
        config = _row(scratch, "configs", run["config_id"])
        devices = list(scratch.query("SELECT * FROM devices"))
    finally:
        scratch.close()

    extra = json.loads(run.get("extra") or "{}")
    extra.update({"job_id": job["id"], "daemon_pid": os.getpid(), "policy": job["policy"],
                  "job_provenance_key": job["provenance_key"]})
    run = {k: v for k, v in run.items() if k != "id"}
    run["extra"] = extra
    with transaction(db):
        if host:
            db["hosts"].insert(host, pk="id", ignore=True)
        if devices:
            db["devices"].upsert_all(devices, pk="id")
        if workload:
            have = _row(db, "workloads", workload["id"])
            if have is None or (have.get("params") is None and workload.get("params") is not None):
                db["workloads"].upsert(workload, pk="id")
        if config:
            db["configs"].insert(config, pk="id", ignore=True)
        run_id = insert_run(db, run, samples)
        finish_job(db, job["id"], state="done" if run["status"] == "ok" else "failed", run_id=run_id)
    return run_id
