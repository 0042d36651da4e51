"""The advisory lock that keeps a kernel binaries' tar and its recorded SHA-256 a pair.

They are two files, each replaced by a rename. Two processes saving the same artifacts at once (a bench and
the daemon measuring one configuration, two GPUs' workers) could otherwise leave one's tar beside the
other's digest, refused by every later warm start; and a reader could read the digest of one save and open
the tar of the next. A save holds `<key>.kernels.lock` exclusively for its two renames, a reader shares it
while it reads the digest and opens the tar (it hashes the open file afterwards, unlocked).

An flock, so the kernel drops it when its holder dies, and a lock file left behind never blocks anyone. It
is never waited on for long: the kernels are an optimisation, so a save that cannot take the lock within
`LOCK_WAIT_S` skips them and a reader goes on without them (`KernelsLockBusy`).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_SUFFIX = ".kernels.lock"
LOCK_WAIT_S = 5.0  # each holder keeps it for two renames, or for reading a digest and opening a file
RETRY_S = 0.01
LOCK_FILE_MODE = 0o666  # less the umask, as the files it guards: a serving process of another user opens it too


class KernelsLockBusy(TimeoutError):
    """The kernels' lock stayed held by another process (or could not be opened by a save) for `LOCK_WAIT_S`."""


def kernels_lock_path(artifacts_path: str | os.PathLike) -> Path:
    """The lock file beside an artifacts file (`<key>.bin` -> `<key>.kernels.lock`)."""
    path = Path(artifacts_path)
    return path.with_name(path.stem + LOCK_SUFFIX)


def _open_lock_file(path: Path, *, exclusive: bool) -> int:
    # Read-only opens are enough for flock; a save tries read-write first, which NFS needs for an exclusive lock.
    flags = os.O_CREAT | os.O_CLOEXEC
    if exclusive:
        try:
            return os.open(path, flags | os.O_RDWR, LOCK_FILE_MODE)
        except PermissionError:
            pass  # a lock file created by another user's reader: read access still locks
    return os.open(path, flags | os.O_RDONLY, LOCK_FILE_MODE)


@contextmanager
def kernels_lock(artifacts_path: str | os.PathLike, *, exclusive: bool, wait_s: float | None = None
                 ) -> Iterator[bool]:
    """Hold the kernels' lock of `artifacts_path`, exclusively (a save) or shared (a read), for the block.

    Yields True when held. A reader that cannot open or create the lock file (a read-only folder, saved by an
    earlier joulepilot) yields False and reads unlocked: the tar's digest check still refuses a mismatch.
    Raises KernelsLockBusy when the lock is not free within `wait_s` (default `LOCK_WAIT_S`), and for a save
    whose lock file cannot be opened."""
    path = kernels_lock_path(artifacts_path)
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    try:
        fd = _open_lock_file(path, exclusive=exclusive)
    except OSError as exc:
        if exclusive:
            raise KernelsLockBusy(f"{path} cannot be opened ({type(exc).__name__}: {exc})") from exc
        yield False
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelsLockBusy(f"{path} was held by another process for more than {wait_s:g} s") from None
                time.sleep(RETRY_S)
        yield True
    finally:
        os.close(fd)  # drops the lock
