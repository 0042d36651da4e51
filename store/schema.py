"""Table definitions and the ordered list of migrations; the store records the version (`Store.schema_version`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .compile_energy import PART_COLUMNS, legacy_parts
from .connection import Store
from .keys import provenance_key

# Version 1 is the first layout ever written; later versions are reached only through MIGRATIONS,
# so a database from any earlier release opens and is brought forward in place.
V1 = """
CREATE TABLE hosts (
    id TEXT PRIMARY KEY,            -- stable hash of hostname + machine id
    hostname TEXT NOT NULL,
    cpu TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE devices (
    id TEXT PRIMARY KEY,            -- host_id + '/' + device id ('gpu:0', 'cpu:0', ...)
    host_id TEXT NOT NULL REFERENCES hosts(id),
    device TEXT NOT NULL,           -- 'gpu:0', 'cpu:0', 'dram:0'
    kind TEXT NOT NULL,
    name TEXT,
    uuid TEXT,
    driver TEXT,
    power_limit_w REAL,
    memory_bytes INTEGER,
    source TEXT
);
CREATE TABLE workloads (
    id TEXT PRIMARY KEY,            -- hash of spec + batch size + input shape arguments
    spec TEXT NOT NULL,             -- 'mlp', 'torchvision:resnet50', 'pkg.mod:factory'
    batch_size INTEGER NOT NULL,
    params INTEGER,
    flops_per_inference REAL,       -- per batch (one forward call)
    graph_nodes INTEGER,
    op_mix TEXT,                    -- JSON {op family: count}
    inputs TEXT,                    -- JSON description of example inputs
    created_at REAL NOT NULL
);
CREATE TABLE configs (
    id TEXT PRIMARY KEY,            -- stable hash of the configuration
    label TEXT NOT NULL,
    mode TEXT NOT NULL,
    fusion TEXT NOT NULL,
    options TEXT NOT NULL,          -- JSON of raw Inductor overrides
    precision TEXT NOT NULL,
    dynamic INTEGER NOT NULL,
    batch_size INTEGER NOT NULL
);
CREATE TABLE runs (
    id INTEGER PRIMARY KEY,
    workload_id TEXT NOT NULL REFERENCES workloads(id),
    config_id TEXT NOT NULL REFERENCES configs(id),
    host_id TEXT NOT NULL REFERENCES hosts(id),
    device TEXT NOT NULL,           -- torch device string, 'cuda:0' or 'cpu'
    device_name TEXT,
    status TEXT NOT NULL,           -- 'ok' | 'failed'
    reason TEXT,
    started_at REAL NOT NULL,
    finished_at REAL,
    compile_s REAL,
    compile_energy_j REAL,
    warmup_s REAL,
    window_s REAL,
    inferences INTEGER,             -- forward calls in the timed window
    latency_ms_p50 REAL,
    latency_ms_p95 REAL,
    throughput_per_s REAL,          -- samples per second (batch_size * calls / s)
    energy_j REAL,                  -- whole timed window, metered devices together
    energy_j_per_inference REAL,    -- per forward call (one batch)
    energy_above_idle_j_per_inference REAL,
    idle_power_w REAL,
    avg_power_w REAL,
    peak_power_w REAL,
    energy_source TEXT,             -- 'nvml' | 'rapl' | 'estimate'
    peak_memory_bytes INTEGER,
    graph_breaks INTEGER,
    recompiles INTEGER,
    max_rel_error REAL,
    torch_version TEXT,
    triton_version TEXT,
    driver_version TEXT,
    joulepilot_version TEXT,
    extra TEXT                      -- JSON for anything else
);
CREATE INDEX runs_workload_config ON runs(workload_id, config_id);
CREATE TABLE power_samples (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    t_s REAL NOT NULL,              -- seconds since the window opened
    device TEXT NOT NULL,
    power_w REAL NOT NULL
);
CREATE INDEX power_samples_run ON power_samples(run_id);
CREATE TABLE decisions (
    id INTEGER PRIMARY KEY,
    policy TEXT NOT NULL,
    policy_hash TEXT NOT NULL,
    device_kind TEXT NOT NULL,
    torch_version TEXT NOT NULL,
    config_id TEXT,
    state TEXT NOT NULL,            -- 'verified' | 'provisional' | 'fallback' | 'violated'
    reason TEXT,
    decided_at REAL NOT NULL,
    details TEXT                    -- JSON: candidates, break-even, predictions
);
CREATE INDEX decisions_policy ON decisions(policy, device_kind, decided_at);
CREATE TABLE deployments (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    policy TEXT,
    workload_id TEXT,
    config_id TEXT,
    host_id TEXT,
    device TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE deployment_samples (
    id INTEGER PRIMARY KEY,
    deployment_id INTEGER NOT NULL REFERENCES deployments(id),
    t_start REAL NOT NULL,
    t_end REAL NOT NULL,
    energy_j REAL NOT NULL,
    inferences INTEGER NOT NULL,
    avg_power_w REAL,
    peak_power_w REAL,
    energy_source TEXT NOT NULL
);
CREATE INDEX deployment_samples_dep ON deployment_samples(deployment_id, t_start);
"""

# Version 2: provenance as one comparable key, idle-adjusted window energy, and the shared-GPU
# attribution of deployment samples.
V2 = """
ALTER TABLE runs ADD COLUMN provenance_key TEXT;
ALTER TABLE runs ADD COLUMN energy_above_idle_j REAL;
ALTER TABLE runs ADD COLUMN artifacts_path TEXT;
ALTER TABLE runs ADD COLUMN warm_start_s REAL;
ALTER TABLE deployment_samples ADD COLUMN other_processes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE deployment_samples ADD COLUMN share REAL;
ALTER TABLE deployment_samples ADD COLUMN config_id TEXT;
CREATE INDEX runs_provenance ON runs(workload_id, config_id, provenance_key);
"""

# Version 3: the daemon's durable work queue, the hooks' benchmark requests, heartbeats, and
# decision violations raised by the envelope guard.
V3 = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY,
    policy TEXT NOT NULL,
    workload TEXT,
    host_id TEXT,
    requested_at REAL NOT NULL,
    handled_at REAL,
    note TEXT
);
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY,
    policy TEXT NOT NULL,
    workload_id TEXT NOT NULL,
    config_id TEXT NOT NULL,
    provenance_key TEXT NOT NULL,
    state TEXT NOT NULL,            -- 'queued' | 'running' | 'done' | 'failed'
    run_id INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (workload_id, config_id, provenance_key)
);
CREATE TABLE heartbeats (
    id INTEGER PRIMARY KEY,
    pid INTEGER NOT NULL,
    host_id TEXT,
    at REAL NOT NULL,
    state TEXT NOT NULL,            -- 'idle' | 'sweeping' | 'paused' | 'fitting' | 'stopped'
    detail TEXT
);
CREATE TABLE violations (
    id INTEGER PRIMARY KEY,
    decision_id INTEGER,
    policy TEXT NOT NULL,
    deployment TEXT NOT NULL,
    config_id TEXT,
    limit_name TEXT NOT NULL,
    limit_value REAL NOT NULL,
    measured_value REAL NOT NULL,
    at REAL NOT NULL
);
"""

# Version 4: what a deployment was started with (device kind, energy source, the policy's limits), so
# reports can show the envelope without finding the policy file again.
V4 = """
ALTER TABLE deployments ADD COLUMN details TEXT;
"""

# Version 5: the compile window's energy in a GPU part and a CPU part, each with its source
# (`store.compile_energy`); `compile_energy_j` stays their sum. Older runs keep their one figure as the part
# of their device, the other part NULL ("not metered").
V5 = """
ALTER TABLE runs ADD COLUMN compile_energy_gpu_j REAL;
ALTER TABLE runs ADD COLUMN compile_energy_gpu_source TEXT;
ALTER TABLE runs ADD COLUMN compile_energy_cpu_j REAL;
ALTER TABLE runs ADD COLUMN compile_energy_cpu_source TEXT;
"""

# Version 6: how a configuration meets a set of input shapes ('none' | 'buckets': pad to shape buckets).
V6 = """
ALTER TABLE configs ADD COLUMN padding TEXT NOT NULL DEFAULT 'none';
"""

# Version 7: regional compilation, a configuration knob: '' compiles the whole model (every configuration
# stored before), 'auto' the most repeated block class, else the named block class.
V7 = """
ALTER TABLE configs ADD COLUMN regional TEXT NOT NULL DEFAULT '';
"""

# Version 8: generation workloads (a prompt, then new tokens against a KV cache). A workload gains its task
# ('generate'; NULL is a forward pass, every workload stored before), prompt and new-token counts and the model
# config's overrides (JSON, also of a forward pass built with them); a configuration its KV cache ('dynamic'
# unless set) and whether the prompt's forward pass is compiled too; a run the figures of a generation that a
# decision ranks or limits on (the rest of a generation's figures are in its `extra.generation`).
# The runs columns only a generation fills (NULL on a forward pass's run).
GENERATION_RUN_COLUMNS = ("energy_j_per_token", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p95", "tokens_per_s",
                          "tokens_match")
V8 = """
ALTER TABLE workloads ADD COLUMN task TEXT;
ALTER TABLE workloads ADD COLUMN prompt_len INTEGER;
ALTER TABLE workloads ADD COLUMN new_tokens INTEGER;
ALTER TABLE workloads ADD COLUMN model_options TEXT;
ALTER TABLE configs ADD COLUMN cache TEXT NOT NULL DEFAULT 'dynamic';
ALTER TABLE configs ADD COLUMN compile_prefill INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN energy_j_per_token REAL;
ALTER TABLE runs ADD COLUMN ttft_ms_p50 REAL;
ALTER TABLE runs ADD COLUMN tpot_ms_p50 REAL;
ALTER TABLE runs ADD COLUMN tpot_ms_p95 REAL;
ALTER TABLE runs ADD COLUMN tokens_per_s REAL;
ALTER TABLE runs ADD COLUMN tokens_match INTEGER;
"""

# Version 9: a metered generation counts the tokens it generated in each window (generated tokens of the whole
# batch, over the generate calls that ended in it), beside the calls; NULL for a deployment that serves forward
# calls (every window stored before).
V9 = """
ALTER TABLE deployment_samples ADD COLUMN tokens INTEGER;
"""

# Version 10: what the store looks runs up by, from `extra` into indexed columns (before, only SQLite's JSON
# functions could find them): the policy the daemon measured a run for, the first run of the worker whose further
# window a run is, and the id of the side file a run was committed under (`store.pending`). `extra` keeps them
# too; `run_index_columns` fills them from it on every insert, and the migration for the runs stored before.
RUN_INDEX_COLUMNS = {"policy": str, "first_run_id": int, "pending_id": str}
V10 = """
ALTER TABLE runs ADD COLUMN policy TEXT;
ALTER TABLE runs ADD COLUMN first_run_id INTEGER;
ALTER TABLE runs ADD COLUMN pending_id TEXT;
CREATE INDEX runs_policy ON runs(policy);
CREATE INDEX runs_first_run ON runs(first_run_id);
CREATE INDEX runs_pending ON runs(pending_id)
"""


# Version 11: a fleet's hosts share one store. A job is claimed by one host (`claimed_by`, a host id) for a lease
# that its daemon renews while it measures (`lease_expires_at`): a claim whose lease ran out belongs to a host that
# died, and goes back to the queue. `windows`: the energy windows its worker takes (NULL: one), so any host that
# claims it measures what the host that queued it asked. The provenance key no longer names the host or its
# driver (`keys.provenance_key`): the runs, jobs and decisions stored before are keyed again.
V11 = """
ALTER TABLE jobs ADD COLUMN claimed_by TEXT;
ALTER TABLE jobs ADD COLUMN lease_expires_at REAL;
ALTER TABLE jobs ADD COLUMN windows INTEGER;
CREATE INDEX jobs_state ON jobs(state)
"""


def run_index_columns(extra: Any) -> dict[str, Any]:
    """The RUN_INDEX_COLUMNS of a run from its `extra` (JSON text or a dict): None where it holds no value of the
    column's type. Python's JSON reads the NaN a worker's result may leave in `extra`, which SQLite's refused."""
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except (ValueError, RecursionError):
            extra = None
    if not isinstance(extra, dict):
        extra = {}
    return {name: value if isinstance(value, kind) and not isinstance(value, bool) else None
            for name, kind in RUN_INDEX_COLUMNS.items() for value in [extra.get(name)]}


Migration = Callable[[Store], None]


def _script(sql: str) -> Migration:
    def apply(db: Store) -> None:
        for statement in sql.split(";"):
            if statement.strip():
                db.execute(db.ddl(statement))

    return apply


def _v10(db: Store) -> None:
    _script(V10)(db)
    updates = []
    for run_id, extra in db.execute("SELECT id, extra FROM runs WHERE extra IS NOT NULL").fetchall():
        values = run_index_columns(extra)
        if any(v is not None for v in values.values()):
            updates.append([*values.values(), run_id])
    db.executemany(f"UPDATE runs SET {', '.join(f'{c} = ?' for c in RUN_INDEX_COLUMNS)} WHERE id = ?", updates)


def _v11(db: Store) -> None:
    _script(V11)(db)
    keys: dict[str, str] = {}
    updates = []
    for run_id, old, *stack in db.execute("SELECT id, provenance_key, device_name, torch_version, triton_version, "
                                          "joulepilot_version FROM runs WHERE provenance_key IS NOT NULL").fetchall():
        keys[old] = new = provenance_key(*stack)
        if new != old:
            updates.append([new, run_id])
    db.executemany("UPDATE runs SET provenance_key = ? WHERE id = ?", updates)
    taken: set[tuple[str, str, str]] = set()
    for job_id, workload_id, config_id, old in db.execute(
            "SELECT id, workload_id, config_id, provenance_key FROM jobs ORDER BY id DESC").fetchall():
        new = keys.get(old, old)
        if (workload_id, config_id, new) in taken:  # two hosts' jobs of one measurement: the newest stays
            db.execute("DELETE FROM jobs WHERE id = ?", [job_id])
            continue
        taken.add((workload_id, config_id, new))
        if new != old:
            db.execute("UPDATE jobs SET provenance_key = ? WHERE id = ?", [new, job_id])
    for decision_id, text in db.execute("SELECT id, details FROM decisions WHERE details IS NOT NULL").fetchall():
        try:
            details = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if isinstance(details, dict) and details.get("provenance_key") in keys:
            details["provenance_key"] = keys[details["provenance_key"]]
            db.execute("UPDATE decisions SET details = ? WHERE id = ?", [json.dumps(details, sort_keys=True), decision_id])


def _v5(db: Store) -> None:
    _script(V5)(db)
    rows = db.execute("SELECT id, device, compile_energy_j, energy_source FROM runs"
                        " WHERE compile_energy_j IS NOT NULL").fetchall()
    updates = []
    for run_id, device, compile_energy_j, energy_source in rows:
        parts = legacy_parts(device, compile_energy_j, energy_source)
        updates.append([parts[c] for c in PART_COLUMNS] + [run_id])
    db.executemany(f"UPDATE runs SET {', '.join(f'{c} = ?' for c in PART_COLUMNS)} WHERE id = ?", updates)


# MIGRATIONS[i] takes a database from version i to version i + 1.
MIGRATIONS: list[Migration] = [_script(V1), _script(V2), _script(V3), _script(V4), _v5, _script(V6), _script(V7),
                              _script(V8), _script(V9), _v10, _v11]
SCHEMA_VERSION = len(MIGRATIONS)
