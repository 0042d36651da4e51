"""The `live_children` fixture (tests/conftest.py) that tests of killed and stopped processes check for leftovers
with: what the test started counts, what was already running when it began does not, nor anything such a process
starts meanwhile (the session's PostgreSQL server forks backends and autovacuum workers at any time: a whole-suite
run once failed a zygote test on an autovacuum worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
# Waits for a line on stdin, then starts a sleeping child and prints its pid.
STARTS_ON_CUE = ("import subprocess, sys, time\n"
                 "sys.stdin.readline()\n"
                 f"child = subprocess.Popen({SLEEP!r})\n"
                 "print(child.pid, flush=True)\n"
                 "time.sleep(60)\n")


def test_an_earlier_process_and_what_it_starts_later_are_not_the_tests(request):
    earlier = subprocess.Popen([sys.executable, "-c", STARTS_ON_CUE], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    grandchild = None
    own = None
    try:
        live = request.getfixturevalue("live_children")  # its snapshot: `earlier` was already running
        earlier.stdin.write("go\n")
        earlier.stdin.flush()
        grandchild = int(earlier.stdout.readline())
        own = subprocess.Popen(SLEEP)
        pids = {proc.pid for proc in live()}
        assert own.pid in pids
        assert earlier.pid not in pids and grandchild not in pids, (pids, earlier.pid, grandchild)
    finally:
        for proc in (own, earlier):
            if proc is not None:
                proc.kill()
                proc.wait()
        if grandchild is not None:
            try:
                os.kill(grandchild, signal.SIGKILL)
            except ProcessLookupError:
                pass
