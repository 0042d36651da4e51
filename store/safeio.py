"""Untrusted text and files with bounds: quotes shortened, JSON kept small, only regular files read.

Policy files, workload modules and the hooks' requests are written by other people; whatever of
them is echoed into an error, a log line or a heartbeat must stay small, and reading them must never
block (a FIFO named `x.toml` blocks `open()` until a writer appears, and signals do not interrupt it).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

QUOTE_CHARS = 200


class FileRefused(ValueError):
    """A file that is not read: not a regular file, or larger than allowed. `reason` says which."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def shorten(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` itself when short, else its start and `… (N chars)` so a quote never grows with its input."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} chars)"


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, from its st_mode."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def is_regular_file(path: str | os.PathLike) -> bool:
    """True for a regular file (or a link to one); never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_regular_file(path: str | os.PathLike, *, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file; FileRefused for anything else, or for more than `max_bytes`.

    The file is opened non-blocking and checked on the open descriptor, so a FIFO or device swapped in
    after a stat() still cannot block the caller. OSError (missing, unreadable) passes through.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(path, f"not a regular file ({file_kind(info.st_mode)})")
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileRefused(path, f"too large ({info.st_size:,} bytes; at most {max_bytes:,} are read)")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:  # it grew while we read
                raise FileRefused(path, f"too large (over {max_bytes:,} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def bound_json(value: Any, *, max_str: int = 500, max_items: int = 50, max_depth: int = 8) -> Any:
    """A JSON-able copy of `value` with every string shortened, every list and table cut to `max_items`
    (a cut table says how many keys it dropped under "…"), and nesting below `max_depth` summarised."""

    def bound(item: Any, depth: int) -> Any:
        if isinstance(item, str):
            return shorten(item, max_str)
        if isinstance(item, Mapping):
            if depth >= max_depth:
                return f"(a table of {len(item)} keys, not kept)"
            pairs = list(item.items())
            out = {shorten(str(k), max_str): bound(v, depth + 1) for k, v in pairs[:max_items]}
            if len(pairs) > max_items:
                out["…"] = f"{len(pairs) - max_items} more keys not kept"
            return out
        if isinstance(item, list | tuple | set | frozenset):
            items = list(item)
            if depth >= max_depth:
                return f"(a list of {len(items)} items, not kept)"
            return [bound(v, depth + 1) for v in items[:max_items]]
        if item is None or isinstance(item, bool | int | float):
            return item
        return shorten(str(item), max_str)

    return bound(value, 0)


def bounded_json_text(detail: Mapping[str, Any], *, max_bytes: int, **limits: int) -> str:
    """`detail` as JSON text of at most about `max_bytes`: bounded with `bound_json`, then its largest
    top-level values replaced by a note saying how large they were until it fits."""
    data = bound_json(dict(detail), **limits)
    text = json.dumps(data, sort_keys=True, default=str)
    while len(text) > max_bytes and data:
        sizes = {k: len(json.dumps(v, default=str)) for k, v in data.items()}
        largest = max(sizes, key=sizes.__getitem__)
        if isinstance(data[largest], str) and data[largest].startswith("(omitted:"):
            break
        data[largest] = f"(omitted: {sizes[largest]:,} bytes of JSON)"
        text = json.dumps(data, sort_keys=True, default=str)
    return text
