"""Statistics over repeats of one configuration (policies.noise): intervals, ties, tie-breaks, repeats."""

from __future__ import annotations

import math

import pytest
from joulepilot.policies.judge import Run
from joulepilot.policies.noise import (
    DEFAULT_SPREAD_REL,
    MAX_REPEATS,
    MIN_REPEATS,
    MODE_SIMPLICITY,
    Interval,
    TieEntry,
    assumed_spread_rel,
    break_tie,
    counted,
    distribution_free_high,
    median,
    median_interval,
    repeat_advice,
    t_quantile,
    typical_rel_std,
)


def test_median_of_odd_and_even_counts():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        median([])


@pytest.mark.parametrize(("p", "dof", "table"), [(0.9, 2, 1.886), (0.9, 5, 1.476), (0.975, 5, 2.571),
                                                  (0.975, 30, 2.042), (0.95, 1, 6.314)])
def test_t_quantile_matches_the_table(p, dof, table):
    assert t_quantile(p, dof) == pytest.approx(table, rel=0.01)


def test_fewer_than_three_runs_get_the_conservative_spread():
    one = median_interval([2.0])
    assert (one.low, one.high) == pytest.approx((2.0 * (1 - DEFAULT_SPREAD_REL), 2.0 * (1 + DEFAULT_SPREAD_REL)))
    assert "assumed" in one.method
    # A larger spread seen on this workload's repeats widens it; a smaller one never narrows it.
    assert median_interval([2.0], spread_rel=0.12).high == pytest.approx(2.24)
    assert median_interval([2.0], spread_rel=0.01).high == pytest.approx(one.high)
    two = median_interval([1.0, 1.5])
    assert two.low <= 1.0 and two.high >= 1.5  # both runs inside


def test_interval_narrows_as_runs_are_added():
    runs = [1.00, 1.04, 0.96]
    three = median_interval(runs)
    nine = median_interval(runs * 3)
    assert three.low < three.median < three.high
    assert nine.high - nine.low < (three.high - three.low) / 2
    assert three.low <= median(runs) <= three.high


def test_agreeing_runs_are_moderated_by_the_workloads_typical_spread():
    identical = [2.0, 2.0, 2.0]
    assert median_interval(identical).high == pytest.approx(2.0)  # nothing to moderate with
    moderated = median_interval(identical, prior_rel_std=0.04)
    assert moderated.high > 2.0 and moderated.low < 2.0
    assert typical_rel_std([[1.0, 1.1, 0.9], [5.0], [2.0, 2.0, 2.0]]) == pytest.approx(
        median([0.1, 0.0]))


def test_assumed_spread_follows_the_typical_spread_but_not_below_the_default():
    assert assumed_spread_rel(0.0) == DEFAULT_SPREAD_REL
    assert assumed_spread_rel(0.10) > 0.10


def test_upper_bound_is_what_the_envelope_is_checked_against():
    powers = [440.0, 452.0, 446.0]
    assert median(powers) < 450.0 < median_interval(powers).high  # median within 450 W, upper bound over it
    assert median_interval([300.0]).high == pytest.approx(300.0 * (1 + DEFAULT_SPREAD_REL))


def test_the_distribution_free_bound_is_the_order_statistic_that_keeps_the_confidence():
    # P(the median lies outside [k-th lowest, k-th highest] of n runs) = 2 P(Binomial(n, 1/2) < k)
    assert distribution_free_high([1.0, 2.0, 3.0]) is None  # [min, max] of 3 covers it only 75% of the time
    assert distribution_free_high([4.0, 1.0, 3.0, 2.0]) == 4.0  # 87.5% >= 80%
    assert distribution_free_high([589.0, 655.0, 655.0, 589.0, 655.0]) == 655.0
    assert distribution_free_high([float(v) for v in range(10)]) == 7.0  # [x3, x8]: 89% (x4..x7 would be 66%)
    assert distribution_free_high([float(v) for v in range(10)], confidence=0.95) == 8.0  # [x2, x9]: 97.9%


def test_an_envelope_is_not_held_against_a_power_above_every_one_of_enough_runs():
    """Five runs all under 676 W, whose parametric interval (the other configurations' wider spread moderating
    this one's) reaches over it: within the envelope, by the highest run."""
    from joulepilot.policies.judge import Rules, judge
    from joulepilot.policies.schema import Limits

    def runs(energy, powers):
        return [Run(ok=True, energy_j_per_inference=energy * (1 + 0.001 * i), avg_power_w=w, compile_s=10.0,
                    compile_energy_j=1.0, max_rel_error=0.0, fresh_process=True) for i, w in enumerate(powers)]

    configs = [{"id": c, "label": c, "mode": "default", "precision": "bf16", "fusion": "default", "batch_size": 32}
               for c in ("close", "noisy", "low")]
    measured = {"close": runs(2.8, [589.0, 655.0, 655.0, 589.0, 655.0]),
                "noisy": runs(5.0, [300.0, 420.0, 520.0, 380.0, 610.0]),
                "low": runs(3.1, [430.0, 436.0, 440.0])}
    rules = Rules(objective="energy", expected_inferences=10_000_000, limits=Limits(max_avg_power_w=676.0))
    out = judge(configs, measured, rules)
    close = out.verdicts["close"]
    assert close.avg_power_w.high == 655.0 and "at most its highest run" in close.avg_power_w.method
    assert close.feasible and out.chosen.config_id == "close"
    assert median_interval([589.0, 655.0, 655.0, 589.0, 655.0], prior_rel_std=0.2).high > 676.0


def _entry(key, power, compile_s, mode, objective=1.0, spread=0.01):
    def interval(v):
        return None if v is None else Interval(v, v * (1 - spread), v * (1 + spread), 3, "")
    return TieEntry(key, interval(objective), interval(power), interval(compile_s), mode)


def test_tie_break_prefers_lower_average_power():
    winner, why = break_tie([_entry("a", 400, 10, "default"), _entry("b", 300, 90, "max-autotune")])
    assert (winner.key, why) == ("b", "lower average power")


def test_tie_break_goes_to_the_cheaper_compile_when_power_is_within_the_noise():
    winner, why = break_tie([_entry("a", 400, 90, "default"), _entry("b", 401, 12, "reduce-overhead")])
    assert (winner.key, why) == ("b", "cheaper compile")


def test_tie_break_then_prefers_the_simpler_mode_in_order():
    for simpler, harder in zip(MODE_SIMPLICITY, MODE_SIMPLICITY[1:], strict=False):
        winner, why = break_tie([_entry("hard", 400, 20, harder), _entry("simple", 401, 20.1, simpler)])
        assert (winner.key, why) == ("simple", "simpler mode")


def test_tie_break_falls_back_to_the_lower_median():
    winner, why = break_tie([_entry("a", 400, 20, "default", objective=1.01),
                             _entry("b", 400, 20, "default", objective=1.00)])
    assert (winner.key, why) == ("b", "lower median")


def test_flagged_runs_count_only_after_a_clean_repeat():
    flagged = Run(ok=True, flagged="window warning")
    clean = Run(ok=True)
    failed = Run(ok=False)
    assert counted([flagged]) == []
    assert counted([flagged, failed]) == []
    assert counted([flagged, clean, failed]) == [0, 1]
    advice = repeat_advice([flagged], close_call=False)
    assert advice.more == MIN_REPEATS - 1 and advice.fresh_process  # a new process, its windows the clean runs


def test_a_contender_is_measured_three_times_with_a_fresh_process_among_them():
    first = Run(ok=True, fresh_process=True)
    advice = repeat_advice([first], close_call=False)
    # One new process taking both missing windows: one more compile, not two.
    assert advice.more == MIN_REPEATS - 1 and advice.fresh_process
    second = Run(ok=True, fresh_process=True)
    third = Run(ok=True, fresh_process=False)
    assert repeat_advice([first, second, third], close_call=False).more == 0


def test_three_same_process_runs_still_need_a_fresh_one():
    runs = [Run(ok=True, fresh_process=True)] + [Run(ok=True, fresh_process=False)] * 2
    advice = repeat_advice(runs, close_call=False)
    assert advice.more == 1 and advice.fresh_process


def test_close_calls_get_more_runs_up_to_the_cap():
    runs = [Run(ok=True, fresh_process=True)] * MIN_REPEATS
    assert repeat_advice(runs, close_call=True).more == 2  # another process, two windows in it
    assert repeat_advice(runs + [Run(ok=True)], close_call=True).more == 1  # one short of the cap
    capped = [Run(ok=True, fresh_process=True)] * MAX_REPEATS
    assert repeat_advice(capped, close_call=True).more == 0
    # Failed and flagged runs count towards the cap: a noisy host cannot keep a configuration forever.
    noisy = [Run(ok=True, flagged="window warning")] * MAX_REPEATS
    assert repeat_advice(noisy, close_call=True).more == 0


def test_intervals_reject_bad_input():
    with pytest.raises(ValueError):
        median_interval([])
    with pytest.raises(ValueError):
        median_interval([1.0], confidence=1.5)
    with pytest.raises(ValueError):
        break_tie([])
    assert math.isinf(t_quantile(0.9, 0))
