"""Guided searches take turns a whole search at a time (one per device), and a device keeps the workload whose
zygote it has up: with two policies of two workloads on one device, the pass measures one workload's
configurations, then the other's, instead of alternating (which would close and start each workload's zygote
again at every job)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from daemon_factories import write_daemon_config, write_policy
from joulepilot.compiler.zygote import FORKED
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.daemon_config import load_daemon_config
from joulepilot.controller.gpu_scheduler import assign_jobs
from joulepilot.store import list_runs, open_db
from joulepilot.store.jsonvalues import json_object


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def _job(job_id: int, workload: str) -> SimpleNamespace:
    return SimpleNamespace(id=job_id, workload_id=workload)


def test_a_device_takes_the_job_of_the_workload_it_measured_last():
    jobs = [_job(1, "a"), _job(2, "b"), _job(3, "a")]
    pairs, left = assign_jobs(["cuda:0", "cuda:1"], jobs, {"cuda:0": "b", "cuda:1": "a"})
    assert [(device, job.id) for device, job in pairs] == [("cuda:0", 2), ("cuda:1", 1)]
    assert [job.id for job in left] == [3]


def test_a_new_device_leaves_another_devices_workload_alone_where_it_can():
    jobs = [_job(1, "a"), _job(2, "b")]
    pairs, left = assign_jobs(["cuda:1"], jobs, {"cuda:0": "a"})  # cuda:0 busy with a, its zygote up
    assert [(device, job.id) for device, job in pairs] == [("cuda:1", 2)] and [job.id for job in left] == [1]
    pairs, left = assign_jobs(["cuda:1"], [_job(1, "a")], {"cuda:0": "a"})  # nothing else queued: take it
    assert [(device, job.id) for device, job in pairs] == [("cuda:1", 1)] and left == []
    assert assign_jobs([], jobs, {}) == ([], jobs) and assign_jobs(["cpu"], [], {}) == ([], [])


def test_two_guided_searches_on_one_device_run_one_after_the_other(tmp_path, flow_worker, own_tmpdir,
                                                                     restore_logging):
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    for name, workload in (("first", "mlp"), ("second", "tests.workload_factories:linear")):
        path = write_policy(policies, name, workload=workload, modes=("eager", "default"), strategy="guided")
        path.write_text(path.read_text() + "max_measurements = 2\n")  # the baseline and one more
    cfg = load_daemon_config(write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies,
                                                 min_seconds=0.2))
    result = Daemon(cfg).run(once=True)
    assert result.exit_code == 0, result.summary
    runs = sorted(list_runs(open_db(db)), key=lambda r: r["id"])
    specs = [json_object(r["extra"]).get("policy") for r in runs]
    assert specs.count("first") == 2 and specs.count("second") == 2, specs
    switches = sum(1 for before, after in zip(specs, specs[1:], strict=False) if before != after)
    assert switches == 1, specs  # one search to its end, then the other: each workload's zygote started once
    assert {json_object(r["extra"])["worker_process"] for r in runs} == {FORKED}
