"""The ids the store derives from content: equal inputs give equal ids on every host and in every run."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def stable_id(*parts: Any, length: int = 16) -> str:
    """A short hash of JSON-encoded parts: equal inputs give equal ids on every host and run."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def provenance_key(device_name: str | None, torch_version: str | None, triton_version: str | None,
                   joulepilot_version: str | None) -> str:
    """The key of measurements that are compared with one another: the kind of device and the software stack,
    not the host or its driver, so the hosts of a fleet that share a device kind and torch share runs, jobs and
    decisions (the host and the driver are kept on every run as columns)."""
    return stable_id("provenance", device_name, torch_version, triton_version, joulepilot_version)
