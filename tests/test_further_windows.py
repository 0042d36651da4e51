"""A repeat the guided search asks for takes its windows in one worker process (`Step.windows`): each further
window is stored as a run of its own, marked `extra.window_in_process`, in the transaction of the job's first
run; their spans tile the job, so the tuning bill and the search's cost count each second once."""

from __future__ import annotations

import time

import pytest
from daemon_factories import write_daemon_config, write_policy
from joulepilot.compiler import CompileConfig, worker_budget
from joulepilot.compiler.bench import further_span_s, further_window_rows
from joulepilot.compiler.runner import run_worker_job
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import load_daemon_config
from joulepilot.policies.judge import Run
from joulepilot.store import (
    commit_run,
    commit_run_or_set_aside,
    host_identity,
    import_pending_runs,
    list_runs,
    open_db,
)
from joulepilot.store.decisions import latest_decision
from joulepilot.store.jsonvalues import json_object
from test_pending_runs import FILLER_CONFIG, FILLER_WORKLOAD, _make_full


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def test_a_worker_takes_the_further_windows_in_its_process(flow_worker, own_tmpdir):
    job = {"kind": "bench", "spec": "mlp", "device": "cpu", "config": CompileConfig(mode="default").to_row(),
           "min_seconds": 0.2, "idle_power_w": {}, "windows": 3}
    result = run_worker_job(job, budget=worker_budget(120, 0.6))
    assert result["status"] == "ok", result.get("reason")
    further = result["further_windows"]
    assert [w["extra"]["window_in_process"] for w in further] == [2, 3]
    for window in further:
        assert window["window_s"] >= 0.2 and window["inferences"] > 0 and window["energy_source"] == "estimate"
        assert window["energy_j_per_inference"] == pytest.approx(window["energy_j"] / window["inferences"])
        assert window["latency_ms_p50"] > 0 and window["extra"]["latency_calls"] >= 1
        assert result["started_at"] < window["started_at"] < window["finished_at"] <= result["finished_at"]
    assert further[0]["finished_at"] <= further[1]["started_at"]


def test_a_worker_whose_numerical_check_is_over_the_limit_takes_no_further_window(own_tmpdir):
    """The real worker, eager bf16 (no compile): its outputs differ from the fp32 reference by far more than the bound,
    so of the three windows asked for it takes one; the check is one per process, so the others could only repeat a
    configuration the policy cannot apply."""
    job = {"kind": "bench", "spec": "mlp", "device": "cpu",
           "config": CompileConfig(mode="eager", precision="bf16").to_row(), "min_seconds": 0.2, "idle_power_w": {},
           "windows": 3, "windows_max_rel_error": 1e-6}
    result = run_worker_job(job, budget=worker_budget(120, 0.6))
    assert result["status"] == "ok", result.get("reason")
    assert result["max_rel_error"] > 1e-6 and not result.get("further_windows")


def test_a_gated_worker_asks_its_parent_before_each_further_window_with_the_windows_so_far(flow_worker, own_tmpdir):
    """The real worker, asked for three windows under a gate that says yes once: before window 2 it gives the first
    window's figures (a fresh process), before window 3 both windows' (the second a further window); it stops there."""
    asked: list[list[dict]] = []

    def gate(runs):
        asked.append([dict(r) for r in runs])
        return len(asked) == 1

    job = {"kind": "bench", "spec": "mlp", "device": "cpu", "config": CompileConfig(mode="default").to_row(),
           "min_seconds": 0.2, "idle_power_w": {}, "windows": 3}
    result = run_worker_job(job, budget=worker_budget(120, 0.6), window_gate=gate)
    assert result["status"] == "ok", result.get("reason")
    assert [len(runs) for runs in asked] == [1, 2]
    first, second = (Run.from_row(r) for r in asked[1])
    assert first.ok and first.fresh_process and first.compile_s == pytest.approx(result["compile_s"])
    assert first.energy_j_per_inference == pytest.approx(result["energy_j_per_inference"])
    assert first.energy_source == "estimate" and first.latency_ms_p95 == pytest.approx(result["latency_ms_p95"])
    assert second.ok and not second.fresh_process and second.energy_j_per_inference > 0
    assert [w["extra"]["window_in_process"] for w in result["further_windows"]] == [2]


def test_a_gate_that_says_no_or_fails_leaves_the_worker_one_window(flow_worker, own_tmpdir):
    def refuse(runs):
        return False

    def broken(runs):
        raise RuntimeError("the store went away")

    for gate in (refuse, broken):
        job = {"kind": "bench", "spec": "mlp", "device": "cpu", "config": CompileConfig(mode="default").to_row(),
               "min_seconds": 0.2, "idle_power_w": {}, "windows": 3}
        result = run_worker_job(job, budget=worker_budget(120, 0.6), window_gate=gate)
        assert result["status"] == "ok", result.get("reason")
        assert not result.get("further_windows")


def test_a_worker_whose_parent_does_not_answer_takes_no_further_window(tmp_path):
    """The worker's side alone: no answer within the wait is a no, so a worker never hangs on a parent that is gone."""
    from joulepilot.compiler import window_gate

    started = time.monotonic()
    assert window_gate.ask(tmp_path, 2, [{"status": "ok"}], wait_s=0.3) is False
    assert 0.3 <= time.monotonic() - started < 5
    assert window_gate.answer(tmp_path, lambda runs: True, 1) == (2, True)  # answered late, for the record
    assert window_gate.answer(tmp_path, lambda runs: True, 2) == (2, None)  # a question is answered once


def test_the_windows_a_worker_takes_depend_on_its_numerical_check_only_with_a_bound():
    from joulepilot.compiler.worker import _windows

    assert _windows({"windows": 3}, 0.5) == 3  # no bound: what was asked
    assert _windows({"windows": 3, "windows_max_rel_error": 1e-2}, 1e-3) == 3
    assert _windows({"windows": 3, "windows_max_rel_error": 1e-2}, 1e-2) == 3  # at the limit is within it
    assert _windows({"windows": 3, "windows_max_rel_error": 1e-2}, 0.5) == 1
    assert _windows({"windows": 3, "windows_max_rel_error": 1e-2}, None) == 3  # nothing measured: nothing known
    assert _windows({"windows": "x"}, None) == 1


def _first_row(started: float, finished: float) -> dict:
    return {"workload_id": FILLER_WORKLOAD["id"], "config_id": FILLER_CONFIG["id"], "host_id": host_identity()["id"],
            "device": "cpu", "status": "ok", "started_at": started, "finished_at": finished, "compile_s": 4.0,
            "compile_energy_j": 40.0, "compile_energy_cpu_j": 40.0, "warmup_s": 0.5, "window_s": 1.0,
            "energy_j": 10.0, "energy_j_per_inference": 0.1, "inferences": 100, "max_rel_error": 1e-6,
            "latency_ms_p50": 9.0, "latency_ms_p95": 9.5, "energy_source": "estimate",
            "artifacts_path": "/tmp/a.bin", "extra": {"job_wall_s": 20.0, "latency_s": 1.0, "describe": {"x": 1},
                                                       "window": {"devices": []}, "worker_env": {"A": "1"}}}


def _window(index: int, started: float, finished: float, energy_j: float) -> dict:
    return {"started_at": started, "finished_at": finished, "window_s": 1.0, "inferences": 100,
            "energy_j": energy_j, "energy_j_per_inference": energy_j / 100, "latency_ms_p50": 8.0,
            "latency_ms_p95": 8.5, "energy_source": "estimate", "power_samples": [[started, "cpu:0", 11.0]],
            "extra": {"window_in_process": index, "latency_calls": 50, "window": {"devices": []}}}


def test_further_windows_become_runs_whose_spans_tile_the_job():
    row = _first_row(100.0, 116.0)
    rows = further_window_rows(row, [_window(3, 112.0, 113.5, 12.0), _window(2, 109.0, 110.5, 11.0)])
    (second, second_samples), (third, _) = rows
    assert row["finished_at"] == 109.0 and (second["started_at"], second["finished_at"]) == (109.0, 112.0)
    assert (third["started_at"], third["finished_at"]) == (112.0, 116.0)  # the last one until the worker ended
    assert row["extra"]["windows_in_process"] == 3 and row["extra"]["job_wall_s"] == pytest.approx(13.0)
    assert further_span_s(rows) == pytest.approx(7.0)
    for more in (second, third):
        for key in ("compile_s", "compile_energy_j", "compile_energy_cpu_j", "warmup_s", "artifacts_path"):
            assert key not in more  # no compile, warm-up or artifacts of its own
        assert more["max_rel_error"] == 1e-6 and more["config_id"] == row["config_id"]
        assert "describe" not in more["extra"] and "job_wall_s" not in more["extra"]
        assert more["extra"]["worker_env"] == {"A": "1"}
    assert second["energy_j_per_inference"] == 0.11 and second["latency_ms_p50"] == 8.0
    assert second_samples == [(109.0, "cpu:0", 11.0)]
    assert not Run.from_row(second).fresh_process and Run.from_row(row).fresh_process
    assert Run.from_row(second).wall_s == pytest.approx(3.0)
    assert further_window_rows(_first_row(1.0, 2.0), []) == []


def test_further_windows_are_committed_with_the_first_run_or_set_aside_with_it(tmp_path):
    db = open_db(tmp_path / "j.db")
    now = time.time()
    row = _first_row(now, now + 6)
    further = further_window_rows(row, [_window(2, now + 3, now + 4, 11.0)])
    refs = {"host": host_identity(), "workload": FILLER_WORKLOAD, "config": FILLER_CONFIG}
    first_id = commit_run(db, row, [], further=further, **refs)
    runs = {r["id"]: r for r in list_runs(db)}
    assert len(runs) == 2 and json_object(runs[first_id + 1]["extra"])["first_run_id"] == first_id
    assert json_object(runs[first_id + 1]["extra"])["window_in_process"] == 2

    full = open_db(tmp_path / "full.db")
    _make_full(full)
    outcome = commit_run_or_set_aside(full, _first_row(now, now + 6), [], further=further, **refs)
    assert outcome.run_id is None and outcome.pending_path.is_file()
    full.execute("PRAGMA max_page_count = 1000000")
    (item,) = import_pending_runs(full)
    stored = [r for r in list_runs(full) if r["status"] == "ok"]
    assert item.run_id is not None and len(stored) == 2
    assert {json_object(r["extra"]).get("first_run_id") for r in stored} == {None, item.run_id}


def test_a_job_takes_the_windows_the_host_that_queued_it_asked_for(db):
    # A guided search's repeat or an exhaustive policy's (controller.planner.plan_repeats) asks for the windows its
    # configuration still needs; the job carries them, so whichever host of a fleet claims it takes them.
    from joulepilot.store.daemon_state import enqueue_job, finish_job, get_job

    daemon = Daemon.__new__(Daemon)  # `_windows_for` reads the job alone
    repeat, _ = enqueue_job(db, policy="p", workload_id="w", config_id="c1", provenance_key="k", windows=2)
    first, _ = enqueue_job(db, policy="p", workload_id="w", config_id="c2", provenance_key="k")
    assert daemon._windows_for(get_job(db, repeat)) == 2 and daemon._windows_for(get_job(db, first)) == 1
    finish_job(db, first, state="done", run_id=None)
    assert enqueue_job(db, policy="p", workload_id="w", config_id="c2", provenance_key="k", windows=3) == (first, True)
    assert daemon._windows_for(get_job(db, first)) == 3  # queued again as a repeat: what the repeat asks


def test_the_daemon_stores_a_jobs_further_windows_as_runs_of_that_job(tmp_path, flow_worker, own_tmpdir,
                                                                       restore_logging, monkeypatch):
    monkeypatch.setattr(Daemon, "_windows_for", lambda self, job: 3)  # as a repeat of three windows would
    db_path = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "one", modes=("eager",))
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=db_path, policies=policies,
                                                 min_seconds=0.2))
    result = Daemon(cfg).run(once=True)
    assert result.exit_code == 0, result.summary
    runs = sorted(list_runs(open_db(db_path)), key=lambda r: r["id"])
    extras = [json_object(r["extra"]) for r in runs]
    assert [r["status"] for r in runs] == ["ok"] * 3 and result.summary["runs_ok"] == 1  # one job
    assert [e.get("window_in_process") for e in extras] == [None, 2, 3]
    first = runs[0]
    assert extras[0]["windows_in_process"] == 3 and first["compile_s"] is not None
    assert extras[0]["budget"] == worker_budget(cfg.bench.budget_s, 0.2 * 3).to_dict()  # grown for 3 windows
    for run, extra in zip(runs[1:], extras[1:], strict=True):
        assert extra["first_run_id"] == first["id"] and extra["job_id"] == extras[0]["job_id"]
        assert extra["policy"] == "one" and "job_wall_s" not in extra and run["compile_s"] is None
    assert first["finished_at"] == runs[1]["started_at"] and runs[1]["finished_at"] == runs[2]["started_at"]
    # the job's seconds: the first run's job_wall_s plus the further windows' spans
    spans = sum(r["finished_at"] - r["started_at"] for r in runs[1:])
    assert 0 < extras[0]["job_wall_s"] and extras[0]["job_wall_s"] + spans >= sum(r["window_s"] for r in runs)


def test_every_run_of_a_two_window_job_carries_its_pending_id(tmp_path):
    """A commit's `pending_id` is how an import finds a run already stored; the further window of a two-window job
    used to be stored without one."""
    now = time.time()
    refs = {"host": host_identity(), "workload": FILLER_WORKLOAD, "config": FILLER_CONFIG}
    db = open_db(tmp_path / "j.db")
    row = _first_row(now, now + 6)
    commit_run_or_set_aside(db, row, [], further=further_window_rows(row, [_window(2, now + 3, now + 4, 11.0)]),
                            **refs)
    stored = [json_object(r["extra"]) for r in list_runs(db)]
    assert len(stored) == 2 and stored[0]["pending_id"] and stored[0]["pending_id"] == stored[1]["pending_id"]

    full = open_db(tmp_path / "full.db")  # set aside, then imported: the same holds
    _make_full(full)
    row = _first_row(now, now + 6)
    outcome = commit_run_or_set_aside(full, row, [], further=further_window_rows(row, [_window(2, now + 3, now + 4,
                                                                                             11.0)]), **refs)
    full.execute("PRAGMA max_page_count = 1000000")
    (item,) = import_pending_runs(full)
    kept = [json_object(r["extra"]) for r in list_runs(full) if r["status"] == "ok"]
    assert item.run_id is not None and len(kept) == 2
    assert outcome.pending_path.name.endswith(f"{kept[0]['pending_id'][:8]}.json")
    assert kept[0]["pending_id"] == kept[1]["pending_id"]


def test_a_guided_pass_takes_each_further_window_only_while_the_judge_asks_for_it(tmp_path, flow_worker, own_tmpdir,
                                                                                   restore_logging, monkeypatch):
    """A guided policy's first measurements ask for three windows each, its repeats for the windows they still
    need; the daemon gives each worker the gate (`controller.guided.window_gate`, spied on here, not replaced) and
    every process takes exactly the windows the gate allowed: its first, then one per yes until the first no or
    the windows it was offered."""
    from joulepilot.controller import daemon as daemon_mod

    answers: list[tuple[str, int, bool]] = []  # (config id, windows the gate was shown, its answer), in order
    real_gate = daemon_mod.window_gate

    def spying_gate(db, policy, device_kind, config_id, **kwargs):
        gate = real_gate(db, policy, device_kind, config_id, **kwargs)

        def asked(rows):
            more = gate(rows)
            answers.append((config_id, len(rows), more))
            return more

        return asked

    import joulepilot.compiler as compiler_mod

    offered: dict[str, list[int]] = {}  # config id -> the windows each of its processes was offered, in order
    real_measure = compiler_mod.measure_config

    def spying_measure(workload, cfg, **kwargs):
        offered.setdefault(cfg.id, []).append(kwargs.get("windows", 1))
        return real_measure(workload, cfg, **kwargs)

    monkeypatch.setattr(daemon_mod, "window_gate", spying_gate)
    monkeypatch.setattr(compiler_mod, "measure_config", spying_measure)
    # a 10-ms stand-in call: on a loaded CI machine a 2-ms call's window was flagged "repeat this run", which left
    # the fastest configuration out of a verified decision
    monkeypatch.setenv("JOULEPILOT_FLOW_CALL_S", "0.01")
    db_path = tmp_path / "j.db"
    policies = tmp_path / "policies"
    write_policy(policies, "g", modes=("eager", "default"), precisions=("fp32", "bf16"), strategy="guided")
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=db_path, policies=policies,
                                                 min_seconds=0.2))
    result = Daemon(cfg).run(once=True)
    assert result.exit_code == 0, result.summary
    runs = sorted(list_runs(open_db(db_path)), key=lambda r: r["id"])
    processes: dict[int, list[str]] = {}  # a process's first run id -> the configuration of each of its windows
    for run in runs:
        extra = json_object(run["extra"])
        processes.setdefault(extra.get("first_run_id") or run["id"], []).append(run["config_id"])
    # the processes in order, against the gate's answers in order: each asked before its window 2, 3 ... with the
    # windows so far, and took one more window per yes, none after a no
    pending = list(answers)
    for windows in processes.values():
        config_id, taken = windows[0], len(windows)
        asked = []
        while pending and pending[0][0] == config_id and pending[0][1] == len(asked) + 1:
            asked.append(pending.pop(0)[2])
        most = offered[config_id].pop(0)  # a first measurement is offered 3, a repeat the windows it still needs
        assert taken == 1 + sum(asked) and all(asked[:-1]) and taken <= most, (windows, asked, most)
        assert not asked or not asked[-1] or taken == most  # a yes to the last window offered leaves none to ask
    assert not pending, pending
    assert not any(offered.values()), offered  # every process offered windows stored at least its first
    assert any(len(w) == 3 for w in processes.values())  # the best so far took the windows a verified decision needs
    database = open_db(db_path)
    try:
        decision = latest_decision(database, "g", "cpu")
    finally:
        database.close()
    best = CompileConfig(mode="default", precision="bf16", batch_size=8).id  # the stand-in's fastest, least busy
    shown = [(r["config_id"], r["status"], r["energy_j_per_inference"], json_object(r["extra"]).get("window_warning"))
             for r in runs]
    assert decision.state == "verified" and decision.config_id == best, (decision.reason, shown)


def _stored(energy: float, *, compile_s: float | None, compile_j: float | None, window: int) -> dict:
    """A run row as the store gives it: a further window stores no compile figures of its own."""
    return {"status": "ok", "energy_j_per_inference": energy, "avg_power_w": 500.0, "compile_s": compile_s,
            "compile_energy_j": compile_j, "energy_source": "nvml", "extra": {"window_in_process": window}}


def test_a_further_window_is_amortised_with_its_configurations_compile():
    """Recorded on the H200 (session 21, EfficientNet-B0, batch 64): reduce-overhead bf16 in three windows of one
    process, whose first call compiled for 4.8 kJ, against eager fp32 (3.44 J per call, a 0.1-s compile). Over
    1000 inferences the compile costs 4.8 J per call, so eager is the better choice; counted only with the first
    window (the other two stored without compile figures), the compiled configuration's median left it out."""
    from joulepilot.compiler import CompileConfig
    from joulepilot.policies.judge import Rules, judge, with_process_compile

    eager, compiled = CompileConfig("eager").to_row(), CompileConfig("reduce-overhead", precision="bf16").to_row()
    process = [Run.from_row(_stored(1.3464, compile_s=29.66, compile_j=4802.1, window=1)),
               Run.from_row(_stored(1.3517, compile_s=None, compile_j=None, window=2)),
               Run.from_row(_stored(1.3805, compile_s=None, compile_j=None, window=3))]
    baseline = [Run.from_row(_stored(3.4402, compile_s=0.1, compile_j=50.0, window=1))]
    assert [r.fresh_process for r in process] == [True, False, False]
    assert [r.compile_energy_j for r in with_process_compile(process)] == [4802.1, 4802.1, 4802.1]
    few = judge([eager, compiled], {eager["id"]: baseline, compiled["id"]: process}, Rules(expected_inferences=1000))
    assert few.chosen is not None and few.chosen.config_id == eager["id"]
    assert few.verdicts[compiled["id"]].amortised_j == pytest.approx(1.3517 + 4.8021)
    many = judge([eager, compiled], {eager["id"]: baseline, compiled["id"]: process},
                 Rules(expected_inferences=10_000_000))
    assert many.chosen is not None and many.chosen.config_id == compiled["id"]
    # Only a further window inherits: a run that started its process keeps what it measured.
    alone = [Run.from_row(_stored(1.35, compile_s=None, compile_j=None, window=1)), *process[1:]]
    assert with_process_compile(alone) == alone
