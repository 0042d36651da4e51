"""One measurement per idle GPU at a time: on which devices the daemon may start a job now, and the jobs
running there.

The daemon's pass hands jobs to `GpuScheduler` from its own thread, which alone reads and writes the store;
each job runs in a thread of its own (`compiler.device_pool`) that starts the worker and waits for it, and
its outcome comes back to the pass as an event. Idle detection and production-first pausing are per device:
a device takes a job only when it is idle (a quiet period, or, right after our own job there, no one else
computing on it), and production load returning on one GPU stops only the job on that GPU; the other GPUs'
jobs go on, and the stopped job goes back to the queue, where an idle GPU may take it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from joulepilot.compiler.device_pool import DevicePool, Finished, Notice

from .idle import IdleTracker, own_process_tree
from .job_runner import JobOutcome, JobRunner, OnStart, StopCheck

log = logging.getLogger(__name__)

WORKER_STARTED = "worker_started"  # a Notice's `what` when a job's worker process started (value: its pid)

Measure = Callable[[StopCheck, OnStart], Any]


class GpuScheduler:
    """Jobs on `devices`, one per device at a time, each stoppable on its own.

    All methods but `cancel_all` belong to the pass's thread; `cancel_all` is safe from a signal handler."""

    def __init__(self, devices: Sequence[str], tracker: Callable[[str], IdleTracker], *,
                 preempt_every_s: float) -> None:
        self.pool = DevicePool(devices)
        self._tracker = tracker
        self._preempt_every_s = preempt_every_s
        self._runners: dict[str, JobRunner] = {}
        self._stop_reason: str | None = None
        # Devices whose last job here ended a moment ago: their utilisation still shows that job, so a
        # next job may start unless someone else has started computing, without a new quiet period.
        self._just_ours: set[str] = set()
        self.preempted: set[str] = set()  # devices production load took back during this pass

    @property
    def devices(self) -> list[str]:
        return self.pool.devices

    @property
    def concurrent(self) -> int:
        return self.pool.concurrent

    def running(self) -> dict[str, Any]:
        """The key of the job running on each busy device."""
        return self.pool.running()

    def free(self) -> list[str]:
        return self.pool.free()

    def cancel_all(self, reason: str) -> None:
        """Stop every running job and refuse new ones (the daemon is stopping)."""
        self._stop_reason = reason
        for runner in list(self._runners.values()):
            runner.cancel(reason)

    def ready_devices(self, own_pids: Iterable[int] | None = None) -> list[str]:
        """Free devices where a job may start now, in the pool's order."""
        own = set(own_pids) if own_pids is not None else own_process_tree()
        ready: list[str] = []
        for device in self.pool.free():
            tracker = self._tracker(device)
            if device in self._just_ours:
                if not tracker.busy_now(own):
                    ready.append(device)
                    continue
                self._just_ours.discard(device)  # someone else computes there now: wait for a quiet period
                log.info("%s: %s", device, tracker.last.reason if tracker.last else "busy")
                continue
            if tracker.poll(own):
                ready.append(device)
        return ready

    def waiting_reason(self) -> str:
        """Why the free devices are not ready (the first one's last reading)."""
        for device in self.pool.free():
            last = self._tracker(device).last
            if last is not None:
                return f"{device}: {last.reason}"
        return "quiet period"

    def start(self, device: str, key: Any, measure: Measure) -> None:
        """Run `measure(stop_check, on_start)` for the job `key` on `device`, in a thread of its own, stopped
        when `cancel_all` is called or when production load returns on this device."""
        runner = JobRunner()
        self._runners[device] = runner
        if self._stop_reason is not None:  # a stop that came while this job was being set up
            runner.cancel(self._stop_reason)
        tracker = self._tracker(device)
        needs_check = tracker.needs_quiet_period

        def production_returned() -> str | None:
            if needs_check and tracker.busy_now(own_process_tree()):
                return tracker.last.reason if tracker.last else "production load returned"
            return None

        def on_start(pid: int) -> None:
            self.pool.post(device, key, WORKER_STARTED, pid)

        self.pool.start(device, key, lambda: runner.run(measure, preempt_check=production_returned,
                                                        preempt_every_s=self._preempt_every_s, on_start=on_start))

    def next_event(self, timeout: float | None) -> Finished | Notice | None:
        """The next thing a job reported (its worker started, it ended), waiting up to `timeout` seconds. A
        Finished's `result` is the job's JobOutcome, or its `error` what the measurement raised."""
        event = self.pool.next_event(timeout)
        if isinstance(event, Finished):
            self._runners.pop(event.device, None)
            outcome = event.result if isinstance(event.result, JobOutcome) else None
            if event.error is None and outcome is not None and outcome.kind == "measured":
                self._just_ours.add(event.device)
            else:
                self._just_ours.discard(event.device)
            if outcome is not None and outcome.kind == "preempted":
                self.preempted.add(event.device)
        return event


def assign_jobs(devices: Sequence[str], jobs: Sequence[Any],
                last_workload: dict[str, str]) -> tuple[list[tuple[str, Any]], list[Any]]:
    """Pairs idle `devices` with queued `jobs` (each with a `workload_id`), in queue order, and returns the
    pairs and the jobs left. A device takes a job of the workload it measured last where one is queued (that
    workload's zygote is up on it), else the first job whose workload no other device measured last, else
    the first job."""
    remaining = list(jobs)
    pairs: list[tuple[str, Any]] = []
    for device in devices:
        if not remaining:
            break
        pick = next((job for job in remaining if job.workload_id == last_workload.get(device)), None)
        if pick is None:
            elsewhere = {workload for other, workload in last_workload.items() if other != device}
            pick = next((job for job in remaining if job.workload_id not in elsewhere), remaining[0])
        remaining.remove(pick)
        pairs.append((device, pick))
    return pairs, remaining
