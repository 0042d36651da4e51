"""Runs that could not be committed (disk full, I/O error, a lock held too long) are kept in side files.

A finished measurement is expensive; when its COMMIT fails, the run, its samples, the rows it
references and its job id go to `<db>.pending/run-*.json` (written atomically), and the next `bench`
or daemon start imports them (`import_pending_runs`). Each side file carries a `pending_id` that is
stored in the run's `extra`, so a kill between the import's commit and the file's removal never
imports a run twice.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from .commit import commit_run
from .daemon_state import get_job
from .errors import StoreError
from .files import write_file_atomic

PENDING_SUFFIX = ".pending"


class RunNotStored(StoreError):
    """A finished run could be neither committed nor kept in a side file; the message says which run."""


@dataclass
class StoreOutcome:
    run_id: int | None  # the stored run, or None when it was set aside
    pending_path: Path | None = None  # the side file holding it, when set aside
    error: str = ""  # why the commit failed


@dataclass
class PendingImport:
    path: Path
    run_id: int | None  # None when the file could not be imported (it is kept)
    job_id: int | None = None
    error: str = ""
    already_stored: bool = False  # an earlier import committed it but was stopped before removing the file


def database_file(db: sqlite_utils.Database) -> Path | None:
    """The main database file behind `db` (None for an in-memory database)."""
    for _seq, name, file in db.execute("PRAGMA database_list").fetchall():
        if name == "main":
            return Path(file) if file else None
    return None


def pending_dir(db: sqlite_utils.Database) -> Path | None:
    path = database_file(db)
    return None if path is None else path.with_name(path.name + PENDING_SUFFIX)


def _write_side_file(folder: Path, record: Mapping[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"run-{time.strftime('%Y%m%dT%H%M%S')}-{record['pending_id'][:8]}.json"
    return write_file_atomic(target, json.dumps(record, default=str).encode("utf-8"))


def commit_run_or_set_aside(db: sqlite_utils.Database, run: Mapping[str, Any],
                            samples: Sequence[Sequence[Any]] = (), *, host: Mapping[str, Any] | None = None,
                            devices: Iterable[Mapping[str, Any]] = (), workload: Mapping[str, Any] | None = None,
                            config: Mapping[str, Any] | None = None, job_id: int | None = None,
                            further: Sequence[tuple[Mapping[str, Any], Sequence[Sequence[Any]]]] = ()
                            ) -> StoreOutcome:
    """`commit_run`, and when SQLite refuses the commit, the same data in a side file beside the database.

    Raises RunNotStored when the side file cannot be written either (its message names both errors)."""
    devices = list(devices)
    pending_id = uuid.uuid4().hex
    run = dict(run)
    extra = run.get("extra")
    extra = dict(json.loads(extra) if isinstance(extra, str) else (extra or {}))
    try:
        return StoreOutcome(commit_run(db, run, samples, host=host, devices=devices, workload=workload,
                                       config=config, job_id=job_id, further=further))
    except sqlite3.OperationalError as exc:
        error = str(exc)
    extra["pending_id"] = pending_id
    record = {"pending_id": pending_id, "written_at": time.time(), "error": error, "job_id": job_id,
              "run": {**run, "extra": extra}, "samples": [list(s) for s in samples], "host": host,
              "devices": devices, "workload": workload, "config": config,
              "further": [{"run": dict(more), "samples": [list(x) for x in more_samples]}
                          for more, more_samples in further]}
    folder = pending_dir(db)
    if folder is None:
        raise RunNotStored(f"the run could not be stored ({error}) and an in-memory database has no folder "
                           "to keep it in")
    try:
        path = _write_side_file(folder, record)
    except OSError as exc:
        raise RunNotStored(f"the run could not be stored in {database_file(db)} ({error}) nor kept in "
                           f"{folder} ({exc.strerror or exc}); free space on that disk") from exc
    return StoreOutcome(None, path, error)


def _stored_pending_run(db: sqlite_utils.Database, pending_id: str) -> int | None:
    row = db.execute("SELECT id FROM runs WHERE json_extract(extra, '$.pending_id') = ?", [pending_id]).fetchone()
    return None if row is None else int(row[0])


def pending_files(db: sqlite_utils.Database) -> list[Path]:
    folder = pending_dir(db)
    if folder is None or not folder.is_dir():
        return []
    return sorted(folder.glob("run-*.json"))


def import_pending_runs(db: sqlite_utils.Database) -> list[PendingImport]:
    """Commit every side file left by an earlier failed commit and remove it; returns what happened to each.

    A job named in a side file is finished with its run unless it was done meanwhile. A file that cannot
    be imported is kept (its `error` says why) and tried again at the next start."""
    imported: list[PendingImport] = []
    for path in pending_files(db):
        try:
            record = json.loads(path.read_text())
            pending_id = record["pending_id"]
            run = record["run"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            imported.append(PendingImport(path, None, error=f"unreadable side file: {exc}"))
            continue
        job_id = record.get("job_id")
        existing = _stored_pending_run(db, pending_id)
        if existing is not None:
            path.unlink(missing_ok=True)
            imported.append(PendingImport(path, existing, job_id, already_stored=True))
            continue
        job = get_job(db, job_id) if job_id is not None else None
        finish = job_id if job is not None and job.state != "done" else None
        try:
            run_id = commit_run(db, run, record.get("samples") or (), host=record.get("host"),
                                devices=record.get("devices") or (), workload=record.get("workload"),
                                config=record.get("config"), job_id=finish,
                                further=[(more["run"], more.get("samples") or ())
                                         for more in record.get("further") or ()])
        except (sqlite3.Error, ValueError) as exc:
            imported.append(PendingImport(path, None, job_id, error=str(exc)))
            continue
        path.unlink(missing_ok=True)
        imported.append(PendingImport(path, run_id, job_id))
    return imported


def describe_import(item: PendingImport) -> str:
    """One line about one side file, for bench's stderr and the daemon's log."""
    if item.run_id is None:
        return f"pending run {item.path} not imported yet ({item.error}); it is kept and retried at the next start"
    job = f" (job {item.job_id})" if item.job_id is not None else ""
    if item.already_stored:
        return f"pending run {item.path} was already stored as run {item.run_id}{job}; side file removed"
    return f"imported run {item.run_id}{job} kept in {item.path} after an earlier failed commit"
