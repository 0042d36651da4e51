"""A SIGTERM (with `flush_on_sigterm`) that lands while the main thread is inside a deployment's flush.

Python runs the handler in the main thread, between two bytecodes of the flush it interrupts, while that flush holds
the deployment's locks. The process must still end within the exit wait, and every served window be in the store, or
in the side file where the store refuses it. Each test runs a real serving process, signalled at an exact point of
its flush: the deployment's buffer lock (or its store write) sends the process SIGTERM from inside the flush, or from
inside `close()` as it keeps the last windows aside.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from joulepilot.runtime import metered
from joulepilot.store import open_db
from joulepilot.store.deployments import get_deployment, read_samples

from tests.test_deployment_store_faults import side_files, write_lock_held

SERVER = textwrap.dedent("""
    import signal, sys, threading
    from joulepilot.runtime import attach, metered

    db_path, where, previous, store_wait_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    metered.STORE_WAIT_S = store_wait_s  # how long a flush waits for a locked store (taken at the first write)
    if previous == "exit3":  # a framework's own handler, installed before joulepilot's
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))

    class SignallingLock:
        # The deployment's buffer lock: once armed, the main thread that takes it sends the process SIGTERM, whose
        # handler Python then runs right there, with the lock held.
        def __init__(self):
            self.lock, self.armed = threading.Lock(), False

        def __enter__(self):
            self.lock.acquire()
            if self.armed and threading.current_thread() is threading.main_thread():
                self.armed = False
                signal.raise_signal(signal.SIGTERM)
            return self

        def __exit__(self, *exc):
            self.lock.release()

    def busy_work(x):
        return sum(range(x))

    dep = attach(busy_work, "stopping", db=db_path, device="cpu", interval_s=0.1, flush_interval_s=3600,
                 flush_on_sigterm=True)
    buffer_lock = dep._buffer_lock = SignallingLock()
    while len(dep._buffer) < 3:  # a few windows, buffered and not yet written
        dep(2000)
    print(dep.inferences, metered.EXIT_WAIT_S, flush=True)
    sys.stdin.readline()  # the test is ready (it may have locked the store)

    if where in ("buffer_lock", "close"):
        buffer_lock.armed = True
    else:  # inside the store write: the write lock held, the transaction open and the batch written in it
        store_samples = metered.store_samples

        def store_then_signal(db, deployment_id, batch):
            stored = store_samples(db, deployment_id, batch)
            signal.raise_signal(signal.SIGTERM)
            return stored

        metered.store_samples = store_then_signal
    print("signalling", flush=True)
    try:
        if where == "close":  # the metering thread's last write waits for the locked store longer than this
            dep.close(timeout_s=1.0)
        else:
            dep.flush()
    except Exception as exc:  # the locked store's refusal, once the signal has been handled
        print("flush raised", exc, file=sys.stderr, flush=True)
    print("the SIGTERM did not end the process", flush=True)
""")


def run_server(tmp_path: Path, where: str, *, previous: str = "default", locked: bool = False,
               store_wait_s: float = metered.STORE_WAIT_S) -> tuple[subprocess.CompletedProcess, float, int, Path]:
    """Serve, signal at `where` during a flush, wait for the end: (process, seconds from the signal, calls, db)."""
    db_path = tmp_path / "jp.db"
    script = tmp_path / "serve.py"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(script), str(db_path), where, previous, str(store_wait_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    served_text, exit_wait_text = proc.stdout.readline().split()
    exit_wait_s = float(exit_wait_text)

    def signal_and_wait() -> tuple[str, str, float]:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "signalling"
        started = time.monotonic()
        try:
            out, err = proc.communicate(timeout=exit_wait_s + 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"the process was still running {exit_wait_s + 5:.0f} s after the SIGTERM that landed in "
                        f"its flush ({where}): the handler waits for a lock its own thread holds")
        return out, err, time.monotonic() - started

    if locked:
        with write_lock_held(db_path):
            out, err, took_s = signal_and_wait()
    else:
        out, err, took_s = signal_and_wait()
    assert took_s < exit_wait_s, f"the SIGTERM took {took_s:.1f} s to end the process (bound {exit_wait_s} s)"
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert "did not end the process" not in out, done
    return done, took_s, int(served_text), db_path


def stored_calls(db_path: Path) -> int:
    db = open_db(db_path)
    try:
        return sum(s["inferences"] for s in read_samples(db, get_deployment(db, "stopping")["id"]))
    finally:
        db.close()


@pytest.mark.parametrize("where", ["buffer_lock", "store_write"])
def test_a_sigterm_inside_a_flush_ends_the_process_once_the_flush_is_done_with_every_window_stored(tmp_path, where):
    done, _, served, db_path = run_server(tmp_path, where)
    assert done.returncode == -signal.SIGTERM, done.stderr  # the default handler still ended the process
    assert stored_calls(db_path) == served  # the interrupted batch and the last window: none lost, none twice
    assert side_files(db_path) == []


def test_the_previous_sigterm_handler_runs_once_the_interrupted_flush_is_done(tmp_path):
    done, _, served, db_path = run_server(tmp_path, "buffer_lock", previous="exit3")
    assert done.returncode == 3, done.stderr  # the framework's handler decided how the process ends
    assert stored_calls(db_path) == served


@pytest.mark.parametrize(("where", "store_wait_s"), [("buffer_lock", 0.5), ("close", metered.STORE_WAIT_S)])
def test_a_sigterm_while_the_locked_store_refuses_the_windows_keeps_every_one_in_the_side_file(tmp_path, where,
                                                                                            store_wait_s):
    # buffer_lock: in a flush the store refuses; close: in close(), as it keeps aside what its thread has not written.
    done, _, served, db_path = run_server(tmp_path, where, locked=True, store_wait_s=store_wait_s)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert stored_calls(db_path) == 0
    [side] = side_files(db_path)
    assert str(side) in done.stderr  # the exit says where the windows wait
    kept = json.loads(side.read_text())
    assert kept["deployment"] == "stopping"
    assert sum(s["inferences"] for s in kept["samples"]) == served
