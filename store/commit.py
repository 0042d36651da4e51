"""Storing a finished measurement: the run, the rows it references and (for the daemon) its job's new
state in one transaction; and the reads `bench` and the daemon need before measuring."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .connection import Store
from .daemon_state import finish_job
from .db import transaction
from .jsonvalues import json_object
from .records import insert_run, upsert_config, upsert_devices, upsert_workload
from .schema import RUN_INDEX_COLUMNS


def run_columns(db: Store) -> set[str]:
    """The columns of the runs table that a result fills (its other keys go into `extra`; the columns indexing
    `extra` are filled from it)."""
    return db.column_names("runs") - set(RUN_INDEX_COLUMNS)


def workload_needs_description(db: Store, workload_id: str) -> bool:
    """True when the workload is unknown or stored without its description (parameters, FLOPs)."""
    row = db.execute("SELECT params, flops_per_inference FROM workloads WHERE id = ?", [workload_id]).fetchone()
    return row is None or (row[0] is None and row[1] is None)


def find_ok_run(db: Store, *, workload_id: str, config_id: str, provenance_key: str,
                device: str) -> int | None:
    """The newest ok run of this workload and configuration on `device` under `provenance_key`."""
    row = db.execute(
        "SELECT id FROM runs WHERE workload_id = ? AND config_id = ? AND provenance_key = ? AND device = ?"
        " AND status = 'ok' ORDER BY id DESC LIMIT 1",
        [workload_id, config_id, provenance_key, device],
    ).fetchone()
    return None if row is None else int(row[0])


def _write_references(db: Store, host: Mapping[str, Any] | None,
                      devices: Iterable[Mapping[str, Any]], workload: Mapping[str, Any] | None,
                      config: Mapping[str, Any] | None) -> None:
    if host:
        db.execute("INSERT INTO hosts (id, hostname, cpu, created_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                   [host["id"], host["hostname"], host.get("cpu"), host.get("created_at") or time.time()])
        devices = list(devices)
        if devices:
            upsert_devices(db, host["id"], devices)
    if workload:
        have = db.execute("SELECT params FROM workloads WHERE id = ?", [workload["id"]]).fetchone()
        if have is None or (have[0] is None and workload.get("params") is not None):
            upsert_workload(db, workload)
    if config:
        known = db.execute("SELECT 1 FROM configs WHERE id = ?", [config["id"]]).fetchone()
        if known is None:
            upsert_config(db, config)


def commit_run(db: Store, run: Mapping[str, Any], samples: Sequence[Sequence[Any]] = (), *,
               host: Mapping[str, Any] | None = None, devices: Iterable[Mapping[str, Any]] = (),
               workload: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
               job_id: int | None = None,
               further: Sequence[tuple[Mapping[str, Any], Sequence[Sequence[Any]]]] = ()) -> int:
    """Write one finished run with its power samples, the host, devices, workload and configuration
    rows it references, and, when `job_id` is given, that job's end (`done` for an ok run, `failed`
    otherwise), all in one transaction; returns the run id. `further`: (run, samples) of the further
    windows the same worker took, stored after it in the same transaction, each with the first run's id
    in `extra.first_run_id`. A kill at any moment leaves all of it or none of it."""
    with transaction(db):
        _write_references(db, host, devices, workload, config)
        run_id = insert_run(db, run, [tuple(s) for s in samples])  # type: ignore[misc]
        for more, more_samples in further:
            extra = json_object(more.get("extra")) if isinstance(more.get("extra"), str) \
                else dict(more.get("extra") or {})
            insert_run(db, {**more, "extra": {**extra, "first_run_id": run_id}},
                       [tuple(s) for s in more_samples])  # type: ignore[misc]
        if job_id is not None:
            finish_job(db, job_id, state="done" if run.get("status") == "ok" else "failed", run_id=run_id)
    return run_id


def run_warm_start_state(db: Store, run_id: int) -> tuple[str | None, float | None]:
    """(artifacts_path, warm_start_s) of a stored run; (None, None) for a run that does not exist."""
    row = db.execute("SELECT artifacts_path, warm_start_s FROM runs WHERE id = ?", [int(run_id)]).fetchone()
    return (None, None) if row is None else (row[0], row[1])


def record_warm_start(db: Store, run_id: int, warm_start_s: float | None,
                      details: Mapping[str, Any]) -> bool:
    """Set a stored run's `warm_start_s` (None when the warm start failed) and merge `details` into its
    `extra`, in one transaction; False when the run does not exist."""
    with transaction(db):
        row = db.execute("SELECT extra FROM runs WHERE id = ?", [int(run_id)]).fetchone()
        if row is None:
            return False
        extra = {**json_object(row[0]), **details}
        db.execute("UPDATE runs SET warm_start_s = ?, extra = ? WHERE id = ?",
                   [warm_start_s, json.dumps(extra, sort_keys=True, default=str), int(run_id)])
    return True

