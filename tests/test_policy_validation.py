"""Policy files: every kind of validation error names the file, the key, the expectation and the finding."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.policies import PolicyError, find_policy, load_policy, policy_hash
from joulepilot.policies.load import read_toml

from joulepilot.cli import main

EXAMPLES = Path(__file__).parent.parent / "examples" / "policies"

GOOD = """
name = "bert"
workload = "transformers:BertConfig"
batch_size = 16
seq_len = 128
[objective]
minimize = "edp"
expected_inferences = 5_000
[limits]
max_avg_power_w = 400
max_rel_error = 1e-2
[search]
modes = ["eager", "default"]
precisions = ["fp32", "bf16"]
fusion = ["default"]
[fallback]
mode = "eager"
[guard]
windows = 5
action = "fallback"
"""


def write(tmp_path, text, name="p.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    for p in info.value.problems:
        assert p.file == str(path)
        assert str(path) in str(info.value)
    return {p.key: p for p in info.value.problems}


def test_examples_are_valid():
    for path in EXAMPLES.glob("*.toml"):
        policy = load_policy(path)
        assert policy.name == path.stem


def test_good_policy_loads_every_section(tmp_path):
    policy = load_policy(write(tmp_path, GOOD))
    assert (policy.name, policy.workload, policy.batch_size, policy.seq_len) == ("bert", "transformers:BertConfig", 16, 128)
    assert policy.objective.minimize == "edp" and policy.objective.expected_inferences == 5000
    assert policy.limits.items() == [("max_avg_power_w", 400.0), ("max_rel_error", 0.01)]
    assert policy.search.precisions == ("fp32", "bf16") and policy.search.dynamic == (False,)
    assert policy.fallback.precision == "fp32" and policy.guard.windows == 5 and policy.guard.action == "fallback"
    assert policy.shape_args() == {"seq_len": 128}
    assert len(policy.hash) == 16


def test_unknown_keys_get_the_closest_valid_one(tmp_path):
    found = problems(tmp_path, GOOD.replace("batch_size", "batchsize").replace("max_rel_error", "max_rel_eror"))
    assert "did you mean 'batch_size'" in found["batchsize"].hint
    assert "did you mean 'limits.max_rel_error'" in found["limits.max_rel_eror"].hint
    assert "batch_size" in found  # and the required key is reported missing in the same error


def test_a_key_under_the_wrong_table_header_is_pointed_to_its_table(tmp_path):
    """TOML puts every key below a [table] header into that table: a limit written after [search], or a top-level
    key after the first header, is unknown where it landed; the hint says where it belongs, not 'valid keys here'
    (a close typo of a key of its own table still wins: search.mode is search.modes, not fallback.mode)."""
    text = (GOOD.replace("max_avg_power_w = 400\n", "")
            .replace('fusion = ["default"]\n', 'fusion = ["default"]\nmax_avg_power_w = 400\nmode = ["eager"]\n')
            .replace("[guard]\n", '[guard]\ndescription = "bert, served"\n')
            .replace('[objective]\n', '[objective]\nstrategy = "exhaustive"\n'))
    found = problems(tmp_path, text)
    assert set(found) == {"search.max_avg_power_w", "search.mode", "guard.description", "objective.strategy"}
    assert found["search.max_avg_power_w"].hint == ("did you mean 'limits.max_avg_power_w'? move it under the "
                                                    "[limits] header")
    assert found["objective.strategy"].hint == "did you mean 'search.strategy'? move it under the [search] header"
    assert found["guard.description"].hint == ("'description' is a top-level key: move it above the first [table] "
                                               "header")
    assert found["search.mode"].hint == "did you mean 'search.modes'?"
    top = problems(tmp_path, GOOD.replace("[objective]\n", 'max_p95_latency_ms = 10\n[objective]\n'))
    assert top["max_p95_latency_ms"].hint == ("did you mean 'limits.max_p95_latency_ms'? move it under the "
                                              "[limits] header")


def test_wrong_types_and_values_say_expected_and_found(tmp_path):
    text = GOOD.replace("max_avg_power_w = 400", "max_avg_power_w = -3").replace('minimize = "edp"',
                                                                                 'minimize = "joules"')
    text = text.replace("batch_size = 16", 'batch_size = "16"').replace('"default"]\nprecisions', '"defualt"]\nprecisions')
    text = text.replace('action = "fallback"', 'action = "shout"').replace("windows = 5", "windows = true")
    found = problems(tmp_path, text)
    assert found["limits.max_avg_power_w"].expected == "a positive number"
    assert "-3" in found["limits.max_avg_power_w"].found
    assert "did you mean 'edp'" not in found["objective.minimize"].hint  # nothing close to 'joules'
    assert "'energy'" in found["objective.minimize"].expected
    assert "string '16'" in found["batch_size"].found
    assert "did you mean 'default'" in found["search.modes"].hint
    assert "'warn'" in found["guard.action"].expected
    assert "boolean" in found["guard.windows"].found
    assert len(found) == 6  # all reported together


def test_missing_required_keys_and_tables(tmp_path):
    found = problems(tmp_path, 'name = "x"\n[fallback]\nprecision = "fp32"\n[limits]\nmax_peak_power_w = 100\n'
                               'max_avg_power_w = 200\n')
    assert {"workload", "batch_size", "fallback.mode", "limits.max_peak_power_w"} <= set(found)
    assert found["workload"].found == "nothing"
    found = problems(tmp_path, 'name = "x"\nworkload = "mlp"\nbatch_size = 1\nlimits = 3\n')
    assert found["limits"].expected == "a table [limits]"


def test_syntax_error_and_missing_file(tmp_path):
    found = problems(tmp_path, 'name = "x\n')
    assert "(syntax)" in found and "TOML" in found["(syntax)"].expected
    with pytest.raises(PolicyError, match="no such file"):
        load_policy(tmp_path / "absent.toml")


def test_hash_ignores_comments_and_order(tmp_path):
    a = read_toml(write(tmp_path, GOOD, "a.toml"))
    b = read_toml(write(tmp_path, "# a comment\n" + GOOD.replace("batch_size = 16\nseq_len = 128",
                                                                "seq_len = 128\nbatch_size = 16"), "b.toml"))
    assert policy_hash(a) == policy_hash(b)
    assert policy_hash(a) != policy_hash(read_toml(write(tmp_path, GOOD.replace("400", "401"), "c.toml")))


def test_find_policy_by_name_in_search_dirs(tmp_path, monkeypatch, _isolated_home):
    env_dir, home_dir = tmp_path / "env", _isolated_home / "policies"
    env_dir.mkdir()
    home_dir.mkdir()
    write(home_dir, GOOD, "bert.toml")
    write(env_dir, GOOD, "other.toml")
    monkeypatch.setenv("JOULEPILOT_POLICIES", str(env_dir))
    monkeypatch.chdir(tmp_path)
    assert find_policy("bert") == home_dir / "bert.toml"
    assert find_policy("other") == env_dir / "other.toml"
    assert find_policy(str(home_dir / "bert.toml")) == home_dir / "bert.toml"
    with pytest.raises(PolicyError, match="JOULEPILOT_POLICIES"):
        find_policy("nowhere")


def test_cli_check_exit_codes_and_json(tmp_path):
    good = write(tmp_path, GOOD, "good.toml")
    bad = write(tmp_path, GOOD.replace("[guard]", "[gaurd]"), "bad.toml")
    runner = CliRunner()
    ok = runner.invoke(main, ["policy", "check", str(good)])
    assert ok.exit_code == 0 and "ok" in ok.output
    result = runner.invoke(main, ["policy", "check", str(good), str(bad), "--json"])
    assert result.exit_code == 1
    import json

    report = json.loads(result.output)
    assert [r["ok"] for r in report] == [True, False]
    assert report[1]["problems"][0]["key"] == "gaurd" and "guard" in report[1]["problems"][0]["hint"]


def test_check_warns_of_a_budget_the_exhaustive_strategy_ignores_and_keeps_the_file_valid(tmp_path):
    """`budget_s` and `max_measurements` bound the guided search only: under strategy = "exhaustive" they are
    accepted (a file that served before keeps serving) and `policy check` says they do nothing."""
    text = GOOD.replace('fusion = ["default"]\n', 'fusion = ["default"]\nstrategy = "exhaustive"\nbudget_s = 600\n'
                                                   'max_measurements = 12\n')
    path = write(tmp_path, text, "exhaustive.toml")
    assert load_policy(path).search.budget_s == 600  # valid: loads as before
    runner = CliRunner()
    shown = runner.invoke(main, ["policy", "check", str(path)])
    assert shown.exit_code == 0 and f"{path}: ok" in shown.output
    lines = [line for line in shown.output.splitlines() if line.strip().startswith("warning: search.")]
    assert lines == ['  warning: search.budget_s: budget_s = 600 is ignored: the exhaustive strategy measures every '
                     'allowed configuration (remove it, or set strategy = "guided" for a search it bounds)',
                     '  warning: search.max_measurements: max_measurements = 12 is ignored: the exhaustive strategy '
                     'measures every allowed configuration (remove it, or set strategy = "guided" for a search it '
                     'bounds)']
    import json

    (report,) = json.loads(runner.invoke(main, ["policy", "check", str(path), "--json"]).output)
    ours = [w for w in report["warnings"] if w["key"].startswith("search.")]
    assert report["ok"] and [w["key"] for w in ours] == ["search.budget_s", "search.max_measurements"]
    assert all(w["severity"] == "warning" for w in ours)
    # Under the guided strategy they bound the search: nothing to warn of.
    guided = write(tmp_path, text.replace('"exhaustive"', '"guided"'), "guided.toml")
    (report,) = json.loads(runner.invoke(main, ["policy", "check", str(guided), "--json"]).output)
    assert not [w for w in report["warnings"] if w["key"].startswith("search.")]
