"""What the GPU sweep scripts (gpu_sweep.py, generation_energy.py) share: timestamped progress lines, every
finished run appended to OUT/runs.jsonl the moment it finishes (a call cut off at its limit loses only the run in
progress), and the `--max-minutes` deadline after which no run is started."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class SweepLog:
    """`progress` and `stop_before` for `compiler.bench`, writing OUT/runs.jsonl; `figures(run)` words an ok run."""

    def __init__(self, out: Path, *, max_minutes: float, reserve_s: float, figures: Callable[[dict[str, Any]], str],
                 started: float | None = None) -> None:
        started = time.time() if started is None else started
        self.deadline = started + max_minutes * 60 - reserve_s if max_minutes else None
        self.figures = figures
        self.stopped_early = False
        self._jsonl = open(out / "runs.jsonl", "a")  # noqa: SIM115 - appended to run by run, closed by close()

    def progress(self, index: int, total: int, config: Any, run: dict[str, Any] | None) -> None:
        if run is None:
            log(f"  [{index + 1}/{total}] {config.label} ...")
        elif run.get("skipped"):
            log(f"  [{index}/{total}] {config.label}: already measured (run {run['run_id']})")
        else:
            self._jsonl.write(json.dumps(run, default=str) + "\n")
            self._jsonl.flush()
            if run["status"] == "ok":
                log(f"  [{index}/{total}] {config.label}: {self.figures(run)}")
            else:
                log(f"  [{index}/{total}] {config.label}: FAILED {(run.get('reason') or '').splitlines()[0][:200]}")

    def out_of_time(self, config: Any) -> bool:
        if self.deadline is not None and time.time() > self.deadline:
            self.stopped_early = True
            log(f"  deadline: not starting {config.label} or anything after it")
            return True
        return False

    def close(self) -> None:
        self._jsonl.close()
