"""How long joulepilot.compile's decision lookup takes with a store of 10,000 runs.

Builds a store (synthetic runs written with insert_run in one transaction, plus decisions for 50
policies x 4 device kinds x 3 torch versions), then times `joulepilot.runtime.lookup_decision` — find
and load the policy (cached by mtime), look for a lock entry, query the store — N times each:
  * `store`: no lock file, the decision comes from the store;
  * `lock`: the lock file beside the policy answers.
The first call of each (opening the database, parsing the policy) is reported apart as `first_ms`.

    python benchmarks/decision_lookup.py [--runs 10000] [--repeat 2000]

Writes benchmarks/results/decision_lookup.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from joulepilot.compiler import CompileConfig, workload_id
from joulepilot.policies import Decision, load_policy, record_decision, torch_minor, write_lock
from joulepilot.runtime import lookup_decision
from joulepilot.store import insert_run, open_db, transaction, upsert_config, upsert_host, upsert_workload

POLICY = """
name = "bench-policy"
workload = "mlp"
batch_size = 8
[objective]
minimize = "energy"
[limits]
max_avg_power_w = 300
[search]
modes = ["eager", "default"]
precisions = ["fp32", "bf16"]
[fallback]
mode = "eager"
"""


def build_store(path: Path, n_runs: int) -> None:
    rng = random.Random(0)
    db = open_db(path)
    host_id = upsert_host(db)
    configs = [CompileConfig(m, precision=p, batch_size=8) for m in ("eager", "default", "reduce-overhead")
               for p in ("fp32", "bf16", "fp16")]
    workloads = []
    for i in range(20):
        spec = f"pkg.models:model_{i}"
        wid = workload_id(spec, 8)
        upsert_workload(db, {"id": wid, "spec": spec, "batch_size": 8, "params": 10**6 * (i + 1),
                             "flops_per_inference": 1e9 * (i + 1), "graph_nodes": 50 + i})
        workloads.append(wid)
    for cfg in configs:
        upsert_config(db, cfg.to_row())
    t0 = time.time() - 86400
    with transaction(db):
        for i in range(n_runs):
            latency = rng.uniform(1, 20)
            power = rng.uniform(100, 600)
            insert_run(db, {
                "workload_id": rng.choice(workloads), "config_id": rng.choice(configs).id, "host_id": host_id,
                "device": "cuda:0", "device_name": "NVIDIA H200", "status": "ok", "started_at": t0 + i,
                "finished_at": t0 + i + 1, "compile_s": rng.uniform(0, 60), "latency_ms_p50": latency,
                "latency_ms_p95": latency * 1.05, "avg_power_w": power, "peak_power_w": power * 1.1,
                "energy_j_per_inference": power * latency / 1000, "energy_source": "nvml",
                "torch_version": "2.11.0", "max_rel_error": 1e-5,
            }, [(k * 0.1, "gpu:0", power) for k in range(20)])
    with transaction(db):
        for p in range(50):
            for kind in ("cpu", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
                for tv in ("2.10", "2.11", torch_minor()):
                    decision = Decision(policy=f"policy-{p}", policy_hash="x", device_kind=kind, torch_version=tv,
                                        workload="mlp", workload_id=workloads[0], config=configs[p % 9].to_row(),
                                        state="verified", reason="benchmark filler", objective="energy",
                                        expected_inferences=1000, decided_at=t0 + p)
                    record_decision(db, decision)
    db.close()


def time_lookup(policy_path: Path, db_path: Path, repeat: int) -> dict[str, float]:
    tv = torch_minor()
    start = time.perf_counter()
    found = lookup_decision(policy_path, "cpu", tv, db_path)
    first_ms = (time.perf_counter() - start) * 1000
    assert found is not None
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        lookup_decision(policy_path, "cpu", tv, db_path)
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return {"first_ms": first_ms, "median_ms": statistics.median(samples),
            "p95_ms": samples[int(0.95 * (len(samples) - 1))], "max_ms": samples[-1], "n": repeat,
            "source": found.source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "decision_lookup.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        db_path = tmp_path / "store.db"
        started = time.perf_counter()
        build_store(db_path, args.runs)
        build_s = time.perf_counter() - started
        policy_path = tmp_path / "bench-policy.toml"
        policy_path.write_text(POLICY)
        policy = load_policy(policy_path)
        db = open_db(db_path)
        decision = Decision(policy=policy.name, policy_hash=policy.hash, device_kind="cpu",
                            torch_version=torch_minor(), workload="mlp", workload_id=workload_id("mlp", 8),
                            config=CompileConfig("default", batch_size=8).to_row(), state="verified",
                            reason="benchmark", objective="energy", expected_inferences=1000)
        record_decision(db, decision)
        n_runs = db.execute("SELECT count(*) FROM runs").fetchone()[0]
        n_decisions = db.execute("SELECT count(*) FROM decisions").fetchone()[0]
        db.close()
        store = time_lookup(policy_path, db_path, args.repeat)
        write_lock(policy_path, decision)
        lock = time_lookup(policy_path, db_path, args.repeat)

    result = {"runs": n_runs, "decisions": n_decisions, "build_s": round(build_s, 2), "store": store, "lock": lock,
              "target_median_ms": 5.0, "python": platform.python_version(), "machine": platform.machine(),
              "measured_at": time.time()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name in ("store", "lock"):
        r = result[name]
        print(f"{name:5s}: median {r['median_ms']:.3f} ms, p95 {r['p95_ms']:.3f} ms, first call {r['first_ms']:.1f} ms "
              f"(n={r['n']}, {n_runs} runs, {n_decisions} decisions)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
