"""A deployment served through `joulepilot.compile(..., deployment=NAME)`: the hook hands its model to attach."""

from __future__ import annotations

import time
import warnings

import torch
from joulepilot.controller.report import build_report
from joulepilot.runtime import MeteredModel
from joulepilot.runtime import compile as jp_compile
from joulepilot.store import open_db
from joulepilot.telemetry import EnergyMeter

POLICY = """
name = "tiny"
workload = "mlp"
batch_size = 8
[limits]
max_avg_power_w = 400
[guard]
windows = 3
action = "fallback"
"""


def test_served_through_the_hook(tmp_path, monkeypatch):
    monkeypatch.setenv("JOULEPILOT_POLICIES", str(tmp_path))  # the report finds the policy file by name
    policy = tmp_path / "tiny.toml"
    policy.write_text(POLICY)
    db_path = tmp_path / "jp.db"
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).eval()
    x = torch.randn(8, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no decision yet: the hook warns and serves the fallback
        served = jp_compile(model, policy=str(policy), db=str(db_path), deployment="tiny-prod")
    assert isinstance(served, MeteredModel)
    # The independent window opens after the hook returned: the deployment's first window starts at
    # the end of attach, so both cover the serving span (the hook's own policy loading is in neither).
    independent = EnergyMeter(device="cpu", sampler=False)
    independent.begin("span")
    t_end = time.monotonic() + 2.0
    while time.monotonic() < t_end:
        out = served(x)
        time.sleep(0.002)  # served at a steady pace: the windows and their sum are the point, not the load
    served.close()
    window = independent.end("span")
    assert torch.allclose(out, model(x).detach())
    assert served.decision.state == "fallback"  # attribute access reaches the hook's callable

    db = open_db(db_path)
    dep = db.execute("SELECT policy, workload_id, config_id, device FROM deployments WHERE name = 'tiny-prod'"
                     ).fetchone()
    assert dep[0] == "tiny" and dep[1] and dep[2] and dep[3] == "cpu"
    energy, calls = db.execute("SELECT SUM(energy_j), SUM(inferences) FROM deployment_samples").fetchone()
    assert calls == served.inferences > 0
    assert abs(energy - window.energy_j) <= max(0.05 * window.energy_j, 0.2)
    report = build_report(db, "tiny-prod")
    assert report["envelope"]["max_avg_power_w"] == 400  # from the policy file, found by name
    assert served.guard is not None and served.guard.action == "fallback"
