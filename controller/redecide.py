"""What a pass decides: the decision it stores for each stale policy (the policy folders it reads are
`policies.load.load_policy_folders`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("joulepilot.daemon")


def fit_or_none(db: Any) -> Any:
    """The trade-off model fitted on every ok run, or None when there is too little to fit."""
    from .tradeoff import fit

    try:
        return fit(db)
    except Exception as exc:  # no ok runs yet, or too few: decide on measurements alone
        log.info("trade-off model not fitted (%s); deciding on measurements only", exc)
        return None


def decide_now(db: Any, policy: Any, device_kind: str, model: Any, *, decided_by: str, reason: str = "",
               torch_version: str | None = None, provenance_key: str | None = None, max_age_s: float | None = None,
               lock_dir: Path | None = None, record: bool = True, lock: bool = True,
               failed_out: Mapping[str, str] | None = None, until_done: bool = False) -> tuple[Any, Any]:
    """The one decide sequence, the CLI's (`policy explain`, `policy lock`) and the daemon's: a guided policy's
    search is planned on the stored runs (`controller.guided.plan_guided`), then `policies.decide` decides on
    the same runs with the judge, leaves out what broke the envelope, stores the decision with the search's
    summary and `provenance_key`, and writes the lock file (beside the policy, else in `lock_dir`).

    `model`: the trade-off model (`fit_or_none`; the daemon fits it once per pass). `failed_out`: config id
    -> why its job is queued no more (`controller.planner.repeat_blocked`): a guided search stops at one it
    could never measure, an exhaustive policy does not list it to confirm. `until_done`: a guided policy
    whose search is still under way is not decided (the daemon's rule; the CLI decides on what there is).
    Returns (the `Decided`, or None when not decided; the guided plan, or None)."""
    from joulepilot.policies import decide, torch_minor
    from joulepilot.policies.decide import violated_configs

    from .guided import plan_guided

    plan = None
    if policy.search.strategy == "guided":
        plan = plan_guided(db, policy, device_kind, model, torch_version=torch_version, provenance_key=provenance_key,
                           max_age_s=max_age_s, violated=violated_configs(db, policy.name, device_kind),
                           blocked=failed_out)
        if until_done and not plan.done:
            return None, plan
    decided = decide(db, policy, device_kind, model, torch_version=torch_version or torch_minor(),
                     provenance_key=provenance_key, decided_by=decided_by, reason=reason, lock_dir=lock_dir,
                     record=record, lock=lock, search=plan.summary() if plan is not None else None,
                     no_repeat=failed_out if plan is None else None)
    return decided, plan


def warm_start_candidates(decision: Any) -> list[tuple[str, Any]]:
    """The measured configurations whose warm start is worth timing: ('decided', the one the decision
    applies) and ('runner-up', the best other one within every limit by median objective, a run flagged
    "repeat this run" included), as far as they were measured."""
    measured = [c for c in decision.candidates if c.source == "measured" and c.run_id is not None]
    decided = [c for c in measured if c.config_id == decision.config_id][:1]
    rivals = sorted((c for c in measured if c not in decided and c.status in ("chosen", "kept", "flagged")
                     and c.median is not None), key=lambda c: c.median)
    return [("decided", c) for c in decided] + [("runner-up", c) for c in rivals[:1]]


def request_policy_name(requested: str, by_name: dict[str, Any]) -> str | None:
    """The daemon's own policy a hook's request names, or None. Matched by policy name only: a request
    can never bring in a policy file from elsewhere (its workload is code the daemon would run)."""
    return requested if requested in by_name else None


def refused_request(request: dict[str, Any], folders: Sequence[Path], errors: Sequence[dict[str, str]] = (),
                    policies: Sequence[Any] = ()) -> dict[str, Any]:
    """Why a hook's request is not served, for the log and the pass summary (quoted values shortened:
    anything that can write the database wrote them). `errors` and `policies`: what the pass made of its
    policy folders, so that a request for a file in one of them says what differs (the file could not be
    loaded, or it defines another policy name) instead of calling it a file from elsewhere."""
    from joulepilot.policies.schema import name_problem
    from joulepilot.store.jsonvalues import json_object
    from joulepilot.store.safeio import shorten

    path = json_object(request.get("note")).get("policy_path")
    name = shorten(str(request.get("policy")), 120)
    where = ", ".join(str(f) for f in folders) or "(none configured)"
    if isinstance(path, str) and path:
        reason = _in_folder_reason(Path(path), name, folders, errors, policies) or (
            f"its policy file {shorten(path, 200)} is not in the daemon's policy folders ({where}); the "
            f"daemon runs only its own policies: copy the file into one of them to have it measured")
    elif (problem := name_problem(request.get("policy"))) is not None:
        reason = f"it names no policy: {problem}"
    else:
        reason = f"no policy named {name!r} in the daemon's policy folders ({where})"
    return {"id": request.get("id"), "policy": name, "policy_path": shorten(path, 200) if isinstance(path, str)
            else None, "reason": reason}


def _in_folder_reason(path: Path, name: str, folders: Sequence[Path], errors: Sequence[dict[str, str]],
                      policies: Sequence[Any]) -> str | None:
    """Why a request for a policy file inside one of the daemon's folders was not served; None for a file
    outside them."""
    from joulepilot.store.safeio import shorten

    real = _real(path)
    folder = next((f for f in folders if real is not None and real.parent == _real(Path(f))), None)
    if folder is None:
        return None
    shown = shorten(str(path), 200)
    error = next((e["error"] for e in errors if _real(Path(e["file"])) == real), None)
    if error is not None:
        return (f"its policy file {shown} is in the daemon's policy folder {folder}, but the daemon could not load "
                f"it: {shorten(' '.join(error.split()), 600)}")
    defined = next((p.name for p in policies if p.path and _real(Path(p.path)) == real), None)
    if defined is not None:
        return (f"its policy file {shown} defines policy {shorten(defined, 120)!r}, not {name!r} (renamed since the "
                "request?)")
    return (f"its policy file {shown} is named as in the daemon's policy folder {folder}, but no policy file is "
            "there now (removed or renamed since the request)")


def _real(path: Path) -> Path | None:
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):
        return None
