"""How long one connection waits for another writer's lock before SQLite gives up with "database is locked".

`open_db` sets the store's patient default (`db.BUSY_TIMEOUT_MS`). A writer that must never be held up for
long, such as a serving process's metering thread, shortens it on its own connection and keeps what was
refused for a later try instead.
"""

from __future__ import annotations

from .connection import Store


def set_lock_wait_s(db: Store, seconds: float) -> None:
    """Wait at most `seconds` for a lock held by another connection (0: fail at once)."""
    db.set_lock_wait_ms(round(seconds * 1000))
