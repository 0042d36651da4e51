"""What `joulepilot status` shows: is the daemon alive, what it does, the queue, what measuring cost per
policy, each policy's decision and its payback."""

from __future__ import annotations

import os
import time
from typing import Any

import psutil
from joulepilot.policies.bill import bill_of, bill_text
from joulepilot.store import Store, host_identity, shown
from joulepilot.store.daemon_state import (
    HeartbeatRow,
    JobRow,
    fleet_heartbeats,
    host_heartbeat,
    list_jobs,
    queue_counts,
    unhandled_requests,
)
from joulepilot.store.decisions import latest_decisions
from joulepilot.store.runs import daemon_runs

from .instance_lock import lock_is_held, lock_path_for, read_lock_pid


def _pid_alive(pid: int | None) -> bool | None:
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def daemon_status(db: Store, db_path: str | os.PathLike, *, next_jobs: int = 5) -> dict[str, Any]:
    """A snapshot of the daemon serving `db` (read-only; safe while the daemon runs)."""
    now = time.time()
    lock = lock_path_for(db_path)
    held = lock_is_held(lock)
    here = host_identity()
    hb = host_heartbeat(db, here["id"])
    detail = hb.detail if hb else {}
    lock_pid = read_lock_pid(lock) if held else None
    pid = lock_pid or (hb.pid if hb else None)
    daemon = {
        "alive": held,
        "pid": pid,
        "pid_alive": _pid_alive(pid) if pid and (hb is None or detail.get("hostname") in (None, here["hostname"]))
        else None,
        "lock_file": str(lock),
        "state": hb.state if hb else None,
        "doing": detail.get("doing"),
        "current_job": detail.get("job"),
        "current_jobs": detail.get("jobs") or ([detail["job"]] if detail.get("job") else []),  # one per device
        "last_heartbeat_at": hb.at if hb else None,
        "last_heartbeat_age_s": round(now - hb.at, 1) if hb else None,
        "interval_s": detail.get("interval_s"),
        "compile_cache": detail.get("compile_cache"),
    }
    if hb and hb.state == "stopped" and not held:
        daemon["doing"] = detail.get("doing") or "stopped"
    elif hb and not held and detail.get("hostname") in (None, here["hostname"]):
        # Its last heartbeat was not `stopped` and nobody holds its lock on this host: it was killed or crashed,
        # so what that heartbeat said it was doing is no longer going on.
        was = detail.get("doing")
        daemon.update(current_job=None, current_jobs=[],
                      doing="nothing: the daemon ended without stopping (killed or crashed)"
                            + (f"; its last heartbeat said: {was}" if was else ""))
    decisions = [{
        "policy": d.policy,
        "device_kind": d.device_kind,
        "config": d.config_label or d.config_id,
        "state": d.state,
        "reason": d.reason,
        "decided_at": d.decided_at,
        "age_s": round(now - d.decided_at, 1),
        "bill": _decision_bill(d.details),
    } for d in latest_decisions(db)]
    last_pass = detail.get("last_pass") or {}
    no_folder = missing_policy_folders(last_pass)
    running = list_jobs(db, state="running")
    return {
        "db": shown(db_path),
        "daemon": daemon,
        "last_pass": last_pass,
        "no_policy_folder": no_folder,
        # the missing folders are said once, by no_policy_folder
        "policy_errors": [e for e in last_pass.get("policy_errors", [])
                          if not (no_folder and isinstance(e, dict) and e.get("file") in no_folder["folders"])],
        "queue": {
            "counts": queue_counts(db),
            "next": [
                {"id": j.id, "policy": j.policy, "workload": j.workload, "config": j.config_label,
                 "state": j.state, "attempts": j.attempts, "host": j.hostname if j.state == "running" else None}
                for j in running + list_jobs(db, state="queued", limit=next_jobs)
            ],
        },
        "fleet": fleet_status(fleet_heartbeats(db), running, now),
        "requests_pending": len(unhandled_requests(db)),
        "measuring": measuring_per_policy(db, last_pass),
        "decisions": decisions,
    }


def fleet_status(beats: list[HeartbeatRow], running: list[JobRow], now: float) -> list[dict[str, Any]]:
    """Each host that shares the store: its daemon's newest heartbeat (state, what it said it was doing, how long
    ago) and the jobs it has claimed now, with the seconds left on each claim's lease; by host name."""
    hosts: dict[str, dict[str, Any]] = {}
    for beat in beats:
        hosts[str(beat.host_id)] = {"host": beat.detail.get("hostname") or beat.host_id, "host_id": beat.host_id,
                                    "state": beat.state, "doing": beat.detail.get("doing"),
                                    "last_heartbeat_age_s": round(now - beat.at, 1), "measuring": []}
    for job in running:
        if job.claimed_by is None:
            continue
        host = hosts.setdefault(job.claimed_by, {"host": job.hostname or job.claimed_by, "host_id": job.claimed_by,
                                                 "state": None, "doing": None, "last_heartbeat_age_s": None,
                                                 "measuring": []})
        left = round(job.lease_expires_at - now, 1) if job.lease_expires_at is not None else None
        host["measuring"].append({"job": job.id, "policy": job.policy, "config": job.config_label,
                                  "lease_left_s": left})
    return sorted(hosts.values(), key=lambda h: str(h["host"]))


def missing_policy_folders(last_pass: dict[str, Any]) -> dict[str, Any] | None:
    """When none of the daemon's policy folders existed at its last pass (a new host: the config names
    /etc/joulepilot/policies, or the default <JOULEPILOT_HOME>/policies, and nobody created it), so that it has
    nothing to decide: the folders and what to do, in one line (`message`). None otherwise, and for a pass of a
    daemon that did not record its folders."""
    folders = [str(f) for f in last_pass.get("policy_folders") or []]
    missing = set(map(str, last_pass.get("policy_folders_missing") or []))
    if not folders or not set(folders) <= missing:
        return None
    named = " and ".join(folders)
    where = ("name another folder in `policies` of the daemon config or with --policies"
             if last_pass.get("policy_folders_given") else
             "name a folder with --policies DIR or `policies` in the daemon config")
    verb, which = ("does", "it") if len(folders) == 1 else ("do", "one")
    return {"folders": folders,
            "message": f"the daemon has no policy folder: {named} {verb} not exist, so it has no policy to "
                       f"decide; create {which} (mkdir -p {folders[0]}) and put a policy file in it (*.toml, one "
                       f"per model: see examples/policies), or {where}; the next pass reads it"}


def measuring_per_policy(db: Store, last_pass: dict[str, Any]) -> list[dict[str, Any]]:
    """Per policy, what the daemon spent measuring for it: every run it made for the policy (`extra.policy`)
    priced by `policies.bill`, and the last pass's share (`last_pass`: that pass's entry, or None when it
    measured nothing for the policy)."""
    by_policy: dict[str, list[Any]] = {}
    for run in daemon_runs(db):
        by_policy.setdefault(str(run.extra.get("policy")), []).append(run)
    in_last = {e.get("policy"): e for e in last_pass.get("measuring") or [] if isinstance(e, dict)}
    out = []
    for policy in sorted(by_policy.keys() | {p for p in in_last if isinstance(p, str)}):
        bill = bill_of(by_policy.get(policy, [])).to_dict()
        out.append({"policy": policy, **bill, "text": bill_text(bill), "last_pass": in_last.get(policy)})
    return out


def _decision_bill(details: dict[str, Any]) -> dict[str, Any] | None:
    """The decision's tuning bill without its run ids (None for a decision stored before bills were)."""
    bill = details.get("bill")
    if not isinstance(bill, dict):
        return None
    search = bill.get("search")
    if isinstance(search, dict):
        bill = {**bill, "search": {k: v for k, v in search.items() if k != "run_ids"}}
    return bill
