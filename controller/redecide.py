"""What a pass decides: the policy folders it reads, and the decision it stores for each stale policy."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .device_probe import DeviceProbe

log = logging.getLogger("joulepilot.daemon")


def load_policy_folders(folders: Sequence[Path]) -> tuple[list[Any], list[dict[str, str]]]:
    """Every `*.toml` policy in the folders; invalid files come back as errors, never raised.

    Two files with the same policy name: the first folder wins and the other is reported.
    """
    from joulepilot.policies import PolicyError, load_policy

    policies: dict[str, Any] = {}
    errors: list[dict[str, str]] = []
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            errors.append({"file": str(folder), "error": "policy folder does not exist; create it or fix "
                                                           "`policies` in the daemon config / --policies"})
            continue
        for path in sorted(folder.glob("*.toml")):
            try:
                policy = load_policy(path)
            except PolicyError as exc:
                errors.append({"file": str(path), "error": str(exc)})
                continue
            except Exception as exc:  # a policy naming an unknown knob, etc.: report, keep going
                errors.append({"file": str(path), "error": f"{type(exc).__name__}: {exc}"})
                continue
            if policy.name in policies:
                errors.append({"file": str(path), "error": f"policy name {policy.name!r} is already defined by "
                                                           f"{policies[policy.name].path}; names must be unique"})
                continue
            policies[policy.name] = policy
    return list(policies.values()), errors


def fit_or_none(db: Any) -> Any:
    """The trade-off model fitted on every ok run, or None when there is too little to fit."""
    from .tradeoff import fit

    try:
        return fit(db)
    except Exception as exc:  # no ok runs yet, or too few: decide on measurements alone
        log.info("trade-off model not fitted (%s); deciding on measurements only", exc)
        return None


def decide_policy(db: Any, policy: Any, probe: DeviceProbe, model: Any, *, reason: str = "",
                  lock_dir: Path | None = None) -> Any:
    """Decide through `policies.decide` (the one way every command decides): leaves out what broke the
    envelope, stores the decision with this host's provenance, writes the lock file (beside the policy,
    else in `lock_dir`). Returns the `Decided`; a lock file that could not be written is in `lock_error`."""
    from joulepilot.policies import decide

    return decide(db, policy, probe.device_kind, model, provenance_key=probe.provenance_key, decided_by="daemon",
                  reason=reason, lock_dir=lock_dir)


def request_policy_name(requested: str, by_name: dict[str, Any]) -> str | None:
    """The loaded policy a hook's request names (by name, file stem or path), or None."""
    if requested in by_name:
        return requested
    path = Path(requested).expanduser()
    for name, policy in by_name.items():
        if policy.path and (Path(policy.path) == path.resolve() if path.suffix == ".toml" else Path(policy.path).stem
                            == requested):
            return name
    return None


def policy_from_request(request: dict[str, Any]) -> Any | None:
    """The policy file a hook's request points at (`note.policy_path`), when it loads cleanly."""
    from joulepilot.policies import load_policy

    try:
        note = json.loads(request.get("note") or "{}")
    except ValueError:
        return None
    path = note.get("policy_path") if isinstance(note, dict) else None
    if not path or not Path(path).is_file():
        return None
    try:
        policy = load_policy(path)
    except Exception as exc:  # PolicyError or an import failure: reported, never fatal to the pass
        log.warning("request %s: policy file %s does not load: %s", request.get("id"), path, exc)
        return None
    return policy if policy.name == request.get("policy") else None
