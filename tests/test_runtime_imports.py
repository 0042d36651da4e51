"""A serving process: `joulepilot.compile(..., deployment=...)` loads nothing of the agent and installs
no signal handler unless asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.policies import Decision, load_policy, record_decision, torch_minor
from joulepilot.store import get_deployment, open_db, read_samples

EXAMPLE = Path(__file__).parent.parent / "examples" / "policies" / "mlp.toml"
AGENT_ONLY = ("joulepilot.controller", "sklearn", "matplotlib", "prometheus_client", "schedule")

SERVE = textwrap.dedent("""
    import json, signal, sys, warnings
    import torch
    import joulepilot

    policy, db, sigterm = sys.argv[1], sys.argv[2], sys.argv[3] == "flush-on-sigterm"
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    warnings.filterwarnings("error", message="joulepilot")  # a decision is in force: nothing to warn about
    extra = {"flush_on_sigterm": True} if sigterm else {}
    served = joulepilot.compile(model, policy=policy, db=db, deployment="svc", **extra)
    x = torch.randn(8, 16)
    with torch.no_grad():
        same = bool(torch.equal(served(x), model(x)))
    handler = signal.getsignal(signal.SIGTERM)
    served.close()
    print(json.dumps({
        "served_by": type(served).__module__ + "." + type(served).__name__,
        "decision": [served.decision.source, served.decision.config["label"]],
        "same_output": same,
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[4:]
                         or any(m == a or m.startswith(a + ".") for a in sys.argv[4:])),
        "inductor_loaded": "torch._inductor" in sys.modules,
        "sigterm": "default" if handler is signal.SIG_DFL else "joulepilot" if callable(handler) else str(handler),
    }))
""")


@pytest.fixture
def served_policy(tmp_path):
    """The example policy with an eager decision in the store (nothing to compile)."""
    path = tmp_path / "mlp.toml"
    path.write_text(EXAMPLE.read_text())
    policy = load_policy(path)
    config = CompileConfig("eager", batch_size=policy.batch_size)
    db_path = tmp_path / "jp.db"
    db = open_db(db_path)
    record_decision(db, Decision(policy=policy.name, policy_hash=policy.hash, device_kind="cpu",
                                 torch_version=torch_minor(), workload=policy.workload,
                                 workload_id=workload_id(policy.workload, policy.batch_size),
                                 config=config.to_row(), state="verified", reason="chosen by the test",
                                 objective="energy", expected_inferences=1000))
    db.close()
    return path, db_path, config


def serve(tmp_path: Path, policy: Path, db_path: Path, how: str) -> dict:
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    done = subprocess.run([sys.executable, str(script), str(policy), str(db_path), how, *AGENT_ONLY],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": ""})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_serving_loads_nothing_of_the_agent(tmp_path, served_policy):
    policy, db_path, config = served_policy
    seen = serve(tmp_path, policy, db_path, "plain")
    assert seen["served_by"] == "joulepilot.runtime.metered.MeteredModel"
    assert seen["decision"] == ["store", config.label] and seen["same_output"]
    assert seen["loaded"] == []
    assert seen["inductor_loaded"] is False  # an eager decision compiles nothing, so Inductor is not loaded
    assert seen["sigterm"] == "default"
    db = open_db(db_path)
    samples = read_samples(db, get_deployment(db, "svc")["id"])
    assert sum(s["inferences"] for s in samples) == 1  # metered, flushed at close


def test_a_sigterm_handler_only_when_asked(tmp_path, served_policy):
    policy, db_path, _config = served_policy
    seen = serve(tmp_path, policy, db_path, "flush-on-sigterm")
    assert seen["sigterm"] == "joulepilot" and seen["loaded"] == []
