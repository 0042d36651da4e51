"""The daemon's job child: measure one configuration into a scratch database, nothing else.

Usage (by the daemon only): python -m joulepilot.controller.job_child REQUEST.json RESULT.json

The measurement goes through the compiler's `bench` (its own worker subprocess, fresh caches,
budgets) into the scratch SQLite file named in the request; the daemon copies the finished run into
the real database in the same transaction that marks the job done. Exit 0 means the scratch
database holds the run (ok or failed) and RESULT.json says so.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM us when the daemon dies, even by SIGKILL (Linux), so no orphan keeps measuring."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the daemon died before prctl took effect
        raise SystemExit(143)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # Raising unwinds through the compiler's worker runner, which kills its worker's process group.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m joulepilot.controller.job_child REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(args[0]).read_text())
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if request.get("daemon_pid"):
        _die_with_parent(int(request["daemon_pid"]))
    from joulepilot.compiler import CompileConfig, bench
    from joulepilot.store import open_db, upsert_workload

    scratch = open_db(request["scratch_db"])
    try:
        if request.get("workload_row"):
            upsert_workload(scratch, request["workload_row"])  # already described: the worker skips it
        config = CompileConfig.from_row(request["config"])
        started = time.time()
        runs = bench(
            request["spec"], [config], device=request["device"], min_seconds=request["min_seconds"],
            budget_s=request["budget_s"], db=scratch, batch_size=request["batch_size"],
            **request.get("shape_args", {}),
        )
    finally:
        scratch.close()
    result = {"run_ids": [r["run_id"] for r in runs], "status": [r["status"] for r in runs],
              "wall_s": time.time() - started}
    tmp = Path(args[1] + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
