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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .connection import Store
from .db import transaction
from .deployment_writes import record_violation, store_samples
from .deployments import get_deployment, register_deployment
from .files import write_file_atomic
from .pending import (
    PENDING_SUFFIX,
    claimable_files,
    import_claimed_files,
)
from .refusals import StoreRefusal, refused_line, store_refusal
from .safeio import read_regular_file

SIDE_FILE_PREFIX = "deployment-"
FORMAT = 1
VIOLATION_KEYS = ("deployment", "limit_name", "at")  # what a stored violation is keyed by


@dataclass
class DeploymentImport:
    path: Path
    deployment: str | None
    windows: int = 0  # windows stored from the file (new, or a stored one extended)
    calls: int = 0  # the calls those windows served
    violations: int = 0  # violations stored from the file
    already: int = 0  # windows and violations that were stored before (the file outlived an earlier import)
    error: str = ""  # why the file was not imported (it is kept)
    refused: StoreRefusal | None = None  # kept because the database refuses every write now (locked, full, ...)
    tried: bool = True  # False: not tried, as the database had refused another file already


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


def deployment_side_files(db: Store) -> list[Path]:
    """The deployment side files beside `db` to import: those nobody claimed, then stale claims."""
    return claimable_files(db, SIDE_FILE_PREFIX)


def _violation_shape_error(entry: Any) -> str:
    """Why a `violations` entry is not one `record_violation` takes ('' when it is)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("violation"), dict):
        return "a violation that is not an object with its 'violation' object"
    if not all(key in entry["violation"] for key in VIOLATION_KEYS):
        return f"a violation without its {', '.join(VIOLATION_KEYS)}"
    if entry.get("decision") is not None and not isinstance(entry["decision"], dict):
        return "a violation whose 'decision' is not an object"
    return ""


def _read_side_file(path: Path) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(deployment, windows, violations) of a side file; ValueError naming what is wrong with it."""
    record = json.loads(read_regular_file(path))
    if not isinstance(record, dict) or not isinstance(record.get("deployment"), str):
        raise ValueError("no deployment name")
    samples, violations = record.get("samples") or [], record.get("violations") or []
    if not isinstance(samples, list) or not all(isinstance(s, dict) and "t_start" in s for s in samples):
        raise ValueError("'samples' is not a list of windows, each with its t_start")
    if not isinstance(violations, list):
        raise ValueError("'violations' is not a list")
    for entry in violations:
        if why := _violation_shape_error(entry):
            raise ValueError(f"'violations' holds {why}")
    return record["deployment"], samples, violations


def _import_claimed(db: Store, claimed: Path, name: Path,
                    stop: Callable[[], bool] | None) -> DeploymentImport:
    """What importing the claimed file did."""
    try:
        deployment, samples, violations = _read_side_file(claimed)
    except (OSError, ValueError, RecursionError) as exc:
        return DeploymentImport(name, None, error=f"unreadable side file: {exc}")
    item = DeploymentImport(name, deployment)
    try:
        with transaction(db, stop):
            row = get_deployment(db, deployment)
            deployment_id = row["id"] if row is not None else register_deployment(db, deployment)
            stored = store_samples(db, deployment_id, samples)
            for violation in violations:
                *_, new = record_violation(db, violation.get("decision"), violation["violation"])
                item.violations += int(new)
                item.already += int(not new)
    except (sqlite3.Error, ValueError, KeyError, TypeError) as exc:
        # never empty: an empty error would read as stored, and the file would be removed
        return DeploymentImport(name, deployment, error=str(exc) or type(exc).__name__, refused=store_refusal(exc))
    item.windows, item.calls, item.already = stored.written, stored.calls, item.already + stored.already
    return item


def import_deployment_side_files(db: Store, stop: Callable[[], bool] | None = None, *,
                                 refused: StoreRefusal | None = None) -> list[DeploymentImport]:
    """Store every deployment side file beside `db` and remove it; returns what happened to each. A file that
    cannot be imported now (the store is locked, the file is damaged) is kept and tried again next time.

    Each file is claimed first (renamed to a name of this process's, as `import_pending_runs` does), so a
    serving process that rewrites its file meanwhile writes a new one, imported next time, rather than
    losing its newer windows to this import's removal. The wait for the write lock is taken in short slices
    (signals are handled between them); `stop()` returning True ends it. Once the database refuses one file
    for a reason every file would meet (`refusals.store_refusal`: the lock still held after the busy timeout,
    a full disk, a read-only file), the others are left untried for next time (listed with that `refused`,
    `tried` False) rather than each waiting as long again; `refused` given: it refused already, none is tried."""
    return import_claimed_files(deployment_side_files(db),
                                lambda claimed, name: _import_claimed(db, claimed, name, stop),
                                untried=DeploymentImport, stored=lambda item: not item.error,
                                remove=drop_deployment_side_file, stop=stop, refused=refused)


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


def describe_deployment_imports(items: Sequence[DeploymentImport]) -> list[str]:
    """One line per side file imported or kept for its own reason, and one for all those kept because the
    database refused."""
    lines = [describe_deployment_import(item) for item in items if item.refused is None]
    refusals = [item.refused for item in items if item.refused is not None]
    if refusals:
        lines.append(refused_line(len(refusals), items[0].path.parent, refusals[0],
                                  "when a deployment, bench or the daemon next opens this database"))
    return lines
