"""The daemon's exhaustive strategy repeats its contenders: once every allowed configuration is measured, the
chosen one and those that could still beat it by more than the tolerance are measured again (a job each, a
fresh worker process taking the windows still needed) until the chosen one rests on `[search] min_repeats` runs
from two processes, so the pass ends `verified`. A
contender whose repeats keep failing stops at the job's `max_attempts` or at the cap of runs per configuration,
and the decision stays `provisional` saying why, with no job after it. The passes run in this process
(`Daemon.run(once=True)`) with the flow worker: the daemon's flow is real, the model a stand-in."""

from __future__ import annotations

import logging
import sqlite3

import pytest
from daemon_factories import query, write_daemon_config, write_policy
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import load_daemon_config
from joulepilot.controller.planner import stale_reason
from joulepilot.policies import decide, load_policy
from joulepilot.policies.noise import MAX_REPEATS, fresh_process_of
from joulepilot.store import open_db
from joulepilot.store.decisions import latest_decision
from joulepilot.store.jsonvalues import json_object


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request, restore_logging):
    # and the `joulepilot` logger as it was: the daemon passes run here set up its handler and level
    monkeypatch.syspath_prepend(str(request.config.rootpath))
    # 10-ms stand-in calls: a run flagged "repeat this run" on a loaded machine would add repeats these tests
    # do not count
    monkeypatch.setenv("JOULEPILOT_FLOW_CALL_S", "0.01")


def _pass(cfg) -> dict:
    logging.getLogger("joulepilot").handlers.clear()  # each pass sets the daemon's log handler up again
    result = Daemon(cfg).run(once=True)
    assert result.exit_code == 0, result.summary
    return result.summary


def _config(tmp_path, *, max_attempts: int | None = None):
    path = write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=tmp_path / "policies",
                               min_seconds=0.2)
    if max_attempts is not None:
        path.write_text(path.read_text().replace("[bench]\n", f"[bench]\nmax_attempts = {max_attempts}\n"))
    return load_daemon_config(path)


def _runs(db) -> dict[str, list[dict]]:
    """config label -> its runs, oldest first, each with `fresh` (it started its worker process)."""
    rows = query(db, "SELECT runs.*, configs.label FROM runs JOIN configs ON configs.id = runs.config_id "
                     "ORDER BY runs.id")
    out: dict[str, list[dict]] = {}
    for row in rows:
        row["fresh"] = fresh_process_of(json_object(row["extra"]))
        out.setdefault(row["label"], []).append(row)
    return out


def _decision(db):
    database = open_db(db)
    try:
        return latest_decision(database, "mlp", "cpu")
    finally:
        database.close()


def _clear_flags(db) -> None:
    """Remove bench's "repeat this run" flag (`extra.window_warning`) from every stored run."""
    with sqlite3.connect(db) as connection:
        connection.execute("UPDATE runs SET extra = json_remove(extra, '$.window_warning')")
    connection.close()


def _policy(tmp_path, extra: str = "", min_repeats: int = 3, **kwargs):
    """The exhaustive policy `mlp` (three runs for a verified decision unless `min_repeats` says otherwise),
    `extra` appended."""
    path = write_policy(tmp_path / "policies", "mlp", min_repeats=min_repeats, **kwargs)
    path.write_text(path.read_text() + extra)
    return path


def test_a_pass_repeats_the_contenders_until_the_decision_is_verified(tmp_path, flow_worker, own_tmpdir):
    # The compiled configurations break the compile-time limit (the stand-in's compile waits 0.1 s): they are
    # never contenders, whatever the estimate meter's noise makes of the two eager ones.
    _policy(tmp_path, "[limits]\nmax_compile_s = 0.05\n", modes=("eager", "default"), precisions=("fp32", "bf16"))
    cfg = _config(tmp_path)
    summary = _pass(cfg)

    db = tmp_path / "j.db"
    decision = _decision(db)
    assert decision.state == "verified", decision.reason
    runs = _runs(db)
    chosen = runs[decision.details["config"]["label"]]
    assert len(chosen) >= 3 and all(r["status"] == "ok" for r in chosen)
    assert sum(r["fresh"] for r in chosen) >= 2
    # Each repeat was a job of its own: a fresh worker process taking the windows the contender still needed.
    repeated = {r["config"] for r in summary["repeats"]}
    assert decision.details["config"]["label"] in repeated
    assert all(r["why"] and r["windows"] >= 1 for r in summary["repeats"])
    for label, its_runs in runs.items():
        if label in repeated:  # a contender: confirmed now
            assert len(its_runs) >= 3 and sum(r["fresh"] for r in its_runs) >= 2, label
        else:  # never a contender: measured once
            assert len(its_runs) == 1, label
    assert len(runs["default/fp32/b8"]) == len(runs["default/bf16/b8"]) == 1
    # Repeated: the chosen one and any tie that could still differ from it by more than the 2% tolerance; a tie
    # within the tolerance needs no more runs (the tie-break settles it). A configuration repeated as a close call
    # may be no contender once its own repeats are in (the estimate meter's noise decides which), so only the
    # chosen one is sure to be both.
    assert decision.config_id in {r["config_id"] for r in summary["repeats"]}
    assert decision.config_id in decision.details["contenders"]
    assert decision.details["confirm"] == [] and not decision.details["confirm_reason"]
    # One job per configuration, then one per repeat; a job's further windows are runs of it.
    assert summary["enqueued"] == summary["runs_ok"] == len(runs) + len(summary["repeats"])
    assert sum(len(r) for r in runs.values()) == summary["runs_ok"] + sum(r["windows"] - 1 for r in summary["repeats"])
    # What the pass spent prices every run it stored, a repeat's further windows included.
    (spent,) = summary["measuring"]
    assert spent["runs"] == sum(len(r) for r in runs.values())

    # The next pass finds the decision current: nothing is measured again; but where bench flagged a run
    # "repeat this run" (a busy host) that could beat the choice, the decision asks for it and that pass measures
    # it again (and confirms whatever its new run makes a contender).
    again = _pass(cfg)
    flagged = set(decision.details["repeat"])
    if not flagged:
        assert again["stale"] == [] and again["enqueued"] == 0 and again["repeats"] == []
        assert sum(len(r) for r in _runs(db).values()) == sum(len(r) for r in runs.values())
    else:
        assert again["stale"] == [{"policy": "mlp", "reason": 'runs it could rest on were flagged "repeat this run"'}]
        grown = {rs[0]["config_id"] for label, rs in _runs(db).items() if len(rs) > len(runs[label])}
        assert flagged <= grown


def test_min_repeats_one_is_verified_after_one_pass_without_a_repeat(tmp_path, flow_worker, own_tmpdir):
    _policy(tmp_path, min_repeats=1, modes=("eager", "default"))
    summary = _pass(_config(tmp_path))
    db = tmp_path / "j.db"
    assert summary["repeats"] == [] and summary["enqueued"] == 2
    assert _decision(db).state == "verified"
    assert {label: len(r) for label, r in _runs(db).items()} == {"eager/fp32/b8": 1, "default/fp32/b8": 1}


@pytest.mark.parametrize("max_attempts", [3, MAX_REPEATS * 2])
def test_a_contender_whose_repeats_keep_failing_stops_and_the_decision_stays_provisional(
        tmp_path, flow_worker, own_tmpdir, monkeypatch, max_attempts):
    # One run each, verified under min_repeats = 1; then the policy asks for three, and every worker fails.
    policy_file = _policy(tmp_path, min_repeats=1, modes=("eager", "default"))
    cfg = _config(tmp_path, max_attempts=max_attempts)
    _pass(cfg)
    db = tmp_path / "j.db"
    chosen = _decision(db).details["config"]["label"]
    policy_file.write_text(policy_file.read_text().replace("min_repeats = 1\n", "min_repeats = 3\n"))
    monkeypatch.setenv("JOULEPILOT_WORKER_MODULE", "tests.no_such_worker")  # every worker dies as it starts

    summary = _pass(cfg)
    runs = _runs(db)
    # Each contender's repeat (the chosen one's, and that of one tying with it) is retried as its job allows
    # (max_attempts), never past the cap of runs per configuration.
    stop_after = min(max_attempts, MAX_REPEATS - 1)
    repeated = [r["config"] for r in summary["repeats"]]
    assert chosen in repeated
    for label, its_runs in runs.items():
        failed = [r for r in its_runs if r["status"] != "ok"]
        assert len(its_runs) == 1 + len(failed)
        if label not in repeated and json_object(its_runs[0]["extra"]).get("window_warning"):
            # A loaded machine flagged its one run "repeat this run": it does not count, so the pass measures the
            # configuration again as a job of its own (not a repeat), whose worker fails too.
            assert failed, label
            continue
        assert len(failed) == repeated.count(label) == (stop_after if label in repeated else 0), label
    decision = _decision(db)
    assert decision.state == "provisional" and decision.details["config"]["label"] == chosen
    why = f"its job failed {max_attempts} times" if max_attempts < MAX_REPEATS else \
        f"cap of {MAX_REPEATS} runs reached"
    _, said, after = decision.reason.partition(f"it has 1 of the 3 runs a verified decision needs; it is not "
                                               f"measured again: {why}")
    assert said, decision.reason
    # A rival whose one run a loaded machine flagged "repeat this run" is named after it, and nothing else is.
    flagged = [label for label, its_runs in runs.items()
               if any(json_object(r["extra"]).get("window_warning") for r in its_runs)]
    assert after == "" or (flagged and after == "".join(
        f'; {label} measured better, but its run was flagged "repeat this run" so it cannot be verified'
        for label in flagged if label in after)), decision.reason
    assert decision.details["confirm"] == []

    # No loop: the next pass finds nothing to do, and neither does the one after it.
    for _ in range(2):
        later = _pass(cfg)
        assert later["stale"] == [] and later["enqueued"] == 0 and later["decided"] == []
    assert sum(len(r) for r in _runs(db).values()) == sum(len(r) for r in runs.values())
    assert query(db, "SELECT COUNT(*) AS n FROM jobs WHERE state IN ('queued', 'running')")[0]["n"] == 0


def test_a_stored_decision_with_contenders_to_confirm_is_stale_and_the_daemon_confirms_them(
        tmp_path, flow_worker, own_tmpdir):
    # The runs exist (a pass under min_repeats = 1); `policy lock` then decides under min_repeats = 3.
    policy_file = _policy(tmp_path, min_repeats=1, modes=("eager", "default"))
    cfg = _config(tmp_path)
    first = _pass(cfg)
    # This test is about the runs a verified decision needs. On a loaded machine bench may flag a run "repeat this
    # run", and a flagged run makes the decision stale for that reason first (that rule is tested in
    # test_daemon_pass and test_hardening_decisions); the flags are cleared so the reason under test is the one given.
    _clear_flags(tmp_path / "j.db")
    policy_file.write_text(policy_file.read_text().replace("min_repeats = 1\n", "min_repeats = 3\n"))
    policy = load_policy(policy_file)
    database = open_db(tmp_path / "j.db")
    try:
        decided = decide(database, policy, "cpu", provenance_key=first["provenance_key"], decided_by="policy lock")
        row = latest_decision(database, "mlp", "cpu")
    finally:
        database.close()
    assert decided.decision.state == "provisional"
    # The chosen configuration first (with one that ties with it, when the estimate's noise makes one).
    item = decided.decision.confirm[0]
    assert item["config_id"] == decided.decision.config_id and item["runs"] == 2
    # Only the chosen configuration and its contenders are confirmed. Which contenders depends on the estimate's
    # noise on this machine: a close call is confirmed, a tie within the tolerance is settled by the tie-break
    # without more runs, and one whose run a loaded machine flagged "repeat this run" is a repeat
    # (`Decision.repeat`), not a confirmation (the judge's rules, tested with seeded runs below).
    assert {c["config_id"] for c in decided.decision.confirm} <= \
        set(decided.decision.contenders) | {decided.decision.config_id}
    reason = "its choice rests on 1 of the 3 runs a verified decision needs"
    assert stale_reason(row, policy_hash=policy.hash, provenance_key=first["provenance_key"], max_age_s=1e9) == reason

    summary = _pass(cfg)
    assert summary["stale"] == [{"policy": "mlp", "reason": reason}]
    assert summary["repeats"][0]["config_id"] == decided.decision.config_id and summary["enqueued"] >= 1
    assert _decision(tmp_path / "j.db").state == "verified"


# --- the resolver's side: which contenders an exhaustive decision lists to confirm (seeded runs, no worker) ----

EAGER32, EAGER16 = ("eager", "fp32"), ("eager", "bf16")
BEST = {"energy_j_per_inference": 0.50, "avg_power_w": 20.0}
OTHER = {"energy_j_per_inference": 1.00, "avg_power_w": 20.0}
FAILED = {"status": "failed", "energy_j_per_inference": None, "avg_power_w": 20.0}


def _seeded_policy(tmp_path, strategy: str):
    from decision_factories import write_policy as write_seeded_policy

    path = write_seeded_policy(tmp_path / "seeded", limit_w=1000.0)
    path.write_text(path.read_text().replace("[search]\n", f'[search]\nstrategy = "{strategy}"\n'))
    return load_policy(path)


def test_an_exhaustive_decision_lists_its_unconfirmed_contenders_and_a_guided_one_leaves_them_to_its_search(
        tmp_path, db):
    from decision_factories import config, seed_runs
    from joulepilot.policies import resolve

    seed_runs(db, {EAGER16: BEST, EAGER32: OTHER})  # eager bf16 clearly best: the only contender
    best = config(*EAGER16).id
    guided = resolve(_seeded_policy(tmp_path, "guided"), db, "cpu")
    assert guided.contenders == [best] and guided.confirm == [] and guided.confirm_reason == ""
    exhaustive = resolve(_seeded_policy(tmp_path, "exhaustive"), db, "cpu")
    assert exhaustive.state == "provisional" and exhaustive.contenders == [best]
    assert exhaustive.confirm == [{"config_id": best, "label": "eager/bf16/b8", "runs": 2,
                                   "why": "contender with 1 of 3 runs"}]
    assert exhaustive.confirm_reason == "its choice rests on 1 of the 3 runs a verified decision needs"

    # A close call that the cap of runs cannot settle: eager fp32's runs (1.0, 0.51, 0.51 J) spread so widely that
    # it could still beat eager bf16 by more than the 2% tolerance, and would at 5 runs of each too: the lower
    # median stands, and neither is measured again.
    for _ in range(2):
        seed_runs(db, {EAGER16: BEST, EAGER32: {**BEST, "energy_j_per_inference": 0.51}})
    noisy = resolve(_seeded_policy(tmp_path, "exhaustive"), db, "cpu")
    assert set(noisy.contenders) == {best, config(*EAGER32).id} and noisy.config_id == best
    assert noisy.confirm == [] and noisy.state == "verified"
    assert ("eager/fp32/b8 could still beat it by more than the 2% tolerance, but the runs are too noisy for 5 runs "
            "of each to tell (+-49% now): the lower median stands and they are not measured again") in noisy.reason


def test_a_close_call_that_more_runs_can_settle_is_measured_again_on_both_sides(tmp_path, db):
    # eager fp32's runs (0.54, 0.49, 0.51 J) against eager bf16's three of 0.50 J: it could still beat eager bf16 by
    # more than the 2% tolerance, and two more runs of each could tell: both are measured again, the chosen one
    # first.
    from decision_factories import config, seed_runs
    from joulepilot.policies import resolve

    for joules in (0.54, 0.49, 0.51):
        seed_runs(db, {EAGER16: BEST, EAGER32: {**BEST, "energy_j_per_inference": joules}})
    tie = resolve(_seeded_policy(tmp_path, "exhaustive"), db, "cpu")
    assert set(tie.contenders) == {config(*EAGER16).id, config(*EAGER32).id}
    assert [c["config_id"] for c in tie.confirm] == [tie.config_id, config(*EAGER32).id]
    assert tie.confirm_reason == "its choice is a close call that more runs may still decide otherwise"
    assert "eager/fp32/b8 could still beat it by more than the 2% tolerance;" in tie.reason


def test_a_contender_at_the_cap_or_whose_job_failed_out_is_not_listed_and_the_reason_says_why(tmp_path, db):
    from decision_factories import config, seed_runs
    from joulepilot.policies import resolve

    policy = _seeded_policy(tmp_path, "exhaustive")
    seed_runs(db, {EAGER16: BEST, EAGER32: OTHER})
    best = config(*EAGER16).id
    blocked = resolve(policy, db, "cpu", no_repeat={best: "its job failed 3 times"})
    assert blocked.confirm == [] and blocked.state == "provisional"
    assert blocked.reason.endswith("it has 1 of the 3 runs a verified decision needs; it is not measured again: "
                                   "its job failed 3 times")
    for _ in range(MAX_REPEATS - 2):
        seed_runs(db, {EAGER16: FAILED})
    below_cap = resolve(policy, db, "cpu")  # one ok and three failed runs: one more may still be tried
    assert [c["config_id"] for c in below_cap.confirm] == [best]
    seed_runs(db, {EAGER16: FAILED})  # five runs in all: the cap
    capped = resolve(policy, db, "cpu")
    assert capped.confirm == [] and capped.state == "provisional"
    assert capped.reason.endswith(f"it is not measured again: cap of {MAX_REPEATS} runs reached")


def test_a_contender_that_cannot_beat_the_chosen_one_by_more_than_the_tolerance_is_not_confirmed(tmp_path, db):
    # One run each, eager fp32 6% above eager bf16: their assumed +-5% intervals overlap, so both contend, but
    # eager fp32 cannot be better by more than the 2% tolerance (6% - hypot(5%, 5%) of difference at most): a
    # tie settled without more runs of it; only the chosen one is confirmed.
    from decision_factories import config, seed_runs
    from joulepilot.policies import resolve

    seed_runs(db, {EAGER16: BEST, EAGER32: {**BEST, "energy_j_per_inference": 0.53}})
    best = config(*EAGER16).id
    decision = resolve(_seeded_policy(tmp_path, "exhaustive"), db, "cpu")
    assert set(decision.contenders) == {best, config(*EAGER32).id}
    assert [c["config_id"] for c in decision.confirm] == [best]
