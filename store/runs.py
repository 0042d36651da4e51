"""Measured runs as the deciding code reads them: typed rows, filtered by workload, device kind and
torch version, and the latest run of each configuration.

`RunRow` holds a `runs` row with the workload spec and the configuration's knobs joined in, `extra`
and `options` decoded. (`records.list_runs` keeps plain dicts for the CLI's tables and JSON.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .compile_energy import complete_compile_energy_j
from .connection import Store
from .devicekind import device_kind as kind_of
from .jsonvalues import json_object
from .records import RUN_LIST_SQL
from .rows import StoredRow
from .torchversion import torch_major_minor


@dataclass
class RunRow(StoredRow):
    """One run: the `runs` columns, then its workload's spec and its configuration's label and knobs."""

    id: int
    workload_id: str
    config_id: str
    host_id: str
    device: str
    status: str
    started_at: float
    device_name: str | None = None
    reason: str | None = None
    finished_at: float | None = None
    compile_s: float | None = None
    compile_energy_j: float | None = None
    warmup_s: float | None = None
    window_s: float | None = None
    inferences: int | None = None
    latency_ms_p50: float | None = None
    latency_ms_p95: float | None = None
    throughput_per_s: float | None = None
    energy_j: float | None = None
    energy_j_per_inference: float | None = None
    energy_above_idle_j_per_inference: float | None = None
    idle_power_w: float | None = None
    avg_power_w: float | None = None
    peak_power_w: float | None = None
    energy_source: str | None = None
    peak_memory_bytes: int | None = None
    graph_breaks: int | None = None
    recompiles: int | None = None
    max_rel_error: float | None = None
    torch_version: str | None = None
    triton_version: str | None = None
    driver_version: str | None = None
    joulepilot_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    provenance_key: str | None = None
    energy_above_idle_j: float | None = None
    artifacts_path: str | None = None
    warm_start_s: float | None = None
    compile_energy_gpu_j: float | None = None
    compile_energy_gpu_source: str | None = None
    compile_energy_cpu_j: float | None = None
    compile_energy_cpu_source: str | None = None
    # a generation's figures (NULL for a forward pass): J per generated token (prefill and decode of the whole
    # batch), time to first token and per output token, tokens per second, greedy tokens equal to eager's
    energy_j_per_token: float | None = None
    ttft_ms_p50: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p95: float | None = None
    tokens_per_s: float | None = None
    tokens_match: int | None = None
    # `extra`'s policy, first_run_id and pending_id, indexed (schema.RUN_INDEX_COLUMNS)
    policy: str | None = None
    first_run_id: int | None = None
    pending_id: str | None = None
    # joined from workloads and configs
    workload: str | None = None
    config_label: str | None = None
    mode: str | None = None
    fusion: str | None = None
    precision: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    dynamic: int | None = None
    batch_size: int | None = None
    padding: str | None = None
    regional: str | None = None
    cache: str | None = None
    compile_prefill: int | None = None
    task: str | None = None  # 'generate', or None for a forward pass
    prompt_len: int | None = None
    new_tokens: int | None = None
    model_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_columns(cls, row: Any) -> RunRow:
        run = super().from_columns(row)
        run.extra = json_object(run.extra)
        run.options = json_object(run.options)
        run.model_options = json_object(run.model_options)
        return run

    @property
    def device_kind(self) -> str:
        return kind_of(self)

    @property
    def torch_minor(self) -> str:
        return torch_major_minor(self.torch_version)

    @property
    def complete_compile_energy_j(self) -> float | None:
        """GPU + CPU compile joules when every part was metered, else None (`store.compile_energy`)."""
        return complete_compile_energy_j(self)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _runs(db: Store, where: str, args: list[Any]) -> list[RunRow]:
    """Runs newest first (highest id first)."""
    cur = db.execute(f"{RUN_LIST_SQL} WHERE {where} ORDER BY runs.id DESC", args)
    names = [c[0] for c in cur.description]
    return [RunRow.from_columns(dict(zip(names, values, strict=True))) for values in cur.fetchall()]


def ok_runs(db: Store, *, workload: str | None = None) -> list[RunRow]:
    """Every ok run, newest first; `workload`: only runs of this workload spec (any batch or shape)."""
    if workload is None:
        return _runs(db, "runs.status = 'ok'", [])
    return _runs(db, "runs.status = 'ok' AND workloads.spec = ?", [workload])


def workload_runs(db: Store, workload_id: str, device_kind: str | None = None,
                  torch_version: str | None = None) -> list[RunRow]:
    """Every run (ok or failed) of one workload, newest first; `device_kind` ('cpu' or a GPU's name) and
    `torch_version` (major.minor) keep the runs on that kind and torch when given."""
    return [run for run in _runs(db, "runs.workload_id = ?", [workload_id])
            if (device_kind is None or run.device_kind == device_kind)
            and (torch_version is None or run.torch_minor == torch_version)]


def latest_per_config(runs: Iterable[RunRow], *, failed_if_no_ok: bool = False) -> dict[str, RunRow]:
    """config_id -> its latest ok run, from runs given newest first. `failed_if_no_ok`: a configuration
    with no ok run gets its latest failed run instead (left out otherwise). Keys come newest first."""
    latest: dict[str, RunRow] = {}
    for run in runs:
        have = latest.get(run.config_id)
        if run.ok:
            if have is None or not have.ok:
                latest[run.config_id] = run
        elif failed_if_no_ok and have is None:
            latest[run.config_id] = run
    return latest


def ok_runs_per_config(db: Store, workload_id: str, device_kind: str,
                       torch_version: str | None = None) -> dict[str, list[RunRow]]:
    """config_id -> every ok run of the workload on `device_kind` under torch major.minor `torch_version`
    (None: any torch), newest first: each repeat of a configuration, not only its latest."""
    grouped: dict[str, list[RunRow]] = {}
    for run in workload_runs(db, workload_id, device_kind, torch_version):
        if run.ok:
            grouped.setdefault(run.config_id, []).append(run)
    return grouped


def latest_runs(db: Store, workload_id: str, device_kind: str, torch_version: str | None = None,
                *, failed_if_no_ok: bool = False) -> dict[str, RunRow]:
    """config_id -> the latest ok run of the workload on `device_kind` under torch major.minor
    `torch_version` (None: any torch); `failed_if_no_ok` as in `latest_per_config`."""
    return latest_per_config(workload_runs(db, workload_id, device_kind, torch_version),
                             failed_if_no_ok=failed_if_no_ok)


def recent_ok_runs(db: Store, workload_id: str, provenance_key: str, min_finished_at: float
                   ) -> list[RunRow]:
    """Ok runs of a workload under one provenance finished since `min_finished_at`, newest first."""
    return _runs(db, "runs.workload_id = ? AND runs.provenance_key = ? AND runs.status = 'ok' "
                     "AND COALESCE(runs.finished_at, runs.started_at) >= ?",
                 [workload_id, provenance_key, min_finished_at])


def warm_start_source(db: Store, workload_id: str, config_id: str, *, host_id: str, provenance_key: str,
                      min_finished_at: float | None = None) -> int | None:
    """The id of the newest ok run of `config_id` on `workload_id` that this host made under one provenance
    (finished since `min_finished_at`, when given), compiling cold and saving its compile artifacts; None when
    there is none."""
    where = ("workload_id = ? AND config_id = ? AND host_id = ? AND provenance_key = ? AND status = 'ok' "
             "AND compile_s IS NOT NULL AND artifacts_path IS NOT NULL")
    args: list[Any] = [workload_id, config_id, host_id, provenance_key]
    if min_finished_at is not None:
        where += " AND COALESCE(finished_at, started_at) >= ?"
        args.append(min_finished_at)
    row = db.execute(f"SELECT id FROM runs WHERE {where} ORDER BY id DESC LIMIT 1", args).fetchone()
    return None if row is None else int(row[0])


def configs_measured_by(db: Store, host_id: str, provenance_key: str) -> set[str]:
    """The configurations this host has a run of (any workload, any status) under one provenance."""
    return {row[0] for row in db.execute("SELECT DISTINCT config_id FROM runs WHERE host_id = ? AND provenance_key = ?",
                                         [host_id, provenance_key]).fetchall()}


def daemon_runs(db: Store, policy: str | None = None) -> list[RunRow]:
    """Runs the daemon made for a policy (`extra.policy`, any policy when None), newest first."""
    if policy is None:
        return _runs(db, "runs.policy IS NOT NULL", [])
    return _runs(db, "runs.policy = ?", [policy])


def further_window_run_ids(db: Store, first_run_id: int) -> list[int]:
    """The runs stored as further windows of the worker process whose first run is `first_run_id`
    (`extra.first_run_id`), oldest first."""
    rows = db.execute("SELECT id FROM runs WHERE first_run_id = ? ORDER BY id", [int(first_run_id)]).fetchall()
    return [int(row[0]) for row in rows]


def runs_by_id(db: Store, run_ids: Iterable[int]) -> list[RunRow]:
    """The stored runs among `run_ids`, newest first (ids not stored are left out)."""
    ids = sorted({int(i) for i in run_ids})
    if not ids:
        return []
    return _runs(db, f"runs.id IN ({', '.join('?' for _ in ids)})", ids)
