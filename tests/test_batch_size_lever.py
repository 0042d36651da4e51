"""The batch-size lever (`[search] batch_sizes`): the grid covers each batch size, the objective is J per sample,
latency limits stay per call, an envelope the policy's batch size cannot meet is met at a smaller one, the daemon
queues and measures each configuration at its own batch size, and the hook says when the decided batch size is
not the policy's. A policy without `batch_sizes` is unchanged. Real SQLite; nothing is compiled (runs are
stored as a finished job would store them; the hook's decision is eager)."""

from __future__ import annotations

import time
import types
import warnings
from typing import Any

import pytest
import torch
from decision_factories import db_file
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.controller.guided import plan_guided
from joulepilot.controller.planner import plan_policy
from joulepilot.policies import candidate_configs, decide, load_policy, resolve, torch_minor, validate
from joulepilot.policies.batches import config_workload_id
from joulepilot.runtime import compile as jp_compile
from joulepilot.store import insert_run, upsert_config, upsert_host, upsert_workload

# Synthetic physics of one model: at batch 32, eager fp32 draws 120 W for 1.0 J per call, stock compile 110 W
# for 0.8 J; a smaller batch draws less power and fewer joules per call, but more joules per sample.
POWER_AT_32 = {"eager": 120.0, "default": 110.0}
ENERGY_AT_32 = {"eager": 1.0, "default": 0.8}
JITTER = (-0.01, 0.0, 0.01)


def figures(mode: str, batch: int, jitter: float = 0.0) -> dict[str, float]:
    scale = batch / 32
    power = POWER_AT_32[mode] * (0.35 + 0.65 * scale) * (1 + jitter)
    return {"avg_power_w": power, "peak_power_w": power * 1.05,
            "energy_j_per_inference": ENERGY_AT_32[mode] * (0.2 + 0.8 * scale) * (1 + jitter),
            "latency_ms_p50": 1.8 + 0.3 * batch, "latency_ms_p95": 2.0 + 0.3 * batch}


def make_policy(batch_sizes: list[int] | None = None, **limits: float) -> Any:
    search: dict[str, Any] = {"modes": ["eager", "default"], "precisions": ["fp32"], "strategy": "guided"}
    if batch_sizes is not None:
        search["batch_sizes"] = batch_sizes
    return validate({"name": "svc", "workload": "mlp", "batch_size": 32, "limits": limits, "search": search},
                    "svc.toml")


def store_run(db: Any, policy: Any, mode: str, batch: int, *, jitter: float = 0.0, window: int = 1,
              provenance_key: str = "p") -> int:
    """One ok run of `mode` fp32 at `batch`, under the policy's workload at that batch size, as a daemon job of
    the policy stores it."""
    cfg = CompileConfig(mode, precision="fp32", batch_size=batch)
    upsert_workload(db, {"id": config_workload_id(policy, cfg), "spec": policy.workload, "batch_size": batch,
                         "params": 1000, "flops_per_inference": 1e6 * batch})
    upsert_config(db, cfg.to_row())
    host = upsert_host(db, {"id": "test-host", "hostname": "test", "cpu": "x86"})
    now = time.time()
    compiles = mode != "eager"
    return insert_run(db, {
        "workload_id": config_workload_id(policy, cfg), "config_id": cfg.id, "host_id": host, "device": "cpu",
        "status": "ok", "started_at": now, "finished_at": now + 10, "compile_s": 5.0 if compiles else 0.0,
        "compile_energy_j": 50.0 if compiles else 0.0, "max_rel_error": 1e-4, "energy_source": "estimate",
        "torch_version": f"{torch_minor()}.0", "window_s": 2.0, "provenance_key": provenance_key,
        "extra": {"policy": policy.name, "window_in_process": window}, **figures(mode, batch, jitter)})


def store_repeats(db: Any, policy: Any, configs: list[tuple[str, int]]) -> None:
    for jitter in JITTER:
        for mode, batch in configs:
            store_run(db, policy, mode, batch, jitter=jitter)


def candidate(decision: Any, mode: str, batch: int) -> Any:
    cid = CompileConfig(mode, precision="fp32", batch_size=batch).id
    return next(c for c in decision.candidates if c.config_id == cid)


ALL = [(mode, batch) for mode in ("eager", "default") for batch in (8, 16, 32)]


def test_the_grid_covers_each_batch_size_and_the_baselines_stay_at_the_policys():
    policy = make_policy([8, 16])
    grid = candidate_configs(policy)
    assert sorted((c.mode, c.batch_size) for c in grid) == sorted(ALL)
    assert len({c.id for c in grid}) == 6
    # Each batch size's configurations are measured under that batch size's workload.
    assert {config_workload_id(policy, c) for c in grid} == {workload_id("mlp", b) for b in (8, 16, 32)}


def test_an_envelope_the_policys_batch_size_cannot_meet_is_met_at_a_smaller_one(db):
    """70 W: every configuration at batch 32 (and 16) is over it; at batch 8 both fit, and stock compile has the
    lower J per sample. The guided search measures its baseline (eager fp32) at batch 32 first, then the smaller
    batch sizes, and the decision picks stock compile at batch 8."""
    policy = make_policy([8, 16, 32], max_avg_power_w=70.0)
    asked: list[str] = []
    for _ in range(60):
        plan = plan_guided(db, policy, "cpu")
        if plan.done:
            break
        step = plan.next[0]
        asked.append(step.config.label)
        for window in range(step.windows):
            store_run(db, policy, step.config.mode, step.config.batch_size, jitter=JITTER[len(asked) % 3],
                      window=window + 1)
    else:
        pytest.fail(f"the search did not stop: {asked}")
    assert asked[0] == "eager/fp32/b32"  # the baseline, at the policy's batch size
    assert "default/fp32/b8" in asked and plan.objective_unit == "J/sample"

    decision = decide(db, policy, "cpu", lock=False, search=plan.summary()).decision
    assert decision.state in ("verified", "provisional") and decision.label == "default/fp32/b8"
    assert decision.objective_unit == "J/sample" and decision.batch_sizes == [32, 8, 16]
    assert "amortised J/sample" in decision.reason
    assert "batch size 8, not the policy's batch_size 32" in decision.reason
    assert candidate(decision, "default", 32).status == "rejected"

    # The same store without the lever: the policy's batch size alone cannot meet the envelope.
    alone = resolve(make_policy(max_avg_power_w=70.0), db, "cpu")
    assert alone.state == "infeasible" and alone.config["batch_size"] == 32


def test_with_several_batch_sizes_the_objective_is_per_sample_and_latency_limits_per_call(db):
    """p95 latency is 2 + 0.3 x batch ms per call: at batch 32 (11.6 ms) over the 10 ms limit, which it would
    meet per sample; batch 16 has the lowest J per sample of what is left, though not the lowest J per call."""
    policy = make_policy([8, 16], max_p95_latency_ms=10.0)
    store_repeats(db, policy, [("default", b) for b in (8, 16, 32)])
    decision = resolve(policy, db, "cpu")
    assert decision.state == "verified" and decision.label == "default/fp32/b16"
    assert decision.objective_unit == "J/sample"

    b32, b16, b8 = (candidate(decision, "default", b) for b in (32, 16, 8))
    assert b32.status == "rejected" and any(r.startswith("max_p95_latency_ms") for r in b32.reasons)
    for cand, batch in ((b16, 16), (b8, 8)):
        per_call = figures("default", batch)["energy_j_per_inference"] + 50.0 / policy.objective.expected_inferences
        assert cand.score == pytest.approx(per_call / batch, rel=1e-9)
        assert cand.amortised_energy_j == pytest.approx(per_call, rel=1e-9)  # the J/call column stays per call
    assert b8.amortised_energy_j < b16.amortised_energy_j and b16.score < b8.score


def test_when_no_batch_size_fits_the_lowest_power_one_is_infeasible_with_its_shortfall(db):
    policy = make_policy([8, 16], max_avg_power_w=50.0)
    store_repeats(db, policy, ALL)
    decision = resolve(policy, db, "cpu")
    chosen = candidate(decision, "default", 8)  # the lowest average power of all six
    assert decision.state == "infeasible" and decision.config_id == chosen.config_id
    shortfall = f"exceeds 50 W by {chosen.avg_power_w_high / 50.0 - 1:.0%}"
    assert decision.confidence.startswith("lowest measured average power") and shortfall in decision.confidence
    assert "the power envelope cannot be met" in decision.reason and shortfall in decision.reason
    assert "batch size 8, not the policy's batch_size 32" in decision.reason


def test_the_exhaustive_plan_lists_every_batch_size_and_reads_each_ones_runs(db):
    policy = make_policy([8, 16])
    store_run(db, policy, "eager", 8)
    plan = plan_policy(db, policy, reason="test", provenance_key="p", max_age_s=86400)
    assert plan.already_measured == ["eager/fp32/b8"]
    assert sorted((c.mode, c.batch_size) for c in plan.to_measure) == sorted(set(ALL) - {("eager", 8)})


def test_a_policy_without_batch_sizes_is_unchanged_and_reads_no_other_batch_size(db):
    """Runs of the same model at batch 8 (made by `bench`, or by another policy) that would meet the envelope are
    not this policy's: its grid, its plans and its decision are at batch 32 only, in J per call."""
    policy = make_policy(max_avg_power_w=70.0)
    assert candidate_configs(policy) == [CompileConfig("eager", batch_size=32), CompileConfig("default", batch_size=32)]
    store_repeats(db, policy, ALL)
    decision = resolve(policy, db, "cpu")
    assert decision.state == "infeasible" and decision.label == "default/fp32/b32"
    assert decision.objective_unit == "J" and decision.batch_sizes == [32]
    assert decision.workload_ids == [workload_id("mlp", 32)]
    assert "batch size" not in decision.reason
    per_call = figures("default", 32)["energy_j_per_inference"] + 50.0 / policy.objective.expected_inferences
    assert candidate(decision, "default", 32).score == pytest.approx(per_call, rel=1e-9)
    assert [m["label"] for m in plan_guided(db, policy, "cpu").measured] == ["eager/fp32/b32", "default/fp32/b32"]
    assert plan_policy(db, policy, reason="t", provenance_key="p", max_age_s=86400).already_measured == \
        ["eager/fp32/b32", "default/fp32/b32"]


def test_the_daemon_queues_and_measures_a_configuration_at_its_own_batch_size(tmp_path, monkeypatch,
                                                                             restore_logging):
    """Once the baselines (batch 32) are measured over the envelope, the guided search asks for a batch-8
    configuration: the daemon queues it under the batch-8 workload and its worker measures batch 8, not the
    policy's 32."""
    import joulepilot.compiler as compiler
    from daemon_factories import write_daemon_config
    from joulepilot.controller.daemon import Daemon, GuidedState
    from joulepilot.controller.daemon_config import load_daemon_config
    from joulepilot.controller.planner import measured_config
    from joulepilot.store import open_db, queued_jobs

    policy = make_policy([8], max_avg_power_w=70.0)
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db",
                                                 policies=tmp_path / "policies"))
    daemon = Daemon(cfg)
    daemon.db = open_db(tmp_path / "j.db")
    for mode in ("eager", "default"):
        store_run(daemon.db, policy, mode, 32)
    daemon._guided = {policy.name: GuidedState(set())}
    daemon._pass_model_fitted = True  # plan without a trade-off model
    probe = types.SimpleNamespace(device_kind="cpu", provenance_key="p", device="cpu")
    summary = {"enqueued": 0}
    assert daemon._advance_guided({policy.name: policy}, probe, summary)
    (job,) = queued_jobs(daemon.db)
    step = daemon._guided[policy.name].plan.next[0]
    assert step.config.batch_size == 8 and job.config_id == step.config.id
    assert job.workload_id == workload_id("mlp", 8)

    measured: list[Any] = []
    monkeypatch.setattr(compiler, "measure_config", lambda spec, config, **kwargs: measured.append(config))
    daemon._contexts["cpu"] = object()  # this pass's idle baseline, taken already

    class Scheduler:
        started: list[tuple[str, Any, Any]] = []

        def running(self) -> dict:
            return {}

        def start(self, device: str, running: Any, measure: Any) -> None:
            self.started.append((device, running, measure))

    scheduler = Scheduler()
    daemon._start_job(scheduler, job, policy, "cpu", {}, probe)
    (device, running, measure), = scheduler.started
    assert running.label == step.config.label
    measure(lambda: None, lambda pid: None)
    assert [c.batch_size for c in measured] == [8]
    # Only a stored configuration that names no batch size takes the policy's.
    row = CompileConfig("eager", batch_size=8).to_row()
    assert measured_config(row, policy).batch_size == 8
    assert measured_config({**row, "batch_size": None}, policy).batch_size == 32
    daemon.db.close()


def test_the_hook_applies_a_decision_at_another_batch_size_and_says_so(tmp_path, db):
    """The decision is eager fp32 at batch 16 for a policy served at batch 8: the hook applies it to the caller's
    model, keeps the caller's batch size, and says so in a warning, the reason and the details."""
    path = tmp_path / "svc.toml"
    path.write_text('name = "svc"\nworkload = "mlp"\nbatch_size = 8\n[search]\nmodes = ["eager"]\n'
                    'batch_sizes = [16]\n[fallback]\nmode = "eager"\n')
    policy = load_policy(path)
    for jitter in JITTER:  # per sample, batch 16 (0.15 J / 16) beats batch 8 (0.1 J / 8)
        for batch, energy in ((8, 0.1), (16, 0.15)):
            cfg = CompileConfig("eager", batch_size=batch)
            upsert_workload(db, {"id": config_workload_id(policy, cfg), "spec": "mlp", "batch_size": batch})
            upsert_config(db, cfg.to_row())
            host = upsert_host(db, {"id": "test-host", "hostname": "test"})
            insert_run(db, {"workload_id": config_workload_id(policy, cfg), "config_id": cfg.id, "host_id": host,
                            "device": "cpu", "status": "ok", "started_at": 1.0, "finished_at": 2.0,
                            "energy_j_per_inference": energy * (1 + jitter), "avg_power_w": 10.0,
                            "latency_ms_p95": 1.0, "energy_source": "estimate", "torch_version": f"{torch_minor()}.0"})
    decided = decide(db, policy, "cpu", lock=False).decision
    assert decided.label == "eager/fp32/b16"

    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = jp_compile(model, policy=path, db=db_file(db))
    applied = served.decision
    assert applied.source == "store" and applied.config_id == decided.config_id
    assert applied.details["batch_size"] == {"decided": 16, "policy": 8}
    assert "batch size 16, not the policy's batch_size 8" in applied.reason
    assert any("does not change your batch size" in str(w.message) for w in caught)
    assert served(torch.randn(8, 16)).shape == (8, 8)  # the caller's batch of 8 is served as it is


def test_explain_and_the_report_name_the_chosen_batch_size(tmp_path, db):
    from click.testing import CliRunner
    from joulepilot.controller.report import build_report, render
    from joulepilot.controller.report_markdown import md
    from joulepilot.store.deployments import insert_samples, register_deployment

    from joulepilot.cli import main

    path = tmp_path / "svc.toml"
    path.write_text('name = "svc"\nworkload = "mlp"\nbatch_size = 32\n[limits]\nmax_avg_power_w = 70\n'
                    '[search]\nmodes = ["eager", "default"]\nbatch_sizes = [8, 16]\n[fallback]\nmode = "eager"\n')
    policy = load_policy(path)
    store_repeats(db, policy, ALL)
    shown = CliRunner().invoke(main, ["policy", "explain", str(path), "--db", db_file(db)])
    assert shown.exit_code == 0, shown.output
    assert "decision   default/fp32/b8  [verified]" in shown.output
    assert "batch      8 (the policy's batch_size is 32; searched 8, 16, 32, compared in J/sample)" in shown.output

    decided = decide(db, policy, "cpu", lock=False).decision
    host = upsert_host(db)
    dep = register_deployment(db, "svc-live", policy=policy.name, workload_id=decided.workload_id,
                              config_id=decided.config_id, host_id=host, device="cpu")
    insert_samples(db, dep, [{"t_start": 1.0, "t_end": 2.0, "energy_j": 0.5, "inferences": 10, "avg_power_w": 50.0,
                              "peak_power_w": 55.0, "energy_source": "estimate", "config_id": decided.config_id}])
    report = build_report(db, "svc-live")
    assert "batch size 8, not the policy's batch_size 32" in report["configuration"]["decision_reason"]
    assert md("batch size 8, not the policy's batch_size 32") in render(report, "md")  # as Markdown escapes it


def test_unmeasured_batch_sizes_are_predicted_with_their_own_workload(db):
    """The trade-off model (fitted on the committed synthetic sweep of other models) predicts a configuration at
    batch 8 from the model's workload at batch 8: never described here, so made from batch 32's row with FLOPs
    per call scaled by 8/32."""
    from pathlib import Path

    from joulepilot.controller.tradeoff import fit
    from joulepilot.policies.batches import workload_rows_by_batch
    from joulepilot.store import import_runs, read_export

    import_runs(db, read_export(Path(__file__).parent / "data" / "synthetic_sweep.json"), source="synthetic")
    model = fit(db)
    policy = make_policy([8])
    store_repeats(db, policy, [("eager", 32), ("default", 32)])
    rows = workload_rows_by_batch(db, policy)
    assert rows[8]["batch_size"] == 8 and rows[8]["flops_per_inference"] == rows[32]["flops_per_inference"] / 4

    decision = resolve(policy, db, "cpu", model)
    b8 = candidate(decision, "default", 8)
    assert b8.source == "predicted"
    config = CompileConfig("default", batch_size=8)
    at_8 = model.predict(rows[8], config, "cpu")["energy_j_per_inference"][0]
    assert b8.predicted["energy_j_per_inference"][0] == pytest.approx(at_8)
    assert at_8 != pytest.approx(model.predict(rows[32], config, "cpu")["energy_j_per_inference"][0])
    assert b8.score == pytest.approx(b8.amortised_energy_j / 8)  # ranked per sample, as the measured ones
