"""Applying and metering a generation (issue 27 item 5): `joulepilot.compile` prepares a causal LM's `generate` with
the decided configuration, meters the tokens it generates, and reports, exports and guards them."""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from joulepilot.compiler import CompileConfig, load_workload, workload_id
from joulepilot.compiler.generation import fixed_length_generate, generated_tokens
from joulepilot.compiler.generation_workloads import Generation
from joulepilot.policies import load_policy, resolve, torch_minor
from joulepilot.policies.resolve import record_decision
from joulepilot.runtime import attach
from joulepilot.runtime.guard import EnvelopeGuard
from joulepilot.store import insert_run, open_db, upsert_config, upsert_host, upsert_workload
from joulepilot.store.deployments import get_deployment, read_samples

import joulepilot
from joulepilot.cli import main

PROMPT, NEW, BATCH = 12, 6, 2
GENERATION = Generation(PROMPT, NEW)
STATIC = CompileConfig("default", cache="static", batch_size=BATCH)
EAGER = CompileConfig("eager", batch_size=BATCH)
POLICY = f"""name = "chat"
workload = "tiny-llama"
batch_size = {BATCH}
task = "generate"
prompt_len = {PROMPT}
new_tokens = {NEW}
[model_options]
num_hidden_layers = 1
[search]
modes = ["eager", "default"]
min_repeats = 1
"""


def _tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    workload = load_workload("tiny-llama", BATCH, generation=GENERATION, model_options={"num_hidden_layers": 1})
    return workload.model, workload.example_inputs[0]


@pytest.fixture
def decided(tmp_path: Path, dynamo_reset) -> tuple[Path, Path]:
    """A policy file and a store whose decision is the static-cache compile (it measured fewer J per token)."""
    policy_path = tmp_path / "chat.toml"
    policy_path.write_text(POLICY)
    db_path = tmp_path / "jp.db"
    db = open_db(db_path)
    upsert_host(db, {"id": "host", "hostname": "box"})
    wid = upsert_workload(db, {"id": workload_id("tiny-llama", BATCH, model_options={"num_hidden_layers": 1},
                                                 generation=GENERATION), "spec": "tiny-llama", "batch_size": BATCH,
                               "task": "generate", "prompt_len": PROMPT, "new_tokens": NEW})
    for config, per_token in ((EAGER, 0.02), (STATIC, 0.01)):
        upsert_config(db, config.to_row())
        insert_run(db, {"workload_id": wid, "config_id": config.id, "host_id": "host", "device": "cpu",
                        "status": "ok", "started_at": time.time() - 60, "finished_at": time.time() - 30,
                        "energy_j_per_inference": per_token * BATCH * NEW, "energy_j_per_token": per_token,
                        "tpot_ms_p50": 2.0, "tpot_ms_p95": 3.0, "ttft_ms_p50": 5.0, "tokens_match": 1,
                        "avg_power_w": 10.0, "compile_s": 1.0 if config.compiles else 0.0, "compile_energy_j": 1.0,
                        "graph_breaks": 2 if config.compiles else 0,
                        "energy_source": "estimate", "torch_version": torch.__version__})
    policy = load_policy(policy_path)
    decision = resolve(policy, db, "cpu", torch_version=torch_minor())
    assert decision.label == STATIC.label
    record_decision(db, decision)
    db.close()
    return policy_path, db_path


@pytest.fixture
def dynamo_reset():
    yield
    torch._dynamo.reset()


def test_the_hook_prepares_generate_with_the_decided_static_cache_compile(decided):
    policy_path, db_path = decided
    model, input_ids = _tiny()
    reference = fixed_length_generate(model, input_ids, NEW)
    # the decided compile's arguments, with the caller's backend on top (no Inductor build in a unit test)
    served = joulepilot.compile(model, policy=str(policy_path), db=str(db_path), backend="eager")
    assert served.decision.config["label"] == STATIC.label and served.decision.state == "verified"
    assert model.generation_config.cache_implementation == "static"
    assert model.generation_config.max_cache_len == PROMPT + NEW - 1 and model.generation_config.disable_compile
    assert model._joulepilot_generation.compiled is not None
    assert torch.equal(served.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW,
                                       min_new_tokens=NEW), reference)
    assert served.flush() == 0 and served.close() is None  # the documented interface


def test_a_metered_generation_counts_its_tokens_and_reports_joules_per_token(decided, tmp_path):
    policy_path, db_path = decided
    model, input_ids = _tiny()
    served = joulepilot.compile(model, policy=str(policy_path), db=str(db_path), deployment="chat-prod",
                                backend="eager")
    mask = torch.ones_like(input_ids)
    for _ in range(5):
        served.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW)
    assert (served.inferences, served.tokens) == (5, 5 * BATCH * NEW)
    assert served.decision.config["label"] == STATIC.label
    served.close()
    db = open_db(db_path)
    samples = read_samples(db, get_deployment(db, "chat-prod")["id"])
    db.close()
    assert sum(s["tokens"] for s in samples) == 5 * BATCH * NEW and sum(s["inferences"] for s in samples) == 5
    energy = sum(s["energy_j"] for s in samples)
    out = CliRunner().invoke(main, ["report", "-d", "chat-prod", "--db", str(db_path), "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["totals"]["tokens"] == 5 * BATCH * NEW
    assert report["totals"]["j_per_token"] == pytest.approx(energy / (5 * BATCH * NEW))
    assert report["baselines"]["eager_fp32"]["unit"] == "J/token"
    assert report["baselines"]["eager_fp32"]["j_per_token"] == pytest.approx(0.02)
    md = CliRunner().invoke(main, ["report", "-d", "chat-prod", "--db", str(db_path), "-f", "md"]).stdout
    assert "| generated tokens | 60 |" in md and "| energy per generated token |" in md
    csv = CliRunner().invoke(main, ["report", "-d", "chat-prod", "--db", str(db_path), "-f", "csv"]).stdout
    assert "chat-prod,totals,tokens,60,tokens" in csv and ",totals,j_per_token," in csv
    html = CliRunner().invoke(main, ["report", "-d", "chat-prod", "--db", str(db_path), "-f", "html"]).stdout
    assert "Energy per token" in html and "Generated tokens" in html


def test_the_exporter_counts_tokens_beside_inferences(decided):
    from joulepilot.controller.exporter import JoulepilotCollector

    policy_path, db_path = decided
    model, input_ids = _tiny()
    served = joulepilot.compile(model, policy=str(policy_path), db=str(db_path), deployment="chat-prod",
                                backend="eager")
    served.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW, min_new_tokens=NEW)
    served.close()
    families = {m.name: m for m in JoulepilotCollector(db_path).collect()}
    tokens = families["joulepilot_tokens"].samples
    assert [(s.name, s.labels["deployment"], s.labels["policy"], s.value) for s in tokens] == [
        ("joulepilot_tokens_total", "chat-prod", "chat", BATCH * NEW)]
    per_token = families["joulepilot_policy_energy_joules_per_token"].samples
    assert [(s.labels["policy"], s.labels["source"], s.value) for s in per_token] == [("chat", "estimate", 0.01)]


def test_a_generation_policy_on_a_model_without_generate_serves_it_uncompiled_after_one_warning(decided):
    policy_path, db_path = decided
    model = torch.nn.Linear(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = joulepilot.compile(model, policy=str(policy_path), db=str(db_path), deployment="chat-prod")
    lines = [str(w.message) for w in caught if "joulepilot" in str(w.message)]
    assert len(lines) == 1 and 'task = "generate", but the model (Linear) has no transformers generate()' in lines[0]
    assert "\n" not in lines[0] and served.decision.config["label"] == "eager/fp32/b1"
    assert served(torch.ones(1, 4)).shape == (1, 4)
    assert served.flush() == 0


def test_a_forward_policy_leaves_generate_uncompiled_and_says_so_once(tmp_path):
    path = tmp_path / "fwd.toml"
    path.write_text('name = "fwd"\nworkload = "transformers:LlamaConfig"\nbatch_size = 2\nseq_len = 12\n'
                    '[fallback]\nmode = "eager"\n')
    model, input_ids = _tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = joulepilot.compile(model, policy=str(path), db=str(tmp_path / "none.db"))
        first = served.generate(input_ids, max_new_tokens=2)
        served.generate(input_ids, max_new_tokens=2)
    said = [str(w.message) for w in caught if "generate() runs uncompiled" in str(w.message)]
    assert len(said) == 1 and first.shape == (BATCH, PROMPT + 2)


def test_generated_tokens_stop_at_each_sequences_end_of_sequence_token():
    class Settings:
        eos_token_id = 7

    class Model:
        generation_config = Settings()

    prompt = torch.zeros(3, 4, dtype=torch.long)
    new = torch.tensor([[1, 2, 3, 4], [7, 0, 0, 0], [5, 7, 0, 0]])
    output = torch.cat([prompt, new], dim=1)
    assert generated_tokens(Model(), output, (prompt,), {}) == 4 + 1 + 2
    assert generated_tokens(Model(), output, (), {"input_ids": prompt, "eos_token_id": None}) == 12
    assert generated_tokens(Model(), output, (prompt,), {"eos_token_id": [4, 3]}) == 3 + 4 + 4


class ConstantPowerMeter:
    """A meter reading 100 W all the time (a GPU decoding, as far as the guard can tell)."""

    devices: list = []
    primary_source = "rapl"

    def __init__(self) -> None:
        self.started = time.monotonic()

    def read_energy_j(self) -> dict[str, float]:
        return {"cpu:0": 100.0 * (time.monotonic() - self.started)}

    def read_power_w(self) -> dict[str, float]:
        return {"cpu:0": 100.0}

    def close(self) -> None:
        pass


class SlowGenerator:
    """A model whose one generate call outlasts several metering windows."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.generation_config = None

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.cat([input_ids, torch.ones(input_ids.shape[0], 3, dtype=torch.long)], dim=1)


def test_windows_of_a_generate_call_under_way_are_not_idle_to_the_guard(tmp_path):
    guard = EnvelopeGuard(50.0, windows=3, action="warn")
    dep = attach(SlowGenerator(1.6), "slow-gen", db=tmp_path / "jp.db", device="cpu", interval_s=0.25,
                 meter=ConstantPowerMeter(), guard=guard, policy={"name": "slow", "task": "generate"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trip's own warning
        done = threading.Event()
        worker = threading.Thread(target=lambda: (dep.generate(torch.zeros(2, 4, dtype=torch.long)), done.set()))
        worker.start()
        worker.join(10)
    dep.close()
    assert done.is_set() and dep.tokens == 6
    # no call ended in the first windows, yet the call ran through them: the 100 W over them trips the guard
    assert guard.tripped is not None and len(guard.tripped.window_powers_w) == 3


def test_a_trip_of_a_generation_says_its_joules_per_token():
    from joulepilot.runtime.guard import trip_message

    guard = EnvelopeGuard(300.0, windows=2)
    assert guard.feed(350.0, inferences=1, energy_j=1750.0, tokens=2000) is None
    trip = guard.feed(360.0, inferences=1, energy_j=1800.0, tokens=1500)
    assert trip is not None and (trip.energy_j, trip.tokens) == (3550.0, 3500)
    message = trip_message("chat-prod", trip, "reduce-overhead/static-cache/bf16/b8", "nvml")
    assert message.endswith("; 1.014 J per generated token in those windows (3500 tokens)")
    forward = EnvelopeGuard(300.0, windows=2)
    forward.feed(350.0, inferences=10)
    assert "per generated token" not in trip_message("svc", forward.feed(350.0, inferences=10), None, "nvml")


def test_explain_names_a_generations_graph_breaks_without_a_doctor_command_it_cannot_run(decided):
    policy_path, db_path = decided
    out = CliRunner().invoke(main, ["policy", "explain", str(policy_path), "--db", str(db_path), "--json"])
    assert out.exit_code == 0, out.output
    (note,) = json.loads(out.stdout)["graph_breaks"]
    assert note["summary"] == "2 graph breaks" and note["labels"] == [STATIC.label]
