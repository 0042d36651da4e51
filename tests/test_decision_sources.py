"""Figures from different energy sources are never ranked against each other (`policies.sources`): the
resolver, the guided search's decision and the tuning bill compare candidates on runs of one source, the most
trustworthy one with a candidate within the limits; the others are listed as not compared, with why. Real
SQLite stores seeded with runs (`decision_factories.seed_runs`); nothing is compiled."""

from __future__ import annotations

from decision_factories import config, seed_rounds, seed_runs, write_policy
from joulepilot.controller.guided import plan_guided, search_settings
from joulepilot.controller.search import GuidedSearch
from joulepilot.policies import load_policy, resolve
from joulepilot.policies.bill import tuning_bill
from joulepilot.policies.judge import Rules, Run
from joulepilot.store.runs import workload_runs

EAGER32, EAGER16, DEF32, DEF16 = ("eager", "fp32"), ("eager", "bf16"), ("default", "fp32"), ("default", "bf16")
ESTIMATES = "its energy figures are estimates"


def _fig(energy_j: float, power_w: float, source: str) -> dict:
    return {"energy_j_per_inference": energy_j, "avg_power_w": power_w, "energy_source": source}


def _policy(tmp_path, limit_w: float = 1000.0):
    return load_policy(write_policy(tmp_path / "policies", limit_w=limit_w))


def _cand(decision, key):
    return next(c for c in decision.candidates if c.config_id == config(*key).id)


def _search(db, policy) -> GuidedSearch:
    """The guided search engine over the policy's grid, with every stored run of it as its prior."""
    from joulepilot.policies import torch_minor
    from joulepilot.policies.resolve import candidate_configs, policy_workload_id

    grid = candidate_configs(policy)
    prior: dict[str, list[Run]] = {}
    for run in reversed(workload_runs(db, policy_workload_id(policy), "cpu", torch_minor())):
        prior.setdefault(run.config_id, []).append(Run.from_row(run))

    def never(config, fresh_process):
        raise AssertionError("the test only decides")

    return GuidedSearch(grid, never, None, rules=Rules.of(policy), settings=search_settings(policy), prior=prior)


def _rapl_and_cheaper_estimate(db) -> None:
    # eager fp32 metered by RAPL; eager bf16 only estimated, and its estimate looks far cheaper.
    seed_rounds(db, {EAGER32: _fig(1.0, 20.0, "rapl"), EAGER16: _fig(0.3, 10.0, "estimate")})


def test_a_rapl_configuration_is_decided_over_a_cheaper_looking_estimate(tmp_path, db):
    _rapl_and_cheaper_estimate(db)
    decision = resolve(_policy(tmp_path), db, "cpu")
    rapl, estimate = _cand(decision, EAGER32), _cand(decision, EAGER16)
    assert decision.config_id == rapl.config_id and decision.state == "verified"
    assert decision.ranked_source == "rapl" and decision.measured["energy_source"] == "rapl"
    assert rapl.status == "chosen"
    # Listed, with its own figures labelled, but not compared.
    assert estimate.status == "uncompared" and estimate.figures["energy_source"] == "estimate"
    assert estimate.score < rapl.score
    assert estimate.reasons[0] == "not compared: measured with estimate; the decision ranks rapl runs"
    assert (f"1 candidate measured only with estimate ({estimate.label}) is not compared: the decision ranks "
            f"rapl runs") in decision.reason
    assert ESTIMATES not in decision.reason
    assert decision.contenders == [rapl.config_id] and "only measured configuration" in decision.confidence


def test_an_all_estimate_decision_decides_among_them_and_says_so(tmp_path, db):
    seed_rounds(db, {EAGER32: _fig(1.0, 20.0, "estimate"), EAGER16: _fig(0.3, 10.0, "estimate")})
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert decision.config_id == config(*EAGER16).id and decision.state == "verified"
    assert ESTIMATES in decision.reason and "not measurements" in decision.reason
    assert decision.ranked_source == "estimate" and decision.measured["energy_source"] == "estimate"
    assert _cand(decision, EAGER32).status == "kept"
    assert not [c for c in decision.candidates if c.status == "uncompared"]


def test_a_measured_source_within_the_limits_wins_even_when_an_estimate_draws_less(tmp_path, db):
    # The envelope is checked within one source too: RAPL's eager fp32 fits 25 W; the estimate's eager bf16
    # fits as well and looks cheaper, but the decision ranks RAPL runs.
    seed_rounds(db, {EAGER32: _fig(1.0, 20.0, "rapl"), EAGER16: _fig(0.3, 5.0, "estimate")})
    decision = resolve(_policy(tmp_path, limit_w=25.0), db, "cpu")
    assert decision.config_id == config(*EAGER32).id and decision.ranked_source == "rapl"


def test_an_estimate_within_the_limits_is_ranked_when_no_measurement_is(tmp_path, db):
    # Every RAPL configuration breaks the 15 W envelope; the estimated one fits: the decision ranks estimates
    # (and says so), and the RAPL one is listed as not compared rather than as over the envelope.
    seed_rounds(db, {EAGER32: _fig(1.0, 20.0, "rapl"), EAGER16: _fig(0.3, 10.0, "estimate")})
    decision = resolve(_policy(tmp_path, limit_w=15.0), db, "cpu")
    rapl = _cand(decision, EAGER32)
    assert decision.config_id == config(*EAGER16).id and rapl.status == "uncompared"
    assert rapl.reasons[0] == "not compared: measured with rapl; the decision ranks estimate runs"
    assert ESTIMATES in decision.reason and decision.ranked_source == "estimate"


def test_the_infeasible_pick_is_the_lowest_power_of_the_runs_ranked(tmp_path, db):
    # Nothing fits 5 W: the lowest-power RAPL configuration is applied, not the estimate that claims less power.
    seed_rounds(db, {EAGER32: _fig(1.0, 30.0, "rapl"), DEF32: _fig(0.8, 20.0, "rapl"),
                     EAGER16: _fig(0.3, 8.0, "estimate")})
    decision = resolve(_policy(tmp_path, limit_w=5.0), db, "cpu")
    assert decision.state == "infeasible" and decision.config_id == config(*DEF32).id
    assert _cand(decision, EAGER16).status == "uncompared" and decision.ranked_source == "rapl"
    assert "exceeds" in decision.confidence and "not compared" in decision.reason


def test_a_configurations_runs_of_another_source_are_not_counted(tmp_path, db):
    # eager fp32: one RAPL run, then two estimated ones after RAPL became unreadable. Its median rests on the
    # RAPL run alone, and one run is not the three a verified decision needs.
    seed_runs(db, {EAGER32: _fig(1.0, 20.0, "rapl")})
    seed_rounds(db, {EAGER32: _fig(0.2, 5.0, "estimate")}, rounds=2)
    decision = resolve(_policy(tmp_path), db, "cpu")
    chosen = _cand(decision, EAGER32)
    assert decision.config_id == chosen.config_id
    assert chosen.repeats == 1 and chosen.median == 1.0 and chosen.figures["energy_source"] == "rapl"
    assert chosen.figures["avg_power_w"] == 20.0
    assert "2 runs metered by estimate not counted: the decision ranks rapl runs" in chosen.notes
    assert decision.state == "provisional" and "it has 1 of the 3 runs a verified decision needs" in decision.reason
    assert decision.ranked_source == "rapl"


def test_break_even_is_against_eager_metered_by_the_same_source(tmp_path, db):
    # eager fp32 is only estimated; default fp32 (RAPL) has no eager baseline of its own source.
    seed_rounds(db, {EAGER32: _fig(2.0, 20.0, "estimate"), DEF32: _fig(1.0, 20.0, "rapl")})
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert decision.config_id == config(*DEF32).id
    assert decision.eager_energy_j_per_inference is None
    assert decision.break_even_inferences is None and decision.break_even_never is False


def test_the_bills_baseline_counts_its_runs_of_the_applied_source(tmp_path, db):
    # Stock compile (default fp32, the baseline) has RAPL runs and older estimated ones; default bf16 (RAPL)
    # is applied. The saving is RAPL against RAPL.
    seed_rounds(db, {DEF32: _fig(0.1, 20.0, "estimate")}, rounds=2)
    seed_rounds(db, {DEF32: _fig(1.0, 20.0, "rapl"), DEF16: _fig(0.6, 20.0, "rapl")})
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert decision.config_id == config(*DEF16).id
    bill = tuning_bill(db, decision)
    assert bill["baseline"]["source"] == "rapl" and bill["baseline"]["runs"] == 3
    assert bill["baseline"]["energy_j_per_inference"] == 1.0
    assert bill["verdict"] == "pays_back" and bill["saving_source"] == "rapl"
    assert abs(bill["saving_j_per_inference"] - 0.4) < 1e-9


def test_the_search_engine_decides_within_one_source(tmp_path, db):
    _rapl_and_cheaper_estimate(db)
    policy = _policy(tmp_path)
    search = _search(db, policy)
    out = search.judgement()
    state, chosen, reason = out.state, out.chosen, out.reason
    assert state == "verified" and chosen.config_id == config(*EAGER32).id and chosen.source == "rapl"
    estimate = out.verdicts[config(*EAGER16).id]
    assert estimate.source == "estimate" and estimate.objective.median < chosen.objective.median
    assert estimate.not_compared == "not compared: measured with estimate; the decision ranks rapl runs"
    assert "is not compared: the decision ranks rapl runs" in reason and ESTIMATES not in reason
    assert [m.config_id for m in out.ties] == [chosen.config_id]
    result = search.result("test")
    assert {m.config_id: m.status for m in result.measured}[estimate.config_id] == "uncompared"

    # The daemon's plan, resumed from the same store, agrees with the resolver.
    plan = plan_guided(db, policy, "cpu")
    by_id = {m["config_id"]: m for m in plan.measured}
    assert plan.state == resolve(policy, db, "cpu").state == "verified"
    assert by_id[config(*EAGER32).id]["status"] == "chosen" and by_id[config(*EAGER32).id]["energy_source"] == "rapl"
    assert by_id[config(*EAGER16).id]["status"] == "uncompared"


def test_the_search_engine_decides_among_estimates_and_says_so(tmp_path, db):
    seed_rounds(db, {EAGER32: _fig(1.0, 20.0, "estimate"), EAGER16: _fig(0.3, 10.0, "estimate")})
    out = _search(db, _policy(tmp_path)).judgement()
    state, chosen, reason = out.state, out.chosen, out.reason
    assert state == "verified" and chosen.config_id == config(*EAGER16).id
    assert ESTIMATES in reason and "not compared" not in reason


def test_the_search_engine_counts_only_runs_of_the_source_ranked(tmp_path, db):
    seed_runs(db, {EAGER32: _fig(1.0, 20.0, "rapl")})
    seed_rounds(db, {EAGER32: _fig(0.2, 5.0, "estimate")}, rounds=2)
    out = _search(db, _policy(tmp_path)).judgement()
    state, chosen, reason = out.state, out.chosen, out.reason
    assert chosen.config_id == config(*EAGER32).id and chosen.objective.median == 1.0
    assert chosen.objective.n == 1 and chosen.avg_power_w.median == 20.0
    assert state == "provisional" and "1 of the 3 runs" in reason


def test_a_partly_estimated_window_ranks_above_a_whole_estimate_and_says_so(tmp_path, db):
    # eager fp32's windows were metered partly by NVML and partly estimated ('estimate+nvml' as a window joins
    # them); eager bf16 was wholly estimated. The decision ranks the partly metered runs.
    seed_rounds(db, {EAGER32: _fig(1.0, 20.0, "estimate+nvml"), EAGER16: _fig(0.3, 10.0, "estimate")})
    decision = resolve(_policy(tmp_path), db, "cpu")
    assert decision.config_id == config(*EAGER32).id and _cand(decision, EAGER16).status == "uncompared"
    assert "its energy figures are partly estimated (nvml+estimate)" in decision.reason
    assert decision.ranked_source == "nvml+estimate"
