"""Typed writes and reads for hosts, devices, workloads, configurations and runs."""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .connection import Store
from .db import transaction
from .keys import stable_id
from .schema import run_index_columns


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            return Path(path).read_text().strip()
        except OSError:
            continue
    return ""


# Names this host in the store instead of its hostname: for several daemons on one machine that must count as
# several hosts (containers that share the machine's id, a fleet rehearsed on one box).
HOSTNAME_ENV = "JOULEPILOT_HOSTNAME"


def host_identity() -> dict[str, Any]:
    hostname = os.environ.get(HOSTNAME_ENV, "").strip() or socket.gethostname()
    return {
        "id": stable_id(hostname, _machine_id()),
        "hostname": hostname,
        "cpu": platform.processor() or platform.machine(),
    }


def _insert_sql(table: str, columns: Sequence[str], on_conflict: str | None) -> str:
    sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})"
    if on_conflict == "nothing":
        return sql + " ON CONFLICT DO NOTHING"
    if on_conflict == "update":  # the row's columns replace the stored ones; the others are kept
        updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c != "id")
        return sql + f" ON CONFLICT (id) DO UPDATE SET {updates}"
    return sql


def insert_row(db: Store, table: str, row: Mapping[str, Any], *, on_conflict: str | None = None) -> int | None:
    """Insert one row of `table` (column -> value); `on_conflict`: None (a duplicate id is an error), "nothing"
    (a row with that id stays as it is) or "update" (its columns take the row's values). Returns the id of a new
    row of a table with integer ids, else None."""
    return db.insert_id(_insert_sql(table, list(row), on_conflict), list(row.values()))


def upsert_host(db: Store, host: Mapping[str, Any] | None = None) -> str:
    host = dict(host or host_identity())
    existing = db.execute("SELECT id FROM hosts WHERE id = ?", [host["id"]]).fetchone()
    if existing is None:
        with transaction(db):
            db.execute(
                "INSERT INTO hosts (id, hostname, cpu, created_at) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [host["id"], host["hostname"], host.get("cpu"), time.time()],
            )
    return host["id"]


def upsert_devices(db: Store, host_id: str, devices: Iterable[Mapping[str, Any]]) -> None:
    """Record metered devices (dicts shaped like telemetry.DeviceInfo.to_dict())."""
    rows = []
    for d in devices:
        rows.append(
            {
                "id": f"{host_id}/{d['id']}",
                "host_id": host_id,
                "device": d["id"],
                "kind": d.get("kind", ""),
                "name": d.get("name"),
                "uuid": d.get("uuid"),
                "driver": d.get("driver"),
                "power_limit_w": d.get("power_limit_w"),
                "memory_bytes": d.get("memory_bytes"),
                "source": d.get("source"),
            }
        )
    if rows:
        with transaction(db):
            db.executemany(_insert_sql("devices", list(rows[0]), "update"), [list(r.values()) for r in rows])


def upsert_workload(db: Store, workload: Mapping[str, Any]) -> str:
    """Insert a workload description (keys as in the workloads table); returns its id."""
    row = dict(workload)
    for key in ("op_mix", "inputs"):
        if key in row and not isinstance(row[key], str) and row[key] is not None:
            row[key] = json.dumps(row[key], sort_keys=True)
    row.setdefault("created_at", time.time())
    with transaction(db):
        insert_row(db, "workloads", row, on_conflict="update")
    return row["id"]


def upsert_config(db: Store, config: Mapping[str, Any]) -> str:
    """Insert a configuration (keys as in the configs table); returns its id."""
    row = dict(config)
    if not isinstance(row.get("options"), str):
        row["options"] = json.dumps(row.get("options") or {}, sort_keys=True)
    row["dynamic"] = int(bool(row.get("dynamic")))
    with transaction(db):
        insert_row(db, "configs", row, on_conflict="update")
    return row["id"]


RUN_JSON_FIELDS = ("extra",)


def insert_run(
    db: Store,
    run: Mapping[str, Any],
    power_samples: Sequence[tuple[float, str, float]] = (),
) -> int:
    """Write one finished run and its power samples in a single transaction; returns the run id.

    A run is only ever written whole, so a kill at any moment leaves either no row or a complete one.
    """
    row = dict(run)
    for key in RUN_JSON_FIELDS:
        if key in row and row[key] is not None and not isinstance(row[key], str):
            row[key] = json.dumps(row[key], sort_keys=True, default=str)
    row.update(run_index_columns(row.get("extra")))
    columns = db.column_names("runs")
    unknown = sorted(set(row) - columns)
    if unknown:
        raise ValueError(f"unknown run fields {unknown}; known fields are {sorted(columns)}")
    with transaction(db):
        run_id = insert_row(db, "runs", row)
        if power_samples:
            db.executemany(
                "INSERT INTO power_samples (run_id, t_s, device, power_w) VALUES (?, ?, ?, ?)",
                [(run_id, t, dev, p) for t, dev, p in power_samples],
            )
    return run_id


RUN_LIST_SQL = """
SELECT runs.*, workloads.spec AS workload, configs.label AS config_label, configs.mode, configs.fusion,
       configs.precision, configs.options, configs.dynamic, configs.batch_size, configs.padding, configs.regional,
       configs.cache, configs.compile_prefill, workloads.task, workloads.prompt_len, workloads.new_tokens,
       workloads.model_options
FROM runs
JOIN workloads ON workloads.id = runs.workload_id
JOIN configs ON configs.id = runs.config_id
"""


def list_runs(
    db: Store,
    *,
    workload: str | None = None,
    workload_id: str | None = None,
    run_id: int | None = None,
    status: str | None = None,
    limit: int | None = None,
    since: float | None = None,
) -> list[dict[str, Any]]:
    """Runs joined with their workload spec and configuration, newest first (plain dicts, JSON columns
    as stored: the CLI's tables and `--json` output; `runs.RunRow` is the typed read).

    `workload`: a workload spec; `workload_id`: one workload; `run_id`: that run only; `since` (epoch
    seconds) keeps runs started at or after it.
    """
    clauses, args = [], []
    if workload is not None:
        clauses.append("workloads.spec = ?")
        args.append(workload)
    if workload_id is not None:
        clauses.append("runs.workload_id = ?")
        args.append(workload_id)
    if run_id is not None:
        clauses.append("runs.id = ?")
        args.append(int(run_id))
    if since is not None:
        clauses.append("runs.started_at >= ?")
        args.append(float(since))
    if status is not None:
        clauses.append("runs.status = ?")
        args.append(status)
    sql = RUN_LIST_SQL + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY runs.id DESC"
    if limit:
        sql += f" LIMIT {int(limit)}"
    cur = db.execute(sql, args)
    names = [c[0] for c in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def power_samples(db: Store, run_id: int) -> list[dict[str, Any]]:
    return list(db.query("SELECT t_s, device, power_w FROM power_samples WHERE run_id = ? ORDER BY t_s",
                         [run_id]))
