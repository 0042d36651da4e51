"""The whole chain on the CPU: bench the built-in mlp (with the fake worker: compiling in the benchmark is what
test_bench_cli covers), fit, resolve a policy, and joulepilot.compile it for real."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from joulepilot.compiler import CompileConfig, bench, load_workload
from joulepilot.controller import fit
from joulepilot.policies import load_policy, record_decision, resolve
from joulepilot.policies.resolve import run_flag
from joulepilot.runtime import compile as jp_compile

EXAMPLE = Path(__file__).parent.parent / "examples" / "policies" / "mlp.toml"


@pytest.mark.slow
def test_bench_fit_resolve_compile(tmp_path, db, fake_worker):
    policy_path = tmp_path / "mlp.toml"
    shutil.copy(EXAMPLE, policy_path)
    policy = load_policy(policy_path)
    configs = [CompileConfig("eager", batch_size=8), CompileConfig("default", batch_size=8)]
    runs = bench("mlp", configs, device="cpu", min_seconds=0.5, db=db, batch_size=8)
    assert [r["status"] for r in runs] == ["ok", "ok"], [r.get("reason") for r in runs]

    model = fit(db)
    decision = resolve(policy, db, "cpu", model)
    assert decision.config["id"] in {c.id for c in configs}
    if all(run_flag(r) for r in runs):  # a contended host: bench asked for repeats, nothing is verified
        assert decision.state == "provisional" and "repeat this run" in decision.reason, decision.reason
    else:  # one run of each: the best is applied, provisional until it has the runs a verified decision needs
        assert decision.state == "provisional", decision.reason
        assert "it has 1 of the 3 runs a verified decision needs" in decision.reason
        chosen = next(c for c in decision.candidates if c.status == "chosen")
        assert decision.config_id == chosen.config_id
        assert run_flag(next(r for r in runs if r["config_id"] == chosen.config_id)) is None
        assert chosen.source == "measured" and chosen.figures["max_rel_error"] <= policy.limits.max_rel_error
    record_decision(db, decision)

    workload = load_workload("mlp", batch_size=8, device="cpu")
    compiled = jp_compile(workload.model, policy=policy_path, db=db)
    assert compiled.decision.source == "store" and compiled.decision.config_id == decision.config_id
    (x,) = workload.example_inputs
    with torch.no_grad():
        expected = workload.model(x)
    out = compiled(x)
    rel = ((out - expected).abs().max() / expected.abs().max()).item()
    assert rel <= policy.limits.max_rel_error
