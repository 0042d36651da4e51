"""Replay recorded sweeps through the resolver: the decisions must respect MEASURED limits.

Parameterised by file: the synthetic sweep always, plus every real GPU sweep committed as
tests/data/gpu_sweep_<device>.json (run exchange format).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from collections import Counter
from pathlib import Path

import pytest
from joulepilot.compiler.workloads import workload_id
from joulepilot.controller import fit
from joulepilot.controller.features import device_kind
from joulepilot.policies import resolve, torch_minor, validate
from joulepilot.store import import_runs, list_runs, read_export

DATA = Path(__file__).parent / "data"
SWEEPS = [DATA / "synthetic_sweep.json", *sorted(DATA.glob("gpu_sweep_*.json"))]


@pytest.fixture(params=SWEEPS, ids=lambda p: p.name)
def sweep(request, db):
    import_runs(db, read_export(request.param))
    return db


def _ints(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _ints(v)
    elif isinstance(value, list):
        for v in value:
            yield from _ints(v)
    elif isinstance(value, int) and not isinstance(value, bool):
        yield value


def _shape(row):
    """seq_len / image_size that reproduce the workload's id (they are not stored as columns)."""
    try:
        found = set(_ints(json.loads(row["inputs"] or "{}")))
    except ValueError:
        found = set()
    options = [None, *sorted(found)]
    for seq_len, image_size in itertools.product(options, options):
        if workload_id(row["spec"], row["batch_size"], seq_len, image_size) == row["id"]:
            return seq_len, image_size
    pytest.skip(f"cannot reproduce the id of workload {row['spec']}")


def _cases(db):
    """(workload row, device kind, torch minor, ok runs) for each workload/device/torch in the store."""
    runs = list_runs(db, status="ok")
    groups = Counter((r["workload_id"], device_kind(r), torch_minor(r["torch_version"])) for r in runs)
    for (wid, kind, tv), n in groups.items():
        if n < 3:
            continue
        row = next(iter(db.query("SELECT * FROM workloads WHERE id = ?", [wid])))
        mine = [r for r in runs if r["workload_id"] == wid and device_kind(r) == kind
                and torch_minor(r["torch_version"]) == tv]
        yield row, kind, tv, mine


def _policy(row, runs, **sections):
    seq_len, image_size = _shape(row)
    raw = {
        "name": "replay", "workload": row["spec"], "batch_size": row["batch_size"],
        "objective": {"minimize": "energy", "expected_inferences": 10_000_000},
        "search": {"modes": sorted({r["mode"] for r in runs}), "precisions": sorted({r["precision"] for r in runs}),
                   "fusion": sorted({r["fusion"] for r in runs})},
        "fallback": {"mode": "eager"},
    }
    if seq_len:
        raw["seq_len"] = seq_len
    if image_size:
        raw["image_size"] = image_size
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return validate(raw)


def _measured(decision, figure):
    chosen = next(c for c in decision.candidates if c.status == "chosen")
    return chosen.figures[figure]


def _applies_measured(decision) -> bool:
    """The decision applies the measured configuration it chose: `verified` when its repeats confirm it,
    `provisional` on fewer runs (most configurations of a recorded sweep were measured once or twice)."""
    chosen = next((c for c in decision.candidates if c.status == "chosen"), None)
    return (decision.state in ("verified", "provisional") and chosen is not None
            and chosen.source == "measured" and chosen.config_id == decision.config_id)


def test_power_envelope_below_the_fastest_config(sweep):
    checked = 0
    for row, kind, tv, runs in _cases(sweep):
        fastest = min(runs, key=lambda r: r["latency_ms_p95"])
        envelope = fastest["avg_power_w"] * 0.9
        if not any(r["avg_power_w"] <= envelope for r in runs):
            continue
        decision = resolve(_policy(row, runs, limits={"max_avg_power_w": envelope}), sweep, kind, torch_version=tv)
        assert _applies_measured(decision), decision.reason
        assert _measured(decision, "avg_power_w") <= envelope
        assert decision.config_id != fastest["config_id"]
        rejected = [c for c in decision.candidates if c.status == "rejected" and c.source == "measured"
                    and c.figures.get("avg_power_w") is not None]
        assert rejected and all("max_avg_power_w" in " ".join(c.reasons) for c in rejected)
        checked += 1
    assert checked


def test_tight_tolerance_refuses_bf16_over_the_error(sweep):
    checked = 0
    for row, kind, tv, runs in _cases(sweep):
        bf16_errors = [r["max_rel_error"] for r in runs if r["precision"] == "bf16" and r["max_rel_error"] is not None]
        if not bf16_errors:
            continue
        tolerance = min(bf16_errors) / 2
        decision = resolve(_policy(row, runs, limits={"max_rel_error": tolerance}), sweep, kind, torch_version=tv)
        assert decision.config["precision"] != "bf16"
        for cand in decision.candidates:
            err = cand.figures.get("max_rel_error")
            if cand.source == "measured" and err is not None and err > tolerance:
                assert cand.status == "rejected"
                assert any(r.startswith("max_rel_error: measured") for r in cand.reasons)
        if _applies_measured(decision):
            assert _measured(decision, "max_rel_error") <= tolerance
        checked += 1
    assert checked


def test_few_expected_inferences_prefer_cheap_compiles(sweep):
    checked = 0
    for row, kind, tv, runs in _cases(sweep):
        if not any(r["mode"] == "eager" for r in runs) or not any(r["mode"] != "eager" for r in runs):
            continue
        few = resolve(_policy(row, runs, objective={"expected_inferences": 100}), sweep, kind, torch_version=tv)
        many = resolve(_policy(row, runs, objective={"expected_inferences": 10**10}), sweep, kind, torch_version=tv)
        assert _applies_measured(few) and _applies_measured(many)
        assert few.config["mode"] == "eager"
        assert (_measured(few, "compile_energy_j") or 0) <= min(r["compile_energy_j"] or 0 for r in runs
                                                                 if r["mode"] != "eager")
        if min(r["energy_j_per_inference"] for r in runs if r["mode"] != "eager") < \
                min(r["energy_j_per_inference"] for r in runs if r["mode"] == "eager"):
            assert many.config["mode"] != "eager"
            assert many.break_even_inferences is not None and 0 < many.break_even_inferences < math.inf
        checked += 1
    assert checked


def test_nothing_feasible_falls_back_with_the_reason(sweep):
    row, kind, tv, runs = next(_cases(sweep))
    decision = resolve(_policy(row, runs, limits={"max_p95_latency_ms": 1e-6}), sweep, kind, torch_version=tv)
    assert decision.state == "fallback"
    assert decision.config["mode"] == "eager" and decision.config["precision"] == "fp32"
    assert "max_p95_latency_ms" in decision.reason
    # Every measured candidate is rejected; the policy's grid may also hold combinations the sweep never
    # measured (a fusion preset swept under one mode only), which stay unknown and are never applied.
    assert all(c.status == "rejected" for c in decision.candidates if c.source == "measured")
    assert all(c.status in ("rejected", "unknown") for c in decision.candidates)


def test_prediction_only_candidate_is_provisional_never_verified(sweep):
    row, kind, tv, runs = next(_cases(sweep))
    target = next(r for r in runs if r["mode"] != "eager")
    model = fit(sweep)  # fitted while the target is still measured: predictions are informed
    sweep.execute("DELETE FROM runs WHERE config_id = ? AND workload_id = ?", [target["config_id"], row["id"]])
    policy = _policy(row, runs)
    policy = dataclasses.replace(policy, search=dataclasses.replace(
        policy.search, modes=(target["mode"],), precisions=(target["precision"],), fusion=(target["fusion"],)))
    decision = resolve(policy, sweep, kind, model, torch_version=tv)
    assert decision.state == "provisional"
    assert decision.proposed["id"] == target["config_id"]
    assert decision.config["mode"] == "eager"  # the fallback stays applied until it is measured
    (cand,) = decision.candidates
    assert cand.source == "predicted" and cand.status == "proposed"
    assert all(math.isfinite(m) and math.isfinite(s) for m, s in cand.predicted.values())

    # with measured feasible candidates too, a predicted one is never the applied (chosen) config
    full = resolve(_policy(row, runs), sweep, kind, model, torch_version=tv)
    assert _applies_measured(full)
    assert all(c.source == "measured" for c in full.candidates if c.status == "chosen")
    assert full.config_id != target["config_id"]


def test_decision_reports_break_even_against_eager(sweep):
    row, kind, tv, runs = next(_cases(sweep))
    decision = resolve(_policy(row, runs), sweep, kind, torch_version=tv)
    # Every repeat counts: eager fp32's figure is the median over all its ok runs, not the latest one.
    eager_runs = [r["energy_j_per_inference"] for r in runs if r["mode"] == "eager" and r["precision"] == "fp32"]
    eager = {"energy_j_per_inference": statistics.median(eager_runs)}
    assert decision.eager_energy_j_per_inference == pytest.approx(eager["energy_j_per_inference"])
    chosen = next(c for c in decision.candidates if c.status == "chosen")
    if chosen.config["mode"] != "eager" and chosen.figures["energy_j_per_inference"] < eager["energy_j_per_inference"]:
        expected = chosen.figures["compile_energy_j"] / (eager["energy_j_per_inference"]
                                                         - chosen.figures["energy_j_per_inference"])
        assert decision.break_even_inferences == pytest.approx(expected)


def test_configs_that_broke_a_deployment_envelope_are_excluded(sweep):
    checked = 0
    for row, kind, tv, runs in _cases(sweep):
        policy = _policy(row, runs)
        first = resolve(policy, sweep, kind, torch_version=tv)
        if not _applies_measured(first):
            continue
        second = resolve(policy, sweep, kind, torch_version=tv, exclude={first.config_id})
        assert second.config_id != first.config_id
        excluded = next(c for c in second.candidates if c.config["id"] == first.config_id)
        assert excluded.status == "rejected"
        assert any("envelope guard" in r for r in excluded.reasons)
        checked += 1
    assert checked
