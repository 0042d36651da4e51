"""The batch-size lever: which batch sizes a policy's grid covers, and where their runs are stored.

A policy serves at its `batch_size`; `[search] batch_sizes` allows the search to measure other batch sizes
too. The grid then covers every allowed configuration at each of them, the policy's `batch_size` always
among them (the baselines reports compare against, eager fp32 and stock compile fp32, stay at it), and the
objective is energy per sample (J per call / batch size) so that configurations of different batch sizes
compare; latency limits stay per call. Without `batch_sizes` the grid is the policy's batch size alone and
nothing changes: the objective is J per call, as before.

A workload's identity includes its batch size (`compiler.workload_id`): each batch size's runs are stored
under a workload of its own, so a policy with the lever reads the runs of several workloads, one per batch
size, whose configurations never overlap (the batch size is part of a configuration's id).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from joulepilot.store import Store
from joulepilot.store.catalog import workload_row as stored_workload
from joulepilot.store.runs import RunRow, workload_runs

from .schema import Policy


def grid_batch_sizes(policy: Policy) -> tuple[int, ...]:
    """The batch sizes the policy's grid covers: its `batch_size` first, then `[search] batch_sizes`."""
    listed = getattr(policy.search, "batch_sizes", None) or ()
    return tuple(dict.fromkeys((int(policy.batch_size), *(int(b) for b in listed))))


def per_sample(policy: Policy) -> bool:
    """Whether the policy's objective is per sample: its grid spans several batch sizes."""
    return len(grid_batch_sizes(policy)) > 1


def batch_workload_id(policy: Policy, batch_size: int | None = None) -> str:
    """The id of the policy's workload at `batch_size` (default: the policy's own)."""
    from joulepilot.compiler import workload_id

    batch = int(batch_size or policy.batch_size)
    return workload_id(policy.workload, batch, **policy.workload_args())


def config_workload_id(policy: Policy, config: Any) -> str:
    """The workload a configuration of the policy's grid is measured (and its runs stored) under: the
    policy's workload at the configuration's own batch size. `config`: a CompileConfig or a configs row."""
    batch = config.get("batch_size") if isinstance(config, Mapping) else getattr(config, "batch_size", None)
    return batch_workload_id(policy, batch)


def grid_workload_ids(policy: Policy) -> dict[int, str]:
    """batch size -> workload id, for every batch size of the grid (the policy's own first)."""
    return {batch: batch_workload_id(policy, batch) for batch in grid_batch_sizes(policy)}


def grid_runs(db: Store, policy: Policy, device_kind: str | None = None,
              torch_version: str | None = None) -> list[RunRow]:
    """Every run (ok or failed) of the policy's workload at each batch size of its grid, newest first;
    `device_kind` and `torch_version` (major.minor) as in `store.workload_runs`."""
    ids = list(grid_workload_ids(policy).values())
    if len(ids) == 1:
        return workload_runs(db, ids[0], device_kind, torch_version)
    runs = [run for wid in ids for run in workload_runs(db, wid, device_kind, torch_version)]
    return sorted(runs, key=lambda r: -int(r.id or 0))


def workload_rows_by_batch(db: Store, policy: Policy) -> dict[int, dict[str, Any] | None]:
    """batch size -> the workloads row the trade-off model predicts a configuration of that batch size with.

    The stored row of that batch size's workload when it was described (it has FLOPs or parameters), else one
    made from a described row of another batch size of the grid (the policy's own first): the same model with
    this batch size and FLOPs per call scaled by it. None for every batch size when none is described."""
    stored = {batch: stored_workload(db, wid) for batch, wid in grid_workload_ids(policy).items()}

    def described(row: Mapping[str, Any] | None) -> bool:
        return row is not None and bool(row.get("flops_per_inference") or row.get("params"))

    reference_batch = next((b for b, row in stored.items() if described(row)), None)
    if reference_batch is None:
        return {b: (dict(row) if row is not None else None) for b, row in stored.items()}
    reference = stored[reference_batch]
    out: dict[int, dict[str, Any] | None] = {}
    for batch, row in stored.items():
        if described(row):
            out[batch] = dict(row)  # type: ignore[arg-type]
            continue
        scaled = dict(reference)  # type: ignore[arg-type]
        scaled.update(id=batch_workload_id(policy, batch), batch_size=batch)
        flops = reference.get("flops_per_inference")  # type: ignore[union-attr]
        if flops:
            scaled["flops_per_inference"] = float(flops) * batch / reference_batch
        out[batch] = scaled
    return out


def batch_note(policy: Policy, config: Mapping[str, Any]) -> str:
    """'' when `config` is at the policy's batch size; else a sentence naming the batch size it was chosen
    at, for a decision's reason (the hook does not change the caller's batch)."""
    batch = int(config.get("batch_size") or policy.batch_size)
    if batch == int(policy.batch_size):
        return ""
    searched = ", ".join(map(str, sorted(grid_batch_sizes(policy))))
    return (f"it runs at batch size {batch}, not the policy's batch_size {policy.batch_size} (the search compared "
            f"batch sizes {searched} in J per sample): its figures hold when the model is served batches of {batch}")
