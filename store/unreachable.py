"""What a daemon leaves on its own host while its database server cannot be reached, for `status` and the exporter
there, which cannot read the database either: since when, the error, and how many runs wait in side files (each
measured run the daemon could not store, imported when the server answers again). The file is beside the
database's other side files (`db.side_path`) and is removed once the daemon reaches the database again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .connection import Store
from .db import side_path
from .files import write_file_atomic
from .pending import CLAIM_MARK, PENDING_SUFFIX

UNREACHABLE_SUFFIX = ".unreachable.json"


def unreachable_path(target: str | os.PathLike) -> Path:
    path = side_path(target)
    return path.with_name(path.name + UNREACHABLE_SUFFIX)


def waiting_runs(target: str | os.PathLike) -> int:
    """The runs set aside for `target` on this host and not imported yet (side files, claimed ones too)."""
    path = side_path(target)
    folder = path.with_name(path.name + PENDING_SUFFIX)
    if not folder.is_dir():
        return 0
    return sum(1 for p in folder.glob("run-*.json*") if p.name.endswith(".json") or CLAIM_MARK in p.name)


def read_unreachable(target: str | os.PathLike) -> dict[str, Any] | None:
    """The outage the daemon recorded (`since`, `error`, `pid`, `at`: its latest failed try), with the runs
    waiting now; None when it reached the database last (or never recorded one)."""
    try:
        data = json.loads(unreachable_path(target).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {**data, "waiting_runs": waiting_runs(target)}


def note_unreachable(target: str | os.PathLike, error: str) -> dict[str, Any]:
    """Record that the database could not be reached just now (an outage already recorded keeps its start)."""
    now = time.time()
    before = read_unreachable(target) or {}
    since = before.get("since") if isinstance(before.get("since"), int | float) else now
    record = {"since": since, "at": now, "error": error, "pid": os.getpid()}
    write_file_atomic(unreachable_path(target), json.dumps(record).encode("utf-8"), durable=False)
    return {**record, "waiting_runs": waiting_runs(target)}


def check_reachable(db: Store) -> None:
    """One round trip to the database: raises StoreUnreachable while its server does not answer."""
    db.execute("SELECT 1")


def clear_unreachable(target: str | os.PathLike) -> dict[str, Any] | None:
    """The database answered: remove the record; returns the outage it held, or None."""
    before = read_unreachable(target)
    if before is not None:
        unreachable_path(target).unlink(missing_ok=True)
    return before
