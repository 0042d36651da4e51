"""Runs that could not be committed (disk full, I/O error, a lock held too long, a signal) are kept in side
files.

A finished measurement is expensive; when its commit fails or is interrupted (SIGTERM, Ctrl-C, any error
raised meanwhile), the run, its samples, the rows it references and its job id go to
`<db>.pending/run-*.json` (written atomically) before the error goes on, and the next `bench` or daemon start
imports them (`import_pending_runs`). Every run committed here carries a `pending_id` in its `extra`, the
same as its side file's, so a run whose commit did go through just before an interruption, or a kill between
an import's commit and the file's removal, is never imported twice.

Several processes may import at once (two `bench` starts, a bench start and a daemon pass). Each file is
claimed first by renaming it to `run-*.json.claimed-<pid>-<time>-<token>`: a rename is atomic, so one
importer wins and the others skip the file. A claim whose process is gone, or older than CLAIM_STALE_S, is
claimed again by the next importer; the run's `pending_id` is looked up inside the import's transaction, so
an importer that was only slow, or a copy of the file, stores nothing a second time.

The wait for another process's write lock is taken in slices of `connection.LOCK_SLICE_MS`, up to the connection's busy
timeout in all: SQLite waits in C code, where Python cannot run a signal handler, so one long wait would
hold off a SIGTERM until it ended. Once the database refuses one file for a reason every file would meet (the
lock still held after that wait, a full disk, a read-only file: `refusals.store_refusal`), the others are not
tried: each would only wait as long again. They keep their names for the next start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .commit import commit_run
from .connection import Store
from .daemon_state import get_job
from .db import transaction
from .errors import StoreError, database_error
from .files import write_file_atomic
from .refusals import StoreRefusal, store_refusal

log = logging.getLogger(__name__)

PENDING_SUFFIX = ".pending"
CLAIM_MARK = ".claimed-"  # run-X.json.claimed-<pid>-<unix time>-<token>: being imported by that process
CLAIM_STALE_S = 600.0  # a claim this old is taken over even if its pid is alive (a reused pid, a hung importer)


class RunNotStored(StoreError):
    """A finished run could be neither committed nor kept in a side file; the message says which run."""


@dataclass
class StoreOutcome:
    run_id: int | None  # the stored run, or None when it was set aside
    pending_path: Path | None = None  # the side file holding it, when set aside
    error: str = ""  # why the commit failed
    failure: StoreError | None = None  # SQLite's refusal as the store's error (`database_error`): damaged, full, ...


@dataclass
class PendingImport:
    path: Path
    run_id: int | None  # None when the file could not be imported (it is kept)
    job_id: int | None = None
    error: str = ""
    already_stored: bool = False  # another import (or the commit itself) stored it before this one could
    refused: StoreRefusal | None = None  # kept because the database refuses every write now (locked, full, ...)
    tried: bool = True  # False: not tried, as the database had refused another file already


def pending_dir(db: Store) -> Path | None:
    path = db.side_path
    return None if path is None else path.with_name(path.name + PENDING_SUFFIX)


def _write_side_file(folder: Path, record: Mapping[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"run-{time.strftime('%Y%m%dT%H%M%S')}-{record['pending_id'][:8]}.json"
    return write_file_atomic(target, json.dumps(record, default=str).encode("utf-8"))


def _failure(exc: BaseException, db: Store) -> StoreError | None:
    """SQLite's refusal of the commit as the store's error, naming the file and the fix; None for anything else."""
    if isinstance(exc, StoreError):  # PostgreSQL's, mapped where it was raised
        return exc
    if not isinstance(exc, sqlite3.Error):
        return None
    try:
        where: Any = db.file or "(in memory)"
    except sqlite3.Error:
        where = "(the database)"
    return database_error(where, exc)


def _why(exc: BaseException, failure: StoreError | None) -> str:
    if failure is not None:
        return str(failure)
    if isinstance(exc, SystemExit):
        return f"exit {exc.code} during the commit"
    if isinstance(exc, KeyboardInterrupt):
        return "Ctrl-C during the commit"
    return f"{type(exc).__name__} during the commit: {exc}"


def _keep_aside(db: Store, record: Mapping[str, Any]) -> Path:
    """Write the side file. A second interruption while it is written (Ctrl-C twice) is held back until the
    file is whole, then raised."""
    error = record["error"]
    folder = pending_dir(db)
    if folder is None:
        raise RunNotStored(f"the run could not be stored ({error}) and an in-memory database has no folder "
                           "to keep it in")
    interrupted: BaseException | None = None
    for _attempt in range(3):
        try:
            path = _write_side_file(folder, record)
            break
        except OSError as exc:
            raise RunNotStored(f"the run could not be stored in {db.target} ({error}) nor kept in "
                               f"{folder} ({exc.strerror or exc}); free space on that disk") from exc
        except BaseException as exc:
            interrupted = exc
    else:
        assert interrupted is not None
        raise interrupted
    if interrupted is not None:
        raise interrupted
    return path


def commit_run_or_set_aside(db: Store, run: Mapping[str, Any],
                            samples: Sequence[Sequence[Any]] = (), *, host: Mapping[str, Any] | None = None,
                            devices: Iterable[Mapping[str, Any]] = (), workload: Mapping[str, Any] | None = None,
                            config: Mapping[str, Any] | None = None, job_id: int | None = None,
                            further: Sequence[tuple[Mapping[str, Any], Sequence[Sequence[Any]]]] = (),
                            stop: Callable[[], bool] | None = None) -> StoreOutcome:
    """`commit_run`, and when SQLite refuses the commit, the same data in a side file beside the database.

    Anything else raised during the commit (SystemExit from a SIGTERM handler, KeyboardInterrupt, a bug)
    also sets the run aside first, then propagates. The wait for the write lock is taken in short slices
    (signals are handled between them) up to the connection's busy timeout; `stop()` returning True ends
    it early (a daemon asked to stop), setting the run aside.

    Raises RunNotStored when the side file cannot be written either (its message names both errors)."""
    devices = list(devices)
    pending_id = uuid.uuid4().hex
    run = _with_pending_id(run, pending_id)
    samples = [list(s) for s in samples]
    further = [(_with_pending_id(more, pending_id), [list(x) for x in more_samples]) for more, more_samples in further]
    try:
        with transaction(db, stop):
            run_id = commit_run(db, run, samples, host=host, devices=devices, workload=workload, config=config,
                                job_id=job_id, further=further)
        return StoreOutcome(run_id)
    except BaseException as exc:
        failure = _failure(exc, db)
        error = _why(exc, failure)
        record = {"pending_id": pending_id, "written_at": time.time(), "error": error, "job_id": job_id,
                  "run": run, "samples": samples, "host": host, "devices": devices, "workload": workload,
                  "config": config, "further": [{"run": more, "samples": more_samples}
                                                for more, more_samples in further]}
        path = _keep_aside(db, record)
        if failure is not None:
            return StoreOutcome(None, path, error, failure)
        log.warning("the run could not be stored in %s (%s); it is kept in %s and imported the next time bench "
                    "or the daemon opens this database", db.target, error, path)
        raise


def _with_pending_id(run: Mapping[str, Any], pending_id: str) -> dict[str, Any]:
    """`run` with `pending_id` in its `extra`: every run of one commit (the first window and the further ones the
    same worker took) carries its side file's id; `_stored_pending_run` answers with the first of them."""
    extra = run.get("extra")
    extra = dict(json.loads(extra) if isinstance(extra, str) else (extra or {}))
    return {**run, "extra": {**extra, "pending_id": pending_id}}


def _stored_pending_run(db: Store, pending_id: str) -> int | None:
    """The first run committed with this `pending_id` (`extra.pending_id`), if any."""
    row = db.execute("SELECT id FROM runs WHERE pending_id = ? ORDER BY id LIMIT 1", [pending_id]).fetchone()
    return None if row is None else int(row[0])


def _claimed_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{CLAIM_MARK}{os.getpid()}-{int(time.time())}-{secrets.token_hex(3)}")


def _unclaimed_name(path: Path) -> Path:
    return path.with_name(path.name.split(CLAIM_MARK, 1)[0])


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _claim_is_stale(path: Path, now: float) -> bool:
    """A claim whose importer is gone, or so old that it cannot be a working importer's (a pid reused)."""
    try:
        pid, claimed_at, _token = path.name.split(CLAIM_MARK, 1)[1].split("-")
        return now - int(claimed_at) > CLAIM_STALE_S or not _process_alive(int(pid))
    except ValueError:  # not a name this module writes
        return False


def pending_files(db: Store) -> list[Path]:
    """The side files waiting to be imported: those nobody claimed, then stale claims (their importer died)."""
    return claimable_files(db, "run-")


def claimable_files(db: Store, prefix: str) -> list[Path]:
    """The side files `<prefix>*.json` beside `db` that an importer may claim: those nobody claimed, then
    stale claims."""
    folder = pending_dir(db)
    if folder is None or not folder.is_dir():
        return []
    now = time.time()
    stale = [p for p in folder.glob(f"{prefix}*.json{CLAIM_MARK}*") if _claim_is_stale(p, now)]
    return sorted(folder.glob(f"{prefix}*.json")) + sorted(stale)


def _claim(path: Path) -> Path | None:
    """Rename the side file to a name of this process's: of several importers renaming it at once, exactly
    one succeeds; None for the others (the file is theirs to import, or already imported)."""
    claimed = _claimed_name(_unclaimed_name(path))
    try:
        os.rename(path, claimed)
    except FileNotFoundError:
        return None
    return claimed


def _give_back(claimed: Path, name: Path) -> None:
    """Return a file this process could not import to its own name, for the next start. Never over a file
    written under that name since the claim (a serving process rewrites its deployment side file at each
    refusal): the file given back then takes a name of its own beside it."""
    target = name
    while True:
        try:
            os.link(claimed, target)  # unlike a rename, fails rather than replace a file of that name
        except FileExistsError:
            target = name.with_name(f"{name.stem}-{secrets.token_hex(3)}{name.suffix}")
            continue
        except FileNotFoundError:  # taken over meanwhile by another importer (we were too slow)
            return
        except OSError:  # a file system without hard links; a claim left in place is stale once we exit
            if not target.exists():
                with contextlib.suppress(FileNotFoundError):
                    os.rename(claimed, target)
            return
        claimed.unlink(missing_ok=True)
        return


def _import_claimed(db: Store, claimed: Path, name: Path, stop: Callable[[], bool] | None
                    ) -> PendingImport:
    try:
        record = json.loads(claimed.read_text())
        pending_id = record["pending_id"]
        run = record["run"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return PendingImport(name, None, error=f"unreadable side file: {exc}")
    job_id = record.get("job_id")
    try:
        with transaction(db, stop):
            # In the transaction: another importer of the same run (a copy of the file, a claim taken over
            # from a slow importer) may have committed it while this one waited for the write lock.
            existing = _stored_pending_run(db, pending_id)
            if existing is not None:
                return PendingImport(name, existing, job_id, already_stored=True)
            job = get_job(db, job_id) if job_id is not None else None
            finish = job_id if job is not None and job.state != "done" else None
            run_id = commit_run(db, run, record.get("samples") or (), host=record.get("host"),
                                devices=record.get("devices") or (), workload=record.get("workload"),
                                config=record.get("config"), job_id=finish,
                                further=[(more["run"], more.get("samples") or ())
                                         for more in record.get("further") or ()])
    except (sqlite3.Error, ValueError, KeyError, TypeError) as exc:
        return PendingImport(name, None, job_id, error=str(exc), refused=store_refusal(exc))
    return PendingImport(name, run_id, job_id)


def import_pending_runs(db: Store, stop: Callable[[], bool] | None = None, *,
                        refused: StoreRefusal | None = None) -> list[PendingImport]:
    """Commit every side file left by an earlier failed commit and remove it; returns what happened to each.

    Each file is first claimed (renamed to a name of this process's), so of several processes importing at
    once (two bench starts, a bench start and a daemon pass) only one imports it; the others skip it, and
    files claimed by another live importer are not listed. A file whose claimer died, or that was claimed
    more than CLAIM_STALE_S ago, is claimed again. A job named in a side file is finished with its run
    unless it was done meanwhile. A file that cannot be imported is given back (its `error` says why) and
    tried again at the next start; so is one whose import is interrupted (SIGTERM, Ctrl-C). `stop()`
    returning True ends a wait for the write lock (the file is given back).

    Once the database refuses a file for a reason every file would meet (`refusals.store_refusal`: the lock
    still held after the busy timeout, a full disk, a read-only file), the files after it are not claimed nor
    tried: they are listed with the same `refused` and `tried` False, and keep their names for the next
    start. `refused` given: the database refused already (another kind of side file), so none is tried."""
    return import_claimed_files(pending_files(db), lambda claimed, name: _import_claimed(db, claimed, name, stop),
                                untried=PendingImport, stored=lambda item: item.run_id is not None,
                                remove=lambda claimed: claimed.unlink(missing_ok=True), stop=stop, refused=refused)


Item = TypeVar("Item", bound=Any)


def import_claimed_files(paths: Iterable[Path], import_one: Callable[[Path, Path], Item], *,
                         untried: Callable[..., Item], stored: Callable[[Item], bool],
                         remove: Callable[[Path], None], stop: Callable[[], bool] | None,
                         refused: StoreRefusal | None) -> list[Item]:
    """The import loop of every kind of side file: each file claimed, imported by `import_one(claimed, name)`,
    then removed (`remove`) when `stored(item)`, else given back under its name. Once an item's `refused` says
    the database refuses every write (or `refused` is given), the files after it are neither claimed nor tried:
    each is listed as `untried(name, None, error=..., refused=..., tried=False)` and keeps its name. An
    interrupted import (SIGTERM, Ctrl-C) gives its file back; `stop()` returning True ends the loop."""
    imported: list[Item] = []
    for path in paths:
        if stop is not None and stop():
            break
        name = _unclaimed_name(path)
        if refused is not None:
            imported.append(untried(name, None, error=refused.error, refused=refused, tried=False))
            continue
        claimed = _claim(path)
        if claimed is None:  # another importer took it
            continue
        try:
            item = import_one(claimed, name)
        except BaseException:  # the transaction was rolled back; the next start imports it
            _give_back(claimed, name)
            raise
        if stored(item):
            remove(claimed)
        else:
            _give_back(claimed, name)
            refused = item.refused
        imported.append(item)
    return imported


def describe_import(item: PendingImport) -> str:
    """One line about one side file, for bench's stderr and the daemon's log."""
    if item.run_id is None:
        return f"pending run {item.path} not imported yet ({item.error}); it is kept and retried at the next start"
    job = f" (job {item.job_id})" if item.job_id is not None else ""
    if item.already_stored:
        return f"pending run {item.path} was already stored as run {item.run_id}{job}; side file removed"
    return f"imported run {item.run_id}{job} kept in {item.path} after an earlier failed commit"
