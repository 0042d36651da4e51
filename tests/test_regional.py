"""Regional compilation: which blocks, one compiled code shared by every instance, the configuration knob,
the policy's [search] regional and regional_block, bench --regional, and the store's configs.regional.

Compiles here use Dynamo with the "eager" backend: what is counted is Dynamo's work (frames traced,
graphs captured), which is the same as under Inductor, without an Inductor compile per test."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from joulepilot.compiler import (
    CompileConfig,
    ConfigError,
    RegionalError,
    apply_config,
    block_classes,
    choose_block,
    compile_blocks,
    plan_configs,
)
from joulepilot.compiler.builtin_models import MLP, ConvNet, TinyTransformer
from joulepilot.compiler.inductor import effective_key
from joulepilot.compiler.regional import describe_regional
from joulepilot.controller.features import FeatureSpace
from joulepilot.controller.planner import compile_cost_rank
from joulepilot.policies import PolicyError, load_policy
from joulepilot.policies.resolve import candidate_configs
from joulepilot.store import list_runs, open_db, stable_id, upsert_config
from joulepilot.store.connection import Store
from joulepilot.store.db import schema_version
from joulepilot.store.runs import workload_runs
from joulepilot.store.schema import MIGRATIONS, SCHEMA_VERSION
from torch._dynamo.utils import counters

from tests.block_models import Block, BlockStack

GPU_SWEEP = Path(__file__).parent / "data" / "gpu_sweep_h200.json"
EAGER_BACKEND = {"backend": "eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class WiderLast(BlockStack):
    """A stack whose last block is a second variant of the class (different widths inside)."""

    def __init__(self) -> None:
        super().__init__(layers=3)
        last = Block()
        last.mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        self.blocks.append(last)


# --- which blocks ----------------------------------------------------------------------------------------
def test_auto_picks_the_most_repeated_block_class_not_leaves():
    model = BlockStack(layers=6)
    classes = block_classes(model)
    # Linear repeats 14 times but is a leaf; Block and its inner Sequential both repeat 6 times, and the
    # tie goes to the class holding more parameters (the outer one).
    assert [(b.name, b.instances) for b in classes[:2]] == [("Block", 6), ("Sequential", 6)]
    block = choose_block(model, "auto")
    assert block.name == "Block" and block.qualname == "tests.block_models.Block"
    assert block.paths == tuple(f"blocks.{i}" for i in range(6))
    assert block.variants == 1
    assert block.params_per_instance == sum(p.numel() for p in model.blocks[0].parameters())


def test_transformer_layers_are_the_blocks_of_the_builtin_transformer():
    block = choose_block(TinyTransformer(layers=3), "auto")
    assert (block.name, block.instances, block.variants) == ("EncoderLayer", 3, 1)


def test_nested_instances_of_one_class_keep_the_innermost():
    # ConvNet: `features` is a Sequential holding the three conv blocks, which are Sequentials too.
    block = choose_block(ConvNet(), "auto")
    assert block.name == "Sequential"
    assert block.paths == ("features.0", "features.2", "features.4")
    assert block.variants == 3  # 3->32, 32->64, 64->128 channels: one compile each


def test_a_named_class_is_taken_even_a_leaf_and_by_qualified_name():
    model = BlockStack(layers=2)
    assert choose_block(model, "tests.block_models.Block").paths == ("blocks.0", "blocks.1")
    linear = choose_block(model, "Linear")
    assert linear.instances == 6 and linear.variants == 4  # stem, head, and two shapes inside the blocks


def test_no_repeated_block_and_an_absent_class_are_one_line_errors():
    with pytest.raises(RegionalError, match="no repeated block in MLP") as err:
        choose_block(MLP(), "auto")
    assert "\n" not in str(err.value) and "regional = false" in str(err.value)
    with pytest.raises(RegionalError, match=r"no submodule of class 'BertLayer'; its repeated block classes "
                                            r"are Block \(4\), Sequential \(4\)") as err:
        choose_block(BlockStack(), "BertLayer")
    assert isinstance(err.value, ConfigError)


# --- one compiled code for every instance ------------------------------------------------------------
def test_regional_compile_traces_one_block_and_reuses_it_for_every_instance():
    model = BlockStack(layers=6).eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)
        block = compile_blocks(model, "auto", EAGER_BACKEND)
        out = model(x)
        model(x)
    assert block.instances == 6
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert model._compiled_call_impl is None and model.stem._compiled_call_impl is None
    # Six instances, one traced frame and one graph: the others passed its guards.
    assert counters["frames"]["total"] == 1 and counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out, expected)


def test_whole_model_compile_traces_everything_in_one_graph():
    model = BlockStack(layers=6).eval()
    compiled = torch.compile(model, **EAGER_BACKEND)
    with torch.no_grad():
        compiled(torch.randn(3, 16))
    whole_ops = counters["stats"]["calls_captured"]
    torch._dynamo.reset()
    counters.clear()
    model = BlockStack(layers=6).eval()
    compile_blocks(model, "auto", EAGER_BACKEND)
    with torch.no_grad():
        model(torch.randn(3, 16))
    regional_ops = counters["stats"]["calls_captured"]
    # Regional tracing captures one block's calls; the whole model's graph holds all six and more.
    assert whole_ops > 6 * regional_ops


def test_each_variant_of_the_block_class_is_one_more_compile():
    model = WiderLast().eval()
    block = compile_blocks(model, "auto", EAGER_BACKEND)
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert (block.instances, block.variants) == (4, 2)
    assert counters["frames"]["total"] == 2


def test_block_variants_are_not_recorded_as_graph_breaks_but_breaks_inside_blocks_are():
    # The worker counts breaks from Dynamo's graph-break log (compiler.graph_breaks), as the doctor does: a
    # block class's second variant is a recompile of its forward, not a break.
    from joulepilot.compiler.graph_breaks import recording_graph_breaks

    from tests.block_models import breaking_stack

    model = WiderLast().eval()
    block = compile_blocks(model, "auto", EAGER_BACKEND)
    with recording_graph_breaks() as whole_breaks, torch.no_grad():
        model(torch.randn(2, 16))
    assert counters["stats"]["unique_graphs"] == 2 and block.variants == 2
    assert whole_breaks.breaks == []

    torch._dynamo.reset()
    counters.clear()
    breaking, (x,) = breaking_stack(layers=3)
    block = compile_blocks(breaking, "auto", EAGER_BACKEND)
    with recording_graph_breaks() as breaks, torch.no_grad():
        breaking(x)
    assert block.variants == 1 and counters["stats"]["unique_graphs"] > 1
    assert len(breaks.breaks) >= 1


def test_variants_past_the_recompile_limit_are_warned_about():
    block = choose_block(WiderLast(), "auto")
    assert "warning" not in describe_regional(block)
    with torch._dynamo.config.patch(recompile_limit=1):
        described = describe_regional(block)
    assert described["recompile_limit"] == 1
    assert "2 distinct Block variants exceed Dynamo's recompile limit of 1" in described["warning"]
    assert described["paths"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def test_apply_config_compiles_the_blocks_and_says_which():
    model = BlockStack(layers=3).eval()
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    run = apply_config(CompileConfig("default", regional=True), model, "cpu", compile_kwargs=EAGER_BACKEND)
    torch.testing.assert_close(run(x), expected)
    assert run.regional.name == "Block" and run.regional.instances == 3
    assert run.compiled is model  # the blocks were compiled in place; the model itself was not wrapped
    whole = apply_config(CompileConfig("default"), BlockStack(layers=3), "cpu", compile_kwargs=EAGER_BACKEND)
    assert whole.regional is None


# --- the configuration knob --------------------------------------------------------------------------------
def test_whole_model_configuration_ids_are_those_stored_before_the_knob():
    records = json.loads(GPU_SWEEP.read_text())
    assert len(records) > 10
    for record in records:
        stored = record["config"]
        assert CompileConfig.from_row(stored).id == stored["id"], stored["label"]
        assert CompileConfig.from_row(stored).regional == ""


def test_regional_configuration_has_its_own_id_label_and_row():
    whole = CompileConfig("default", precision="bf16", batch_size=8)
    auto = whole.replace(regional=True)
    named = whole.replace(regional="BertLayer")
    assert whole.id == stable_id("config", "default", "default", [], "bf16", False, 8)
    assert len({whole.id, auto.id, named.id}) == 3
    assert auto.regional == "auto" and whole.replace(regional=False).regional == ""
    assert auto.label == "default/bf16/regional/b8" and named.label == "default/bf16/regional=BertLayer/b8"
    assert CompileConfig.from_row(named.to_row()) == named and named.to_row()["regional"] == "BertLayer"
    assert "regional" not in whole.to_row()  # rows of whole-model configurations are as they were
    assert effective_key(whole, "cpu") != effective_key(auto, "cpu") != effective_key(named, "cpu")


def test_regional_refuses_eager_and_names_that_are_not_classes():
    with pytest.raises(ConfigError, match="eager' does not compile, so regional compilation does not apply"):
        CompileConfig("eager", regional=True)
    with pytest.raises(ConfigError, match="regional must be true, false, 'auto' or a module class name"):
        CompileConfig("default", regional="my block")


def test_plan_configs_adds_a_regional_variant_of_each_compiled_configuration():
    plan = plan_configs(["eager", "default"], precisions=["fp32", "bf16"], regional=["", "auto"])
    assert [c.label for c in plan] == ["eager/fp32/b1", "eager/bf16/b1", "default/fp32/b1",
                                       "default/fp32/regional/b1", "default/bf16/b1", "default/bf16/regional/b1"]


def test_trade_off_features_and_compile_order_tell_regional_apart():
    whole, regional = CompileConfig("default"), CompileConfig("default", regional="auto")
    space = FeatureSpace.learn([({}, whole.to_row(), "cpu")])
    index = space.names.index("regional")
    assert space.vector({}, whole, "cpu")[index] == 0.0 and space.vector({}, regional, "cpu")[index] == 1.0
    assert sorted([regional, CompileConfig("eager"), whole], key=compile_cost_rank) == [
        CompileConfig("eager"), whole, regional]


# --- the policy's [search] -----------------------------------------------------------------------------------
POLICY = """
name = "stack"
workload = "tests.block_models:block_stack"
batch_size = 2
[search]
modes = ["eager", "default"]
{search}
[fallback]
mode = "eager"
"""


def _policy(tmp_path, search: str):
    path = tmp_path / "stack.toml"
    path.write_text(POLICY.format(search=search))
    return path


def test_policy_regional_knob_doubles_the_compiled_candidates(tmp_path):
    policy = load_policy(_policy(tmp_path, "regional = [false, true]"))
    assert policy.search.regional == (False, True) and policy.search.regional_block is None
    assert [c.label for c in candidate_configs(policy)] == ["eager/fp32/b2", "default/fp32/b2",
                                                             "default/fp32/regional/b2"]
    default = load_policy(_policy(tmp_path, ""))
    assert [c.label for c in candidate_configs(default)] == ["eager/fp32/b2", "default/fp32/b2"]


def test_policy_regional_and_shape_set_padding_are_searched_together(tmp_path):
    path = tmp_path / "mixer.toml"
    path.write_text('name = "mixer"\nworkload = "tests.shape_workloads:build"\nbatch_size = 2\n'
                    '[search]\nmodes = ["eager", "default"]\nregional = [false, true]\n'
                    '[shapes]\nseq_len = [5, 6, 7, 9, 12]\n[fallback]\nmode = "eager"\n')
    policy = load_policy(path)
    configs = candidate_configs(policy)
    compiled = {(c.dynamic, c.padding, c.regional) for c in configs if c.compiles}
    assert compiled == {(d, p, r) for d in (False, True) for p in ("none", "buckets") for r in ("", "auto")}
    assert [c.label for c in configs if not c.compiles] == ["eager/fp32/b2"]  # eager ignores all three
    ranked = sorted(configs, key=compile_cost_rank)
    for whole, regional in zip(ranked[1::2], ranked[2::2], strict=True):  # each regional right after its whole
        assert regional == whole.replace(regional="auto")


def test_daemon_plan_measures_the_regional_variant_after_its_whole_model_configuration(tmp_path, db):
    from joulepilot.controller.planner import plan_policy

    policy = load_policy(_policy(tmp_path, 'regional = [true, false]\nprecisions = ["fp32", "bf16"]'))
    plan = plan_policy(db, policy, reason="no decision yet", provenance_key="p", max_age_s=86400.0)
    assert [c.label for c in plan.to_measure] == [
        "eager/fp32/b2", "eager/bf16/b2", "default/fp32/b2", "default/fp32/regional/b2", "default/bf16/b2",
        "default/bf16/regional/b2"]


def test_policy_names_the_block_class(tmp_path):
    policy = load_policy(_policy(tmp_path, 'regional = [true]\nregional_block = "Block"'))
    assert [c.regional for c in candidate_configs(policy)] == ["", "Block"]  # eager, then default/regional=Block


@pytest.mark.parametrize(("search", "key", "says"), [
    ('regional = "yes"', "search.regional", "a non-empty array of booleans"),
    ('regional = [true]\nregional_block = "two words"', "search.regional_block", "a module class name"),
    ('regional = [true]\nregional_block = "auto"', "search.regional_block", "a module class name"),
    ('regional_block = "Block"', "search.regional_block", "search.regional to include true"),
])
def test_bad_regional_settings_are_one_clean_problem(tmp_path, search, key, says):
    path = _policy(tmp_path, search)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    (problem,) = err.value.problems
    assert problem.key == key and says in problem.expected and problem.file == str(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    if key == "search.regional_block" and "include true" in says:
        assert "set regional = [false, true] under [search]" in problem.hint


# --- the store --------------------------------------------------------------------------------------------
def test_configs_gain_a_regional_column_and_old_rows_read_as_whole_model(tmp_path):
    path = tmp_path / "v4.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for step in MIGRATIONS[:4]:
        step(Store(conn))
    conn.execute("PRAGMA user_version = 4")
    old = CompileConfig("default", batch_size=2)
    conn.execute("INSERT INTO configs VALUES (?, ?, 'default', 'default', '{}', 'fp32', 0, 2)", [old.id, old.label])
    conn.execute("INSERT INTO hosts VALUES ('h1', 'box', 'x86', 1.0)")
    conn.execute("INSERT INTO workloads (id, spec, batch_size, created_at) VALUES ('w1', 'mlp', 2, 1.0)")
    conn.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at) "
                 "VALUES ('w1', ?, 'h1', 'cpu', 'ok', 2.0)", [old.id])
    conn.close()

    db = open_db(path)
    (run,) = list_runs(db)
    assert run["regional"] == "" and CompileConfig.from_row(run) == old
    regional = old.replace(regional="Block")
    upsert_config(db, regional.to_row())
    db.execute("INSERT INTO runs (workload_id, config_id, host_id, device, status, started_at) "
               "VALUES ('w1', ?, 'h1', 'cpu', 'ok', 3.0)", [regional.id])
    newest = workload_runs(db, "w1")[0]
    assert newest.regional == "Block" and CompileConfig.from_row(newest) == regional


def test_a_version_6_database_gets_regional_as_migration_7_and_both_knobs_round_trip(tmp_path):
    path = tmp_path / "v6.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for step in MIGRATIONS[:6]:
        step(Store(conn))
    conn.execute("PRAGMA user_version = 6")
    padded = CompileConfig("default", dynamic=True, batch_size=2, padding="buckets")
    conn.execute("INSERT INTO configs VALUES (?, ?, 'default', 'default', '{}', 'fp32', 1, 2, 'buckets')",
                 [padded.id, padded.label])
    conn.close()

    db = open_db(path)
    assert schema_version(db) == SCHEMA_VERSION >= 7
    (row,) = db.query("SELECT * FROM configs")
    assert row["regional"] == "" and row["padding"] == "buckets" and CompileConfig.from_row(row) == padded
    both = padded.replace(regional="Block")
    assert both.id not in (padded.id, padded.replace(padding="none").id)
    assert both.label == "default/fp32/dynamic/pad/regional=Block/b2"
    upsert_config(db, both.to_row())
    stored = next(db.query("SELECT * FROM configs WHERE id = ?", [both.id]))
    assert (stored["padding"], stored["regional"]) == ("buckets", "Block") and CompileConfig.from_row(stored) == both


# --- bench --regional ---------------------------------------------------------------------------------------
def test_bench_regional_measures_whole_and_regional_and_records_the_blocks(tmp_path, fake_worker):
    from click.testing import CliRunner

    from joulepilot.cli import main

    db_path = tmp_path / "bench.db"
    result = CliRunner().invoke(main, ["bench", "tests.block_models:block_stack", "--device", "cpu", "--modes",
                                       "default", "--regional", "--min-seconds", "0.2", "--no-warm-start",
                                       "--db", str(db_path), "--json"])
    assert result.exit_code == 0, result.output
    runs = {r["config_label"]: r for r in json.loads(result.stdout)}
    assert set(runs) == {"default/fp32/b1", "default/fp32/regional/b1"}
    assert all(r["status"] == "ok" for r in runs.values())
    regional = runs["default/fp32/regional/b1"]
    assert regional["regional"] == "auto" and runs["default/fp32/b1"]["regional"] == ""
    blocks = regional["extra"]["regional"]
    assert (blocks["name"], blocks["instances"], blocks["variants"]) == ("Block", 4, 1)
    assert "regional" not in runs["default/fp32/b1"]["extra"]
    stored = {r["config_label"]: r["regional"] for r in list_runs(open_db(db_path))}
    assert stored == {"default/fp32/b1": "", "default/fp32/regional/b1": "auto"}


def test_bench_regional_block_that_the_model_lacks_fails_the_run_with_the_reason(tmp_path, fake_worker):
    from click.testing import CliRunner

    from joulepilot.cli import main

    result = CliRunner().invoke(main, ["bench", "tests.block_models:block_stack", "--device", "cpu", "--modes",
                                       "default", "--regional-block", "BertLayer", "--min-seconds", "0.2",
                                       "--no-warm-start", "--db", str(tmp_path / "b.db"), "--json"])
    runs = {r["config_label"]: r for r in json.loads(result.stdout)}
    failed = runs["default/fp32/regional=BertLayer/b1"]
    assert failed["status"] == "failed"
    assert "no submodule of class 'BertLayer'; its repeated block classes are Block (4)" in failed["reason"]
    assert runs["default/fp32/b1"]["status"] == "ok" and result.exit_code == 0


def test_bench_refuses_a_regional_block_that_is_not_a_class_name(tmp_path):
    from click.testing import CliRunner

    from joulepilot.cli import main

    result = CliRunner().invoke(main, ["bench", "mlp", "--device", "cpu", "--regional-block", "not a class",
                                       "--db", str(tmp_path / "b.db")])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        "Error: --regional-block 'not a class' is not a class name: give the block class to compile, e.g. "
        "--regional-block EncoderLayer (or --regional for the most repeated one)"]


# --- the hook -----------------------------------------------------------------------------------------------
def test_hook_applies_a_regional_decision_to_the_blocks(tmp_path):
    from joulepilot.compiler import workload_id
    from joulepilot.policies import Decision, torch_minor, write_lock
    from joulepilot.runtime import compile as jp_compile

    policy_path = tmp_path / "mlp.toml"  # the example policy, with regional compilation in its grid
    example = Path(__file__).parent.parent / "examples" / "policies" / "mlp.toml"
    policy_path.write_text(example.read_text().replace('fusion = ["default"]', 'fusion = ["default"]\nregional = [false, true]'))
    policy = load_policy(policy_path)
    config = CompileConfig("default", regional=True, batch_size=policy.batch_size)
    write_lock(policy_path, Decision(
        policy=policy.name, policy_hash=policy.hash, device_kind="cpu", torch_version=torch_minor(),
        workload=policy.workload, workload_id=workload_id(policy.workload, policy.batch_size), config=config.to_row(),
        state="verified", reason="chosen by the test", objective="energy", expected_inferences=1000))
    model, x = BlockStack(layers=5).eval(), torch.randn(policy.batch_size, 16)
    with torch.no_grad():
        expected = model(x)
    compiled = jp_compile(model, policy=policy_path, db=tmp_path / "none.db", backend="eager")
    assert compiled.decision.source == "lock" and compiled.decision.config["regional"] == "auto"
    assert compiled.regional.name == "Block" and compiled.regional.instances == 5
    assert compiled.decision.details["artifacts_loaded"] is False  # none saved for this decision
    torch.testing.assert_close(compiled(x), expected)
    assert counters["frames"]["total"] == 1 and all(b._compiled_call_impl is not None for b in model.blocks)


# --- benchmarks/warm_start_regional.py -------------------------------------------------------------------
def test_warm_start_regional_script_compares_whole_and_regional(tmp_path, fake_worker, capsys):
    import importlib.util

    path = Path(__file__).parent.parent / "benchmarks" / "warm_start_regional.py"
    spec = importlib.util.spec_from_file_location("warm_start_regional", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    results = tmp_path / "out" / "result.json"
    code = script.main(["tests.block_models:block_stack", "--device", "cpu", "--min-seconds", "0.2",
                        "--batch-size", "2", "--json", "--results", str(results)])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(results.read_text())
    assert printed["device"] == "cpu" and printed["torch_version"] == torch.__version__ and printed["date_utc"]
    rows = {r["variant"]: r for r in printed["rows"]}
    assert rows["whole"]["config"] == "default/fp32/b2" and rows["whole"]["block"] is None
    assert rows["regional"]["config"] == "default/fp32/regional/b2"
    assert rows["regional"]["block"]["name"] == "Block" and rows["regional"]["block"]["instances"] == 4
    for row in rows.values():
        assert row["status"] == "ok" and row["j_per_call"] > 0 and row["energy_source"] == "estimate"
        assert row["compile_s"] > 0
    (comparison,) = printed["regional_vs_whole"]
    assert comparison["compile_speedup"] == pytest.approx(rows["whole"]["compile_s"] / rows["regional"]["compile_s"])
    assert comparison["j_per_call_change_pct"] == pytest.approx(
        100 * (rows["regional"]["j_per_call"] / rows["whole"]["j_per_call"] - 1))
    script.print_table(printed)
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("tests.block_models:block_stack batch 2 on ") and "(cpu)" in table[0]
    assert table[1].split()[:4] == ["variant", "precompile", "compile", "s"]
    assert table[3].split()[0] == "regional" and table[3].endswith("Block x4 (1 variant(s))")
    assert table[-1].startswith("regional vs whole (precompile off): compile ")  # off by default


def test_a_class_is_named_by_its_public_dotted_name_and_mistakes_say_what_to_write():
    model = BlockStack(layers=2)
    # torch.nn.Linear is torch.nn.modules.linear.Linear: the name everyone writes
    assert choose_block(model, "torch.nn.Linear") == choose_block(model, "torch.nn.modules.linear.Linear")
    assert choose_block(model, "torch.nn.LayerNorm").paths == ("blocks.0.norm", "blocks.1.norm")
    with pytest.raises(RegionalError, match=r"no submodule of class 'nn\.Linear' \(did you mean "
                                            r"'torch\.nn\.modules\.linear\.Linear'\?\)"):
        choose_block(model, "nn.Linear")
    # the model's own class is not one of its blocks
    with pytest.raises(RegionalError, match=r"'BlockStack' is the class of the whole model.*regional = false"):
        choose_block(model, "BlockStack")


def test_a_plain_name_two_classes_share_is_refused_not_half_compiled():
    class Block(torch.nn.Module):  # another library's Block beside tests.block_models.Block
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model = BlockStack(layers=2)
    model.extra = torch.nn.ModuleList(Block() for _ in range(3))
    with pytest.raises(RegionalError, match=r"'Block' names 2 classes of BlockStack") as err:
        choose_block(model, "Block")
    assert f"{Block.__module__}.{Block.__qualname__}" in str(err.value) and "tests.block_models.Block" in str(err.value)
    assert choose_block(model, "tests.block_models.Block").paths == ("blocks.0", "blocks.1")
