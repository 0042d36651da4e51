"""Which daemon job describes a workload (parameters, FLOPs, graph) on a GPU: for a guided policy the baseline,
since the search picks the next configuration from the trade-off model's predictions, which need the
description; for an exhaustive one the first compiled job, so that the eager baseline does not wait for Dynamo.
The pass runs in this process (`Daemon.run(once=True)`); the job's measurement raises before any worker starts,
so the test sees the daemon's choice, not a measurement."""

from __future__ import annotations

import importlib
import logging

import pytest
from daemon_factories import write_daemon_config, write_policy
from joulepilot.compiler import CompileConfig
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import load_daemon_config

bench_module = importlib.import_module("joulepilot.compiler.bench")  # the package exports `bench`, the function


def test_the_rule_on_a_gpu():
    eager, default = CompileConfig(mode="eager"), CompileConfig(mode="default")
    assert not bench_module.describes_now("cuda:0", eager, True)
    assert bench_module.describes_now("cuda:0", eager, True, next_job_planned_from_it=True)
    assert bench_module.describes_now("cuda:0", default, True, next_job_planned_from_it=False)


@pytest.mark.parametrize(("strategy", "planned_from_it"), [("guided", True), ("exhaustive", False)])
def test_the_daemon_tells_the_rule_whether_the_search_plans_from_the_job(tmp_path, flow_worker, own_tmpdir,
                                                                        monkeypatch, strategy, planned_from_it):
    write_policy(tmp_path / "policies", "mlp", modes=("eager", "default"), strategy=strategy)
    path = write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=tmp_path / "policies",
                               min_seconds=0.2)
    path.write_text(path.read_text().replace("[bench]\n", "[bench]\nmax_attempts = 1\n"))
    asked = []
    original = bench_module.describes_now

    def recording(device, config, a_later_job_compiles, **kwargs):
        asked.append((config.mode, kwargs.get("next_job_planned_from_it", False)))
        return original(device, config, a_later_job_compiles, **kwargs)

    def cannot_meter(self, device):
        raise RuntimeError(f"no meter can read {device}")

    monkeypatch.setattr(bench_module, "describes_now", recording)
    monkeypatch.setattr(Daemon, "_pass_context", cannot_meter)
    logging.getLogger("joulepilot").handlers.clear()
    Daemon(load_daemon_config(path)).run(once=True)
    assert asked and asked[0] == ("eager", planned_from_it)
