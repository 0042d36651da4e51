"""Holding a signal until the main thread leaves the code it interrupted.

Python runs a signal handler in the main thread, between two bytecodes of whatever that thread was running. A
handler that needs a lock the interrupted code holds (a `threading.Lock` is not reentrant) would wait for it
forever. Code of the main thread that holds such locks runs inside `busy()`; a signal that arrives meanwhile is
noted, with the moment it arrived, and handled by the same thread as soon as the outermost `busy()` block ends
(however it ends). Other threads never run signal handlers, so for them `busy()` does nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Handles a signal: (signal number, the frame it interrupted, time.monotonic() when it arrived).
Handle = Callable[[int, Any, float], None]


class SignalDeferral:
    """Counts the main thread's nested `busy()` blocks and holds a signal that arrives inside one."""

    def __init__(self) -> None:
        self._depth = 0
        self._owner: int | None = None  # the thread whose blocks are counted (set as the first one opens)
        self._pending: tuple[int, Any, float, Handle] | None = None

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Run the block with signals handled after it, when it is the main thread's."""
        if threading.get_ident() != threading.main_thread().ident:
            yield
            return
        self._owner = threading.get_ident()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._pending is not None:
                signum, frame, arrived, handle = self._pending
                self._pending = None
                handle(signum, frame, arrived)

    def deliver(self, signum: int, frame: Any, handle: Handle) -> None:
        """From a signal handler: `handle` the signal now, or once the interrupted `busy()` block ends. Signals
        that arrive while one is held are handled once, timed from the first."""
        arrived = time.monotonic()
        if self._depth > 0:
            if self._pending is None:
                self._pending = (signum, frame, arrived, handle)
            return
        handle(signum, frame, arrived)

    def held_since(self) -> float | None:
        """time.monotonic() when the signal being held arrived; None when none is."""
        return self._pending[2] if self._pending is not None else None

    def forked(self) -> None:
        """In a child just forked: the parent's held signal is not the child's, nor are the blocks its main thread was
        in unless this thread forked from inside them."""
        self._pending = None
        if threading.get_ident() != self._owner:
            self._depth = 0
