"""Writing a file whole or not at all, with ordinary permissions.

`tempfile.mkstemp` creates its file 0600, and `os.replace` keeps that mode, so a file written that way
by the daemon's user cannot be read by a serving process running as another user. These files are
created 0666 minus the umask, like any file a program writes.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

FILE_MODE = 0o666  # the umask takes away what the site does not want (0644 with the usual 022)


def stage_file(path: str | os.PathLike, data: bytes, *, mode: int = FILE_MODE, durable: bool = True) -> Path:
    """Write `data` to a new temporary file beside `path` (synced unless `durable=False`) and return its path, for
    the caller to rename over `path` (`os.replace`) when it chooses, e.g. together with another file under a lock.
    `mode` as in `write_file_atomic`. Raises OSError with nothing left behind."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_file_atomic(path: str | os.PathLike, data: bytes, *, mode: int = FILE_MODE, durable: bool = True) -> Path:
    """Write `data` to `path` through a temporary file in the same folder, synced, then renamed over it.

    A reader sees the old file or the new one, never a part; a crash leaves at most a `.tmp` file.
    `mode` less the umask is the new file's (0o777 for an executable). `durable=False` skips the sync, for
    files that only a power loss could leave damaged and that are checked again before use (a cache). Raises
    OSError (read-only folder, permissions, full disk) with nothing left behind.
    """
    target = Path(path)
    tmp = stage_file(target, data, mode=mode, durable=durable)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
