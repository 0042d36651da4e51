"""Opening the database: location, WAL, busy timeout, migrations, and one transaction per write."""

from __future__ import annotations

import functools
import hashlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .connection import Store
from .errors import (
    DatabaseCorrupt,
    DatabaseMissing,
    SchemaTooNew,
    StoreError,
    damaged_message,
    database_error,
    is_busy,
)
from .schema import MIGRATIONS, SCHEMA_VERSION
from .urls import is_postgres_url, redacted

BUSY_TIMEOUT_MS = 30_000
# Opening a database file of at most this size runs SQLite's `PRAGMA quick_check` (each page's structure, not the
# indexes' contents) once per process and state of the file, so that damage anywhere is said at once rather than
# by whichever command happens to read the damaged pages. It costs about 3-9 ms per MiB on the 2-core VM (the
# 12 MiB store of benchmarks/decision_lookup.py: 90-130 ms), paid once: `joulepilot.compile`'s first lookup, not
# the lookups after it. A larger file is not checked at open; SQLite's errors on its damaged pages are reported the
# same way when they are read.
QUICK_CHECK_MAX_BYTES = 16 << 20
_found_whole: set[tuple[int, int, int, int]] = set()  # (device, inode, size, mtime) of files quick_check passed


def default_home() -> Path:
    """`JOULEPILOT_HOME`, else the platform's user data folder for joulepilot."""
    env = os.environ.get("JOULEPILOT_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("joulepilot", appauthor=False))


def default_db_path() -> Path:
    """`JOULEPILOT_DB`, else `joulepilot.db` under the home folder."""
    env = os.environ.get("JOULEPILOT_DB")
    if env:
        return Path(env).expanduser()
    return default_home() / "joulepilot.db"


def database_target(path: str | os.PathLike | None = None) -> Path | str:
    """The database `path` names, else JOULEPILOT_DB, else the default file: a Path, or a postgresql:// URL."""
    if path:
        return str(path) if is_postgres_url(str(path)) else Path(path).expanduser()
    env = os.environ.get("JOULEPILOT_DB")
    return env if is_postgres_url(env) else default_db_path()


def side_path(target: str | os.PathLike) -> Path:
    """The path whose siblings hold a database's side files (`<path>.pending/`, the daemon's `<path>.daemon.lock`):
    a SQLite file's own path; for a PostgreSQL database, a name under JOULEPILOT_HOME/postgresql (created here)
    from a hash of its URL without the password, so hosts' processes on one database and one home share them."""
    if not is_postgres_url(str(target)):
        return Path(target).expanduser()
    folder = default_home() / "postgresql"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{hashlib.sha256(redacted(str(target)).encode()).hexdigest()[:16]}.db"


def shown(target: str | os.PathLike) -> str:
    """How messages and outputs name a database: its path, or its URL without the password."""
    return redacted(str(target)) if is_postgres_url(str(target)) else str(Path(target))


def schema_version(db: Store) -> int:
    return db.schema_version()


def migrate(db: Store) -> int:
    """Bring the database to SCHEMA_VERSION; each step commits with its version number, so a step that
    fails (a full disk) leaves the database whole at the version before it, and raises its own error."""
    current = schema_version(db)
    if current > SCHEMA_VERSION:
        raise SchemaTooNew(
            f"database schema version {current} is newer than this joulepilot understands "
            f"({SCHEMA_VERSION}); upgrade joulepilot or point --db at another file"
        )
    for version in range(current, SCHEMA_VERSION):
        with transaction(db):
            if db.schema_version() == version:  # else another process migrated while we waited for the lock
                MIGRATIONS[version](db)
                db.set_schema_version(version + 1)
    return schema_version(db)


def opened_immutable(db: Store) -> bool:
    """Whether `open_db(read_only=True)` had to open this database immutable (a WAL database in a folder this
    user cannot write): such a connection never sees later commits, so keep it for one read, not longer."""
    return db.immutable


def _connect(target: Path, *, read_only: bool, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> Store:
    timeout = busy_timeout_ms / 1000
    if not read_only:
        return Store(sqlite3.connect(str(target), timeout=timeout, isolation_level=None, check_same_thread=False))
    uri = Path(os.path.realpath(target)).as_uri()
    try:
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=timeout, isolation_level=None,
                               check_same_thread=False)
        conn.execute("PRAGMA user_version").fetchone()
        return Store(conn)
    except sqlite3.OperationalError as exc:
        if is_busy(exc):  # locked by a writer: immutable would read around the lock (and the WAL); say so
            raise
        # A WAL database in a folder we cannot write (no -shm to create): read it as immutable.
        return Store(sqlite3.connect(f"{uri}?immutable=1", uri=True, timeout=timeout, isolation_level=None,
                                     check_same_thread=False), immutable=True)


def open_db(path: str | os.PathLike | None = None, *, migrate_schema: bool = True, must_exist: bool = False,
            read_only: bool = False, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> Store:
    """Open the joulepilot database at `path` or the default location.

    By default the file is created if needed and migrated to this version's schema. `must_exist`
    refuses a missing file (read commands given a mistyped --db); `read_only` opens it without writing
    anything (no migration, no journal-mode change), which also works on a read-only file or folder.
    Every failure is a StoreError (subclasses: DatabaseMissing, DatabaseCorrupt, SchemaTooNew) whose
    message names the file and the fix. `busy_timeout_ms`: how long each statement waits for another
    process's lock (the serving hook waits less than the default, see `runtime.lookup`).
    """
    target = database_target(path)
    if isinstance(target, str):
        return _open_postgres(target, migrate_schema=migrate_schema, must_exist=must_exist, read_only=read_only,
                              busy_timeout_ms=busy_timeout_ms)
    if (must_exist or read_only) and not target.is_file():
        raise DatabaseMissing(f"database {target} does not exist; check --db / JOULEPILOT_DB (a new database "
                              f"is created by `joulepilot bench`, `joulepilot runs import` or the daemon)")
    if not read_only:
        make_db_folder(target)
    try:
        db = _connect(target, read_only=read_only, busy_timeout_ms=busy_timeout_ms)
    except sqlite3.DatabaseError as exc:
        raise database_error(target, exc, busy_timeout_ms=busy_timeout_ms) from exc
    except (OSError, sqlite3.Error) as exc:
        raise StoreError(f"cannot open database {target}: {exc}; pass --db or set JOULEPILOT_DB") from exc
    conn = db.conn
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if read_only:
            conn.execute("PRAGMA query_only = ON")
        # Before anything is written (WAL, migrations): another program's database is left as it was.
        version = _check_is_joulepilot(db, target, empty_ok=not (read_only or must_exist))
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(f"database {target} has schema version {version}, newer than this joulepilot "
                               f"understands ({SCHEMA_VERSION}); upgrade joulepilot or point --db at another file")
        _quick_check(conn, target)
        if not read_only:
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        if migrate_schema and not read_only:
            migrate(db)
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise database_error(target, exc, busy_timeout_ms=busy_timeout_ms) from exc
    except StoreError:
        conn.close()
        raise
    return db


def _open_postgres(url: str, *, migrate_schema: bool, must_exist: bool, read_only: bool,
                   busy_timeout_ms: int) -> Store:
    """`open_db` for a PostgreSQL database: the same checks, without a file's (WAL, quick_check, its folder)."""
    from .postgres import open_postgres

    db = open_postgres(url, read_only=read_only, busy_timeout_ms=busy_timeout_ms)
    try:
        version = _check_is_joulepilot(db, redacted(url), empty_ok=not (read_only or must_exist))
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(f"database {redacted(url)} has schema version {version}, newer than this joulepilot "
                               f"understands ({SCHEMA_VERSION}); upgrade joulepilot or point --db at another database")
        if migrate_schema and not read_only:
            migrate(db)
    except BaseException:
        db.close()
        raise
    return db


def make_db_folder(target: str | os.PathLike) -> None:
    """The default database's folder (under JOULEPILOT_HOME) is created when missing; any other database's folder
    must exist (StoreError otherwise): a mistyped --db / JOULEPILOT_DB would leave a tree of folders and a new,
    empty store behind."""
    target = Path(target).expanduser()
    folder = target.parent
    if folder.is_dir():
        return
    if target.absolute() == (default_home() / "joulepilot.db").absolute():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the folder {folder} of the default database: {exc.strerror or exc}; "
                             f"set JOULEPILOT_HOME to a writable folder, or pass --db") from exc
        return
    raise StoreError(f"the folder of database {target} does not exist ({folder}); create it (mkdir -p {folder}) or "
                     f"pass --db / set JOULEPILOT_DB with a file in an existing folder")


def _quick_check(conn: sqlite3.Connection, target: Path) -> None:
    """DatabaseCorrupt when SQLite's quick_check finds the file damaged; skipped for files over
    QUICK_CHECK_MAX_BYTES and for a file state this process checked already."""
    try:
        info = os.stat(target)
    except OSError:
        return
    state = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    if info.st_size == 0 or info.st_size > QUICK_CHECK_MAX_BYTES or state in _found_whole:
        return
    rows = conn.execute("PRAGMA quick_check(1)").fetchall()  # (1): stop at the first problem
    if rows != [("ok",)]:
        found = " ".join(str(rows[0][0] if rows else "no answer").split())
        raise DatabaseCorrupt(damaged_message(target, f"quick_check: {found[:200]}"))
    _found_whole.add(state)


def open_for_reading(path: str | os.PathLike | None = None) -> Store:
    """Open the database for a command that only reads.

    A missing file is refused (DatabaseMissing), and the file is opened read-only, so a database that
    this user may only read (file or folder) works and nothing is written. A database from an older
    joulepilot is brought to this schema first when it can be written; otherwise the error says so.
    """
    target = database_target(path)
    db = open_db(target, read_only=True)
    version = schema_version(db)
    if version >= SCHEMA_VERSION:
        return db
    db.close()
    try:
        return open_db(target, must_exist=True)
    except StoreError as exc:
        raise StoreError(f"database {redacted(str(target))} has schema version {version}, older than this joulepilot's "
                         f"({SCHEMA_VERSION}), and cannot be upgraded here ({exc.__cause__ or exc}); run one "
                         f"joulepilot command as a user who may write it, or read it with the joulepilot "
                         f"that wrote it") from exc


@functools.cache
def joulepilot_tables(version: int) -> frozenset[str]:
    """The tables a joulepilot database of schema `version` holds (its migrations, replayed in memory)."""
    db = Store(sqlite3.connect(":memory:", isolation_level=None))
    try:
        for step in MIGRATIONS[:version]:
            step(db)
        return frozenset(db.table_names())
    finally:
        db.close()


def _schema_state(db: Store) -> tuple[int, list[str]]:
    """The file's schema version and the names of what its schema holds, tables first (SQLite's own left
    out), read in one snapshot so that a migration committing in another process is seen whole or not at
    all."""
    db.begin_read()
    try:
        version = db.schema_version()
        names = db.schema_names()
    except BaseException:
        db.rollback_quietly()  # a COMMIT here would hide why the read failed behind "no transaction"
        raise
    db.commit()
    return version, names


def _listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_is_joulepilot(db: Store, target: Path, *, empty_ok: bool) -> int:
    """The schema version of a joulepilot database; DatabaseCorrupt for a SQLite file that holds something
    else, and for an empty one unless `empty_ok` (a command that may create the database)."""
    version, names = _schema_state(db)
    what = "SQLite file" if db.dialect == "sqlite" else "database"
    if not names and version == 0:
        if empty_ok:
            return version
        raise DatabaseCorrupt(f"{target} is an empty {what}, not a joulepilot database (no tables); check "
                              f"--db / JOULEPILOT_DB (a new database is created by `joulepilot bench`, "
                              f"`joulepilot runs import` or the daemon)")
    # Each migration step commits its tables with its version, so a joulepilot file of version N holds
    # every table of version N; of a newer version only the first schema's tables can be known here.
    missing = joulepilot_tables(version if 0 < version <= SCHEMA_VERSION else 1) - set(names)
    if version == 0 or missing:
        lacking = ("joulepilot's tables and schema version" if version == 0
                   else f"joulepilot's {_listed(sorted(missing))} of schema version {version}")
        raise DatabaseCorrupt(f"{target} is not a joulepilot database (its schema holds {_listed(names)}, without "
                              f"{lacking}); it was left unchanged: point --db / JOULEPILOT_DB at a joulepilot "
                              f"database, or at a new file to create one")
    return version


@contextmanager
def transaction(db: Store, stop: Callable[[], bool] | None = None) -> Iterator[Store]:
    """One logical write: everything inside commits together or not at all.

    A connection used from several threads (the daemon measuring on several GPUs) runs their transactions
    one after another: without the lock a second thread would find the first one's transaction open and
    write into it, to be committed or rolled back with work that is not its own. The wait for another
    process's write lock is taken in slices (see `Store.begin_write`), which `stop()` returning True ends."""
    with db.write_lock:
        if db.in_transaction:
            yield db  # nested: the outer transaction (this thread's, as we hold the lock) owns the commit
            return
        db.begin_write(stop)
        try:
            yield db
            db.commit()
        except BaseException:
            db.rollback_quietly()  # SQLite may already have rolled back (SQLITE_FULL, SQLITE_IOERR)
            raise
