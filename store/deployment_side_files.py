"""Deployment windows the store refused (locked too long, disk full) wait in a side file beside the database.

A serving process writes its metered windows in batches. When SQLite refuses a batch, the windows stay in
memory for the next try and are also written, whole or not at all, to `<db>.pending/deployment-<id>.json`
(the folder where `bench` keeps runs it could not commit), together with any envelope violation not yet
recorded; the file is rewritten at each refusal and removed once everything in it is stored. A process that
ends while the store still refuses (or is killed meanwhile) leaves the file, and the next deployment attached
to that database, `bench` or the daemon imports it with `import_deployment_side_files`. Windows and violations
are stored idempotently (`store.deployment_writes`), so a file imported twice, or imported while the process
that wrote it is still retrying, counts nothing twice.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from .db import transaction
from .deployment_writes import record_violation, store_samples
from .deployments import get_deployment, register_deployment
from .files import write_file_atomic
from .pending import PENDING_SUFFIX, pending_dir
from .safeio import read_regular_file

SIDE_FILE_PREFIX = "deployment-"
FORMAT = 1


@dataclass
class DeploymentImport:
    path: Path
    deployment: str | None
    windows: int = 0  # windows stored from the file (new, or a stored one extended)
    calls: int = 0  # the calls those windows served
    violations: int = 0  # violations stored from the file
    already: int = 0  # windows and violations that were stored before (the file outlived an earlier import)
    error: str = ""  # why the file was not imported (it is kept)


def deployment_side_file(db_file: str | Path, token: str) -> Path:
    """Where a deployment's refused windows wait: `<db>.pending/deployment-<token>.json`."""
    db_file = Path(db_file)
    return db_file.with_name(db_file.name + PENDING_SUFFIX) / f"{SIDE_FILE_PREFIX}{token}.json"


def set_aside_deployment(path: Path, *, deployment: str, samples: Iterable[Mapping[str, Any]],
                         violations: Iterable[Mapping[str, Any]] = (), error: str = "") -> Path:
    """Write (or rewrite) `path` with what the store refused: `samples` (windows, as `insert_samples` takes them)
    and `violations` (each {"decision": ..., "violation": ...}, as `record_violation` takes them). Raises OSError."""
    record = {"format": FORMAT, "deployment": deployment, "written_at": time.time(), "error": error,
              "samples": [dict(s) for s in samples], "violations": [dict(v) for v in violations]}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_file_atomic(path, json.dumps(record, default=str).encode("utf-8"))


def drop_deployment_side_file(path: Path) -> None:
    """Remove a side file whose contents are all stored now."""
    path.unlink(missing_ok=True)


def deployment_side_files(db: sqlite_utils.Database) -> list[Path]:
    folder = pending_dir(db)
    if folder is None or not folder.is_dir():
        return []
    return sorted(folder.glob(f"{SIDE_FILE_PREFIX}*.json"))


def _import_one(db: sqlite_utils.Database, path: Path) -> DeploymentImport:
    try:
        record = json.loads(read_regular_file(path))
        name = record["deployment"]
        samples = list(record.get("samples") or [])
        violations = list(record.get("violations") or [])
        if not isinstance(name, str) or not all(isinstance(s, dict) and "t_start" in s for s in samples):
            raise ValueError("no deployment name, or a window without its start")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return DeploymentImport(path, None, error=f"unreadable side file: {exc}")
    item = DeploymentImport(path, name)
    try:
        with transaction(db):
            row = get_deployment(db, name)
            deployment_id = row["id"] if row is not None else register_deployment(db, name)
            stored = store_samples(db, deployment_id, samples)
            for violation in violations:
                *_, new = record_violation(db, violation.get("decision"), violation["violation"])
                item.violations += int(new)
                item.already += int(not new)
    except (sqlite3.Error, ValueError, KeyError, TypeError) as exc:
        return DeploymentImport(path, name, error=str(exc))
    item.windows, item.calls, item.already = stored.written, stored.calls, item.already + stored.already
    drop_deployment_side_file(path)
    return item


def import_deployment_side_files(db: sqlite_utils.Database) -> list[DeploymentImport]:
    """Store every deployment side file beside `db` and remove it; returns what happened to each. A file that
    cannot be imported now (the store is locked, the file is damaged) is kept and tried again next time."""
    return [_import_one(db, path) for path in deployment_side_files(db)]


def describe_deployment_import(item: DeploymentImport) -> str:
    """One line about one side file, for a log or a command's stderr."""
    if item.error:
        return (f"deployment windows kept in {item.path} not imported yet ({item.error}); the file is kept and "
                f"imported when a deployment, bench or the daemon next opens this database")
    if not item.windows and not item.violations:
        return f"deployment windows kept in {item.path} were already stored; side file removed"
    parts = [f"{item.windows} metered window{'s' if item.windows != 1 else ''} ({item.calls:,} calls)"]
    if item.violations:
        parts.append(f"{item.violations} envelope violation{'s' if item.violations != 1 else ''}")
    already = f" ({item.already} already stored)" if item.already else ""
    return (f"imported {' and '.join(parts)} of deployment {item.deployment!r}{already} kept in {item.path} when the "
            f"store refused them; side file removed")
