"""benchmarks/sweep_overhead.py: when the daemon's first job started, from its log."""

from __future__ import annotations

import datetime
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("sweep_overhead", ROOT / "benchmarks" / "sweep_overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sweep_overhead"] = module
    spec.loader.exec_module(module)
    return module


def test_the_first_job_line_gives_the_seconds_from_launch():
    script = _script()
    launched = datetime.datetime(2026, 11, 22, 18, 55, 59).timestamp()
    log = ("2026-11-22 18:56:01,236 joulepilot-daemon[824] INFO waiting for an idle device (cuda:0: GPU 0 "
           "utilisation 0%)\n[job 1/12] model0 eager/fp32/b32 on cuda:0: measuring ...\n"
           "2026-11-22 18:56:02,308 joulepilot-daemon[824] INFO job 1: torchvision:resnet18 eager/fp32/b32 on cuda:0\n"
           "2026-11-22 18:56:22,751 joulepilot-daemon[824] INFO job 1: ok, run 1 (20.4s)\n")
    assert abs(script.before_first_job_s(log, launched) - 3.308) < 1e-6
    assert script.before_first_job_s("2026-11-22 18:56:01,236 x INFO nothing measured\n", launched) is None
