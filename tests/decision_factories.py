"""Runs written straight into a real store, and processes that cannot override file permissions.

`seed_runs` stores ok runs of the built-in MLP (batch 8) on this host's CPU under the installed torch,
with the figures a test chooses, so the resolver decides without compiling anything; `seed_rounds` as many
of them as a verified decision needs.
`restricted_cmd` runs a command the way a serving process of another user would meet the daemon's
files: without the power to override permissions (as root, through setpriv dropping
CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH), so a file it does not own obeys its mode bits.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.policies import torch_minor
from joulepilot.policies.noise import MIN_REPEATS
from joulepilot.store import insert_run, upsert_config, upsert_host, upsert_workload

OTHER_UID = 65534  # 'nobody': the owner of files "another user" wrote

POLICY = """name = "{name}"
workload = "mlp"
batch_size = 8
[objective]
minimize = "energy"
expected_inferences = 1_000_000
[limits]
max_avg_power_w = {limit_w}
[search]
modes = ["eager", "default"]
precisions = ["fp32", "bf16"]
[guard]
windows = 2
action = "warn"
[fallback]
mode = "eager"
"""


def write_policy(folder: Path, name: str = "svc", limit_w: float = 0.5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(POLICY.format(name=name, limit_w=limit_w))
    return path


def config(mode: str, precision: str) -> CompileConfig:
    return CompileConfig(mode, precision=precision, batch_size=8)


def seed_runs(db: Any, figures: dict[tuple[str, str], dict[str, Any]], *, device_name: str | None = None,
              torch_version: str | None = None) -> dict[tuple[str, str], int]:
    """One ok run per (mode, precision) with the given figures (energy_j_per_inference, avg_power_w, and
    optionally extra); returns their run ids. Defaults: this host's CPU and the installed torch."""
    host = upsert_host(db, {"id": "test-host", "hostname": "test", "cpu": "x86"})
    wid = upsert_workload(db, {"id": workload_id("mlp", 8), "spec": "mlp", "batch_size": 8, "params": 1000,
                               "flops_per_inference": 1e6, "op_mix": {"linear": 2}})
    version = torch_version or f"{torch_minor()}.0"
    ids = {}
    for (mode, precision), fig in figures.items():
        cfg = config(mode, precision)
        upsert_config(db, cfg.to_row())
        now = time.time()
        run = {"workload_id": wid, "config_id": cfg.id, "host_id": host,
               "device": "cuda:0" if device_name else "cpu", "device_name": device_name, "status": "ok",
               "started_at": now, "finished_at": now + 1, "compile_s": 0.0 if mode == "eager" else 5.0,
               "compile_energy_j": 0.0 if mode == "eager" else 50.0, "latency_ms_p50": 1.0,
               "latency_ms_p95": 1.2, "peak_power_w": fig["avg_power_w"] * 1.1, "max_rel_error": 1e-4,
               "energy_source": "estimate", "torch_version": version, "window_s": 2.0,
               **{k: v for k, v in fig.items() if k != "extra"}}
        if "extra" in fig:
            run["extra"] = fig["extra"]
        ids[(mode, precision)] = insert_run(db, run)
    return ids


def seed_rounds(db: Any, figures: dict[tuple[str, str], dict[str, Any]], rounds: int = MIN_REPEATS,
                **where: Any) -> dict[tuple[str, str], int]:
    """`seed_runs` `rounds` times: by default as many runs, each in a fresh process, as a verified decision
    needs (`policies.noise.confirmation`). Returns the newest round's run ids."""
    ids: dict[tuple[str, str], int] = {}
    for _ in range(rounds):
        ids = seed_runs(db, figures, **where)
    return ids


def db_file(db: Any) -> str:
    return db.execute("PRAGMA database_list").fetchone()[2]


def can_restrict() -> bool:
    return os.geteuid() != 0 or shutil.which("setpriv") is not None


def give_away(*paths: Path) -> None:
    """Make paths belong to 'another user' (as root: chown to nobody; as a user, owned files already
    obey their modes, so nothing is needed)."""
    if os.geteuid() == 0:
        for path in paths:
            os.chown(path, OTHER_UID, OTHER_UID)


def restricted_cmd(argv: Sequence[str]) -> list[str]:
    """argv run without the power to override file permissions."""
    if os.geteuid() != 0:
        return list(argv)
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root's permission overrides")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *argv]


HOOK_SCRIPT = """
import json, sys, warnings
import torch
import joulepilot
policy, db = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    served = joulepilot.compile(model, policy=policy, db=db)
    served(torch.randn(8, 16))
d = served.decision
from torch._dynamo.utils import counters
caches = {k: v for part in ("inductor", "aot_autograd") for k, v in counters[part].items() if "cache" in k}
print(json.dumps({"label": d.config.get("label"), "state": d.state, "source": d.source, "reason": d.reason,
                  "warnings": [str(w.message) for w in caught if "joulepilot" in str(w.message)],
                  "compile_caches": caches}))
"""


def hook_in_new_process(policy: Path | str, db: Path | str, *, restricted: bool = False,
                        env: dict[str, str] | None = None) -> dict[str, Any]:
    """`joulepilot.compile` in a fresh process; returns what it applied and its joulepilot warnings.
    Fails the test with the child's stderr when it raised."""
    argv = [sys.executable, "-c", HOOK_SCRIPT, str(policy), str(db)]
    proc = subprocess.run(restricted_cmd(argv) if restricted else argv, capture_output=True, text=True,
                          timeout=180, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"joulepilot.compile raised in a fresh process:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_unwritable(path: Path) -> None:
    """A folder this test's restricted processes can read but not write (as root: owned by nobody)."""
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
        path.chmod(0o755)
    else:
        path.chmod(0o555)


def make_writable(path: Path) -> None:
    if os.geteuid() == 0:
        os.chown(path, 0, 0)
    path.chmod(0o755)


def compile_with_warnings(policy, db, **kwargs):
    """`joulepilot.compile` of a small linear model with `policy` and `db`, its first call checked against the
    model's own output; returns the served model and the texts of the joulepilot warnings it gave."""
    import warnings

    import torch
    from joulepilot.runtime import compile as jp_compile

    model = torch.nn.Sequential(torch.nn.Linear(16, 4)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = jp_compile(model, policy=policy, db=db, **kwargs)
    x = torch.randn(8, 16)
    assert torch.allclose(served(x).float(), model(x), rtol=5e-2, atol=5e-2)
    return served, [str(w.message) for w in caught if "joulepilot" in str(w.message)]


# Two measured configurations of the built-in MLP, bf16 the cheaper: what the hook tests decide from.
HOOK_FIGURES = {("eager", "bf16"): {"energy_j_per_inference": 0.01, "avg_power_w": 0.2},
                ("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 0.3}}


def decided_policy(tmp_path, db, *, lock: bool = False):
    """A policy written under `tmp_path/policies`, decided from HOOK_FIGURES on this host's CPU and recorded
    (and its lock file written, with `lock`); returns the policy's path and the decision."""
    from joulepilot.policies import load_policy, record_decision, resolve, write_lock

    policy_path = write_policy(tmp_path / "policies")
    seed_runs(db, HOOK_FIGURES)
    decision = resolve(load_policy(policy_path), db, "cpu")
    record_decision(db, decision)
    if lock:
        write_lock(policy_path, decision)
    return policy_path, decision
