"""A slow-to-compile workload factory and small helpers for the daemon's tests.

The factory is used as a workload spec: `<path>/tests/daemon_factories.py:deep_mlp`.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def deep_mlp(batch_size: int = 8):
    """Cheap to run, slow to compile: Inductor has hundreds of small layers to trace and fuse, so a
    signal sent a few seconds into the job lands in the middle of the compile."""
    import torch  # here, not at the top: conftest.py imports this module, and pytest's main process needs no torch
    from torch import nn

    torch.manual_seed(0)
    layers: list = []
    for _ in range(120):
        layers += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    model = nn.Sequential(*layers).eval()
    return model, (torch.randn(batch_size, 16),)


# --- helpers shared by the daemon's tests ---------------------------------------------------------

TESTS_DIR = Path(__file__).resolve().parent
FAKE_WORKER_MODULE = "tests.fake_worker"
FLOW_WORKER_MODULE = "tests.flow_worker"
WORKER_MODULES = ("joulepilot.compiler.worker", FAKE_WORKER_MODULE, FLOW_WORKER_MODULE)


def _use_worker(monkeypatch: Any, module: str) -> str:
    monkeypatch.setenv("JOULEPILOT_WORKER_MODULE", module)
    path = [str(TESTS_DIR.parent), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    return module


def use_fake_worker(monkeypatch: Any) -> str:
    """From now on in this test, every worker (in-process `bench`, or a daemon or CLI subprocess, which inherit
    the environment) runs as tests/fake_worker.py: the real worker with eager calls in place of torch.compile."""
    return _use_worker(monkeypatch, FAKE_WORKER_MODULE)


def use_flow_worker(monkeypatch: Any) -> str:
    """From now on in this test, every worker runs as tests/flow_worker.py: the worker's protocols and measuring
    loops without torch, on a stand-in for the model (for tests about the daemon's and the CLI's flow)."""
    return _use_worker(monkeypatch, FLOW_WORKER_MODULE)


def is_worker(cmdline: Sequence[str]) -> bool:
    """Whether a command line is a benchmark worker's (the real one or the fake)."""
    return any(module in cmdline for module in WORKER_MODULES)


def write_policy(folder: Path, name: str, *, workload: str = "mlp", modes: Sequence[str] = ("eager",),
                 precisions: Sequence[str] = ("fp32",), extra: str = "", strategy: str = "exhaustive",
                 min_repeats: int | None = None) -> Path:
    """A policy file; `exhaustive` with `min_repeats = 1` by default, so the daemon's tests measure each
    configuration once (the guided search's repeats are tested in test_guided_planner.py, the exhaustive
    strategy's in test_exhaustive_repeats.py). `min_repeats`: written when given; None leaves a guided
    policy at the policy's default and gives an exhaustive one 1."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    if min_repeats is None and strategy == "exhaustive":
        min_repeats = 1
    path.write_text(
        f'name = "{name}"\nworkload = "{workload}"\nbatch_size = 8\n{extra}\n'
        f"[search]\nmodes = {list(modes)!r}\nprecisions = {list(precisions)!r}\n"
        f"strategy = {strategy!r}\n".replace("'", '"')
        + (f"min_repeats = {min_repeats}\n" if min_repeats is not None else "")
    )
    return path


def write_daemon_config(path: Path, *, db: Path, policies: Path, interval_s: float = 3600, exporter: bool = False,
                        port: int = 0, min_seconds: float = 0.5) -> Path:
    path.write_text(
        f'db = "{db}"\npolicies = ["{policies}"]\ninterval_s = {interval_s}\nlog_level = "INFO"\n'
        f"[bench]\nmin_seconds = {min_seconds}\nbudget_s = 300\n"
        f"[idle]\npoll_s = 0.5\n"
        f'[exporter]\nenabled = {"true" if exporter else "false"}\nport = {port}\n'
    )
    return path


def daemon_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "joulepilot", "daemon", *args]


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def query(db_path: Path, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
    conn = sqlite3.connect(db_path, timeout=30)
    try:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(sql, params).fetchall()]
    finally:
        conn.close()


def poll_query(db_path: Path, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """query() for wait_for: [] while the database does not exist or is not migrated yet."""
    if not Path(db_path).exists():
        return []
    try:
        return query(db_path, sql, params)
    except sqlite3.OperationalError:
        return []
