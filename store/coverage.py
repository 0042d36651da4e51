"""What the stored runs cover: which device kinds and torch versions have ok measurements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .connection import Store
from .devicekind import device_kind
from .torchversion import torch_major_minor


def ok_run_groups(db: Store) -> list[dict[str, Any]]:
    """Ok runs counted per workload, device, device name and torch version (raw values, as stored)."""
    cur = db.execute(
        "SELECT workload_id, device, device_name, torch_version, COUNT(*) AS runs FROM runs WHERE status = 'ok' "
        "GROUP BY workload_id, device, device_name, torch_version")
    names = [c[0] for c in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


@dataclass
class RunCoverage:
    """Device kinds with any ok run in the store, and the (device kind, torch major.minor) pairs one
    workload has ok runs on: [{device_kind, torch_version, runs}], sorted."""

    device_kinds: set[str]
    workload_pairs: list[dict[str, Any]]


def run_coverage(db: Store, workload_id: str) -> RunCoverage:
    kinds: set[str] = set()
    pairs: dict[tuple[str, str], int] = {}
    for group in ok_run_groups(db):
        kind = device_kind(group)
        kinds.add(kind)
        if group["workload_id"] == workload_id:
            key = (kind, torch_major_minor(group["torch_version"]))
            pairs[key] = pairs.get(key, 0) + group["runs"]
    listed = [{"device_kind": k, "torch_version": t, "runs": n} for (k, t), n in sorted(pairs.items())]
    return RunCoverage(kinds, listed)
