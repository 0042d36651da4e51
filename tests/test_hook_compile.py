"""joulepilot.compile: lock file first, then the store, else the fallback with one warning and a request."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.policies import Decision, load_policy, record_decision, torch_minor, write_lock
from joulepilot.runtime import compile as jp_compile
from joulepilot.runtime import lookup_decision, merge_compile_kwargs

EXAMPLE = Path(__file__).parent.parent / "examples" / "policies" / "mlp.toml"


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


@pytest.fixture
def policy_path(tmp_path):
    """The example policy, searching bf16 too: the hook applies only decisions within the policy's grid."""
    path = tmp_path / "mlp.toml"
    path.write_text(EXAMPLE.read_text().replace('precisions = ["fp32"]', 'precisions = ["fp32", "bf16"]'))
    return path


def decision_for(policy_path, config, state="verified"):
    policy = load_policy(policy_path)
    return Decision(policy=policy.name, policy_hash=policy.hash, device_kind="cpu", torch_version=torch_minor(),
                    workload=policy.workload, workload_id=workload_id(policy.workload, policy.batch_size),
                    config=config.to_row(), state=state, reason="chosen by the test", objective="energy",
                    expected_inferences=1000)


def test_lock_file_decision_is_applied_with_autocast(policy_path, tmp_path):
    write_lock(policy_path, decision_for(policy_path, CompileConfig("eager", precision="bf16", batch_size=8)))
    model, x = small_model(), torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a decision exists: nothing to warn about
        compiled = jp_compile(model, policy=policy_path, db=tmp_path / "none.db")
    assert compiled.decision.source == "lock" and compiled.decision.state == "verified"
    assert compiled.decision.config["precision"] == "bf16"
    out = compiled(x)
    assert out.dtype == torch.bfloat16  # autocast applied on the CPU
    assert torch.allclose(out.float(), model(x), rtol=5e-2, atol=5e-2)
    assert not (tmp_path / "none.db").exists()  # the lookup never creates a store


def test_policy_found_by_name(policy_path, monkeypatch):
    write_lock(policy_path, decision_for(policy_path, CompileConfig("eager", batch_size=8)))
    monkeypatch.setenv("JOULEPILOT_POLICIES", str(policy_path.parent))
    compiled = jp_compile(small_model(), policy="mlp")
    assert compiled.decision.source == "lock"


def test_store_decision_when_no_lock_and_stale_ones_ignored(policy_path, db):
    record_decision(db, decision_for(policy_path, CompileConfig("eager", precision="bf16", batch_size=8)))
    found = lookup_decision(policy_path, "cpu", torch_minor(), db)
    assert found.source == "store" and found.config["precision"] == "bf16" and found.id is not None
    compiled = jp_compile(small_model(), policy=str(policy_path), db=db)
    assert compiled.decision.source == "store"
    assert lookup_decision(policy_path, "NVIDIA H200", torch_minor(), db) is None
    # the policy changes: the decision made for its old content no longer applies
    policy_path.write_text(policy_path.read_text().replace("max_rel_error = 1e-3", "max_rel_error = 1e-4"))
    assert lookup_decision(policy_path, "cpu", torch_minor(), db) is None


def test_no_decision_applies_fallback_warns_once_and_requests(policy_path, db):
    model, x = small_model(), torch.randn(8, 16)
    with pytest.warns(UserWarning, match="no decision for policy 'mlp'.*fallback eager/fp32/b8"):
        compiled = jp_compile(model, policy=policy_path, db=db)
    assert compiled.decision.state == "fallback" and compiled.decision.source == "none"
    assert torch.equal(compiled(x), model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jp_compile(model, policy=policy_path, db=db)  # said once only
    requests = list(db.query("SELECT * FROM requests"))
    assert len(requests) == 1
    assert requests[0]["policy"] == "mlp" and requests[0]["workload"] == "mlp" and requests[0]["host_id"]
    note = json.loads(requests[0]["note"])
    assert note["policy_path"] == str(policy_path.resolve()) and note["device_kind"] == "cpu"


def test_user_kwargs_merge_over_the_decision():
    plain = CompileConfig("reduce-overhead", batch_size=8)
    assert merge_compile_kwargs(plain, "cuda:0", {"fullgraph": True}) == {
        "dynamic": False, "mode": "reduce-overhead", "fullgraph": True}
    merged = merge_compile_kwargs(plain, "cuda:0", {"options": {"epilogue_fusion": False}})
    assert "mode" not in merged and merged["options"]["epilogue_fusion"] is False
    assert merged["options"]["triton.cudagraphs"] is True  # the mode, expanded under the user's options
    preset = CompileConfig("default", fusion="no-epilogue-fusion", batch_size=8)
    assert merge_compile_kwargs(preset, "cpu", {"mode": "max-autotune-no-cudagraphs"}) == {
        "dynamic": False, "mode": "max-autotune-no-cudagraphs"}


def test_decided_fallback_is_applied_and_still_requests_measurement(policy_path, db):
    write_lock(policy_path, decision_for(policy_path, CompileConfig("eager", batch_size=8), state="fallback"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a decision exists: no warning, only a request for the daemon
        compiled = jp_compile(small_model(), policy=policy_path, db=db)
    assert compiled.decision.source == "lock" and compiled.decision.state == "fallback"
    assert [r["policy"] for r in db.query("SELECT policy FROM requests")] == ["mlp"]
