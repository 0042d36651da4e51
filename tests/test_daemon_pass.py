"""The daemon for real: policy folder -> measured runs (the first through a real Inductor compile), decisions,
lock files. The first pass is a daemon process of its own; the passes after it, about what the daemon redoes,
run the same command in this process (`joulepilot daemon --once` through click), which saves a process start
with its imports per pass and checks the same summary, log and store."""

from __future__ import annotations

import json
import logging
import subprocess

from cache_checks import assert_compiled_from_caches
from click.testing import CliRunner
from daemon_factories import TESTS_DIR, daemon_cmd, query, use_flow_worker, write_daemon_config, write_policy
from joulepilot.policies import read_lock, torch_minor
from joulepilot.policies.resolve import REPEAT_LIMIT
from joulepilot.store import open_db
from joulepilot.store.daemon_state import add_request

from joulepilot.cli import main


def once_in_a_process(config):
    proc = subprocess.run(daemon_cmd("--config", str(config), "--once", "--json"), capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def once(config):
    """The same pass in this process. The daemon logs to the stderr it finds when it first configures logging;
    each pass here gets a stderr of its own, so its handler is set up again."""
    logging.getLogger("joulepilot").handlers.clear()
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    return json.loads(result.stdout), result.stderr


def flagged(db) -> bool:
    """Whether the newest ok run carries bench's "repeat this run" flag."""
    extra = query(db, "SELECT extra FROM runs WHERE status = 'ok' ORDER BY id DESC LIMIT 1")[0]["extra"]
    return "window_warning" in json.loads(extra or "{}")


def status(db):
    result = CliRunner().invoke(main, ["status", "--db", str(db), "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    return json.loads(result.stdout)


def test_once_measures_decides_locks_then_only_redecides_what_changed(tmp_path, monkeypatch, restore_logging):
    db = tmp_path / "j.db"
    policies = tmp_path / "policies"
    # One compiled configuration keeps this test quick; cheapest-first ordering is tested in the units
    # and in the fault tests. Its workload is one Linear layer: a real Inductor compile that needs no C++
    # build (test_bench_cli compiles the built-in mlp, C++ kernels included).
    policy_file = write_policy(policies, "mlp", workload=f"{TESTS_DIR / 'workload_factories.py'}:linear",
                               modes=("default",))
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)

    # Pass 1: nothing known -> a measurement (a real Inductor compile), a decision, a lock file.
    summary, _ = once_in_a_process(config)
    assert summary["stale"] == [{"policy": "mlp", "reason": "no decision yet"}]
    assert summary["enqueued"] == 1 and summary["runs_ok"] == 1 and summary["runs_failed"] == 0
    assert [d["policy"] for d in summary["decided"]] == ["mlp"]
    runs = query(db, "SELECT runs.*, configs.mode FROM runs JOIN configs ON configs.id = runs.config_id ORDER BY runs.id")
    assert [r["mode"] for r in runs] == ["default"]
    assert all(r["status"] == "ok" and r["provenance_key"] == summary["provenance_key"] for r in runs)
    assert all(r["energy_j_per_inference"] > 0 and r["finished_at"] for r in runs)
    jobs = query(db, "SELECT * FROM jobs ORDER BY id")
    assert [j["state"] for j in jobs] == ["done"]
    for job, run in zip(jobs, runs, strict=True):  # each job linked to the run it produced, and back
        assert job["run_id"] == run["id"] and json.loads(run["extra"])["job_id"] == job["id"]
    decisions = query(db, "SELECT * FROM decisions")
    # The policy asks for one run (`min_repeats = 1`, write_policy's default for the daemon's tests: the
    # exhaustive strategy's repeats are test_exhaustive_repeats.py's), so the measured configuration is
    # verified; while bench flagged its run "repeat this run" (a contended host), the decision is provisional
    # and applies the fallback instead.
    applies_measured = not flagged(db)
    state = "verified" if applies_measured else "provisional"
    assert len(decisions) == 1 and decisions[0]["state"] == state and decisions[0]["device_kind"] == "cpu"
    if applies_measured:
        assert decisions[0]["config_id"] == runs[0]["config_id"]
        assert decisions[0]["reason"].endswith("1 of 1 candidates measured within limits")
    assert json.loads(decisions[0]["details"])["provenance_key"] == summary["provenance_key"]
    entry = read_lock(policy_file, "cpu", torch_minor())
    assert entry is not None and entry["config_id"] == decisions[0]["config_id"]
    assert summary["lock_files"] == [str(policy_file.with_name("mlp.lock.json"))]
    # The compiled configuration's warm start is timed: a worker with empty caches loads the saved artifacts,
    # and its first call hits them. It is the decided one, or, while its run is flagged and the fallback is
    # applied, the runner-up.
    (warm,) = summary["warm_starts"]
    assert warm["role"] == ("decided" if applies_measured else "runner-up")
    assert warm["run_id"] == runs[0]["id"] and warm["warm_start_s"] > 0
    stored = query(db, "SELECT warm_start_s, extra FROM runs WHERE id = ?", [runs[0]["id"]])[0]
    assert stored["warm_start_s"] == warm["warm_start_s"]
    stored_extra = json.loads(stored["extra"])
    assert_compiled_from_caches(stored_extra["warm_start_caches"], stored_extra.get("warm_start_cache_bypasses"), 1)
    assert stored_extra["warm_start_role"] == warm["role"] and stored_extra["job_wall_s"] > 0
    st = status(db)
    assert st["daemon"]["alive"] is False and st["daemon"]["state"] == "stopped"
    assert st["decisions"][0]["policy"] == "mlp" and st["decisions"][0]["state"] == state
    assert st["queue"]["counts"]["done"] == 1

    # Pass 1b: the policy asks for two runs -> a repeat in a fresh process, which starts from the artifacts the
    # cold run saved (a warm start, no second compile) and then measures as any run; a second repeat only where
    # bench flagged one of them.
    policy_file.write_text(policy_file.read_text().replace("min_repeats = 1", "min_repeats = 2"))
    summary, _ = once(config)
    assert summary["stale"] == [{"policy": "mlp", "reason": "the policy file changed"}]
    repeats = query(db, "SELECT * FROM runs WHERE id > ? ORDER BY id", [runs[0]["id"]])
    assert 1 <= len(repeats) == summary["enqueued"] <= 2
    for repeat in repeats:
        repeat_extra = json.loads(repeat["extra"])
        assert repeat["status"] == "ok" and repeat["compile_s"] is None and repeat["compile_energy_j"] is None
        assert repeat["warm_start_s"] > 0 and repeat_extra["warm_start_from"] == runs[0]["id"]
        assert_compiled_from_caches(repeat_extra["compile_caches"], repeat_extra.get("compile_cache_bypasses"), 1)
        assert repeat["energy_j_per_inference"] > 0 and repeat["artifacts_path"] is None
    assert summary["warm_starts"] == []  # the repeat was the decided configuration's warm start
    decision = query(db, "SELECT * FROM decisions ORDER BY id DESC LIMIT 1")[0]
    if not any("window_warning" in json.loads(r["extra"]) for r in [runs[0], *repeats]):
        assert decision["state"] == "verified" and decision["config_id"] == runs[0]["config_id"]
    extra_runs = len(repeats)

    # The passes below are about what the daemon redoes, not about compiling: their workers are the flow worker.
    use_flow_worker(monkeypatch)
    # While the decision asks for a repeat of a flagged run, the next pass measures it again (bounded).
    for _ in range(REPEAT_LIMIT):
        if not json.loads(query(db, "SELECT details FROM decisions ORDER BY id DESC LIMIT 1")[0]["details"])["repeat"]:
            break
        summary, _ = once(config)
        assert summary["stale"][0]["reason"] == 'runs it could rest on were flagged "repeat this run"'
        assert summary["enqueued"] == 1 and len(summary["decided"]) == 1
    n_runs, n_decisions = len(query(db, "SELECT id FROM runs")), len(query(db, "SELECT id FROM decisions"))
    assert n_runs - extra_runs <= REPEAT_LIMIT

    # Pass 2: everything current -> nothing new.
    summary, _ = once(config)
    assert summary["stale"] == [] and summary["enqueued"] == 0 and summary["decided"] == []
    assert len(query(db, "SELECT id FROM runs")) == n_runs and len(query(db, "SELECT id FROM decisions")) == n_decisions

    # Pass 3: the policy file changed (a new limit) -> re-decided from the measurements already made.
    policy_file.write_text(policy_file.read_text().replace("batch_size = 8", "batch_size = 8\n[limits]\n"
                                                          "max_p95_latency_ms = 10000"))
    summary, _ = once(config)
    assert summary["stale"] == [{"policy": "mlp", "reason": "the policy file changed"}]
    assert summary["enqueued"] == 0 and len(summary["decided"]) == 1
    decisions = query(db, "SELECT * FROM decisions ORDER BY id")
    assert len(decisions) == n_decisions + 1 and decisions[-1]["policy_hash"] != decisions[0]["policy_hash"]
    assert len(query(db, "SELECT id FROM runs")) == n_runs
    assert read_lock(policy_file, "cpu", torch_minor())["policy_hash"] == decisions[-1]["policy_hash"]

    # Pass 4: hooks' requests -> the daemon's own policy is re-decided and its request handled. One names a
    # policy file outside the daemon's folders (the hook's note says where): refused, since its workload is
    # code the daemon would run; it stays pending, like the request for a policy that exists nowhere.
    app_policy = write_policy(tmp_path / "app", "app-mlp", modes=("default",))
    database = open_db(db)
    add_request(database, "mlp", workload="mlp")
    add_request(database, "app-mlp", workload="mlp", note=json.dumps({"policy_path": str(app_policy)}))
    add_request(database, "nowhere", workload="mlp")
    database.close()
    summary, stderr = once(config)
    assert summary["requests"] == 3 and summary["unknown_requests"] == ["app-mlp", "nowhere"]
    refused = {r["policy"]: r for r in summary["refused_requests"]}
    assert str(app_policy) in refused["app-mlp"]["reason"] and "no policy named 'nowhere'" in refused["nowhere"]["reason"]
    assert "for policy 'app-mlp' refused" in stderr
    assert summary["stale"] == [{"policy": "mlp", "reason": "a hook requested it"}]
    assert [d["policy"] for d in summary["decided"]] == ["mlp"]
    handled = {r["policy"]: r["handled_at"] for r in query(db, "SELECT * FROM requests")}
    assert handled["mlp"] and handled["app-mlp"] is None and handled["nowhere"] is None
    assert read_lock(app_policy, "cpu", torch_minor()) is None
    assert len(query(db, "SELECT id FROM runs")) == n_runs
