"""Repeats that start from saved artifacts: a repeat of a compiled configuration in a fresh process loads what
its cold run saved (`measure_config(warm_from_run=...)`) instead of compiling again. What is checked here: which
stored run the daemon starts from (`store.runs.warm_start_source`; the artifacts' path is derived from the job,
never read from the store), that such a run is judged with its configuration's cold compile, and that artifacts
which cannot be loaded leave a cold compile measured as one. A real compile warm-started this way is in
test_warm_start.py (the worker) and test_daemon_pass.py (the daemon's repeat)."""

from __future__ import annotations

import time

import pytest
from joulepilot.compiler import CompileConfig, worker_budget
from joulepilot.compiler.runner import run_worker_job
from joulepilot.policies.judge import Rules, Run, judge, with_process_compile
from joulepilot.policies.schema import Limits
from joulepilot.store import insert_run, upsert_config, upsert_host, upsert_workload
from joulepilot.store.runs import warm_start_source

COLD = {"status": "ok", "energy_j_per_inference": 1.3464, "avg_power_w": 520.0, "compile_s": 29.66,
        "compile_energy_j": 4802.1, "energy_source": "nvml", "extra": {}}
# its repeat in a fresh process, started from the cold run's artifacts: no compile figures, a warm start instead
WARM = {"status": "ok", "energy_j_per_inference": 1.3517, "avg_power_w": 518.0, "compile_s": None,
        "compile_energy_j": None, "warm_start_s": 6.1, "energy_source": "nvml", "extra": {"warm_start_from": 217}}


def test_a_repeat_that_started_from_saved_artifacts_is_judged_with_its_configurations_cold_compile():
    """Figures of the H200 EfficientNet-B0 pass (session 21): reduce-overhead bf16's first process compiled for
    4.8 kJ in 29.7 s. Its repeat warm-started, so it stores neither figure: amortised without the compile it would
    look 4.8 J per call cheaper at 1000 inferences, and a 6-s warm start taken for its compile time would pass a
    `max_compile_s` the configuration does not meet."""
    eager, compiled = CompileConfig("eager").to_row(), CompileConfig("reduce-overhead", precision="bf16").to_row()
    runs = [Run.from_row(COLD), Run.from_row(WARM)]
    assert [r.fresh_process for r in runs] == [True, True] and [r.warm_started for r in runs] == [False, True]
    assert [r.compile_energy_j for r in with_process_compile(runs)] == [4802.1, 4802.1]
    baseline = [Run.from_row({**COLD, "energy_j_per_inference": 3.4402, "compile_s": 0.1, "compile_energy_j": 50.0})]
    few = judge([eager, compiled], {eager["id"]: baseline, compiled["id"]: runs}, Rules(expected_inferences=1000))
    verdict = few.verdicts[compiled["id"]]
    assert verdict.amortised_j == pytest.approx((1.3464 + 1.3517) / 2 + 4.8021)
    assert few.chosen is not None and few.chosen.config_id == eager["id"]
    assert verdict.compile_s is not None and verdict.compile_s.median == 29.66  # the cold run's alone
    limited = judge([eager, compiled], {eager["id"]: baseline, compiled["id"]: runs},
                    Rules(expected_inferences=10_000_000, limits=Limits(max_compile_s=20.0)))
    assert any(v.startswith("max_compile_s") for v in limited.verdicts[compiled["id"]].violations)
    # a run with no compile figures that started its process from nothing keeps what it measured
    unknown = Run.from_row({**WARM, "extra": {}})
    assert with_process_compile([runs[0], unknown]) == [runs[0], unknown]


def _run(db, config, *, host="host-a", provenance="p1", status="ok", compile_s=12.0, artifacts="/a/x.bin",
         finished_at=None, extra=None):
    now = time.time() if finished_at is None else finished_at
    return insert_run(db, {"workload_id": "w1", "config_id": config.id, "host_id": host, "device": "cuda:0",
                           "status": status, "started_at": now - 30, "finished_at": now, "provenance_key": provenance,
                           "compile_s": compile_s, "artifacts_path": artifacts, "extra": extra or {}})


def test_the_daemon_starts_a_repeat_from_its_configurations_newest_cold_run_on_this_host(db):
    config, other = CompileConfig("default", precision="bf16"), CompileConfig("reduce-overhead", precision="bf16")
    for host in ("host-a", "host-b"):
        upsert_host(db, {"id": host, "hostname": host})
    upsert_workload(db, {"id": "w1", "spec": "mlp", "batch_size": 8})
    for cfg in (config, other):
        upsert_config(db, cfg.to_row())

    def source(**kwargs):
        return warm_start_source(db, "w1", config.id, host_id="host-a", provenance_key="p1", **kwargs)

    assert source() is None
    week_ago = time.time() - 7 * 86400
    old = _run(db, config, artifacts="/a/old.bin", finished_at=week_ago)
    assert source() == old
    assert source(min_finished_at=week_ago + 60) is None  # older than the decision age limit
    cold = _run(db, config, artifacts="/a/cold.bin")
    # none of these saved a cold compile's artifacts on this host under this provenance
    _run(db, config, compile_s=None, artifacts=None, extra={"window_in_process": 2, "first_run_id": cold})
    _run(db, config, compile_s=None, artifacts=None, extra={"warm_start_from": cold})
    _run(db, config, status="failed", artifacts="/a/failed.bin")
    _run(db, config, host="host-b", artifacts="/b/cold.bin")
    _run(db, config, provenance="p2", artifacts="/a/p2.bin")
    _run(db, other, artifacts="/a/other.bin")
    assert source() == cold and source(min_finished_at=week_ago + 60) == cold


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_artifacts_that_cannot_be_loaded_leave_a_cold_compile_measured_as_one(tmp_path, fake_worker, damage):
    """The fake worker (the real one with eager calls for compiles) given a repeat whose artifacts are gone or
    damaged: the run compiles cold, records that compile, and says why it did not warm-start."""
    path = tmp_path / "a.bin"
    if damage == "garbage":
        path.write_bytes(b"\x00not a cache artifact" * 10)
    job = {"kind": "bench", "spec": "mlp", "device": "cpu", "config": CompileConfig("default", batch_size=4).to_row(),
           "min_seconds": 0.2, "idle_power_w": {}, "warm_from": str(path), "warm_from_run_id": 5}
    result = run_worker_job(job, budget=worker_budget(60, 0.2))
    assert result["status"] == "ok", result.get("reason")
    extra = result["extra"]
    assert str(path) in extra["warm_start_error"] and extra["warm_start_error"].endswith("compiled cold")
    assert result["compile_s"] > 0 and "warm_start_from" not in extra and result.get("warm_start_s") is None
    assert not Run.from_row(result).warm_started


def test_a_stored_artifacts_path_is_loaded_only_where_this_host_saves_that_configurations_artifacts(tmp_path,
                                                                                                  monkeypatch):
    """What the daemon times a decision's warm start from: a run's recorded `artifacts_path` names a file to load
    only when it is where this host saves the artifacts of that workload, configuration and provenance. A path
    edited into the store (a file of someone else's, say) is never loaded."""
    from joulepilot.compiler.artifacts import artifact_path_for, recorded_artifacts

    monkeypatch.setenv("JOULEPILOT_HOME", str(tmp_path / "home"))
    origin = {"device_name": "NVIDIA H200", "torch_version": "2.11.0+cu130", "triton_version": "3.6.0"}
    config = CompileConfig("default", precision="bf16")
    saved = artifact_path_for("w1", config.id, "NVIDIA H200", "2.11.0+cu130", "3.6.0")
    assert recorded_artifacts(str(saved), "w1", config.id, origin) is None  # not there (yet)
    saved.parent.mkdir(parents=True)
    saved.write_bytes(b"artifacts")
    elsewhere = tmp_path / "planted.bin"
    elsewhere.write_bytes(b"artifacts")
    assert recorded_artifacts(str(saved), "w1", config.id, origin) == saved
    assert recorded_artifacts(str(elsewhere), "w1", config.id, origin) is None
    assert recorded_artifacts(str(saved), "w2", config.id, origin) is None  # another workload's name
    assert recorded_artifacts(str(saved), "w1", config.id, {**origin, "torch_version": "2.12.0"}) is None
    assert recorded_artifacts(None, "w1", config.id, origin) is None
