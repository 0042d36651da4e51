"""What a workload's runs showed of a precision or a mode (`policies.judge.deferred`), read once by the guided
search (what it measures last) and by the resolver (what it proposes for measuring); and, for a guided policy,
that its decision proposes for measuring only what its search measures next.

The recorded case: torchvision's EfficientNet-B0 at batch 64 on an H200 (tests/data/heldout/), where fp16 failed
the numerical check in every mode (relative error 1.0) and the daemon's pass of session 21 still said another fp16
configuration "is predicted better and should be measured"."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from joulepilot.compiler.budget import COMPILE_OVERRUN
from joulepilot.controller import fit
from joulepilot.controller.redecide import decide_now
from joulepilot.controller.search import run_search
from joulepilot.policies import resolve, validate
from joulepilot.policies.judge import Rules, Run, deferred, judge
from joulepilot.policies.schema import Limits
from joulepilot.store import import_runs, read_export
from test_search_engine import (
    BASELINE_PREDICTIONS,
    BASELINE_RUNS,
    EAGER,
    GUIDED,
    STOCK,
    Bench,
    figures,
    prediction,
    predictor,
    row,
)

DATA = Path(__file__).parent / "data"
EFFNET = DATA / "heldout" / "gpu_sweep_h200_efficientnet_b0.json"
SWIN = "torchvision:swin_t"
SWIN_PASS = DATA / "passes" / "h200_swin_t_guided_pass.json"  # the daemon's pass of session 27, its 14 runs
LIMITS = Limits(max_rel_error=2e-2)


def _judged(runs_by_label: dict[str, list[Run]], configs: list[dict]):
    by_label = {c["label"]: c for c in configs}
    return judge(configs, {by_label[label]["id"]: runs for label, runs in runs_by_label.items()},
                 Rules(limits=LIMITS))


def test_a_precision_far_over_the_error_limit_waits_and_one_near_it_does_not():
    fp16, other_fp16, bf16 = row("reduce-overhead", "fp16"), row("default", "fp16"), row("default", "bf16")
    configs = [fp16, other_fp16, bf16]
    far = _judged({fp16["label"]: [Run(ok=True, energy_j_per_inference=1.0, avg_power_w=400, max_rel_error=1.0)]},
                  configs)
    assert deferred(other_fp16, far) == ("fp16 failed the numerical check in reduce-overhead/fp16/b8 (relative "
                                         "error 1, over 2x the limit)")
    assert deferred(bf16, far) == ""
    near = _judged({fp16["label"]: [Run(ok=True, energy_j_per_inference=1.0, avg_power_w=400,
                                        max_rel_error=0.03)]}, configs)
    assert deferred(other_fp16, near) == ""  # over the limit, but another mode may yet meet it


def test_a_mode_whose_compile_overran_waits_in_every_precision():
    slow_bf16, slow_fp16 = row("max-autotune", "bf16"), row("max-autotune", "fp16")
    out = _judged({slow_bf16["label"]: [Run(ok=False, reason=f"{COMPILE_OVERRUN}: 240 s")]},
                  [slow_bf16, slow_fp16, row("default", "bf16")])
    assert slow_bf16["label"] in deferred(slow_fp16, out) and "compile overran the budget" in deferred(slow_fp16, out)
    assert deferred(row("default", "bf16"), out) == ""


def test_the_search_measures_another_precision_before_the_one_that_failed():
    """The forecast ranks the two fp16 configurations first; the first of them fails the check, so bf16 is
    measured before the second fp16 one, whose step says why it came later."""
    ro16, d16, ro_bf16 = row("reduce-overhead", "fp16"), row("default", "fp16"), row("reduce-overhead", "bf16")
    table = {**BASELINE_RUNS, ro16["label"]: [figures(0.40, 380, err=1.0)],
             d16["label"]: [figures(0.42, 360, err=1.0)], ro_bf16["label"]: [figures(0.60, 400, err=1e-2)]}
    predictions = {**BASELINE_PREDICTIONS, ro16["label"]: prediction(0.30, 380, sd_rel=0.3),
                   d16["label"]: prediction(0.32, 360, sd_rel=0.3), ro_bf16["label"]: prediction(0.5, 400, sd_rel=0.3)}
    bench = Bench(table)
    run_search([EAGER, STOCK, ro16, d16, ro_bf16], bench, predictor(predictions), rules=Rules(limits=LIMITS),
               settings=GUIDED)
    fresh = [label for label, is_fresh in bench.calls if is_fresh]
    assert fresh.index(ro16["label"]) < fresh.index(ro_bf16["label"])
    assert d16["label"] not in fresh[:fresh.index(ro_bf16["label"])]


def test_the_resolver_does_not_propose_a_precision_that_failed_on_this_workload(db, tmp_path):
    records = read_export(EFFNET)
    for path in sorted(DATA.glob("*.json")):  # the other workloads, for the trade-off model
        import_runs(db, read_export(path))
    model = fit(db)
    kept = {"eager/fp32/b64", "reduce-overhead/fp16/b64", "reduce-overhead/bf16/b64"}
    import_runs(db, [r for r in records if r["config"]["label"] in kept])
    policy = validate({"name": "effnet", "workload": "torchvision:efficientnet_b0", "batch_size": 64,
                       "objective": {"minimize": "energy", "expected_inferences": 10_000_000},
                       "limits": {"max_rel_error": 2e-2},
                       "search": {"modes": ["eager", "default", "reduce-overhead"], "precisions": ["fp16", "bf16"],
                                  "fusion": ["default", "no-epilogue-fusion"], "min_repeats": 1}})
    decision = resolve(policy, db, "NVIDIA H200", model, torch_version="2.11")
    assert decision.config["label"] == "reduce-overhead/bf16/b64"
    fp16_unmeasured = [c for c in decision.candidates if c.config["precision"] == "fp16" and c.source == "predicted"]
    assert fp16_unmeasured
    for cand in fp16_unmeasured:
        assert cand.status != "proposed"
        assert any(r.startswith("not proposed for measuring: fp16 failed the numerical check in "
                                "reduce-overhead/fp16/b64") for r in cand.reasons), cand.reasons
    assert "fp16" not in (decision.proposed or {}).get("precision", "")
    assert "fp16" not in decision.reason.split("within every limit", 1)[1]
    # The same store without the failed run: an fp16 configuration is what the model proposes.
    db.execute("DELETE FROM runs WHERE config_id IN (SELECT id FROM configs WHERE label = ?)",
               ["reduce-overhead/fp16/b64"])
    again = resolve(dataclasses.replace(policy), db, "NVIDIA H200", model, torch_version="2.11")
    assert again.proposed is not None and again.proposed["precision"] == "fp16"


def test_a_numerical_failure_in_a_flagged_run_still_tells_the_forecast_about_its_precision():
    """The recorded EfficientNet-B0 replay: the first fp16 run failed the check (relative error 1.0) in a window
    bench flagged "repeat this run". The flag says the run's energy and pace may be off, not its output, so the
    forecast of every other fp16 configuration carries that error and none of them is measured; before, a
    flagged run was left out of the error forecast and another fp16 configuration was measured (27 s of
    the replay at seed 0 under the p50 envelope)."""
    ro16, d16, ro_bf16 = row("reduce-overhead", "fp16"), row("default", "fp16"), row("reduce-overhead", "bf16")
    table = {**BASELINE_RUNS, ro16["label"]: [figures(0.40, 380, err=1.0, flagged="energy window 2x slower")],
             d16["label"]: [figures(0.42, 360, err=1.0)], ro_bf16["label"]: [figures(0.60, 400, err=1e-2)]}
    predictions = {**BASELINE_PREDICTIONS, ro16["label"]: prediction(0.30, 380, sd_rel=0.3),
                   d16["label"]: prediction(0.32, 360, sd_rel=0.3), ro_bf16["label"]: prediction(0.5, 400, sd_rel=0.3)}
    bench = Bench(table)
    result = run_search([EAGER, STOCK, ro16, d16, ro_bf16], bench, predictor(predictions),
                        rules=Rules(limits=LIMITS), settings=GUIDED)
    measured = {label for label, _ in bench.calls}
    assert ro16["label"] in measured and ro_bf16["label"] in measured and d16["label"] not in measured
    (skipped,) = [s for s in result.skipped if s.label == d16["label"]]
    assert skipped.reason.startswith("predicted relative error 1 +- ") and "max_rel_error 0.02" in skipped.reason
    assert skipped.p_feasible is not None and skipped.p_feasible < 0.01


def _measured(record: dict) -> bool:
    extra = record["run"].get("extra") or {}
    return not (json.loads(extra) if isinstance(extra, str) else extra).get("synthetic")


def test_a_guided_policy_proposes_only_what_its_search_measures_next(db):
    """The recorded Swin-T pass (H200, session 27; benchmarks/guided_daemon_gpu.sh): the search stopped, nothing
    left could beat reduce-overhead/bf16 by more than the 2% tolerance, yet the decision the daemon stored said
    that reduce-overhead/fp16 "is predicted better and should be measured": the resolver proposed by its own
    rule (the trade-off model's mean below the chosen one's) what the search had skipped. The grid puts
    reduce-overhead/fp16 4.7% above reduce-overhead/bf16."""
    for path in [*sorted(DATA.glob("*.json")), *sorted((DATA / "heldout").glob("*.json"))]:
        import_runs(db, [r for r in read_export(path) if r["workload"]["spec"] != SWIN and _measured(r)])
    model = fit(db)  # as the daemon's pass model: fitted before the pass measured anything of Swin-T
    import_runs(db, read_export(SWIN_PASS))
    policy = validate({"name": "guided_swin", "workload": SWIN, "batch_size": 32,
                       "objective": {"minimize": "energy", "expected_inferences": 10_000_000},
                       "limits": {"max_rel_error": 2e-2},
                       "search": {"strategy": "guided", "modes": ["default", "eager", "reduce-overhead"],
                                  "precisions": ["bf16", "fp16", "fp32", "tf32"],
                                  "fusion": ["default", "no-epilogue-fusion"]}})
    alone = resolve(policy, db, "NVIDIA H200", model, torch_version="2.11")
    assert alone.proposed is not None and alone.proposed["label"] == "reduce-overhead/fp16/b32"

    decided, plan = decide_now(db, policy, "NVIDIA H200", model, decided_by="daemon", torch_version="2.11",
                               record=False, lock=False)
    assert plan.done and plan.stop_reason.startswith("nothing left that could beat the chosen configuration")
    decision = decided.decision
    assert (decision.state, decision.label) == ("verified", "reduce-overhead/bf16/b32")
    assert decision.proposed is None
    assert not [c.label for c in decision.candidates if c.status == "proposed"]
    assert "should be measured" not in decision.reason and "measures" not in decision.reason

    # Before its last three jobs (reduce-overhead/tf32 and the two warm-started repeats) the search was under way:
    # the decision proposes the configuration it measured next, and says so.
    db.execute("DELETE FROM runs WHERE warm_start_s IS NOT NULL OR config_id IN "
               "(SELECT id FROM configs WHERE label = 'reduce-overhead/tf32/b32')")
    decided, plan = decide_now(db, policy, "NVIDIA H200", model, decided_by="daemon", torch_version="2.11",
                               record=False, lock=False)
    assert [(n.kind, n.config.label) for n in plan.next] == [("guided", "reduce-overhead/tf32/b32")]
    assert decided.decision.proposed["label"] == "reduce-overhead/tf32/b32"
    assert decided.decision.reason.endswith("; the guided search measures reduce-overhead/tf32/b32 next")
