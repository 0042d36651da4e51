"""runtime.signal_deferral: a signal that lands inside the main thread's `busy()` block waits for the block to end.

Real signals (SIGUSR1, raised in this process), handled by Python in the main thread as they are in a server.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from joulepilot.runtime.signal_deferral import SignalDeferral


@contextmanager
def usr1_through(deferral: SignalDeferral) -> Iterator[list[tuple[int, float]]]:
    """SIGUSR1 goes through `deferral`; yields the (signal, arrival) of each handling, in order."""
    handled: list[tuple[int, float]] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: deferral.deliver(
        signum, frame, lambda s, f, arrived: handled.append((s, arrived))))
    try:
        yield handled
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_in_a_busy_block_is_handled_once_the_outermost_block_ends():
    deferral = SignalDeferral()
    with usr1_through(deferral) as handled:
        with deferral.busy():
            with deferral.busy():
                before = time.monotonic()
                signal.raise_signal(signal.SIGUSR1)
                signal.raise_signal(signal.SIGUSR1)  # a second one while the first is held: handled with it
                assert handled == []
                assert deferral.held_since() is not None and deferral.held_since() >= before
            assert handled == []  # the outer block still runs
        assert [s for s, _ in handled] == [signal.SIGUSR1]
        assert handled[0][1] >= before  # timed from its arrival, not from the block's end
        assert deferral.held_since() is None
        signal.raise_signal(signal.SIGUSR1)  # outside any block: at once
        assert len(handled) == 2


def test_a_signal_is_handled_after_a_block_that_raises():
    deferral = SignalDeferral()
    with usr1_through(deferral) as handled:
        try:
            with deferral.busy():
                signal.raise_signal(signal.SIGUSR1)
                raise OSError("database is locked")
        except OSError:
            pass
        assert len(handled) == 1


def test_another_threads_busy_block_holds_no_signal_of_the_main_thread():
    deferral = SignalDeferral()
    inside, leave = threading.Event(), threading.Event()

    def busy_elsewhere() -> None:
        with deferral.busy():
            inside.set()
            leave.wait(10)

    with usr1_through(deferral) as handled:
        thread = threading.Thread(target=busy_elsewhere)
        thread.start()
        try:
            assert inside.wait(10)
            signal.raise_signal(signal.SIGUSR1)
            assert len(handled) == 1  # the main thread holds none of that block's locks
        finally:
            leave.set()
            thread.join(10)


def test_a_child_forked_by_another_thread_while_the_main_thread_is_busy_handles_signals_at_once():
    deferral = SignalDeferral()
    status: list[int] = []

    def fork_and_wait() -> None:
        pid = os.fork()
        if pid == 0:  # the child: this thread is its main thread, and it is in no block
            try:
                deferral.forked()
                handled: list[int] = []
                signal.signal(signal.SIGUSR1, lambda s, f: deferral.deliver(s, f, lambda *a: handled.append(s)))
                signal.raise_signal(signal.SIGUSR1)
                os._exit(0 if handled == [signal.SIGUSR1] else 1)
            finally:
                os._exit(2)
        status.append(os.waitpid(pid, 0)[1])

    with deferral.busy():
        thread = threading.Thread(target=fork_and_wait)
        thread.start()
        thread.join(30)
    assert status and os.waitstatus_to_exitcode(status[0]) == 0
