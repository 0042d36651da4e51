"""A deployment attached before a fork (a prefork server such as `gunicorn --preload`) is metered in each
child that serves it, from its first call, and counted once: the parent's unwritten windows stay the parent's,
a child that never serves writes nothing, and a parent that serves nothing while a child does writes no
windows of its own (their energy would be its children's, metered again)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from joulepilot.store import open_db
from joulepilot.store.deployments import get_deployment, read_samples

FORK_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from joulepilot.runtime import attach

    def busy_work(x):
        return sum(range(x))

    def serve(dep, seconds):
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            dep(2000)

    # Flushed hourly: the parent's windows are still buffered when it forks.
    dep = attach(busy_work, "prefork", db=sys.argv[1], device="cpu", interval_s=0.2, flush_interval_s=3600)
    serve(dep, 0.5)
    out = {}

    idle_start = time.time()
    helper = os.fork()
    if helper == 0:  # a helper process that never calls the model
        time.sleep(0.8)
        sys.exit(0)
    out["helper_status"] = os.waitpid(helper, 0)[1]
    out["idle"] = [idle_start, time.time()]

    r, w = os.pipe()
    worker = os.fork()
    if worker == 0:
        os.close(r)
        started = time.time()
        serve(dep, 1.2)
        info = {"served": dep.inferences, "alive": dep._thread.is_alive(), "span": [started, time.time()]}
        os.write(w, json.dumps(info).encode())
        os.close(w)
        sys.exit(0)  # a normal exit: the child's windows are flushed at exit
    os.close(w)
    out["worker_status"] = os.waitpid(worker, 0)[1]
    out["worker"] = json.loads(os.read(r, 65536))
    serve(dep, 0.3)
    dep.close()
    out["parent_served"] = dep.inferences
    print(json.dumps(out))
""")


def test_forked_children_meter_their_own_calls_once(tmp_path):
    db_path = tmp_path / "jp.db"
    script = tmp_path / "prefork.py"
    script.write_text(FORK_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(db_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["helper_status"] == 0 and out["worker_status"] == 0
    worker = out["worker"]
    assert worker["alive"], "the child's calls were not metered: no metering thread in the child"
    assert worker["served"] > 0

    db = open_db(db_path)
    samples = read_samples(db, get_deployment(db, "prefork")["id"])
    # Every call of both processes once: the child neither lost its own nor wrote the parent's buffered windows.
    assert sum(s["inferences"] for s in samples) == out["parent_served"] + worker["served"]

    idle_start, idle_end = out["idle"]
    during_helper = [s for s in samples if s["t_start"] >= idle_start and s["t_end"] <= idle_end]
    assert during_helper and all(s["inferences"] == 0 for s in during_helper)  # the parent's own idle windows
    first, last = worker["span"]
    idle_parent = [s for s in samples if s["inferences"] == 0 and s["t_start"] >= first + 0.3 and s["t_end"] <= last]
    assert idle_parent == []  # while its child served, the idle parent wrote no window of the child's energy


THREADLESS_CHILD = textwrap.dedent("""
    import json, os, sys, threading
    from joulepilot.runtime import attach

    dep = attach(lambda x: x + 1, "prefork", db=sys.argv[1], device="cpu", interval_s=0.2, flush_interval_s=3600)
    dep(1)
    child = os.fork()
    if child == 0:
        def no_thread(self):
            raise RuntimeError("can't start new thread")

        threading.Thread.start = no_thread  # as under a pids limit
        results = [dep(i) for i in range(100)]  # must serve, unmetered
        os.write(1, json.dumps({"results_ok": results == [i + 1 for i in range(100)]}).encode() + b"\\n")
        os._exit(0)
    _, status = os.waitpid(child, 0)
    dep.close()
    print(json.dumps({"child_status": status}))
""")


def test_a_child_that_cannot_start_its_metering_thread_still_serves(tmp_path):
    proc = subprocess.run([sys.executable, "-c", THREADLESS_CHILD, str(tmp_path / "j.db")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {"results_ok": True} in lines and {"child_status": 0} in lines
    assert "cannot meter forked process" in proc.stderr and "can't start new thread" in proc.stderr
    assert "Traceback" not in proc.stderr
