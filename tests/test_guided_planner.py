"""The guided planner (`controller.guided`): what the daemon measures next, read from a real store.

The store is seeded with recorded runs of OTHER workloads (the committed synthetic sweep on an H200)
and the trade-off model is fitted on them; the policy's own workload (the built-in MLP) is measured by
inserting runs through store functions, as a finished daemon job would have stored them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.controller.guided import plan_guided
from joulepilot.controller.planner import ordered_candidates, plan_policy
from joulepilot.controller.search import run_search
from joulepilot.controller.tradeoff import fit
from joulepilot.policies import decide
from joulepilot.policies.judge import Run
from joulepilot.policies.schema import PolicyError, validate
from joulepilot.store import (
    import_runs,
    insert_run,
    open_db,
    read_export,
    upsert_config,
    upsert_host,
    upsert_workload,
)
from joulepilot.store.decisions import latest_decision

from joulepilot.cli import main

DATA = Path(__file__).parent / "data"
KIND = "NVIDIA H200"
TORCH = "2.11"
# Ten configurations with the two precisions: more than a small grid (`SearchSettings.small_grid`), which is
# measured whole rather than searched.
MODES = ["eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"]
POWER_W = 300.0
OVERHEAD_S = 30.0  # seconds a seeded run takes besides compiling


def policy_doc(**search: Any) -> dict[str, Any]:
    return {"name": "svc", "workload": "mlp", "batch_size": 8, "limits": {"max_rel_error": 0.05},
            "search": {"modes": MODES, "precisions": ["fp32", "bf16"], **search}}


def make_policy(**search: Any) -> Any:
    return validate(policy_doc(**search), "svc.toml")


@pytest.fixture(scope="module")
def model_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding only other workloads' runs; copied per test so each starts from it."""
    path = tmp_path_factory.mktemp("seed") / "seed.db"
    db = open_db(path)
    import_runs(db, read_export(DATA / "synthetic_sweep.json"), source="synthetic_sweep.json")
    db.close()
    return path


@pytest.fixture(scope="module")
def model(model_db: Path) -> Any:
    db = open_db(model_db)
    try:
        return fit(db)
    finally:
        db.close()


@pytest.fixture
def db(model_db: Path, tmp_path: Path) -> Any:
    path = tmp_path / "t.db"
    path.write_bytes(model_db.read_bytes())
    database = open_db(path)
    upsert_host(database, {"id": "h", "hostname": "h"})
    upsert_workload(database, {"id": workload_id("mlp", 8), "spec": "mlp", "batch_size": 8, "params": 5_000_000,
                               "flops_per_inference": 2e9, "graph_nodes": 12, "op_mix": {"linear": 3, "relu": 2}})
    yield database
    database.close()


def energy_of(cfg: CompileConfig) -> float:
    """The seeded MLP's J per call: bf16 halves it, compiling saves a fifth."""
    return (0.5 if cfg.precision == "bf16" else 1.0) * (1.0 if cfg.mode == "eager" else 0.8)


def run_row(cfg: CompileConfig, *, by_policy: str | None = "svc", provenance_key: str | None = None
            ) -> dict[str, Any]:
    compile_s = 0.0 if cfg.mode == "eager" else 20.0
    now = time.time()
    return {"workload_id": workload_id("mlp", 8), "config_id": cfg.id, "host_id": "h", "device": "cuda:0",
            "device_name": KIND, "status": "ok", "started_at": now, "finished_at": now + OVERHEAD_S + compile_s,
            "compile_s": compile_s, "compile_energy_j": compile_s * POWER_W, "latency_ms_p50": 1.0,
            "latency_ms_p95": 1.2, "avg_power_w": POWER_W, "peak_power_w": POWER_W * 1.1,
            "max_rel_error": 1e-4 if cfg.precision == "fp32" else 1e-2, "energy_source": "nvml",
            "torch_version": f"{TORCH}.0", "window_s": 5.0, "energy_j_per_inference": energy_of(cfg),
            "extra": {"policy": by_policy} if by_policy else {}, "provenance_key": provenance_key}


def measure(db: Any, cfg: CompileConfig, **kw: Any) -> int:
    """What a finished daemon job leaves: the configuration and its run in the store."""
    upsert_config(db, cfg.to_row())
    return insert_run(db, run_row(cfg, **kw))


def plan(db: Any, policy: Any, model: Any) -> Any:
    return plan_guided(db, policy, KIND, model, torch_version=TORCH)


def eager_fp32() -> CompileConfig:
    return CompileConfig("eager", precision="fp32", batch_size=8)


def default_fp32() -> CompileConfig:
    return CompileConfig("default", precision="fp32", batch_size=8)


def search_to_the_end(db: Any, policy: Any, model: Any, limit: int = 40) -> Any:
    for _ in range(limit):
        current = plan(db, policy, model)
        if current.done:
            return current
        measure(db, current.next[0].config)
    raise AssertionError(f"the guided search did not stop within {limit} measurements")


def test_the_eager_baseline_comes_first_and_the_search_resumes_from_the_store(db: Any, model: Any) -> None:
    policy = make_policy()
    first = plan(db, policy, model)
    assert [(n.config.label, n.kind) for n in first.next] == [(eager_fp32().label, "baseline")]
    assert first.measurements == 0 and first.spent_s == 0 and not first.done

    measure(db, first.next[0].config)
    second = plan(db, policy, model)  # a new call, as after a daemon restart: the state is the store
    # Stock compile fp32 is no baseline of the search: the next pick is the engine's, whatever it is.
    assert [n.kind for n in second.next] == ["guided"] and second.next[0].why.startswith("acquisition")
    assert second.measurements == 1 and second.spent_s == pytest.approx(OVERHEAD_S)
    assert [(m["label"], m["runs"]) for m in second.measured] == [(eager_fp32().label, 1)]


def test_after_stored_runs_the_pick_is_the_engines_best_acquisition(db: Any, model: Any) -> None:
    policy = make_policy()
    measure(db, eager_fp32())
    planned = plan(db, policy, model)
    step = planned.next[0]
    assert step.kind == "guided" and step.why.startswith("acquisition")
    assert step.config.id != eager_fp32().id

    # The same search run in memory, measuring eager fp32 with the same figures, picks the same second
    # (stock compile fp32 is then a candidate like any other).
    workload = {"id": workload_id("mlp", 8), "spec": "mlp", "batch_size": 8, "params": 5_000_000,
                "flops_per_inference": 2e9, "graph_nodes": 12, "op_mix": json.dumps({"linear": 3, "relu": 2})}
    from joulepilot.controller.guided import search_settings
    from joulepilot.policies.judge import Rules

    grid = ordered_candidates(policy)
    by_id = {c.id: c for c in grid}

    def replay(config: Any, fresh: bool) -> Run:
        return Run.from_row(run_row(by_id[config["id"]]))

    settings = search_settings(policy)
    in_memory = run_search(grid, replay, lambda rows: model.predict_many(workload, rows, KIND),
                           rules=Rules.of(policy), settings=type(settings)(**{**vars(settings), "max_measurements": 3}))
    assert [s.kind for s in in_memory.steps][:2] == ["baseline", "guided"]
    assert in_memory.steps[1].label == step.config.label and in_memory.steps[1].why == step.why


def test_candidates_that_cannot_win_are_skipped_with_their_reason(db: Any, model: Any) -> None:
    policy = make_policy()
    final = search_to_the_end(db, policy, model)
    assert final.stop_reason.startswith("nothing left that could beat")
    measured = {m["config_id"] for m in final.measured}
    grid = {c.id for c in plan_policy(db, policy, reason="x", provenance_key="-", max_age_s=1).to_measure}
    assert final.skipped, "a grid of 10 with a clear winner should leave some configuration unmeasured"
    assert {s.config_id for s in final.skipped} == grid - measured
    for skipped in final.skipped:
        assert skipped.reason and "search stopped" not in skipped.reason
        assert "measured best" in skipped.reason or "expected saving" in skipped.reason \
            or "P(within limits)" in skipped.reason
    # The winner (bf16) was measured at least three times: a contender is repeated.
    best = min((m for m in final.measured if m["objective"] is not None), key=lambda m: m["objective"])
    assert best["runs"] >= 3


def test_max_measurements_stops_the_search_and_bench_runs_cost_the_policy_nothing(db: Any, model: Any) -> None:
    policy = make_policy(max_measurements=2)
    measure(db, eager_fp32(), by_policy=None)  # measured by `joulepilot bench`, not by the daemon
    measure(db, default_fp32())
    after_one = plan(db, policy, model)
    assert not after_one.done and after_one.measurements == 1
    measure(db, after_one.next[0].config)
    stopped = plan(db, policy, model)
    assert stopped.done and stopped.stop_reason == "max_measurements reached (2)"
    assert stopped.measurements == 2
    assert all(s.reason for s in stopped.skipped)


def test_budget_s_stops_the_search(db: Any, model: Any) -> None:
    policy = make_policy(budget_s=OVERHEAD_S + 1)
    measure(db, eager_fp32())
    stopped = plan(db, policy, model)
    assert stopped.done and stopped.stop_reason.startswith("budget_s")
    assert stopped.spent_s == pytest.approx(OVERHEAD_S)


def test_configurations_that_broke_the_envelope_are_never_planned(db: Any, model: Any) -> None:
    policy = make_policy()
    planned = plan_guided(db, policy, KIND, model, torch_version=TORCH, violated={eager_fp32().id})
    assert planned.next[0].kind == "guided"  # no baseline left to measure first
    assert planned.next[0].config.id != eager_fp32().id
    assert planned.excluded_violated == [eager_fp32().label]


def test_exhaustive_keeps_the_whole_plan(db: Any) -> None:
    policy = make_policy(strategy="exhaustive")
    measure(db, eager_fp32(), provenance_key="p1")
    full = plan_policy(db, policy, reason="no decision yet", provenance_key="p1", max_age_s=86400)
    assert [c.label for c in full.to_measure] == [c.label for c in ordered_candidates(policy)
                                                  if c.id != eager_fp32().id]
    assert full.already_measured == [eager_fp32().label]


def test_the_decision_keeps_the_search_summary_and_explain_prints_skipped(db: Any, model: Any,
                                                                          tmp_path: Path) -> None:
    policy = make_policy()
    final = search_to_the_end(db, policy, model)
    decide(db, policy, KIND, model, torch_version=TORCH, decided_by="daemon", search=final.summary(), lock=False)
    stored = latest_decision(db, "svc", KIND, TORCH)
    search = stored.details["search"]
    assert search["stop_reason"] == final.stop_reason
    assert [s["reason"] for s in search["skipped"]] == [s.reason for s in final.skipped]
    assert sum(m["runs"] for m in search["measured"]) == search["measurements"]

    file = tmp_path / "svc.toml"
    file.write_text('name = "svc"\nworkload = "mlp"\nbatch_size = 8\n[limits]\nmax_rel_error = 0.05\n'
                    f'[search]\nmodes = {json.dumps(MODES)}\nprecisions = ["fp32", "bf16"]\n')
    db_path = db.execute("PRAGMA database_list").fetchone()[2]
    args = ["policy", "explain", str(file), "--db", db_path, "--device-name", KIND, "--torch-version", TORCH]
    text = CliRunner(env={"COLUMNS": "1000"}).invoke(main, args)  # one line per skipped candidate
    assert text.exit_code == 0, text.output
    # explain plans afresh, with a model fitted on the whole store (the MLP's runs too): its reasons
    # may differ from the daemon's, so its text is checked against its own JSON.
    lines = [line for line in text.output.splitlines() if line.startswith("skipped ")]
    as_json = CliRunner().invoke(main, [*args, "--json"])
    explained = json.loads(as_json.stdout)["search"]
    # It stopped, or names what it would measure next: either is printed.
    head = "stopped    " if explained["stop_reason"] else "next       "
    assert (explained["stop_reason"] or explained["next"]) and any(line.startswith(head)
                                                                   for line in text.output.splitlines())
    assert lines and lines == [f"skipped    {s['label']}: {s['reason']}" for s in explained["skipped"]]
    # The same configurations are unmeasured: skipped, or (explain's model knowing more) the one it would measure.
    unmeasured = {s["label"] for s in explained["skipped"]} | {n["label"] for n in explained["next"] if not n["runs"]}
    assert unmeasured == {s.label for s in final.skipped}


def test_search_keys_are_validated_with_one_line_errors() -> None:
    with pytest.raises(PolicyError) as info:
        validate(policy_doc(strategy="guidd"), "svc.toml")
    assert str(info.value) == ("svc.toml: search.strategy: expected one of 'guided', 'exhaustive', found string "
                               "'guidd' (did you mean 'guided'?)")
    for key, value in (("budget_s", 0), ("max_measurements", 1.5), ("batch_sizes", [8, 0]), ("tolerance_pct", 51),
                       ("tolerance_pct", "2")):
        with pytest.raises(PolicyError) as info:
            validate(policy_doc(**{key: value}), "svc.toml")
        assert str(info.value).startswith(f"svc.toml: search.{key}: expected ") and "\n" not in str(info.value)
    search = validate(policy_doc(budget_s=600, max_measurements=12, batch_sizes=[8, 32, 8], tolerance_pct=5), "p").search
    assert (search.strategy, search.budget_s, search.max_measurements, search.batch_sizes, search.tolerance_pct) == \
        ("guided", 600.0, 12, (8, 32), 5.0)
    assert validate(policy_doc(), "p").search.tolerance_pct == 2.0
