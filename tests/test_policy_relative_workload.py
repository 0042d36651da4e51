"""A relative `workload` path in a policy is relative to the policy file's folder (issue 25, item 11), not to the
current directory of whoever reads the policy: the daemon, started elsewhere, refused such a policy and then the
hook's request for it, saying its file "is not in the daemon's policy folders" while naming that very folder. A
request for a file inside the daemon's folders now says what differs."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

from click.testing import CliRunner
from daemon_factories import write_daemon_config
from decision_factories import seed_runs
from joulepilot.controller.device_probe import probe_device
from joulepilot.policies import load_policy
from joulepilot.policies.load import load_policy_folders
from joulepilot.store import open_db
from joulepilot.store.daemon_state import add_request

from joulepilot.cli import main


def model_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.py"
    path.write_text(textwrap.dedent("""
        import torch

        def build(batch_size=1):
            return torch.nn.Linear(4, 2), (torch.randn(batch_size, 4),)
    """))
    return path


def policy_file(folder: Path, name: str, workload: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(f'name = "{name}"\nworkload = "{workload}"\nbatch_size = 8\n')
    return path


def test_a_relative_workload_path_is_read_against_the_policys_folder(tmp_path, monkeypatch):
    policies = tmp_path / "app" / "policies"
    model = model_file(tmp_path / "app" / "models")
    beside = policy_file(policies, "beside", "model.py:build")
    model_file(policies)
    up = policy_file(policies, "up", "../models/model.py:build")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # where a daemon or a CLI may run from

    assert load_policy(beside, check_workload=True).workload == f"{policies / 'model.py'}:build"
    assert load_policy(up, check_workload=True).workload == f"{model}:build"
    result = CliRunner().invoke(main, ["policy", "check", str(beside), str(up)])
    assert result.exit_code == 0, result.output


def test_the_daemon_loads_a_policy_whose_workload_is_beside_it_from_anywhere(tmp_path, monkeypatch):
    policies = tmp_path / "policies"
    model_file(policies)
    policy_file(policies, "svc", "model.py:build")
    monkeypatch.chdir(tmp_path)
    loaded, errors = load_policy_folders([policies])
    assert errors == [] and [p.name for p in loaded] == ["svc"]


def test_a_missing_relative_file_is_named_where_it_was_looked_for(tmp_path, monkeypatch):
    policies = tmp_path / "policies"
    path = policy_file(policies, "svc", "nothere.py:build")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["policy", "check", str(path), "--json"])
    [problem] = json.loads(result.stdout)[0]["problems"]
    assert result.exit_code == 1 and str(policies / "nothere.py") in problem["found"]


def _daemon_once(cfg: Path) -> dict:
    logging.getLogger("joulepilot").handlers.clear()
    result = CliRunner().invoke(main, ["daemon", "--config", str(cfg), "--once", "--json"])
    assert result.exit_code in (0, 1), (result.output, result.stderr)  # 1: a policy file could not be loaded
    return json.loads(result.stdout)


def test_a_request_for_a_file_in_the_daemons_folder_says_what_differs(tmp_path, restore_logging):
    """One file in the folder does not load, another defines a policy of another name than the request's: each
    refusal says so, never that the file is not in the daemon's folders."""
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    broken = policy_file(policies, "broken", "mlpp")
    renamed = policy_file(policies, "renamed", "mlp")
    renamed.write_text(renamed.read_text().replace('name = "renamed"', 'name = "renamed-v2"') +
                       '[search]\nmodes = ["eager"]\nstrategy = "exhaustive"\nmin_repeats = 1\n')
    store = open_db(db)
    # Measured already under this host's provenance, so the pass decides renamed-v2 without running a benchmark.
    seed_runs(store, {("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 30.0}})
    store.execute("UPDATE runs SET provenance_key = ?", [probe_device("cpu").provenance_key])
    add_request(store, "broken", workload="mlpp", note=json.dumps({"policy_path": str(broken)}))
    add_request(store, "renamed", workload="mlp", note=json.dumps({"policy_path": str(renamed)}))
    store.conn.commit()
    store.close()
    cfg = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)

    summary = _daemon_once(cfg)

    refused = {r["policy"]: r["reason"] for r in summary["refused_requests"]}
    assert "is not in the daemon's policy folders" not in " ".join(refused.values())
    assert "could not load it" in refused["broken"] and "did you mean 'mlp'?" in refused["broken"]
    assert "defines policy 'renamed-v2', not 'renamed'" in refused["renamed"]
