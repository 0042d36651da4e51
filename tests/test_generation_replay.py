"""The judge on recorded generation runs: the H200 runs of `benchmarks/generation_energy.py` and of the daemon's
guided pass (tests/data/generation/, sessions 13, 15 and 16, torch 2.11) decided again from a real SQLite store, for
the policy the daemon ran (llama at prompt 512 / 256 new tokens, bf16, eager/default/reduce-overhead, batch 1 or
8), with its 200 W envelope and without it."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from joulepilot.policies import resolve, validate
from joulepilot.policies.bill import tuning_bill
from joulepilot.store import import_runs, list_runs, read_export

DATA = Path(__file__).parent / "data" / "generation"
LLAMA_OPTIONS = {"hidden_size": 1536, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 12,
                 "num_key_value_heads": 4, "vocab_size": 32000}  # benchmarks/generation_energy.py's llama


@pytest.fixture
def h200(db):
    for path in sorted(DATA.glob("*.json")):
        import_runs(db, read_export(path))
    return db


def _policy(**limits):
    return validate({
        "name": "llama-chat", "workload": "transformers:LlamaConfig", "task": "generate", "batch_size": 1,
        "prompt_len": 512, "new_tokens": 256, "model_options": LLAMA_OPTIONS,
        "objective": {"minimize": "energy", "expected_tokens": 100_000_000},
        "limits": limits,
        "search": {"modes": ["eager", "default", "reduce-overhead"], "precisions": ["bf16"], "batch_sizes": [1, 8]},
    })


def _medians(db):
    """label -> (median J/token, highest average power of a run, runs) of the policy's configurations in the store
    (the data also holds batch 32, which the policy's `batch_sizes` leave out)."""
    by_label: dict[str, list[tuple[float, float]]] = {}
    for run in list_runs(db, status="ok"):
        if run["workload"] == "transformers:LlamaConfig" and run["precision"] == "bf16" and not run["dynamic"] \
                and run["mode"] in ("eager", "default", "reduce-overhead") and run["batch_size"] in (1, 8):
            by_label.setdefault(run["config_label"], []).append((run["energy_j_per_token"], run["avg_power_w"]))
    return {label: (statistics.median(j for j, _ in v), max(w for _, w in v), len(v)) for label, v in by_label.items()}


def test_under_the_200_w_envelope_the_recorded_runs_decide_what_the_daemon_decided(h200):
    decision = resolve(_policy(max_avg_power_w=200), h200, "NVIDIA H200", torch_version="2.11")
    assert decision.state == "verified", decision.reason
    chosen = next(c for c in decision.candidates if c.status == "chosen")
    assert chosen.label == "default/static-cache/bf16/b8"
    assert chosen.figures["avg_power_w"] <= 200
    # every reduce-overhead configuration drew more than the envelope and is rejected for it
    rejected = [c for c in decision.candidates if c.status == "rejected" and c.source == "measured"]
    assert {c.label for c in rejected} >= {"reduce-overhead/static-cache/bf16/b1", "reduce-overhead/static-cache/bf16/b8"}
    assert all("max_avg_power_w" in " ".join(c.reasons) for c in rejected)
    # and among the configurations whose every run was under 200 W, the chosen one has the lowest median J/token
    medians = _medians(h200)
    within = {label: j for label, (j, peak_avg_w, _) in medians.items() if peak_avg_w <= 200}
    assert min(within, key=within.__getitem__) == chosen.label
    assert chosen.figures["energy_j_per_token"] == pytest.approx(within[chosen.label])


def test_without_the_envelope_reduce_overhead_at_batch_8_is_chosen(h200):
    decision = resolve(_policy(), h200, "NVIDIA H200", torch_version="2.11")
    chosen = next(c for c in decision.candidates if c.status == "chosen")
    assert chosen.label == "reduce-overhead/static-cache/bf16/b8"
    # measured once: a choice the runs support, not yet a verified one
    assert decision.state == "provisional" and "1 of the 3 runs" in decision.reason
    eager_b8 = next(c for c in decision.candidates if c.label == "eager/bf16/b8")
    assert chosen.figures["energy_j_per_token"] < 0.5 * eager_b8.figures["energy_j_per_token"]


def test_the_bill_of_a_bf16_generation_policy_pays_back_against_eager_bf16(h200):
    # The policy allows no fp32, so neither fp32 baseline is measured: the payback is counted against eager bf16 at
    # the policy's batch size, for as many sequences as one call of the decided batch of 8.
    decision = resolve(_policy(max_avg_power_w=200), h200, "NVIDIA H200", torch_version="2.11")
    bill = tuning_bill(h200, decision)
    assert bill["baseline"]["kind"] == "eager bf16 at batch 1, for 8 samples" and bill["verdict"] == "pays_back"
    eager_b1 = next(c for c in decision.candidates if c.label == "eager/bf16/b1")
    saving = 8 * eager_b1.figures["energy_j_per_inference"] - decision.measured["energy_j_per_inference"]
    assert bill["saving_j_per_inference"] == pytest.approx(saving)
    assert "against eager bf16 at batch 1, for 8 samples (nvml)" in bill["text"]
