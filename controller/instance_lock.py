"""One daemon per database: an exclusive flock on `<db>.daemon.lock` that holds the owner's pid.

The kernel drops a flock when its holder dies (even by SIGKILL), so a stale lock file never blocks
a restart; the pid inside is only there to tell people who holds it.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from joulepilot.store import side_path

PROBE_RETRIES = 20
PROBE_RETRY_S = 0.05


class DaemonAlreadyRunning(RuntimeError):
    def __init__(self, lock_path: Path, pid: int | None) -> None:
        self.lock_path = lock_path
        self.pid = pid
        who = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"another joulepilot daemon ({who}) already serves this database; it holds {lock_path}. "
            f"Stop it first (kill {pid or '<pid>'}, or systemctl stop joulepilot) or point --db at another database"
        )


def lock_path_for(db_path: str | os.PathLike) -> Path:
    """The lock file beside the database, found through any symlinks, so that two paths to one database
    (a symlink, a relative and an absolute path) share one lock."""
    db_path = Path(os.path.realpath(side_path(db_path)))  # never raises on a link that loops
    return db_path.with_name(db_path.name + ".daemon.lock")


def read_lock_pid(lock_path: str | os.PathLike) -> int | None:
    try:
        text = Path(lock_path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def probe_lock(lock_path: str | os.PathLike) -> bool:
    """True when some process holds the lock now; False when none does or the file does not exist.

    A non-blocking shared flock taken and dropped at once on a read-only descriptor: it needs only
    read access (works from a read-only mount) and never holds the lock for longer than the probe.
    Raises OSError when the file exists but cannot be opened (permissions): that is not "free".
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's shared lock, if it got one
    return False


def lock_is_held(lock_path: str | os.PathLike) -> bool:
    """True when some process holds the lock now (tested without taking it for long); False if unreadable."""
    try:
        return probe_lock(lock_path)
    except OSError:
        return False


class InstanceLock:
    """`with InstanceLock(db_path): ...` or acquire()/release(); raises DaemonAlreadyRunning."""

    def __init__(self, db_path: str | os.PathLike) -> None:
        self.path = lock_path_for(db_path)
        self._fd: int | None = None

    def acquire(self) -> InstanceLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by workers (O_CLOEXEC)
        # `status` and the exporter probe the lock with a brief shared flock; retry past such a probe.
        # The pid in the file proves nothing here: a daemon killed by SIGKILL leaves its pid behind,
        # so only a lock that stays taken for every retry (about a second) means another daemon.
        for attempt in range(PROBE_RETRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == PROBE_RETRIES - 1:
                    os.close(fd)
                    raise DaemonAlreadyRunning(self.path, read_lock_pid(self.path)) from None
                time.sleep(PROBE_RETRY_S)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> InstanceLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
