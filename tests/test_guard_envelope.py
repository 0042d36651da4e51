"""The envelope guard: replayed power traces, what a trip writes, and the fallback swap at the next call."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
import torch
from joulepilot.compiler import CompileConfig, apply_config
from joulepilot.policies.schema import validate
from joulepilot.runtime import (
    EnvelopeGuard,
    EnvelopeWarning,
    Fallback,
    attach,
    guard_from_policy,
    record_trip,
)
from joulepilot.store.decisions import write_decision
from joulepilot.store.deployments import list_violations, violated_config_ids

LIMIT_W = 450.0
# Average power per 5 s window, shaped like DESIGN.md's H200 ResNet-50 figures: compile default fp32
# draws ~569 W, compile default bf16 ~387 W.
ABOVE = [380.0, 569.0, 571.0, 566.0, 570.0]
BELOW = [387.0, 392.0, 380.0, 449.9, 385.0, 390.0]
SPIKES = [387.0, 600.0, 390.0, 610.0, 620.0, 388.0, 600.0]


def replay(guard: EnvelopeGuard, trace: list[float], inferences: int = 100):
    for i, watts in enumerate(trace):
        trip = guard.feed(watts, inferences=inferences, at=float(i))
        if trip is not None:
            return i, trip
    return None, None


def test_trips_on_a_trace_above_the_envelope():
    index, trip = replay(EnvelopeGuard(LIMIT_W, windows=3), ABOVE)
    assert index == 3  # the third consecutive window above 450 W
    assert trip.window_powers_w == [569.0, 571.0, 566.0]
    assert trip.measured_w == pytest.approx(568.666, abs=1e-2)
    assert trip.limit_w == LIMIT_W


def test_does_not_trip_below_or_on_spikes_shorter_than_windows():
    assert replay(EnvelopeGuard(LIMIT_W, windows=3), BELOW) == (None, None)
    assert replay(EnvelopeGuard(LIMIT_W, windows=3), SPIKES) == (None, None)
    assert replay(EnvelopeGuard(LIMIT_W, windows=1), SPIKES)[0] == 1


def test_idle_window_breaks_the_streak_and_trip_latches():
    guard = EnvelopeGuard(LIMIT_W, windows=2)
    assert guard.feed(600.0, inferences=10) is None
    assert guard.feed(600.0, inferences=0) is None  # served nothing: not this configuration's power
    assert guard.feed(600.0, inferences=10) is None
    assert guard.feed(600.0, inferences=10) is not None
    assert guard.feed(600.0, inferences=10) is None  # latched until reset
    assert guard.feed(600.0, inferences=10) is None
    guard.reset()
    assert guard.feed(600.0, inferences=10) is None
    assert guard.feed(600.0, inferences=10) is not None


def test_guard_arguments_are_checked():
    with pytest.raises(ValueError, match="limit_w"):
        EnvelopeGuard(0)
    with pytest.raises(ValueError, match="windows"):
        EnvelopeGuard(100, windows=0)
    with pytest.raises(ValueError, match="action"):
        EnvelopeGuard(100, action="cap")


def _policy(limit_w: float | None = LIMIT_W, action: str = "warn", windows: int = 3):
    raw = {"name": "resnet", "workload": "mlp", "batch_size": 8, "guard": {"action": action, "windows": windows}}
    if limit_w is not None:
        raw["limits"] = {"max_avg_power_w": limit_w}
    return validate(raw, "resnet.toml")


def test_guard_from_policy():
    guard = guard_from_policy(_policy(action="fallback", windows=4))
    assert (guard.limit_w, guard.windows, guard.action) == (LIMIT_W, 4, "fallback")
    assert guard_from_policy(_policy(limit_w=None)) is None


def test_trip_writes_violation_and_violated_decision(db):
    decision_id = write_decision(db, {"policy": "resnet", "policy_hash": "h1", "device_kind": "NVIDIA H200",
                                      "torch_version": "2.13", "config_id": "cfg-fast", "state": "verified",
                                      "reason": "fewest J", "decided_at": time.time(), "details": {}})
    decision = dict(db.query("SELECT * FROM decisions WHERE id = ?", [decision_id]).__next__())
    _, trip = replay(EnvelopeGuard(LIMIT_W, windows=3), ABOVE)
    with pytest.warns(EnvelopeWarning, match=r"'prod-resnet'.*568\.7 W.*450\.0 W"):
        written = record_trip(db, trip, deployment="prod-resnet", policy="resnet", config_id="cfg-fast",
                              decision=decision, device_kind=None, torch_version=None, source="nvml")
    [violation] = list_violations(db, deployment="prod-resnet")
    assert violation["decision_id"] == decision_id
    assert (violation["limit_name"], violation["limit_value"]) == ("max_avg_power_w", LIMIT_W)
    assert violation["measured_value"] == pytest.approx(trip.measured_w)
    latest = db.execute("SELECT state, config_id, device_kind, torch_version FROM decisions "
                        "ORDER BY id DESC LIMIT 1").fetchone()
    assert latest == ("violated", "cfg-fast", "NVIDIA H200", "2.13")
    assert written["decision_id"] != decision_id
    assert violated_config_ids(db, "resnet", "NVIDIA H200") == {"cfg-fast"}
    assert violated_config_ids(db, "resnet", "NVIDIA H100 80GB HBM3") == set()
    assert violated_config_ids(db, "other", "NVIDIA H200") == set()


def test_live_deployment_trips_and_falls_back_at_the_next_call(db, tmp_path):
    """On this CPU the estimate meter reads ~5-10 W while serving; a 0.5 W envelope must trip."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).eval()
    policy = _policy(limit_w=0.5, action="fallback", windows=2)
    built_on: list[str] = []
    eager = CompileConfig(mode="eager", batch_size=8)

    def build():
        built_on.append(threading.current_thread().name)
        return apply_config(eager, model)

    fallback = Fallback(eager.id, eager.label, build)
    db_path = db.execute("PRAGMA database_list").fetchone()[2]
    write_decision(db, {"policy": "resnet", "policy_hash": "h1", "device_kind": "cpu", "torch_version": "2.13",
                        "config_id": "cfg-served", "state": "verified", "reason": "fewest J",
                        "decided_at": time.time(), "details": {}})
    dep = attach(model, "live", policy=policy, db=db_path, device="cpu", interval_s=0.25, fallback=fallback,
                 config_id="cfg-served")
    x = torch.randn(8, 128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deadline = time.monotonic() + 20
        with torch.no_grad():
            while not dep.trips and time.monotonic() < deadline:
                dep(x)
    assert dep.trips, "the guard never tripped"
    assert any(issubclass(w.category, EnvelopeWarning) and "'live'" in str(w.message) for w in caught)
    assert dep.config_id == "cfg-served" and built_on == []  # not swapped yet: only requested
    before = dep._fn
    dep(x)  # the next call swaps, on the caller's thread
    assert built_on == [threading.current_thread().name]
    assert dep._fn is not before and dep.config_id == eager.id
    dep(x)
    assert len(built_on) == 1  # built once
    dep.close()
    [violation] = list_violations(db, deployment="live")
    assert violation["config_id"] == "cfg-served" and violation["limit_value"] == 0.5
    assert violated_config_ids(db, "resnet", "cpu") == {"cfg-served"}
    row = db.execute("SELECT config_id FROM deployments WHERE name = 'live'").fetchone()
    assert row[0] == eager.id  # the store knows what serves now
    configs = {r[0] for r in db.execute("SELECT DISTINCT config_id FROM deployment_samples")}
    assert configs == {"cfg-served", eager.id}


def test_a_trip_of_the_fallback_cites_the_decision_it_writes_not_the_one_broken_before(db):
    """The fallback serves under no decision of its own: when it trips too, its violation names the `violated`
    decision written for it, while the first trip's names the decision that chose the configuration served."""
    model = torch.nn.Linear(16, 4).eval()
    policy = _policy(limit_w=0.5, action="fallback", windows=1)
    db_path = db.execute("PRAGMA database_list").fetchone()[2]
    chosen_id = write_decision(db, {"policy": "resnet", "policy_hash": "h1", "device_kind": "cpu",
                                    "torch_version": "2.13", "config_id": "cfg-served", "state": "verified",
                                    "reason": "fewest J", "decided_at": time.time(), "details": {}})
    dep = attach(model, "twice", policy=policy, db=db_path, device="cpu", interval_s=0.2, base_model=model,
                 config_id="cfg-served")
    x = torch.randn(8, 16)
    deadline = time.monotonic() + 30
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        while len(dep.trips) < 2 and time.monotonic() < deadline:
            dep(x)
    dep.close()
    assert len(dep.trips) >= 2, "the fallback never tripped"
    first, second = sorted(list_violations(db, deployment="twice"), key=lambda v: v["id"])[:2]
    eager_id = CompileConfig(mode="eager", batch_size=8).id
    assert (first["config_id"], first["decision_id"]) == ("cfg-served", chosen_id)
    assert second["config_id"] == eager_id and second["decision_id"] != chosen_id
    cited = db.execute("SELECT state, config_id, policy_hash, device_kind, details FROM decisions WHERE id = ?",
                       [second["decision_id"]]).fetchone()
    assert tuple(cited[:4]) == ("violated", eager_id, "h1", "cpu")
    assert json.loads(cited[4])["violated_decision_id"] is None  # it broke no decision's choice


def test_fallback_built_from_the_policy(db):
    model = torch.nn.Linear(16, 4).eval()
    policy = _policy(limit_w=0.5, action="fallback", windows=1)
    db_path = db.execute("PRAGMA database_list").fetchone()[2]
    dep = attach(model, "from-policy", policy=policy, db=db_path, device="cpu", interval_s=0.2,
                 base_model=model, config_id="cfg-served")
    x = torch.randn(8, 16)
    deadline = time.monotonic() + 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while dep._pending_swap is None and time.monotonic() < deadline:
            dep(x)
    assert dep._pending_swap is not None
    dep(x)
    assert dep.config_id == CompileConfig(mode="eager", batch_size=8).id
    assert torch.allclose(dep(x), model(x))
    dep.close()


@pytest.mark.parametrize("source, wording", [
    ("nvml", "measured average 500.0 W (nvml)"),
    ("estimate", "estimated average 500.0 W (ESTIMATE, not measured)"),
    ("estimate+rapl", "average 500.0 W (estimate+rapl: PARTLY ESTIMATE)"),
])
def test_a_trips_warning_words_its_power_as_its_source_made_it(source, wording):
    from joulepilot.runtime.guard import Trip, trip_message

    text = trip_message("live", Trip(limit_w=450.0, window_powers_w=[490.0, 510.0]), "default/bf16/b8", source)
    assert wording in text and "limit max_avg_power_w = 450.0 W" in text
    assert ("measured" in text.replace("not measured", "")) == (source == "nvml")
