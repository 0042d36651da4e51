"""Deciding a generation policy (issue 27 item 4): J per generated token amortised over expected_tokens, TPOT as
latency, the TPOT and TTFT limits, and the greedy tokens reported beside the decision."""

from __future__ import annotations

import pytest
from joulepilot.compiler import CompileConfig
from joulepilot.policies import validate
from joulepilot.policies.judge import Rules, Run, judge, run_objective

EAGER = CompileConfig("eager", precision="bf16", batch_size=1)
STATIC = CompileConfig("reduce-overhead", precision="bf16", cache="static", batch_size=1)
STATIC_B8 = STATIC.replace(batch_size=8)


def _policy(**more) -> object:
    raw = {"name": "chat", "workload": "tiny-llama", "batch_size": 1, "task": "generate", "prompt_len": 32,
           "new_tokens": 16, "search": {"modes": ["eager", "reduce-overhead"], "precisions": ["bf16"],
                                        "min_repeats": 1}}
    for key, value in more.items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    return validate(raw)


def _run(per_token: float, *, per_call: float = 100.0, tpot: float = 10.0, tpot_p95: float = 12.0,
         ttft: float = 20.0, compile_j: float = 0.0, match: bool = True, steps: int = 16, **more) -> Run:
    return Run(ok=True, energy_j_per_inference=per_call, energy_j_per_token=per_token, avg_power_w=200.0,
               peak_power_w=220.0, latency_ms_p95=tpot * 16, tpot_ms_p50=tpot, tpot_ms_p95=tpot_p95, ttft_ms_p50=ttft,
               compile_s=10.0 if compile_j else 0.0, compile_energy_j=compile_j, max_rel_error=0.01,
               energy_source="nvml", tokens_match=match, tokens_match_steps=steps, **more)


def test_energy_is_joules_per_generated_token_with_compile_amortised_over_expected_tokens():
    rules = Rules.of(_policy(objective={"expected_tokens": 1000}))
    assert (rules.generates, rules.expected_inferences, rules.unit) == (True, 1000, "J/token")
    # 0.5 J/token + 2000 J of compile over 1000 tokens; J per call plays no part
    assert run_objective(_run(0.5, compile_j=2000.0), STATIC.to_row(), rules) == pytest.approx(2.5)
    out = judge([EAGER.to_row(), STATIC.to_row()], {EAGER.id: [_run(2.4)], STATIC.id: [_run(0.6, compile_j=2000.0)]},
                rules)
    assert out.chosen.config_id == EAGER.id  # 2.6 J/token amortised over only 1000 tokens
    many = Rules.of(_policy(objective={"expected_tokens": 10_000_000}))
    out = judge([EAGER.to_row(), STATIC.to_row()], {EAGER.id: [_run(2.4)], STATIC.id: [_run(0.6, compile_j=2000.0)]},
                many)
    assert out.chosen.config_id == STATIC.id
    assert "amortised J/token" in out.reason


def test_batch_sizes_compare_in_joules_per_token_not_per_sample():
    policy = _policy(search={"batch_sizes": [8]})
    rules = Rules.of(policy)
    assert not rules.per_sample
    # per call the batch of 8 costs far more, per token far less
    out = judge([STATIC.to_row(), STATIC_B8.to_row()],
                {STATIC.id: [_run(0.6, per_call=10.0)], STATIC_B8.id: [_run(0.1, per_call=13.0)]}, rules)
    assert out.chosen.config_id == STATIC_B8.id


def test_latency_means_the_median_time_per_output_token():
    rules = Rules.of(_policy(objective={"minimize": "latency"}))
    assert run_objective(_run(0.5, tpot=3.0, tpot_p95=9.0), STATIC.to_row(), rules) == 3.0
    assert "TPOT p50" in judge([STATIC.to_row()], {STATIC.id: [_run(0.5, tpot=3.0)]}, rules).reason


def test_max_tpot_ms_holds_the_p95_and_max_ttft_ms_the_median():
    rules = Rules.of(_policy(limits={"max_tpot_ms": 10.0, "max_ttft_ms": 25.0}))
    out = judge([EAGER.to_row(), STATIC.to_row()],
                {EAGER.id: [_run(2.4, tpot=8.0, tpot_p95=11.0, ttft=15.0)],  # p95 over the limit, p50 within it
                 STATIC.id: [_run(0.6, tpot=3.0, tpot_p95=4.0, ttft=31.0)]}, rules)
    eager, static = out.verdicts[EAGER.id], out.verdicts[STATIC.id]
    assert [v.split(":")[0] for v in eager.violations] == ["max_tpot_ms"]
    assert "tpot_ms_p95 median of 1 run 11 ms > limit 10 ms" in eager.violations[0]
    assert [v.split(":")[0] for v in static.violations] == ["max_ttft_ms"]
    assert out.state == "fallback"


def test_a_run_without_the_figure_a_limit_needs_fails_it():
    rules = Rules.of(_policy(limits={"max_ttft_ms": 25.0}))
    out = judge([STATIC.to_row()], {STATIC.id: [_run(0.6, ttft=None)]}, rules)
    assert out.verdicts[STATIC.id].violations == [
        "max_ttft_ms: ttft_ms_p50 was not measured, so the limit 25 ms cannot be verified"]


def test_greedy_tokens_that_leave_eager_in_the_same_precision_are_reported_never_a_rejection():
    rules = Rules.of(_policy())
    out = judge([EAGER.to_row(), STATIC.to_row()],
                {EAGER.id: [_run(2.4)], STATIC.id: [_run(0.6, match=False, steps=5), _run(0.61, steps=16)]}, rules)
    assert out.chosen.config_id == STATIC.id
    verdict = out.verdicts[STATIC.id]
    assert (verdict.tokens_match, verdict.tokens_match_steps) == (False, 5)
    assert "its greedy tokens match eager bf16's for the first 5 steps only (reported, not a limit" in out.reason


def test_a_stored_generation_run_reads_into_the_judge_run():
    row = {"status": "ok", "energy_j_per_inference": 157.0, "energy_j_per_token": 0.615, "ttft_ms_p50": 31.1,
           "tpot_ms_p50": 2.98, "tpot_ms_p95": 3.07, "tokens_match": 0,
           "extra": '{"generation": {"tokens_match_steps": 8}}'}
    run = Run.from_row(row)
    assert (run.energy_j_per_token, run.ttft_ms_p50, run.tpot_ms_p50, run.tpot_ms_p95) == (0.615, 31.1, 2.98, 3.07)
    assert (run.tokens_match, run.tokens_match_steps) == (False, 8)
