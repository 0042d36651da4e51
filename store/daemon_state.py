"""The daemon's durable state: the job queue, heartbeats, and the hooks' benchmark requests.

Every change of a job's state is one transaction, so a daemon killed at any moment leaves each job
either as it was or fully moved on. The queue is the fleet's: the daemons of every host that shares the
store claim its jobs, one host per job, for a lease their daemon renews while it measures; a claim whose
lease ran out (its host died) and a claim of this host left by its daemon's previous life go back to the
queue. Jobs and heartbeats come back as `JobRow` and `HeartbeatRow`; requests as plain dicts of their columns.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .connection import Store
from .db import transaction
from .jsonvalues import json_column
from .records import upsert_host
from .rows import StoredRow
from .safeio import bounded_json_text

JOB_STATES = ("queued", "running", "done", "failed")
HEARTBEAT_STATES = ("starting", "idle", "sweeping", "paused", "fitting", "stopped")
# A heartbeat's detail is rewritten every few seconds and a thousand are kept: each is bounded.
HEARTBEAT_DETAIL_BYTES = 32_000


# --- jobs -----------------------------------------------------------------------------------------


@dataclass
class JobRow(StoredRow):
    """One `jobs` row; `list_jobs` also fills in the configuration's label and the workload's spec."""

    id: int
    policy: str
    workload_id: str
    config_id: str
    provenance_key: str
    state: str
    attempts: int
    created_at: float
    updated_at: float
    run_id: int | None = None
    claimed_by: str | None = None  # the host id of the daemon measuring it (while `running`)
    lease_expires_at: float | None = None
    windows: int | None = None  # the energy windows its worker takes (None: one)
    config_label: str | None = None
    workload: str | None = None
    hostname: str | None = None  # `list_jobs`: the claiming host's name


def _jobs(db: Store, sql: str, args: list[Any] | None = None) -> list[JobRow]:
    return [JobRow.from_columns(row) for row in db.query(sql, args or [])]


def enqueue_job(
    db: Store, *, policy: str, workload_id: str, config_id: str, provenance_key: str,
    max_attempts: int = 3, windows: int | None = None,
) -> tuple[int, bool]:
    """Queue one measurement (`windows`: the energy windows its worker takes, None for one); returns (job id,
    queued now).

    The queue holds one job per workload, configuration and provenance. An existing job that is
    queued or running is left alone; a done one is queued again (the caller found its run stale); a
    failed one is queued again until it has failed `max_attempts` times.
    """
    now = time.time()
    with transaction(db):
        row = db.execute(
            "SELECT id, state, attempts FROM jobs WHERE workload_id = ? AND config_id = ? AND provenance_key = ?",
            [workload_id, config_id, provenance_key],
        ).fetchone()
        if row is not None:
            job_id, state, attempts = row
            if state == "done" or (state == "failed" and attempts < max_attempts):
                db.execute(
                    "UPDATE jobs SET state = 'queued', policy = ?, windows = ?, claimed_by = NULL, "
                    "lease_expires_at = NULL, updated_at = ?"
                    + (", attempts = 0" if state == "done" else "") + " WHERE id = ?",
                    [policy, windows, now, job_id],
                )
                return job_id, True
            return job_id, False
        return db.insert_id(
            "INSERT INTO jobs (policy, workload_id, config_id, provenance_key, state, attempts, windows, created_at,"
            " updated_at) VALUES (?, ?, ?, ?, 'queued', 0, ?, ?, ?)",
            [policy, workload_id, config_id, provenance_key, windows, now, now],
        ), True


def drop_queued_jobs(db: Store, policy: str, keep_ids: Iterable[int] = ()) -> int:
    """Remove a policy's queued jobs that its current plan no longer wants (the file changed)."""
    keep = list(keep_ids)
    with transaction(db):
        sql = "DELETE FROM jobs WHERE policy = ? AND state = 'queued'"
        if keep:
            sql += f" AND id NOT IN ({', '.join('?' for _ in keep)})"
        return db.execute(sql, [policy, *keep]).rowcount


def failed_out_jobs(db: Store, workload_ids: Iterable[str], provenance_key: str,
                    max_attempts: int) -> dict[str, int]:
    """config_id -> attempts, for the jobs of these workloads under this provenance that failed `max_attempts`
    times or more: `enqueue_job` queues them no more."""
    ids = list(workload_ids)
    if not ids:
        return {}
    rows = db.execute(
        f"SELECT config_id, attempts FROM jobs WHERE workload_id IN ({', '.join('?' for _ in ids)}) "
        "AND provenance_key = ? AND state = 'failed' AND attempts >= ?",
        [*ids, provenance_key, max_attempts],
    ).fetchall()
    return {config_id: int(attempts) for config_id, attempts in rows}


def get_job(db: Store, job_id: int) -> JobRow | None:
    rows = _jobs(db, "SELECT * FROM jobs WHERE id = ?", [job_id])
    return rows[0] if rows else None


def queued_jobs(db: Store, limit: int | None = None) -> list[JobRow]:
    """Queued jobs in the order they will run (oldest first, the planner enqueues cheapest first)."""
    sql = "SELECT * FROM jobs WHERE state = 'queued' ORDER BY id"
    if limit:
        sql += f" LIMIT {int(limit)}"
    return _jobs(db, sql)


def has_open_jobs(db: Store, policy: str) -> bool:
    """True while a job of this policy is queued or running (its sweep is unfinished)."""
    return db.execute("SELECT 1 FROM jobs WHERE policy = ? AND state IN ('queued', 'running') LIMIT 1",
                      [policy]).fetchone() is not None


def claim_job(db: Store, job_id: int, *, host_id: str | None = None, lease_s: float = 0.0) -> bool:
    """Move a queued job to running, claimed by `host_id` until `lease_s` from now (`renew_leases` extends it;
    0: no lease, for a store only this host uses); False when it is no longer queued (another host claimed it)."""
    now = time.time()
    with transaction(db):
        cur = db.execute(
            "UPDATE jobs SET state = 'running', attempts = attempts + 1, claimed_by = ?, lease_expires_at = ?, "
            "updated_at = ? WHERE id = ? AND state = 'queued'",
            [host_id, now + lease_s if lease_s else None, now, job_id],
        )
        return cur.rowcount == 1


def renew_leases(db: Store, host_id: str, job_ids: Iterable[int], lease_s: float) -> list[int]:
    """Extend this host's claims on the jobs it is measuring to `lease_s` from now; returns the ids of those it
    no longer holds (their lease ran out and another host claimed them, or they were put back)."""
    ids = list(job_ids)
    if not ids:
        return []
    marks = ", ".join("?" for _ in ids)
    with transaction(db):
        db.execute(f"UPDATE jobs SET lease_expires_at = ? WHERE claimed_by = ? AND state = 'running' "
                   f"AND id IN ({marks})", [time.time() + lease_s, host_id, *ids])
        held = {r[0] for r in db.execute(f"SELECT id FROM jobs WHERE claimed_by = ? AND state = 'running' "
                                         f"AND id IN ({marks})", [host_id, *ids]).fetchall()}
    return [i for i in ids if i not in held]


def requeue_job(db: Store, job_id: int, *, count_attempt: bool = False) -> None:
    """Put a running job back in the queue (stopped, or paused for production load)."""
    with transaction(db):
        db.execute(
            "UPDATE jobs SET state = 'queued', claimed_by = NULL, lease_expires_at = NULL, updated_at = ?"
            + ("" if count_attempt else ", attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END")
            + " WHERE id = ? AND state = 'running'",
            [time.time(), job_id],
        )


def finish_job(db: Store, job_id: int, *, state: str, run_id: int | None) -> None:
    """Mark a job done or failed, linked to its run. Call inside the transaction that wrote the run."""
    if state not in ("done", "failed"):
        raise ValueError(f"a finished job is 'done' or 'failed', not {state!r}")
    with transaction(db):
        db.execute("UPDATE jobs SET state = ?, run_id = ?, lease_expires_at = NULL, updated_at = ? WHERE id = ?",
                   [state, run_id, time.time(), job_id])


def fail_queued_jobs(db: Store, *, workload_id: str, provenance_key: str) -> int:
    """Mark failed, without running them, the queued jobs of one workload under one provenance (its workload
    could not be built, which every one of its configurations would meet): each counts the attempt it would
    have failed, as `claim_job` would have counted it, so `enqueue_job` treats them as it treats jobs that ran
    and failed. Returns how many."""
    with transaction(db):
        return db.execute(
            "UPDATE jobs SET state = 'failed', attempts = attempts + 1, run_id = NULL, updated_at = ? "
            "WHERE workload_id = ? AND provenance_key = ? AND state = 'queued'",
            [time.time(), workload_id, provenance_key],
        ).rowcount


def extend_leases(db: Store, lease_s: float) -> int:
    """Every running job's claim lasts at least `lease_s` from now; returns how many were extended. After an outage
    of the database, which kept every host from renewing its claims, each holder gets a lease to come back (and
    store the runs it set aside) before its jobs are taken."""
    until = time.time() + lease_s
    with transaction(db):
        return db.execute("UPDATE jobs SET lease_expires_at = ? WHERE state = 'running' AND lease_expires_at < ?",
                          [until, until]).rowcount


def recover_jobs(db: Store, host_id: str | None = None) -> list[int]:
    """Jobs left `running` by a daemon that died go back to `queued`; returns their ids.

    A job is orphaned when its lease ran out (its host stopped renewing it), and, given `host_id`, when this
    host claimed it: only the holder of this host's instance lock runs its jobs, so once the lock is ours every
    job still running under this host's name belongs to a dead process. A running job with no claim (stored
    before claims existed) is taken for this host's too. Another host's job whose lease holds is left to it.
    The attempt it started stays counted."""
    now = time.time()
    where = "state = 'running' AND (lease_expires_at < ?"
    args: list[Any] = [now]
    if host_id is not None:
        where += " OR claimed_by = ? OR claimed_by IS NULL"
        args.append(host_id)
    where += ")"
    with transaction(db):
        ids = [r[0] for r in db.execute(f"SELECT id FROM jobs WHERE {where} ORDER BY id", args).fetchall()]
        if ids:
            marks = ", ".join("?" for _ in ids)
            db.execute("UPDATE jobs SET state = 'queued', claimed_by = NULL, lease_expires_at = NULL, "
                       f"updated_at = ? WHERE id IN ({marks})", [now, *ids])
    return ids


def queue_counts(db: Store) -> dict[str, int]:
    counts = dict.fromkeys(JOB_STATES, 0)
    for state, n in db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall():
        counts[state] = n
    return counts


def list_jobs(db: Store, *, state: str | None = None, limit: int | None = None
              ) -> list[JobRow]:
    """Jobs with their configuration label, workload spec and claiming host's name, in queue order."""
    sql = ("SELECT jobs.*, configs.label AS config_label, workloads.spec AS workload, hosts.hostname AS hostname "
           "FROM jobs LEFT JOIN configs ON configs.id = jobs.config_id "
           "LEFT JOIN workloads ON workloads.id = jobs.workload_id "
           "LEFT JOIN hosts ON hosts.id = jobs.claimed_by")
    args: list[Any] = []
    if state:
        sql += " WHERE jobs.state = ?"
        args.append(state)
    sql += " ORDER BY jobs.id"
    if limit:
        sql += f" LIMIT {int(limit)}"
    return _jobs(db, sql, args)


# --- heartbeats -----------------------------------------------------------------------------------


@dataclass
class HeartbeatRow(StoredRow):
    """One `heartbeats` row; `detail` decoded (text that is not a JSON object is kept as {"raw": text})."""

    id: int
    pid: int
    at: float
    state: str
    host_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_columns(cls, row: Mapping[str, Any]) -> HeartbeatRow:
        beat = super().from_columns(row)
        text = row.get("detail")
        decoded = json_column(text, None) if text else {}
        beat.detail = decoded if isinstance(decoded, dict) else {"raw": text}
        return beat


def write_heartbeat(
    db: Store, state: str, detail: Mapping[str, Any] | None = None, *,
    pid: int | None = None, host_id: str | None = None, keep: int = 1000,
) -> int:
    """Record what the daemon is doing now; old heartbeats beyond `keep` are pruned.

    The detail is bounded (strings shortened, lists cut, at most HEARTBEAT_DETAIL_BYTES of JSON, its
    largest parts replaced by a note of their size), whatever the caller passes."""
    if state not in HEARTBEAT_STATES:
        raise ValueError(f"heartbeat state {state!r} is not one of {HEARTBEAT_STATES}")
    with transaction(db):
        hb_id = db.insert_id(
            "INSERT INTO heartbeats (pid, host_id, at, state, detail) VALUES (?, ?, ?, ?, ?)",
            [pid if pid is not None else os.getpid(), host_id, time.time(), state,
             bounded_json_text(dict(detail or {}), max_bytes=HEARTBEAT_DETAIL_BYTES, max_str=1000,
                               max_items=50)],
        )
        if keep:
            db.execute("DELETE FROM heartbeats WHERE id <= ?", [hb_id - keep])
    return hb_id


def latest_heartbeat(db: Store, state: str | None = None, *, host_id: str | None = None) -> HeartbeatRow | None:
    """The newest heartbeat (in `state`, of the daemon of `host_id`: None for any host)."""
    where, args = [], []
    if state:
        where.append("state = ?")
        args.append(state)
    if host_id is not None:
        where.append("host_id = ?")
        args.append(host_id)
    sql = "SELECT * FROM heartbeats" + (f" WHERE {' AND '.join(where)}" if where else "") + " ORDER BY id DESC LIMIT 1"
    rows = list(db.query(sql, args))
    return HeartbeatRow.from_columns(rows[0]) if rows else None


def host_heartbeat(db: Store, host_id: str) -> HeartbeatRow | None:
    """The newest heartbeat of the daemon of `host_id` (one written before heartbeats named their host counts as
    this host's: a store had one daemon then)."""
    mine = latest_heartbeat(db, host_id=host_id)
    if mine is not None:
        return mine
    newest = latest_heartbeat(db)
    return newest if newest is not None and newest.host_id is None else None


def fleet_heartbeats(db: Store) -> list[HeartbeatRow]:
    """The newest heartbeat of each host's daemon, by host name."""
    rows = db.query("SELECT heartbeats.* FROM heartbeats JOIN (SELECT host_id, MAX(id) AS id FROM heartbeats "
                    "WHERE host_id IS NOT NULL GROUP BY host_id) newest ON newest.id = heartbeats.id ORDER BY heartbeats.id")
    beats = [HeartbeatRow.from_columns(r) for r in rows]
    return sorted(beats, key=lambda b: str(b.detail.get("hostname") or b.host_id))


def list_heartbeats(db: Store, limit: int = 20) -> list[HeartbeatRow]:
    """The newest heartbeats, newest first."""
    return [HeartbeatRow.from_columns(r) for r in db.query(
        "SELECT * FROM heartbeats ORDER BY id DESC LIMIT ?", [int(limit)])]


# --- requests -------------------------------------------------------------------------------------


def add_request(db: Store, policy: str, *, workload: str | None = None,
                host_id: str | None = None, note: str | None = None) -> int:
    """Ask the daemon to (re)benchmark a policy; an unhandled request for the same policy is reused."""
    with transaction(db):
        row = db.execute("SELECT id FROM requests WHERE policy = ? AND handled_at IS NULL", [policy]).fetchone()
        if row is not None:
            return row[0]
        return db.insert_id(
            "INSERT INTO requests (policy, workload, host_id, requested_at, note) VALUES (?, ?, ?, ?, ?)",
            [policy, workload, host_id, time.time(), note],
        )


def add_host_request(db: Store, policy: str, *, workload: str | None,
                     host: Mapping[str, Any], note: Mapping[str, Any]) -> int | None:
    """A serving process asks the daemon to benchmark `policy` for its host (recorded too), unless an
    unhandled request for that policy and host is waiting; returns the new request's id, or None."""
    with transaction(db):
        host_id = upsert_host(db, host)
        waiting = db.execute("SELECT 1 FROM requests WHERE policy = ? AND host_id = ? AND handled_at IS NULL",
                             [policy, host_id]).fetchone()
        if waiting is not None:
            return None
        return db.insert_id(
            "INSERT INTO requests (policy, workload, host_id, requested_at, note) VALUES (?, ?, ?, ?, ?)",
            [policy, workload, host_id, time.time(), json.dumps(dict(note), sort_keys=True)],
        )


def unhandled_requests(db: Store) -> list[dict[str, Any]]:
    return list(db.query("SELECT * FROM requests WHERE handled_at IS NULL ORDER BY id"))


def mark_requests_handled(db: Store, ids: Iterable[int]) -> None:
    """Requests answered by a decision (their `note`, the hook's JSON, is left as written)."""
    ids = list(ids)
    if not ids:
        return
    with transaction(db):
        marks = ", ".join("?" for _ in ids)
        db.execute(f"UPDATE requests SET handled_at = ? WHERE id IN ({marks})", [time.time(), *ids])
