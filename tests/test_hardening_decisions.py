"""Deciding and applying after real trouble: a guard trip, a deployment that broke the envelope, runs
flagged "repeat this run", and a device or torch version that has no runs."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from decision_factories import config, db_file, hook_in_new_process, seed_rounds, seed_runs, write_policy
from joulepilot.controller import fit
from joulepilot.controller.device_probe import probe_device
from joulepilot.controller.planner import fresh_ok_config_ids, stale_reason
from joulepilot.controller.redecide import decide_now
from joulepilot.policies import load_policy, record_decision, resolve, torch_minor, write_lock
from joulepilot.policies.lock import lock_path
from joulepilot.runtime import attach, lookup_decision
from joulepilot.runtime import compile as jp_compile
from joulepilot.store import import_runs, read_export
from joulepilot.store.decisions import latest_decision

from joulepilot.cli import main

H200_SWEEP = Path(__file__).parent / "data" / "gpu_sweep_h200.json"
WARNING = ("calls took 8.6 ms each in the energy window, 1.46x the synchronised p50 of 5.9 ms; something "
           "slowed the window (host contention, launch stalls): repeat this run before relying on its energy "
           "per inference")

# Figures for the four allowed configurations under a 0.5 W envelope: eager/bf16 is the best measured,
# eager/fp32 the next, default/bf16 breaks the envelope.
FIGURES = {
    ("eager", "bf16"): {"energy_j_per_inference": 0.010, "avg_power_w": 0.20},
    ("eager", "fp32"): {"energy_j_per_inference": 0.020, "avg_power_w": 0.30},
    ("default", "fp32"): {"energy_j_per_inference": 0.030, "avg_power_w": 0.40},
    ("default", "bf16"): {"energy_j_per_inference": 0.015, "avg_power_w": 0.90},
}


def _trip_through_the_hook(policy_path: Path, db) -> None:
    """Serve the policy's decision through the hook on this CPU (the estimate meter reads watts, far
    above the 0.5 W envelope) until the guard trips and writes the violation to the store."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    compiled = jp_compile(model, policy=policy_path, db=db)
    assert compiled.decision.state == "verified"
    served = attach(compiled, "svc-prod", policy=load_policy(policy_path), decision=compiled.decision,
                    db=db_file(db), device="cpu", interval_s=0.25)
    x = torch.randn(8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deadline = time.monotonic() + 20
        while not served.trips and time.monotonic() < deadline:
            served(x)
    served.close()
    assert served.trips, "the guard never tripped"


def test_after_a_guard_trip_a_new_process_applies_the_earlier_decision(tmp_path, db):
    """Item 1: the violated row has no configuration; a new process must not raise KeyError but apply
    the newest earlier decision whose configuration did not break the envelope, with one warning."""
    policy_path = write_policy(tmp_path / "policies")
    policy = load_policy(policy_path)
    seed_rounds(db, {k: v for k, v in FIGURES.items() if k != ("eager", "bf16")})
    earlier = resolve(policy, db, "cpu")
    earlier.decided_at -= 60
    record_decision(db, earlier)
    assert earlier.config_id == config("eager", "fp32").id
    seed_rounds(db, {("eager", "bf16"): FIGURES[("eager", "bf16")]})
    newer = resolve(policy, db, "cpu")
    record_decision(db, newer)
    write_lock(policy_path, newer)
    assert newer.state == "verified" and newer.config_id == config("eager", "bf16").id

    _trip_through_the_hook(policy_path, db)
    assert latest_decision(db, "svc", "cpu", torch_minor())["state"] == "violated"
    lock_path(policy_path).unlink()  # a host that reads decisions from the store

    applied = hook_in_new_process(policy_path, db_file(db))
    assert applied["source"] == "store" and applied["state"] == "verified"
    assert applied["label"] == "eager/fp32/b8"
    assert len(applied["warnings"]) == 1 and "broke its power envelope" in applied["warnings"][0]
    assert "eager/fp32/b8" in applied["warnings"][0]


def test_after_a_guard_trip_with_nothing_earlier_the_hook_applies_the_fallback(tmp_path, db):
    policy_path = write_policy(tmp_path / "policies")
    seed_rounds(db, FIGURES)
    record_decision(db, resolve(load_policy(policy_path), db, "cpu"))
    _trip_through_the_hook(policy_path, db)

    found = lookup_decision(policy_path, "cpu", torch_minor(), db)
    assert found is None  # nothing applicable: the caller applies the fallback
    with pytest.warns(UserWarning, match="broke its power envelope.*applying the policy's fallback") as caught:
        served = jp_compile(torch.nn.Linear(16, 4).eval(), policy=policy_path, db=db)
    assert len([w for w in caught if "joulepilot" in str(w.message)]) == 1
    assert served.decision.source == "none" and served.decision.state == "fallback"
    assert served.decision.config["id"] == config("eager", "fp32").id


def test_every_way_to_decide_leaves_out_what_broke_the_envelope(tmp_path, db):
    """Item 3: `policy lock`, `policy explain --record` and the daemon decide through one function: none
    re-selects a configuration a deployment broke, and each records who decided and under what."""
    policy_path = write_policy(tmp_path / "policies")
    seed_rounds(db, FIGURES)
    first = resolve(load_policy(policy_path), db, "cpu")
    record_decision(db, first)
    _trip_through_the_hook(policy_path, db)
    broken = config("eager", "bf16").id
    assert first.config_id == broken

    runner = CliRunner()
    args = ["--db", db_file(db), "--device-name", "cpu"]
    out = runner.invoke(main, ["policy", "lock", str(policy_path), *args, "--json"])
    assert out.exit_code == 0, out.output
    locked = json.loads(out.stdout)
    assert locked["config"]["id"] == config("eager", "fp32").id and locked["state"] == "verified"
    entry = json.loads(lock_path(policy_path).read_text())["entries"]["cpu"][torch_minor()]
    assert entry["config_id"] == config("eager", "fp32").id
    from joulepilot.store.decisions import APPLICABLE_STATES

    row = latest_decision(db, "svc", "cpu", states=APPLICABLE_STATES)
    assert row["id"] == locked["decision_id"] and row["details"]["decided_by"] == "policy lock"
    assert row["details"]["provenance_key"] == probe_device("cpu").provenance_key
    assert broken in row["details"]["excluded_violated"]

    out = runner.invoke(main, ["policy", "explain", str(policy_path), *args, "--record"])
    assert out.exit_code == 0, out.output
    assert "eager/fp32/b8  [verified]" in out.output
    assert "broke the power envelope" in out.output
    row = latest_decision(db, "svc", "cpu", torch_minor())
    assert row["config_id"] == config("eager", "fp32").id
    assert row["details"]["decided_by"] == "policy explain --record"

    probe = probe_device("cpu")
    decided, _plan = decide_now(db, load_policy(policy_path), probe.device_kind, None, decided_by="daemon",
                                reason="test", provenance_key=probe.provenance_key)
    assert decided.decision.config_id == config("eager", "fp32").id
    assert latest_decision(db, "svc", "cpu", torch_minor())["details"]["decided_by"] == "daemon"
    # The hook applies the new decision without a word.
    lock_path(policy_path).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        served = jp_compile(torch.nn.Linear(16, 4).eval(), policy=policy_path, db=db)
    assert served.decision.source == "store" and served.decision.config["id"] == config("eager", "fp32").id


def test_a_flagged_run_never_makes_a_decision_verified(tmp_path, db):
    """Item 20: the best run was flagged "repeat this run": the decision is verified on the best clean
    run, explain shows the flag, and the daemon queues a repeat (at most REPEAT_LIMIT flagged runs)."""
    policy_path = write_policy(tmp_path / "policies")
    flagged = {**FIGURES[("eager", "bf16")], "extra": {"window_warning": WARNING}}
    seed_rounds(db, {k: v for k, v in FIGURES.items() if k != ("eager", "bf16")})  # enough runs to verify
    seed_runs(db, {("eager", "bf16"): flagged})
    policy = load_policy(policy_path)
    decision = resolve(policy, db, "cpu")
    assert decision.state == "verified" and decision.config_id == config("eager", "fp32").id
    cand = next(c for c in decision.candidates if c.config_id == config("eager", "bf16").id)
    assert cand.status == "flagged" and "repeat this run" in cand.flagged
    assert decision.repeat == [config("eager", "bf16").id]

    out = CliRunner().invoke(main, ["policy", "explain", str(policy_path), "--db", db_file(db),
                                    "--device-name", "cpu"])
    assert out.exit_code == 0, out.output
    assert "flagged    eager/bf16/b8" in out.output and "the daemon repeats them" in out.output

    # The daemon: the stored decision asks for a repeat, and the planner does not count the flagged run.
    record_decision(db, decision, provenance_key="pk")
    row = latest_decision(db, "svc", "cpu", torch_minor())
    assert "repeat this run" in stale_reason(row, policy_hash=policy.hash, provenance_key="pk", max_age_s=1e9)
    db.execute("UPDATE runs SET provenance_key = 'pk'")
    fresh = fresh_ok_config_ids(db, decision.workload_id, "pk", 0.0)
    assert config("eager", "bf16").id not in fresh and config("eager", "fp32").id in fresh
    # The repeat is flagged too: no further repeats, and still never verified on it.
    seed_runs(db, {("eager", "bf16"): flagged})
    db.execute("UPDATE runs SET provenance_key = 'pk'")
    assert config("eager", "bf16").id in fresh_ok_config_ids(db, decision.workload_id, "pk", 0.0)
    again = resolve(policy, db, "cpu")
    assert again.config_id == config("eager", "fp32").id and again.repeat == []
    # A clean repeat is what verifies it: then its flagged runs count too, three runs from three processes.
    seed_runs(db, {("eager", "bf16"): FIGURES[("eager", "bf16")]})
    verified = resolve(policy, db, "cpu")
    assert verified.config_id == config("eager", "bf16").id and verified.state == "verified"
    # A flagged run after clean ones counts as the judge counts it: the planner measures nothing again.
    seed_runs(db, {("eager", "fp32"): {**FIGURES[("eager", "fp32")], "extra": {"window_warning": WARNING}}})
    db.execute("UPDATE runs SET provenance_key = 'pk'")
    assert config("eager", "fp32").id in fresh_ok_config_ids(db, decision.workload_id, "pk", 0.0)
    assert resolve(policy, db, "cpu").repeat == []


def test_only_flagged_runs_within_limits_leave_the_decision_provisional(tmp_path, db):
    policy_path = write_policy(tmp_path / "policies")
    flag = {"extra": {"window_warning": WARNING}}
    seed_runs(db, {k: {**v, **flag} if v["avg_power_w"] <= 0.5 else v for k, v in FIGURES.items()})
    decision = resolve(load_policy(policy_path), db, "cpu")
    assert decision.state == "provisional" and decision.config_id == config("eager", "fp32").id
    assert "repeat this run" in decision.reason and "fallback" in decision.reason
    assert not any(c.status == "chosen" for c in decision.candidates)


def test_explain_names_the_device_torch_pairs_that_have_runs(tmp_path, db):
    """Item 21: explain for the H200 under another torch names the pairs with runs and the flag; a device
    kind with no runs at all gets no predictions."""
    import_runs(db, read_export(H200_SWEEP))
    policy = Path(__file__).parent.parent / "examples" / "policies" / "resnet50.toml"
    runner = CliRunner()
    out = runner.invoke(main, ["policy", "explain", str(policy), "--db", db_file(db), "--device-name",
                               "NVIDIA H200", "--torch-version", "2.99"])
    assert out.exit_code == 0, out.output
    assert "NVIDIA H200 / torch 2.11" in out.output and "--torch-version 2.11" in out.output
    out = runner.invoke(main, ["policy", "explain", str(policy), "--db", db_file(db), "--device-name",
                               "NVIDIA H200", "--torch-version", "2.99", "--json"])
    data = json.loads(out.stdout)  # the note goes to stderr
    assert "--torch-version 2.11" in out.stderr
    assert [(p["device_kind"], p["torch_version"]) for p in data["measured_elsewhere"]] == [("NVIDIA H200", "2.11")]

    model = fit(db)
    decision = resolve(load_policy(policy), db, "cpu", model, torch_version="2.11")
    assert all(c.source == "none" for c in decision.candidates)
    assert all("no run at all on cpu" in c.reasons[0] for c in decision.candidates)
    assert "NVIDIA H200 / torch 2.11" in decision.reason
    on_h200 = resolve(load_policy(policy), db, "NVIDIA H200", model, torch_version="2.99")
    assert any(c.source == "predicted" for c in on_h200.candidates)  # a known device kind is still predicted
