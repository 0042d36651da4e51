"""What a pass decides: the policy folders it reads, and the decision it stores for each stale policy."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("joulepilot.daemon")


def load_policy_folders(folders: Sequence[Path]) -> tuple[list[Any], list[dict[str, str]]]:
    """Every `*.toml` policy in the folders; invalid files come back as errors, never raised.

    Only regular files are opened (a FIFO would block the daemon for good). A policy whose workload
    does not resolve is an error too, found without running any of its code. Two files with the same
    policy name: the first folder wins and the other is reported. A folder named twice (or through a
    symbolic link to it), and a file reached twice, is read once: it is not a second policy of that name.
    """
    from joulepilot.policies import PolicyError, load_policy
    from joulepilot.store.safeio import file_kind, shorten

    policies: dict[str, Any] = {}
    errors: list[dict[str, str]] = []
    seen_folders: set[Path] = set()
    seen_files: set[Path] = set()
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            errors.append({"file": str(folder), "error": _not_a_folder(folder)})
            continue
        resolved = folder.resolve()
        if resolved in seen_folders:
            continue
        seen_folders.add(resolved)
        try:  # not Path.glob, which on Python 3.11 takes a folder it may not read for an empty one
            with os.scandir(folder) as entries:
                names = sorted(entry.name for entry in entries if entry.name.endswith(".toml"))
        except OSError as exc:
            errors.append({"file": str(folder), "error": f"cannot list the policy folder "
                                                         f"({exc.strerror or exc}); let the daemon's user "
                                                         "read and enter it (chmod, chown or its group)"})
            continue
        for path in (folder / name for name in names):
            real = path.resolve()
            if real in seen_files:
                continue
            seen_files.add(real)
            try:
                mode = path.stat().st_mode
            except OSError as exc:
                errors.append({"file": str(path), "error": f"skipped: cannot stat it ({exc.strerror or exc})"})
                continue
            if not stat.S_ISREG(mode):
                errors.append({"file": str(path), "error": f"skipped: not a regular file ({file_kind(mode)}); "
                                                           "a policy must be a regular file"})
                continue
            try:
                policy = load_policy(path, check_workload=True)
            except PolicyError as exc:
                errors.append({"file": str(path), "error": str(exc)})
                continue
            except Exception as exc:  # a policy naming an unknown knob, etc.: report, keep going
                errors.append({"file": str(path), "error": shorten(f"{type(exc).__name__}: {exc}", 500)})
                continue
            if policy.name in policies:
                errors.append({"file": str(path), "error": f"policy name {shorten(policy.name)!r} is already "
                                                           f"defined by {policies[policy.name].path}; names must "
                                                           "be unique"})
                continue
            policies[policy.name] = policy
    return list(policies.values()), errors


def _not_a_folder(folder: Path) -> str:
    """Why a policy folder named in the config or with --policies cannot be read, and the fix."""
    fix = "fix `policies` in the daemon config / --policies"
    if folder.exists():  # a policy file given where its folder belongs, most often
        return (f"not a folder: `policies` names folders of *.toml files; name the folder that holds this "
                f"file, or {fix}")
    return f"policy folder does not exist; create it or {fix}"


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


def refused_request(request: dict[str, Any], folders: Sequence[Path]) -> dict[str, Any]:
    """Why a hook's request is not served, for the log and the pass summary (quoted values shortened:
    anything that can write the database wrote them)."""
    from joulepilot.store.jsonvalues import json_object
    from joulepilot.store.safeio import shorten

    path = json_object(request.get("note")).get("policy_path")
    name = shorten(str(request.get("policy")), 120)
    where = ", ".join(str(f) for f in folders) or "(none configured)"
    if isinstance(path, str) and path:
        reason = (f"its policy file {shorten(path, 200)} is not in the daemon's policy folders ({where}); the "
                  f"daemon runs only its own policies: copy the file into one of them to have it measured")
    else:
        reason = f"no policy named {name!r} in the daemon's policy folders ({where})"
    return {"id": request.get("id"), "policy": name, "policy_path": shorten(path, 200) if isinstance(path, str)
            else None, "reason": reason}
