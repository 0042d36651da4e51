"""A policy's [shapes]: parsing and one-line errors, the search grid it opens (dynamic x padding), the daemon
measuring the policy's shape set, `policy explain` marking a recompile limit hit, `bench --shapes`, and the hook
warning that a padded decision needs padded inputs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from daemon_factories import query, use_fake_worker, write_daemon_config
from decision_factories import db_file, seed_runs
from decision_factories import write_policy as write_decision_policy
from joulepilot.compiler import CompileConfig, ShapeSet
from joulepilot.controller.planner import ordered_candidates
from joulepilot.policies import Decision, PolicyError, load_policy, torch_minor, write_lock
from joulepilot.policies.resolve import policy_workload_id, resolve
from joulepilot.runtime import compile as jp_compile

from joulepilot.cli import main

EXAMPLES = Path(__file__).parent.parent / "examples" / "policies"
BASE = 'name = "mixer"\nworkload = "tests.shape_workloads:build"\nbatch_size = 2\n'
SHAPES = "[shapes]\nseq_len = [5, 6, 7, 9, 12]\nweights = [5, 4, 3, 2, 1]\n"


def write(tmp_path, text, name="mixer.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(tmp_path, text) -> dict:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    for problem in info.value.problems:
        assert problem.file == str(path) and "\n" not in str(problem)
    return {p.key: p for p in info.value.problems}


def test_shapes_load_into_a_shape_set_and_open_dynamic_and_padding(tmp_path):
    policy = load_policy(write(tmp_path, BASE + SHAPES))
    assert policy.shapes == ShapeSet("seq_len", (5, 6, 7, 9, 12), (5, 4, 3, 2, 1))
    assert policy.search.dynamic == (False, True) and policy.search.padding == ("none", "buckets")
    assert policy.seq_len is None and policy.shape_args() == {}

    chosen = load_policy(write(tmp_path, BASE + SHAPES.replace("weights = [5, 4, 3, 2, 1]\n", "buckets = [16]\n")
                               + '[search]\ndynamic = [true]\npadding = ["buckets"]\n'))
    assert chosen.shapes.weights == (1.0,) * 5 and chosen.shapes.buckets == (16,)
    assert chosen.search.dynamic == (True,) and chosen.search.padding == ("buckets",)

    plain = load_policy(write(tmp_path, BASE))
    assert plain.shapes is None and plain.search.dynamic == (False,) and plain.search.padding == ("none",)


@pytest.mark.parametrize("text, key, says", [
    (BASE + "[shapes]\nseq_len = [64, 64]\n", "shapes.seq_len", "distinct positive integers"),
    (BASE + "[shapes]\nseq_len = [64, 128]\nimage_size = [224]\n", "shapes", "exactly one of seq_len or image_size"),
    (BASE + "[shapes]\nweights = [1]\n", "shapes", "exactly one of seq_len or image_size"),
    (BASE + "[shapes]\nseq_len = [64, 128]\nweights = [1]\n", "shapes.weights", "one weight per size (2)"),
    (BASE + "[shapes]\nseq_len = [64, 128]\nweights = [1, -1]\n", "shapes.weights", "positive numbers"),
    (BASE + "[shapes]\nseq_len = [100, 300]\nbuckets = [128]\n", "shapes.buckets", "at least the largest size (300)"),
    (BASE + "seq_len = 64\n[shapes]\nseq_len = [64, 128]\n", "seq_len", "no top-level seq_len beside [shapes]"),
    (BASE + "[shapes]\nseqlen = [64]\n", "shapes.seqlen", "a known key"),
    (BASE + "shapes = [64, 128]\n", "shapes", "a table [shapes]"),
    (BASE + "[shapes]\nseq_len = " + str(list(range(1, 18))) + "\n", "shapes.seq_len", "at most 16 sizes"),
    (BASE + '[search]\npadding = ["buckets"]\n', "search.padding", "the policy has no [shapes] to pad"),
    (BASE + SHAPES + '[search]\npadding = ["pad"]\n', "search.padding", "one of 'none', 'buckets'"),
])
def test_a_bad_shapes_table_names_the_file_the_key_and_the_fix(tmp_path, text, key, says):
    found = problems(tmp_path, text)
    assert key in found, found
    assert says in str(found[key])
    if key == "shapes.seqlen":
        assert "did you mean 'shapes.seq_len'" in found[key].hint


def test_policy_check_prints_one_line_per_shapes_problem(tmp_path):
    path = write(tmp_path, BASE + "[shapes]\nseq_len = [100, 300]\nweights = [1]\nbuckets = [128]\n")
    result = CliRunner().invoke(main, ["policy", "check", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == f"{path}: 2 problem(s)"
    assert lines[1] == "  shapes.weights: expected one weight per size (2), found 1 weight(s) (give as many weights as " \
                       "shapes.seq_len has sizes)"
    assert lines[2].startswith("  shapes.buckets: expected a largest bucket of at least the largest size (300)")


def test_the_grid_covers_dynamic_and_padding_only_where_padding_changes_something(tmp_path):
    policy = load_policy(write(tmp_path, BASE + SHAPES))
    labels = [c.label for c in ordered_candidates(policy)]
    # eager once (it compiles nothing), then the compiled mode static before dynamic, unpadded before padded
    assert labels == ["eager/fp32/b2", "default/fp32/b2", "default/fp32/pad/b2", "default/fp32/dynamic/b2",
                      "default/fp32/dynamic/pad/b2"]

    on_buckets = load_policy(write(tmp_path, BASE + "[shapes]\nseq_len = [64, 128, 256, 512]\n"))
    assert [c.label for c in ordered_candidates(on_buckets)] == ["eager/fp32/b2", "default/fp32/b2",
                                                                 "default/fp32/dynamic/b2"]

    plain = load_policy(write(tmp_path, BASE))
    assert [c.id for c in ordered_candidates(plain)] == [CompileConfig(mode="eager", batch_size=2).id,
                                                        CompileConfig(mode="default", batch_size=2).id]


def test_the_shape_set_is_part_of_the_policys_workload(tmp_path):
    policy = load_policy(write(tmp_path, BASE + SHAPES))
    plain = load_policy(write(tmp_path, BASE, "plain.toml"))
    other_weights = load_policy(write(tmp_path, BASE + SHAPES.replace("[5, 4, 3, 2, 1]", "[1, 1, 1, 1, 1]"),
                                      "other.toml"))
    assert len({policy_workload_id(p) for p in (policy, plain, other_weights)}) == 3


def test_the_daemon_measures_the_policys_shape_set(tmp_path, monkeypatch, restore_logging):
    use_fake_worker(monkeypatch)  # compiling is not the point here: which sizes and configurations are measured
    db, policies = tmp_path / "j.db", tmp_path / "policies"
    policies.mkdir()
    # one run each (`min_repeats = 1`): the contenders' repeats are test_exhaustive_repeats.py's
    write(policies, BASE + "[shapes]\nseq_len = [5, 9]\nweights = [3, 1]\n"
                    '[search]\nmodes = ["default"]\ndynamic = [false]\nstrategy = "exhaustive"\nmin_repeats = 1\n')
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies, min_seconds=0.2)
    # the pass in this process (the CLI through click): a daemon process would only add its start and imports
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    assert json.loads(result.stdout)["runs_ok"] == 2
    policy = load_policy(policies / "mixer.toml")
    runs = query(db, "SELECT runs.*, configs.label, configs.padding FROM runs JOIN configs ON configs.id = "
                     "runs.config_id ORDER BY runs.id")
    assert [(r["label"], r["padding"], r["status"]) for r in runs] == [("default/fp32/b2", "none", "ok"),
                                                                       ("default/fp32/pad/b2", "buckets", "ok")]
    for run in runs:
        assert run["workload_id"] == policy_workload_id(policy)
        shapes = json.loads(run["extra"])["shapes"]
        assert [s["size"] for s in shapes["sizes"]] == [5, 9] and shapes["padding"] == run["padding"]
    padded = json.loads(runs[1]["extra"])["shapes"]["sizes"]
    assert [s["run_size"] for s in padded] == [8, 16]
    assert query(db, "SELECT id FROM workloads") == [{"id": policy_workload_id(policy)}]


def test_explain_notes_a_recompile_limit_hit_without_rejecting_the_configuration(db, tmp_path):
    warning = "hit torch._dynamo's recompile limit (8) at seq_len 320: from then on Dynamo runs new shapes ..."
    seed_runs(db, {("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 0.3},
                   ("default", "fp32"): {"energy_j_per_inference": 0.01, "avg_power_w": 0.3,
                                         "extra": {"recompile_limit_hit": True, "recompile_warning": warning}}})
    policy = load_policy(write_decision_policy(tmp_path, limit_w=10.0))
    decision = resolve(policy, db, "cpu")
    by_label = {c.label: c for c in decision.candidates}
    marked = by_label["default/fp32/b8"]
    assert marked.status == "chosen" and len(marked.notes) == 1 and warning in marked.notes[0]
    assert by_label["eager/fp32/b8"].notes == []
    result = CliRunner().invoke(main, ["policy", "explain", str(policy.path), "--db", db_file(db), "--json"])
    assert result.exit_code == 0, result.output
    shown = {c["label"]: c for c in json.loads(result.output)["candidates"]}
    assert warning in shown["default/fp32/b8"]["notes"][0]


def test_bench_cli_measures_a_shape_set_and_refuses_a_bad_one_in_one_line(tmp_path, fake_worker):
    # the fake worker: eager compiles nothing, and its shorter warm-up and latency pass change nothing here
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "tests.shape_workloads:build", "--modes", "eager", "--shapes",
                                  "seq_len=4:3,12", "--batch-size", "2", "--device", "cpu", "--min-seconds", "0.2",
                                  "--db", str(tmp_path / "j.db"), "--json"])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)
    assert run["config_label"] == "eager/fp32/b2"  # eager once: it compiles nothing, so it neither recompiles nor pads
    assert [s["size"] for s in run["extra"]["shapes"]["sizes"]] == [4, 12]
    assert [s["share"] for s in run["extra"]["shapes"]["sizes"]] == [0.75, 0.25]
    for args, says in ((["--shapes", "seq_len=4:x"], "'4:x' is not SIZE or SIZE:WEIGHT"),
                       (["--shapes", "batch=4,8"], "must start with seq_len= or image_size="),
                       (["--shapes", "seq_len=4,8", "--seq-len", "4"], "drop --seq-len"),
                       (["--buckets", "8"], "give --shapes too"),
                       (["--shapes", "seq_len=4,40", "--buckets", "16"], "largest padding bucket (16)")):
        bad = runner.invoke(main, ["bench", "mlp", "--device", "cpu", "--db", str(tmp_path / "j.db"), *args])
        assert bad.exit_code == 1 and says in bad.output, bad.output
        assert len(bad.output.strip().splitlines()) == 1 and "Traceback" not in bad.output


def test_the_hook_warns_once_that_a_padded_decision_needs_padded_inputs(tmp_path):
    path = write(tmp_path, (EXAMPLES / "transformer.toml").read_text(), "transformer.toml")
    policy = load_policy(path)

    def lock(config):
        write_lock(path, Decision(policy=policy.name, policy_hash=policy.hash, device_kind="cpu",
                                  torch_version=torch_minor(), workload=policy.workload,
                                  workload_id=policy_workload_id(policy), config=config.to_row(), state="verified",
                                  reason="chosen by the test", objective="energy", expected_inferences=1000))

    model = torch.nn.Linear(4, 4)
    lock(CompileConfig("default", dynamic=True, batch_size=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an unpadded decision: nothing to say
        jp_compile(model, policy=path, db=tmp_path / "none.db")
    lock(CompileConfig("default", padding="buckets", batch_size=4))
    with pytest.warns(UserWarning, match=r"padded to the seq_len buckets 32, 64; joulepilot.compile does not pad"):
        compiled = jp_compile(model, policy=path, db=tmp_path / "none.db")
    assert compiled.decision.config["padding"] == "buckets"
