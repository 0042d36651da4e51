"""One rule for a `verified` decision, in the resolver and the guided search alike (`policies.judge`, through
`policies.noise.confirmation`): the chosen configuration rests on at least `min_repeats` counted runs (3
unless the policy's `[search] min_repeats` says otherwise), at least two of them in a fresh worker process
unless every rival is worse by more than the tolerance even at the unfavourable end of the difference's
interval. With fewer, the decision is `provisional`, and the chosen measured configuration is still the one
applied.

Real SQLite stores seeded with runs (`decision_factories.seed_runs`, one call per round); a further window of
a worker process is a run with `extra.window_in_process` above 1, as `bench --windows` stores it. Nothing is
compiled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from decision_factories import config, seed_runs, write_policy
from joulepilot.controller.guided import plan_guided
from joulepilot.policies import PolicyError, decide, load_policy, resolve, torch_minor
from joulepilot.policies.judge import Rules, Run
from joulepilot.policies.noise import MIN_REPEATS, confirmation
from joulepilot.runtime.lookup import find_decision

ROOT = Path(__file__).resolve().parent.parent
EAGER32, EAGER16 = ("eager", "fp32"), ("eager", "bf16")
# eager bf16 is clearly the best within the 1000 W envelope; eager fp32 the runner-up.
BEST = {"energy_j_per_inference": 0.50, "avg_power_w": 20.0}
OTHER = {"energy_j_per_inference": 1.00, "avg_power_w": 20.0}
CLOSE = {"energy_j_per_inference": 0.51, "avg_power_w": 20.0}  # 2% over the best: within the tolerance


def _policy(tmp_path, min_repeats: int | None = None):
    path = write_policy(tmp_path / "policies", limit_w=1000.0)
    if min_repeats is not None:
        path.write_text(path.read_text().replace("[search]\n", f"[search]\nmin_repeats = {min_repeats}\n"))
    return load_policy(path)


def _rounds(db, windows: list[int | None], other: dict = OTHER) -> None:
    """One round per entry: a run of each configuration, the best one stored as the given window of its
    worker process (None: the first window, a fresh process)."""
    for window in windows:
        best = {**BEST, "extra": {"window_in_process": window}} if window else BEST
        seed_runs(db, {EAGER16: best, EAGER32: other})


def _engine(db, policy):
    """The guided search's view of the same stored runs, as the daemon builds it."""
    return plan_guided(db, policy, "cpu", torch_version=torch_minor())


def _chosen(plan) -> str | None:
    return next((m["config_id"] for m in plan.measured if m["status"] == "chosen"), None)


def test_one_run_is_provisional_and_the_chosen_configuration_is_applied(tmp_path, db):
    _rounds(db, [None])
    policy = _policy(tmp_path)
    decision = resolve(policy, db, "cpu")
    assert decision.state == "provisional"
    assert decision.config_id == config(*EAGER16).id  # the best measured one, not the fallback (eager fp32)
    assert decision.config_id != config(*EAGER32).id
    assert decision.reason.endswith("; it has 1 of the 3 runs a verified decision needs")
    chosen = next(c for c in decision.candidates if c.config_id == decision.config_id)
    assert chosen.status == "chosen" and chosen.repeats == 1
    assert decision.measured["repeats"] == 1  # its figures are reported, as for any applied measurement


def test_three_runs_in_one_process_stay_provisional_while_a_rival_could_change_the_answer(tmp_path, db):
    _rounds(db, [None, 2, 3], other=CLOSE)  # one worker process that took three windows; a rival 2% behind
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert decision.state == "provisional" and decision.config_id == config(*EAGER16).id
    assert "it has 3 of the 3 runs a verified decision needs, but only 1 of them started its own worker " \
           "process, and it needs 2 while a rival could still change the answer" in decision.reason
    assert plan_guided(db, _policy(tmp_path), "cpu").state == "provisional"


def test_three_runs_in_one_process_are_verified_when_no_rival_could_change_the_answer(tmp_path, db):
    """The runner-up is twice as costly: a second worker process could not change the answer, so the three
    windows of one process verify it (`noise.Confirmation.separated`)."""
    _rounds(db, [None, 2, 3])
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert decision.state == "verified" and decision.config_id == config(*EAGER16).id
    assert "verified decision needs" not in decision.reason
    assert plan_guided(db, _policy(tmp_path), "cpu").state == "verified"


def test_three_runs_from_two_processes_are_verified(tmp_path, db):
    _rounds(db, [None, 2, None])  # a process of two windows, then a fresh one
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert decision.state == "verified" and decision.config_id == config(*EAGER16).id
    assert "verified decision needs" not in decision.reason


def test_a_policys_min_repeats_is_the_number_of_runs_needed(tmp_path, db):
    _rounds(db, [None])
    one = _policy(tmp_path, min_repeats=1)
    assert one.search.min_repeats == 1 and Rules.of(one).min_repeats == 1
    decision = resolve(one, db, "cpu")
    assert decision.state == "verified" and decision.config_id == config(*EAGER16).id

    _rounds(db, [None, None])  # three fresh runs: enough for the default, not for a policy asking five
    five = resolve(_policy(tmp_path / "five", min_repeats=5), db, "cpu")
    assert five.state == "provisional" and five.reason.endswith("; it has 3 of the 5 runs a verified decision needs")
    assert resolve(_policy(tmp_path), db, "cpu").state == "verified"


@pytest.mark.parametrize("value", [0, 6, "3", True])
def test_a_bad_min_repeats_is_one_line_naming_the_key(tmp_path, value):
    path = write_policy(tmp_path / "policies", limit_w=1000.0)
    text = f'"{value}"' if isinstance(value, str) else str(value).lower()
    path.write_text(path.read_text().replace("[search]\n", f"[search]\nmin_repeats = {text}\n"))
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    message = str(err.value)
    assert "search.min_repeats" in message and "an integer from 1 to 5" in message
    assert "Traceback" not in message


@pytest.mark.parametrize(("windows", "min_repeats"), [
    ([None], None), ([None, 2, 3], None), ([None, 2, None], None), ([None], 1), ([None, None], 2),
    ([None, 2], 2),
])
def test_the_guided_search_and_the_resolver_agree(tmp_path, db, windows, min_repeats):
    _rounds(db, windows)
    policy = _policy(tmp_path, min_repeats)
    decision = resolve(policy, db, "cpu")
    plan = _engine(db, policy)
    assert plan.state == decision.state
    assert _chosen(plan) == decision.config_id == config(*EAGER16).id
    # eager fp32 costs twice as much: no rival could change the answer, so one process may verify it.
    expected = confirmation([Run(ok=True, fresh_process=w is None) for w in windows],
                            policy.search.min_repeats, separated=True).confirmed
    assert decision.state == ("verified" if expected else "provisional")


def test_a_recorded_provisional_decision_applies_the_chosen_configuration(tmp_path, db):
    _rounds(db, [None])
    policy = _policy(tmp_path)
    decided = decide(db, policy, "cpu", decided_by="test", lock=False)
    assert decided.decision.state == "provisional"
    applied = find_decision(policy, "cpu", torch_minor(), db).applied
    assert applied is not None and applied.state == "provisional"
    assert applied.config_id == config(*EAGER16).id  # what the hook compiles: not the fallback


def test_flagged_runs_count_only_after_a_clean_one():
    flagged = Run(ok=True, flagged="window warning")
    assert confirmation([flagged] * 3).runs == 0  # nothing counts while every run is flagged
    status = confirmation([Run(ok=True), flagged, flagged, Run(ok=False)])
    assert (status.runs, status.fresh, status.confirmed) == (3, 3, True)
    assert confirmation([Run(ok=True)] * 2).shortfall() == \
        f"it has 2 of the {MIN_REPEATS} runs a verified decision needs"


def test_the_readme_decision_table_shows_what_a_provisional_decision_applies():
    """benchmarks/replay_decisions.py (the README's H200 table): most of the sweep's configurations were
    measured once or twice, so its decisions are provisional; the table still gives the configuration each
    applies, with its measured figures."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "replay_decisions.py"),
                           str(ROOT / "tests" / "data" / "gpu_sweep_h200.json"), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert any(r["state"] == "provisional" for r in rows)
    applying_measured = [r for r in rows if r["state"] in ("verified", "provisional", "infeasible")
                         and "the fallback" not in r["reason"]]
    assert applying_measured
    for row in applying_measured:
        assert row["energy_j_per_inference"] is not None and row["avg_power_w"] is not None, row
        assert row["saving_vs_eager_fp32"] is not None, row
