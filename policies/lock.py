"""Lock files: decisions shipped beside the policy, for hosts without a database.

`<stem>.lock.json` sits next to `<stem>.toml` and holds one entry per device kind and torch
major.minor:

    {"format": 1, "policy": "resnet50",
     "entries": {"NVIDIA H200": {"2.11": {"config": {...configs row...}, "config_id": ..., "state": ...,
                                          "reason": ..., "policy_hash": ..., "decided_at": ...,
                                          "measured": {...}}}}}

Writing merges with the entries already there (other device kinds and torch versions are kept) and
replaces the file atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from joulepilot.store.safeio import FileRefused, read_regular_file

from .resolve import Decision

LOCK_FORMAT = 1


def lock_path(policy_path: str | os.PathLike) -> Path:
    path = Path(policy_path)
    return path.with_name(path.stem + ".lock.json")


def read_lock_file(policy_path: str | os.PathLike) -> dict[str, Any]:
    """The whole lock document ({} when there is none); a corrupt file raises ValueError naming it."""
    path = lock_path(policy_path)
    try:
        text = read_regular_file(path).decode("utf-8")
    except FileNotFoundError:
        return {}
    except FileRefused as exc:  # a FIFO would block open() for good; never wait on one
        raise ValueError(f"{path}: {exc.reason}; remove it and run `joulepilot policy lock {policy_path}` "
                         f"again") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; delete it and run `joulepilot policy lock {policy_path}` "
                         f"again") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); delete it and run `joulepilot policy lock "
                         f"{policy_path}` again") from exc
    if not isinstance(data, dict) or not isinstance(data.get("entries", {}), dict):
        raise ValueError(f"{path}: expected an object with an 'entries' table; regenerate it with "
                         f"`joulepilot policy lock {policy_path}`")
    return data


def read_lock(policy_path: str | os.PathLike, device_kind: str, torch_version: str) -> dict[str, Any] | None:
    """The locked entry for this device kind and torch major.minor, or None."""
    return read_lock_file(policy_path).get("entries", {}).get(device_kind, {}).get(torch_version)


def lock_entry(decision: Decision) -> dict[str, Any]:
    return {
        "config": decision.config,
        "config_id": decision.config_id,
        "label": decision.label,
        "state": decision.state,
        "reason": decision.reason,
        "policy_hash": decision.policy_hash,
        "decided_at": decision.decided_at,
        "workload": decision.workload,
        "workload_id": decision.workload_id,
        "objective": decision.objective,
        "measured": decision.measured,
        "break_even_inferences": decision.break_even_inferences,
        "proposed": decision.proposed,
    }


def write_lock(policy_path: str | os.PathLike, decision: Decision) -> Path:
    """Add or replace this decision's (device kind, torch) entry and write the file atomically."""
    path = lock_path(policy_path)
    data = read_lock_file(policy_path) or {}
    entries = data.get("entries", {})
    entries.setdefault(decision.device_kind, {})[decision.torch_version] = lock_entry(decision)
    document = {"format": LOCK_FORMAT, "policy": decision.policy, "entries": entries}
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(document, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
