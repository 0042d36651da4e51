"""What one daemon pass spent measuring, per policy: the tuning bill of the runs it stored.

The daemon tells a `PassBill` of every job that ends; at the end of the pass `per_policy` prices the
runs those jobs stored (`policies.bill`: seconds, metered joules per source, the unmetered
rest as a labelled estimate). A job that stored no run (stopped, pre-empted, not measurable, or
set aside after a failed commit) is not priced: its seconds are counted apart, as `unstored_s`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from joulepilot.policies.bill import bill_of, bill_text
from joulepilot.store import Store
from joulepilot.store.runs import runs_by_id


class PassBill:
    """The jobs of one pass, per policy; safe to tell from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._run_ids: dict[str, list[int]] = {}
        self._unstored_s: dict[str, float] = {}

    def job_ended(self, policy: str, run_id: int | None, wall_s: float, further_run_ids: Iterable[int] = ()) -> None:
        """A job of `policy` ended: `run_id` the run it stored (None: none), `further_run_ids` the runs of its
        worker's further windows (each priced as a run of its own, as `status` prices them)."""
        if run_id is None and wall_s <= 0:  # nothing ran (the device could not be metered, ...)
            return
        with self._lock:
            self._run_ids.setdefault(policy, [])
            self._unstored_s.setdefault(policy, 0.0)
            if run_id is None:
                self._unstored_s[policy] += max(0.0, wall_s)
            else:
                self._run_ids[policy] += [run_id, *further_run_ids]

    def per_policy(self, db: Store) -> list[dict[str, Any]]:
        """One entry per policy that ran a job this pass, by policy name: `{policy, runs, failed_runs,
        seconds, energy_j, source, metered_j, metered_source, metered_j_by_source, estimated_j, estimated_source,
        unpriced_s, unstored_s, text}`."""
        with self._lock:
            run_ids = {k: list(v) for k, v in self._run_ids.items()}
            unstored = dict(self._unstored_s)
        out = []
        for policy in sorted(run_ids):
            bill = bill_of(runs_by_id(db, run_ids[policy])).to_dict()
            entry = {"policy": policy, **bill, "unstored_s": round(unstored.get(policy, 0.0), 3)}
            entry["text"] = bill_text(bill) + (f"; {entry['unstored_s']:g} s more in jobs that stored no run"
                                               if entry["unstored_s"] else "")
            out.append(entry)
        return out
