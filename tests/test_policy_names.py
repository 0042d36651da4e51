"""Policy and deployment names are bounded (issue 25, item 2): 1 to 128 ASCII letters, digits, '.', '_' and '-',
starting with a letter or a digit. A 500,000-character name, or one holding a NUL or a newline, used to pass
`policy check` and become a 500 KB Prometheus label and a lock file that could never be written. The rule is one
function (`policies.schema.name_problem`), asked by the policy schema, the lookup of a policy by name (`--policy`,
`policy check|explain|lock POLICY`, `joulepilot.compile(policy=...)`), deployment names (`deployment=`,
`attach`) and the daemon's answer to a hook's request."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from decision_factories import compile_with_warnings, db_file, write_policy
from joulepilot.controller.redecide import refused_request
from joulepilot.policies import PolicyError, load_policy
from joulepilot.store.deployments import list_deployments

from joulepilot.cli import main

BAD = {
    "500k-chars": "p" * 500_000,
    "129-chars": "p" * 129,
    "nul": "svc\x00prod",
    "newline": "svc\nprod",
    "space": "svc prod",
    "slash": "team/svc",
    "leading-dot": ".svc",
    "leading-dash": "-svc",
    "non-ascii": "caf\u00e9",
}
GOOD = ["resnet50", "svc.prod_v2-1", "A", "p" * 128, "0day"]
RULE = "letters, digits, '.', '_' and '-'"


def policy_named(folder, name: str):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "named.toml"
    path.write_text(f"name = {json.dumps(name)}\nworkload = \"mlp\"\nbatch_size = 8\n")
    return path


@pytest.mark.parametrize("name", list(BAD.values()), ids=list(BAD))
def test_policy_check_refuses_a_name_outside_the_rule_in_one_short_line(tmp_path, name):
    path = policy_named(tmp_path, name)
    result = CliRunner().invoke(main, ["policy", "check", str(path), "--json"])
    assert result.exit_code == 1
    [checked] = json.loads(result.stdout)
    [problem] = checked["problems"]
    assert problem["key"] == "name" and RULE in problem["expected"] and problem["file"] == str(path)
    assert len(result.stdout) < 2_000
    with pytest.raises(PolicyError) as raised:
        load_policy(path)
    assert "\n" not in str(raised.value) and str(raised.value).startswith(f"{path}: name: expected 1 to 128")


@pytest.mark.parametrize("name", GOOD)
def test_names_within_the_rule_load(tmp_path, name):
    assert load_policy(policy_named(tmp_path, name)).name == name


@pytest.mark.parametrize("command", [["policy", "explain"], ["policy", "lock"], ["policy", "check"]])
@pytest.mark.parametrize("name", [BAD["500k-chars"], BAD["newline"], BAD["space"]], ids=["500k", "newline", "space"])
def test_a_policy_given_by_a_name_outside_the_rule_is_refused_in_one_line(tmp_path, command, name):
    result = CliRunner().invoke(main, [*command, name, "--db", str(tmp_path / "j.db")] if command[1] != "check"
                                else [*command, name])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert RULE in result.output and len(result.output) < 2_000


def test_frontier_policy_option_uses_the_same_rule(tmp_path):
    result = CliRunner().invoke(main, ["frontier", "mlp", "--db", str(tmp_path / "j.db"), "--policy", BAD["newline"]])
    assert result.exit_code == 1 and RULE in result.output


@pytest.mark.parametrize("name", [BAD["500k-chars"], BAD["nul"], BAD["newline"]], ids=["500k", "nul", "newline"])
def test_the_hook_refuses_a_policy_name_outside_the_rule_with_one_warning(tmp_path, name):
    served, said = compile_with_warnings(name, str(tmp_path / "none.db"))
    assert served.decision.source == "none" and served.decision.config["mode"] == "eager"
    [warning] = said
    assert RULE in warning and len(warning) < 2_000


@pytest.mark.parametrize("name", [BAD["500k-chars"], BAD["nul"], BAD["newline"]], ids=["500k", "nul", "newline"])
def test_a_deployment_name_outside_the_rule_is_served_unmetered_with_one_warning(tmp_path, db, name):
    policy_path = write_policy(tmp_path / "policies")
    served, said = compile_with_warnings(policy_path, db_file(db), deployment=name)
    assert type(served).__name__ != "MeteredModel"
    assert any(RULE in w and "unmetered" in w and len(w) < 2_000 for w in said)
    assert list_deployments(db) == []


def test_attach_refuses_a_deployment_name_outside_the_rule(db):
    from joulepilot.runtime import attach

    with pytest.raises(ValueError, match="is not a deployment name"):
        attach(lambda x: x, "svc\nprod", db=db)
    assert list_deployments(db) == []


def test_the_daemon_says_a_request_names_no_policy_name():
    refusal = refused_request({"id": 3, "policy": "svc\x00prod"}, [])
    assert RULE in refusal["reason"] and "\x00" not in json.dumps(refusal["reason"], ensure_ascii=False)
