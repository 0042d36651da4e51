"""One daemon per database: an exclusive flock on `<db>.daemon.lock` that holds the owner's pid.

The kernel drops a flock when its holder dies (even by SIGKILL), so a stale lock file never blocks
a restart; the pid inside is only there to tell people who holds it.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

PROBE_RETRIES = 20


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
    db_path = Path(db_path).expanduser()
    return db_path.with_name(db_path.name + ".daemon.lock")


def read_lock_pid(lock_path: str | os.PathLike) -> int | None:
    try:
        text = Path(lock_path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def lock_is_held(lock_path: str | os.PathLike) -> bool:
    """True when some process holds the lock now (tested without taking it for long)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class InstanceLock:
    """`with InstanceLock(db_path): ...` or acquire()/release(); raises DaemonAlreadyRunning."""

    def __init__(self, db_path: str | os.PathLike) -> None:
        self.path = lock_path_for(db_path)
        self._fd: int | None = None

    def acquire(self) -> InstanceLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by workers (O_CLOEXEC)
        # `status` and the exporter probe the lock with a brief shared flock; retry past such a probe.
        for attempt in range(PROBE_RETRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pid = read_lock_pid(self.path)
                if pid is not None or attempt == PROBE_RETRIES - 1:
                    os.close(fd)
                    raise DaemonAlreadyRunning(self.path, pid) from None
                time.sleep(0.05)
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
