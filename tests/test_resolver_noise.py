"""The resolver ranks configurations by the median of every counted repeat, with an interval: overlapping
intervals are a tie broken by lower average power, then the cheaper compile, then the simpler mode;
the decision states its confidence against the runner-up. Real SQLite stores seeded with repeated runs
(`decision_factories.seed_runs`, one call per repeat); nothing is compiled."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner
from decision_factories import config, db_file, seed_runs, write_policy
from joulepilot.policies import load_policy, resolve
from joulepilot.policies.noise import median
from joulepilot.store import open_db

from joulepilot.cli import main

# Eager runs compile nothing; default-mode runs carry compile_s 5 and compile_energy_j 50 (seed_runs).
EAGER32, EAGER16, DEF32 = ("eager", "fp32"), ("eager", "bf16"), ("default", "fp32")


def _seed(db, series: dict[tuple[str, str], list[dict]]) -> None:
    """Repeat i of every configuration is stored in round i (oldest first)."""
    for i in range(max(len(v) for v in series.values())):
        seed_runs(db, {key: runs[i] for key, runs in series.items() if i < len(runs)})


def _policy(tmp_path, limit_w: float = 1000.0):
    return load_policy(write_policy(tmp_path / "policies", limit_w=limit_w))


def _cand(decision, key):
    return next(c for c in decision.candidates if c.config_id == config(*key).id)


def test_a_tie_within_the_tolerance_goes_to_lower_average_power(tmp_path, db):
    # eager bf16 has the lower median energy, but within 1% and a spread of about 0.4%; eager fp32 draws clearly
    # less power. Even at the unfavourable ends of their intervals eager fp32 is within the 2% tolerance.
    _seed(db, {EAGER16: [{"energy_j_per_inference": e, "avg_power_w": 40.0} for e in (0.996, 1.000, 1.004)],
               EAGER32: [{"energy_j_per_inference": e, "avg_power_w": 20.0} for e in (1.001, 1.005, 1.009)]})
    decision = resolve(_policy(tmp_path), db, "cpu")
    fp32, bf16 = _cand(decision, EAGER32), _cand(decision, EAGER16)
    assert bf16.median < fp32.median and bf16.ci_high >= fp32.ci_low  # a tie by the intervals
    assert decision.state == "verified" and decision.config_id == fp32.config_id
    assert decision.reason.startswith(f"{fp32.label} ties with {bf16.label} (lowest median amortised J/inference "
                                      f"1) within the noise and wins the tie-break on lower average power (20 W vs "
                                      f"40 W)")
    assert decision.confidence.startswith(f"{fp32.label} and {bf16.label} are within 2% of each other")
    assert fp32.repeats == bf16.repeats == 3 and len(fp32.run_ids) == 3


def test_a_tie_that_could_hide_more_than_the_tolerance_stays_with_the_lower_median(tmp_path, db):
    # Their medians are 3% apart with a spread of 4%: eager fp32 draws less power, but it could be worse than
    # eager bf16 by more than the 2% tolerance, so the tie-break does not choose it: a close call.
    _seed(db, {EAGER16: [{"energy_j_per_inference": e, "avg_power_w": 40.0} for e in (0.96, 1.00, 1.04)],
               EAGER32: [{"energy_j_per_inference": e, "avg_power_w": 20.0} for e in (0.99, 1.03, 1.07)]})
    decision = resolve(_policy(tmp_path), db, "cpu")
    fp32, bf16 = _cand(decision, EAGER32), _cand(decision, EAGER16)
    assert bf16.ci_high >= fp32.ci_low  # a tie by the intervals
    assert decision.config_id == bf16.config_id
    assert decision.confidence.startswith(f"{bf16.label} and {fp32.label} tie within the noise ({bf16.label} "
                                          f"lower by 2.9% +- ")
    assert (f"{fp32.label} has the lower average power (20 W vs 40 W), but could be worse by more than the 2% "
            f"tolerance") in decision.confidence
    assert f"{fp32.label} could still beat it by more than the 2% tolerance" in decision.reason


def test_equal_power_goes_to_the_cheaper_compile_then_the_simpler_mode(tmp_path, db):
    same = [{"energy_j_per_inference": e, "avg_power_w": 30.0} for e in (0.998, 1.000, 1.002)]
    compiled = [{**r, "energy_j_per_inference": r["energy_j_per_inference"] - 0.002} for r in same]
    _seed(db, {EAGER32: same, DEF32: compiled})
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert _cand(decision, DEF32).median < _cand(decision, EAGER32).median
    assert decision.config_id == config(*EAGER32).id and "cheaper compile" in decision.reason

    # Same compile seconds too (both compile nothing): the simpler mode decides.
    db2_path = tmp_path / "two.db"
    db2 = open_db(db2_path)
    _seed(db2, {EAGER32: same, DEF32: [{**r, "compile_s": 0.0, "compile_energy_j": 0.0} for r in compiled]})
    decision = resolve(_policy(tmp_path), db2, "cpu")
    assert decision.config_id == config(*EAGER32).id and "simpler mode" in decision.reason
    db2.close()


def test_a_clear_win_states_by_how_much_and_every_repeat_counts(tmp_path, db):
    # eager bf16's newest run is an outlier: the median of its five runs still beats eager fp32.
    bf16 = [0.70, 0.70, 0.71, 0.70, 1.05]
    fp32 = [1.00, 1.01, 1.02]
    _seed(db, {EAGER16: [{"energy_j_per_inference": e, "avg_power_w": 20.0} for e in bf16],
               EAGER32: [{"energy_j_per_inference": e, "avg_power_w": 20.0} for e in fp32]})
    decision = resolve(_policy(tmp_path), db, "cpu")
    chosen, other = _cand(decision, EAGER16), _cand(decision, EAGER32)
    assert decision.config_id == chosen.config_id  # the latest run alone (1.05 J) would lose to fp32
    assert chosen.median == median(bf16) and chosen.repeats == 5
    assert decision.measured["median"] == chosen.median and decision.measured["repeats"] == 5
    # The difference relative to the runner-up's median, +- the facing halves of the two intervals combined.
    diff = (other.median - chosen.median) / other.median
    plus_minus = math.hypot(chosen.ci_high - chosen.median, other.median - other.ci_low) / other.median
    assert decision.confidence == (f"{chosen.label} beats {other.label} by {diff:.0%} +- {plus_minus:.0%} "
                                   f"(median of 5 vs 3 runs)")


def test_explain_shows_median_spread_repeats_and_confidence(tmp_path, db):
    _seed(db, {EAGER16: [{"energy_j_per_inference": e, "avg_power_w": 20.0} for e in (0.70, 0.71, 0.72)],
               EAGER32: [{"energy_j_per_inference": e, "avg_power_w": 20.0} for e in (1.00, 1.01, 1.02)]})
    path = write_policy(tmp_path / "policies", limit_w=1000.0)
    runner = CliRunner()
    out = runner.invoke(main, ["policy", "explain", str(path), "--db", db_file(db), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert " beats " in data["confidence"]
    measured = [c for c in data["candidates"] if c["source"] == "measured"]
    assert measured and all(c["repeats"] == 3 and c["ci_low"] <= c["median"] <= c["ci_high"] for c in measured)
    text = runner.invoke(main, ["policy", "explain", str(path), "--db", db_file(db)], env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    assert f"confidence {data['confidence']}" in text.stdout
    spread = next(c for c in measured if c["status"] == "chosen")
    assert f"±{spread['spread_pct']:.0f}% (3)" in text.stdout


def test_a_flagged_run_counts_once_a_clean_repeat_exists(tmp_path, db):
    flag = {"extra": {"window_warning": "energy window ran 3x slower than the latency pass"}}
    # eager bf16: a clean run, then a newer flagged one. Both count; it is not held back as flagged.
    _seed(db, {EAGER16: [{"energy_j_per_inference": 0.70, "avg_power_w": 20.0},
                         {"energy_j_per_inference": 0.72, "avg_power_w": 20.0, **flag}],
               EAGER32: [{"energy_j_per_inference": 1.0, "avg_power_w": 20.0}]})
    decision = resolve(_policy(tmp_path), db, "cpu")
    bf16 = _cand(decision, EAGER16)
    assert bf16.flagged is None and bf16.repeats == 2
    # Applied, but two runs are not the three a verified decision needs: the flagged one counts among them.
    assert decision.state == "provisional" and decision.config_id == bf16.config_id
    assert decision.reason.endswith("it has 2 of the 3 runs a verified decision needs")

    # A configuration whose only runs are flagged never makes the decision verified.
    seed_runs(db, {DEF32: {"energy_j_per_inference": 0.30, "avg_power_w": 20.0, **flag}})
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert _cand(decision, DEF32).status == "flagged" and decision.config_id == bf16.config_id


def test_a_decision_never_says_a_configuration_ties_with_itself(tmp_path, db):
    """Eager fp32 has the lowest median, default fp32 overlaps it, and eager fp32 also wins the tie-break
    (its compile is cheaper): the reason names the lowest median outright, not 'eager/fp32/b8 ties with
    eager/fp32/b8 ... (0 s vs 0 s)', in the decision and in what `policy explain` and `policy lock` print."""
    _seed(db, {EAGER32: [{"energy_j_per_inference": e, "avg_power_w": 30.0} for e in (0.999, 1.000, 1.001)],
               DEF32: [{"energy_j_per_inference": e, "avg_power_w": 30.0} for e in (1.000, 1.001, 1.002)]})
    path = write_policy(tmp_path / "policies", limit_w=1000.0)
    decision = resolve(load_policy(path), db, "cpu")
    eager = _cand(decision, EAGER32)
    assert decision.config_id == eager.config_id and len(decision.contenders) == 2
    assert f"{eager.label} ties with {eager.label}" not in decision.reason
    assert decision.reason.startswith(f"{eager.label} is the measured configuration with the lowest median")
    assert f"{eager.label} and {eager.label}" not in decision.confidence
    for command in (["policy", "explain"], ["policy", "lock"]):
        out = CliRunner().invoke(main, [*command, str(path), "--db", db_file(db)])
        assert out.exit_code == 0, out.output
        assert f"{eager.label} ties with {eager.label}" not in out.output
