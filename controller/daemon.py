"""The daemon: keeps every policy's decision current without disturbing production work.

Each pass:
 1. loads the policy folders (a file that fails validation is reported and skipped);
 2. takes the hooks' unhandled requests and the policies whose decision is missing or stale;
 3. plans their configurations (cheapest compile first, skipping fresh measurements and
    configurations a deployment found over the envelope) and queues them durably in `jobs`;
 4. runs queued jobs in killable workers, one per idle device at once (`devices`: several GPUs measure
    side by side, see gpu_scheduler.py), re-queueing a job when production load returns on its device
    or the daemon is stopped; once an exhaustive policy's sweep is done, queues a repeat of each contender
    not yet confirmed (`planner.plan_repeats`: a fresh worker process taking the windows it still needs),
    again after every job, until each is confirmed, at the cap of runs, or its job failed out;
 5. refits the trade-off model, re-resolves each policy whose sweep is complete, writes its decision
    and lock file, and marks its requests handled;
 6. writes a heartbeat with the pass summary.

Measuring is kept cheap per configuration: each device's idle baseline is taken once per pass (at its
first job), each job's worker is forked from the zygote of the workload being measured on its device
(which imported torch and built the model once, see `compiler/zygote.py`), and warm starts are timed only
for the configuration a pass decides and its runner-up.

Safety: one daemon per database (flock); SIGTERM/SIGINT stop within seconds (the running jobs are
killed and re-queued, a 'stopped' heartbeat written); SIGHUP re-reads the config. Three process levels:
the daemon starts each device's zygote of the workload, which forks each benchmark worker (both die with
the daemon), and stores each worker's run in the same transaction that marks its job done, from the
pass's thread alone (the threads that wait for the workers never touch the store); a run whose commit
fails waits in a side file that the next pass or start imports, and jobs left `running` by a dead daemon
are re-queued at start.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import schedule
from joulepilot.compiler.device_pool import Finished
from joulepilot.policies.batches import config_workload_id
from joulepilot.policies.decide import newest_sound_decision
from joulepilot.policies.load import load_policy_folders
from joulepilot.store import (
    DatabaseCorrupt,
    RunNotStored,
    StoreUnreachable,
    as_store_error,
    commit_run_or_set_aside,
    host_identity,
    is_postgres_url,
    make_db_folder,
    open_db,
    run_columns,
    shown,
    side_path,
    transaction,
    upsert_host,
    workload_needs_description,
)
from joulepilot.store.catalog import config_row
from joulepilot.store.daemon_state import (
    JobRow,
    claim_job,
    drop_queued_jobs,
    enqueue_job,
    extend_leases,
    finish_job,
    has_open_jobs,
    mark_requests_handled,
    queue_counts,
    queued_jobs,
    recover_jobs,
    renew_leases,
    requeue_job,
    unhandled_requests,
    write_heartbeat,
)
from joulepilot.store.runs import configs_measured_by, further_window_run_ids, warm_start_source
from joulepilot.store.side_file_imports import import_side_files
from joulepilot.store.unreachable import check_reachable, clear_unreachable, note_unreachable

from .daemon_config import DaemonConfig, DaemonConfigError, load_daemon_config
from .device_probe import DeviceProbe, DeviceUnavailable, allowed_devices, check_devices, probe_devices
from .gpu_scheduler import WORKER_STARTED, GpuScheduler, assign_jobs
from .guided import GuidedPlan, plan_guided, window_gate
from .idle import IdleTracker, LoadProbe, own_process_tree
from .instance_lock import DaemonAlreadyRunning, InstanceLock
from .job_runner import JobOutcome
from .pass_bill import PassBill
from .planner import measured_config, plan_policy, plan_repeats, repeat_blocked, stale_reason
from .redecide import (
    decide_now,
    fit_or_none,
    refused_request,
    request_policy_name,
)

__all__ = ["Daemon", "DaemonAlreadyRunning", "DaemonConfigError", "DaemonResult", "DeviceUnavailable"]

log = logging.getLogger("joulepilot.daemon")

HEARTBEAT_EVERY_S = 30.0
# While the database cannot be reached a pass is tried this often (or every interval, if shorter): a host that
# comes back within a lease of the database's return stores what it set aside before another host takes its jobs.
UNREACHABLE_RETRY_S = 15.0
# A heartbeat is written every few seconds and kept a thousand times over: what it repeats of the last
# pass is bounded, however many bad policy files or requests the pass met.
HEARTBEAT_LIST_ITEMS = 10
HEARTBEAT_ERROR_CHARS = 300
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class GuidedState:
    """A guided policy during one pass: what it may not measure, its latest plan, whether it stopped."""

    violated: set[str]
    plan: GuidedPlan | None = None
    stopped: bool = False
    active: bool = False  # it has queued a measurement this pass (and holds one of the pass's search slots)


@dataclass
class RunningJob:
    """A job handed to a device: what the pass needs when it ends."""

    job: JobRow
    policy: Any
    label: str
    device: str
    describes: bool  # its worker describes the workload (FLOPs, op mix), which no other running job does


@dataclass
class DaemonResult:
    exit_code: int
    summary: dict[str, Any] = field(default_factory=dict)


class Daemon:
    def __init__(self, cfg: DaemonConfig, *, config_path: str | None = None, cli_db: str | None = None,
                 cli_policies: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.cli_db = cli_db
        self.cli_policies = tuple(cli_policies)
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self._reload = threading.Event()
        self.scheduler: GpuScheduler | None = None  # this pass's jobs, one per idle device
        self.db: Any = None
        identity = host_identity()
        self.host, self.host_id = identity["hostname"], identity["id"]  # JOULEPILOT_HOSTNAME may name it
        self._leases_renewed_at = 0.0
        self._renewal_failing = False  # the last renewal of the claims failed, and the log said so
        self._store_down = False  # the last pass found the database unreachable: passes are tried sooner
        self._heartbeat_failing = False  # the last heartbeat could not be written, and the log said so
        self._jobs_view: dict[int, dict[str, Any]] = {}  # running job id -> what heartbeats say of it
        self._jobs_lock = threading.Lock()
        self.last_pass: dict[str, Any] = {}
        self._exit_code = 0  # of a daemon that keeps running: 1 once it stopped because the database is damaged
        self._damaged = False  # the database was found damaged: it is written no more (the log said why once)
        self._trackers: dict[str, IdleTracker] = {}
        self._paused = False
        self._exporter: Any = None
        self._logged_policy_errors: dict[str, str] = {}
        self._logged_device_errors: dict[str, str] = {}
        self._logged_no_device = False  # the last pass was skipped for want of a device, and said so
        self._logged_no_policy_folder = False  # the default policy folder is missing, and the log said so
        self._logged_refusals: set[Any] = set()
        self._guided: dict[str, GuidedState] = {}  # this pass's guided policies
        # This pass's exhaustive policies (name -> the configurations that broke their envelope), whose
        # contenders are measured again once their sweep is done, and the windows each such job takes.
        self._exhaustive: dict[str, set[str]] = {}
        # This pass's view of each policy's newest decision (its id, 0 for none): a newer one is another host's.
        self._decision_seen: dict[str, int] = {}
        # This pass's workloads that could not be built, as (policy, workload id): recorded once each.
        self._load_errors: set[tuple[str, str]] = set()
        self._pass_model: Any = None
        self._pass_model_fitted = False
        self._pass_bill = PassBill()  # what this pass's jobs cost, per policy
        # Per pass: the idle baseline and provenance of each device (taken at its first job, on that job's
        # thread, under the device's lock), and the zygotes of the workloads being measured (one per device;
        # their workers are forked from them).
        self._contexts: dict[str, Any] = {}
        self._quiet_baselines: dict[str, tuple[float, float] | None] = {}  # device -> (W, s) of its quiet period
        self._context_locks: dict[str, threading.Lock] = {}
        self._contexts_lock = threading.Lock()
        self._zygotes: Any = None
        # Told of the pass's progress, for a display (`daemon --once` on a terminal): called with
        # ("jobs_planned", {"total", "devices", "open_ended": more may be planned later}), ("job_started", {"job_id", "label", "device"}) and
        # ("job_finished", {"job_id", "kind", "status", "run_id", "reason", "wall_s", "device", "note"}); jobs on
        # several devices overlap. Always from the pass's thread.
        self.listener: Callable[[str, dict[str, Any]], None] | None = None

    @classmethod
    def from_cli(cls, *, config_path: str | None, db: str | None, policies: Sequence[str]) -> Daemon:
        from joulepilot.compiler.remote_cache import RemoteCacheError, configured_url

        cfg = load_daemon_config(config_path).with_overrides(db=db, policies=list(policies))
        try:  # JOULEPILOT_REDIS_URL is read at every job: a malformed one is refused before the first
            configured_url(cfg.compile_cache.redis_url)
        except RemoteCacheError as exc:
            raise DaemonConfigError(str(exc)) from None
        return cls(cfg, config_path=config_path, cli_db=db, cli_policies=policies)

    # --- signals ------------------------------------------------------------------------------------
    def request_stop(self, reason: str = "stop requested") -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            self.stop_event.set()
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.cancel_all(reason)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            self._reload.set()
            return
        self.request_stop(f"received {name}")

    def _install_signals(self) -> dict[int, Any]:
        previous = {}
        if threading.current_thread() is not threading.main_thread():
            return previous
        for sig in (*STOP_SIGNALS, signal.SIGHUP):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def reload_config(self) -> None:
        try:
            new = load_daemon_config(self.config_path).with_overrides(db=self.cli_db, policies=list(self.cli_policies))
        except DaemonConfigError as exc:
            log.error("SIGHUP: config not reloaded, keeping the running one: %s", exc)
            return
        if new.db != self.cfg.db:
            log.warning("SIGHUP: the database cannot change while running (%s); restart the daemon to "
                        "use %s", shown(self.cfg.db), shown(new.db))
            new = DaemonConfig(**{**vars(new), "db": self.cfg.db})
        old_exporter = (self.cfg.exporter.enabled, self.cfg.exporter.bind, self.cfg.exporter.port)
        self.cfg = new
        self._trackers.clear()
        logging.getLogger("joulepilot").setLevel(new.log_level)
        log.info("SIGHUP: reloaded %s", self.config_path or "defaults")
        if self._exporter is not None and old_exporter != (new.exporter.enabled, new.exporter.bind,
                                                          new.exporter.port):
            self._stop_exporter()
            self._start_exporter()

    def _notify(self, event: str, **fields: Any) -> None:
        if self.listener is None:
            return
        try:
            self.listener(event, fields)
        except Exception:  # a display must never stop a measurement
            log.debug("progress listener failed on %s", event, exc_info=True)

    # --- heartbeats ---------------------------------------------------------------------------------
    def running_jobs(self) -> list[dict[str, Any]]:
        """The jobs running now (id, policy, workload, config, device, started_at, worker_pid), oldest first."""
        with self._jobs_lock:
            return [dict(v) for _, v in sorted(self._jobs_view.items())]

    def heartbeat(self, state: str, doing: str, **extra: Any) -> None:
        if self._damaged:
            return
        jobs = self.running_jobs()
        # `job`: the oldest running job (what `joulepilot status` shows as the current job); `jobs`: all of them
        detail = {"doing": doing, "hostname": self.host, "interval_s": self.cfg.interval_s,
                  "job": jobs[0] if jobs else None, "jobs": jobs, "last_pass": bounded_pass(self.last_pass),
                  "config": str(self.config_path or ""), "compile_cache": self._compile_cache_state(), **extra}
        try:
            write_heartbeat(self.db, state, detail, host_id=self.host_id)
        except Exception as exc:  # a locked or full disk must not kill the loop; the next beat retries
            if not self._heartbeat_failing:  # once until one is written again
                log.warning("heartbeat not written: %s; the next beats try again", as_store_error(exc, self.cfg.db)
                            or exc)
            self._heartbeat_failing = True
            return
        self._heartbeat_failing = False

    def _compile_cache_state(self) -> dict[str, Any] | None:
        """The fleet's remote compile cache as the heartbeat records it (`status`, the exporter), or None."""
        from joulepilot.compiler.remote_cache import RemoteCacheError, cache_state, configured_url

        try:
            return cache_state(configured_url(self.cfg.compile_cache.redis_url))
        except RemoteCacheError as exc:  # JOULEPILOT_REDIS_URL changed under a running daemon
            return {"url": None, "answers": False, "problem": str(exc)}

    # --- lifecycle ----------------------------------------------------------------------------------
    def run(self, *, once: bool = False) -> DaemonResult:
        """Raises DeviceUnavailable (before anything is opened) when a device of `devices` cannot be metered,
        DaemonAlreadyRunning when another daemon serves the database, and StoreError when the database cannot be
        used (its folder missing, damaged, full, ...)."""
        _configure_logging(self.cfg.log_level)
        check_devices(self.cfg.devices, str(self.cfg.source or "the daemon's defaults (no --config)"))
        if not is_postgres_url(str(self.cfg.db)):  # its lock file goes there: a mistyped `db` is refused at once
            make_db_folder(self.cfg.db)
        lock = InstanceLock(self.cfg.db)
        lock.acquire()  # raises DaemonAlreadyRunning naming the holder's pid
        previous = self._install_signals()
        try:
            self.db = open_db(self.cfg.db)
            _end_leftover_worker(self.db)
            _remove_stale_scratch(self.cfg.db)
            upsert_host(self.db)  # its name, for what `status` says each host of a fleet measures
            log.info("daemon pid %d: database %s, policies %s, devices %s, every %gs",
                     os.getpid(), shown(self.cfg.db), ", ".join(map(str, self.cfg.policies)), ",".join(self.cfg.devices),
                     self.cfg.interval_s)
            self.heartbeat("starting", "starting")
            if once:
                try:
                    self.run_pass()
                except Exception as exc:
                    problem = as_store_error(exc, self.cfg.db)
                    if problem is None:
                        log.exception("pass failed")
                        return DaemonResult(2, {**self.last_pass, "error": f"{type(exc).__name__}: {exc}"})
                    log.error("pass stopped: %s", problem)  # one line: the file and the fix, no traceback
                    self._damaged = isinstance(problem, DatabaseCorrupt)
                    return DaemonResult(1, {**self.last_pass, "error": str(problem)})
                skipped = self.last_pass.get("policy_errors") or self.last_pass.get("device_errors")
                return DaemonResult(1 if skipped else 0, self.last_pass)
            self._start_exporter()
            self._loop()
            return DaemonResult(self._exit_code, self.last_pass)
        finally:
            self._stop_exporter()
            if self.db is not None:
                stop_doing = self.stop_reason or ("--once pass finished" if once else "exited")
                with self._jobs_lock:
                    self._jobs_view.clear()
                self.heartbeat("stopped", stop_doing)
                self.db.close()
                self.db = None
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            lock.release()
            failed = sys.exc_info()[1]  # what ends it, when it did not start or a pass raised (said below it)
            log.info("daemon stopped (%s)", self.stop_reason or (f"{type(failed).__name__}, said below" if failed else "done"))

    def _loop(self) -> None:
        scheduler = schedule.Scheduler()
        interval = self.cfg.interval_s
        scheduler.every(interval).seconds.do(self._guarded_pass)
        self._guarded_pass()
        last_beat = time.monotonic()
        last_idle_check = last_retry = 0.0
        while not self.stop_event.is_set():
            if self._reload.is_set():
                self._reload.clear()
                self.reload_config()
                self.heartbeat("paused" if self._paused else "idle", "config reloaded")
                if self.cfg.interval_s != interval:
                    interval = self.cfg.interval_s
                    scheduler.clear()
                    scheduler.every(interval).seconds.do(self._guarded_pass)
            scheduler.run_pending()
            now = time.monotonic()
            # A paused sweep resumes as soon as a device has been quiet long enough.
            if self._paused and now - last_idle_check >= self.cfg.idle.poll_s:
                last_idle_check = now
                idle = next((d for d in allowed_devices(self.cfg.devices) if self._device_idle(d)), None)
                if idle is not None:
                    log.info("%s idle again: resuming the sweep", idle)
                    self._guarded_pass()
            if self._store_down and now - last_retry >= min(UNREACHABLE_RETRY_S, interval):
                last_retry = now
                self._guarded_pass()
            if now - last_beat >= min(HEARTBEAT_EVERY_S, interval):
                last_beat = now
                self.heartbeat("paused" if self._paused else "idle",
                               "waiting for the device to be idle" if self._paused else
                               f"next pass in {max(0.0, scheduler.idle_seconds or 0):.0f}s")
            self.stop_event.wait(min(1.0, self.cfg.idle.poll_s))

    def _guarded_pass(self) -> None:
        try:
            self.run_pass()
        except Exception as exc:  # one bad pass must not end the daemon; the next one retries
            problem = as_store_error(exc, self.cfg.db)
            if isinstance(problem, DatabaseCorrupt):  # no pass can work on it: stop (exit 1), saying what to do
                log.error("%s; the daemon stops", problem)
                self._exit_code, self._damaged = 1, True
                self.request_stop("the database is damaged")
                return
            if isinstance(problem, StoreUnreachable):
                self._unreachable(problem)
                return
            if problem is not None:  # full, locked, read-only: one line, and the next pass retries
                log.error("pass failed: %s; retrying at the next interval", problem)
            else:
                log.exception("pass failed; retrying at the next interval")
            self.heartbeat("idle", "last pass failed; see the daemon log")

    def _unreachable(self, problem: StoreUnreachable) -> None:
        """The database server did not answer: recorded on this host for `status` and the exporter, said once per
        outage, and tried again at the next pass. What goes on meanwhile: the hooks apply the decisions in their
        lock files, and a run measured when the server went away waits in a side file."""
        self._store_down = True
        try:
            outage = note_unreachable(self.cfg.db, str(problem))
        except OSError as exc:
            log.error("pass failed: %s (and %s could not be recorded: %s)", problem, "the outage", exc)
            return
        if outage["at"] == outage["since"]:
            log.error("database unreachable: %s. The hooks keep applying the decisions in their lock files; %d "
                      "measured run(s) wait in side files on this host and are stored when it answers; a pass "
                      "tries again every %gs", problem, outage["waiting_runs"],
                      min(UNREACHABLE_RETRY_S, self.cfg.interval_s))
        else:
            log.info("database still unreachable (for %.0fs; %d run(s) waiting); the next pass tries again",
                     outage["at"] - outage["since"], outage["waiting_runs"])

    def _reached(self) -> None:
        """The pass reached the database: an outage recorded before ends, and the runs it set aside are stored."""
        check_reachable(self.db)
        self._store_down = False
        outage = clear_unreachable(self.cfg.db)
        if outage is not None:
            # No host could renew its claims meanwhile: each gets a lease from now to come back and store what
            # it set aside, before another host takes its jobs.
            extended = extend_leases(self.db, self.cfg.fleet.lease_s)
            log.info("database reachable again after %.0fs; storing the %d run(s) set aside meanwhile%s",
                     time.time() - outage["since"], outage["waiting_runs"],
                     f"; {extended} claim(s) of the fleet extended by a lease" if extended else "")

    # --- exporter -----------------------------------------------------------------------------------
    def _start_exporter(self) -> None:
        if not self.cfg.exporter.enabled:
            return
        from .exporter import start_exporter

        try:
            self._exporter = start_exporter(self.cfg.db, port=self.cfg.exporter.port, bind=self.cfg.exporter.bind)
            log.info("exporter: http://%s:%d/metrics", self.cfg.exporter.bind, self._exporter.port)
        except OSError as exc:
            log.error("exporter not started on %s:%d: %s; change [exporter] port in the config, or set "
                      "[exporter] enabled = false when `joulepilot exporter` (joulepilot-exporter.service) "
                      "serves it", self.cfg.exporter.bind, self.cfg.exporter.port, exc)

    def _stop_exporter(self) -> None:
        if self._exporter is not None:
            self._exporter.stop()
            self._exporter = None

    # --- devices ------------------------------------------------------------------------------------
    def _tracker(self, device: str) -> IdleTracker:
        if device not in self._trackers:
            self._trackers[device] = IdleTracker(LoadProbe(device, self.cfg.idle))
        return self._trackers[device]

    def _device_idle(self, device: str) -> bool:
        return self._tracker(device).poll(own_process_tree())

    def _pass_devices(self) -> tuple[list[str], DeviceProbe | None, dict[str, str]]:
        """The devices this pass measures on, the probe of the first (whose kind and provenance the pass
        measures for), and the devices that cannot be metered now with the reason. Devices of another kind
        or provenance (a CPU, another GPU model) are left out with a warning; one that cannot be metered (a
        GPU lost or gone since the start) is logged once while it stays so, and the pass goes on without it."""
        probes, errors = probe_devices(allowed_devices(self.cfg.devices))
        self._log_device_errors(errors)
        if not probes:
            return [], None, errors
        first = probes[0]
        usable = [first.device]
        for other in probes[1:]:
            if other.provenance_key == first.provenance_key:
                usable.append(other.device)
            else:
                log.warning("%s (%s) is not used: this pass measures for %s (%s), the first of `devices`; "
                            "list one kind of device in `devices`", other.device, other.device_kind, first.device,
                            first.device_kind)
        return usable, first, errors

    def _log_device_errors(self, errors: dict[str, str]) -> None:
        """A device that cannot be metered is logged when it first fails (or fails otherwise), and when it is
        back, not at every pass."""
        for device, error in errors.items():
            if self._logged_device_errors.get(device) != error:
                log.error("%s skipped: %s; the daemon goes on with the other devices and tries it again each pass",
                          device, error)
        for device in self._logged_device_errors.keys() - errors.keys():
            log.info("%s can be metered again", device)
        self._logged_device_errors = dict(errors)

    # --- one pass -----------------------------------------------------------------------------------
    def run_pass(self) -> dict[str, Any]:
        from joulepilot.compiler import ZygotePool

        with self._contexts_lock:
            self._contexts, self._context_locks, self._quiet_baselines = {}, {}, {}
        self._zygotes = ZygotePool()
        try:
            return self._run_pass()
        finally:
            zygotes, self._zygotes = self._zygotes, None
            zygotes.close()

    def _run_pass(self) -> dict[str, Any]:
        started = time.time()
        summary: dict[str, Any] = {"started_at": started, "finished_at": None, "policies": 0, "policy_errors": [],
                                   "requests": 0, "stale": [], "enqueued": 0, "runs_ok": 0, "runs_failed": 0,
                                   "requeued": 0, "paused": False, "stopped": False, "decided": [],
                                   "lock_files": [], "unknown_requests": [], "refused_requests": [],
                                   "measuring": [], "warm_starts": [], "repeats": []}
        self.last_pass = {**summary, "in_progress": True}
        self._pass_bill = PassBill()
        self._load_errors = set()
        self._reached()
        self._import_pending()  # before the recovery below: a set-aside run finishes its job
        # No job of this daemon runs between passes: one this host still holds was left by a daemon of this host
        # that died (the first pass after a start), or by a pass that could not put it back (the database went away).
        requeued = recover_jobs(self.db, self.host_id)
        if requeued:
            log.info("job(s) %s re-queued: this host's claim (no job of it runs between passes), or a claim that ran "
                     "out", ", ".join(map(str, requeued)))
        policies, errors = load_policy_folders(self._policy_folders())
        summary["policies"], summary["policy_errors"] = len(policies), errors
        # what `joulepilot status` says when none of them exists (controller.status.missing_policy_folders)
        summary["policy_folders"] = [str(folder) for folder in self.cfg.policies]
        summary["policy_folders_given"] = self.cfg.policies_given
        summary["policy_folders_missing"] = [str(folder) for folder in self.cfg.policies if not folder.exists()]
        self._log_policy_errors(errors)
        by_name = {p.name: p for p in policies}

        devices, probe, device_errors = self._pass_devices()
        summary["device_errors"] = [{"device": d, "error": e} for d, e in device_errors.items()]
        summary["devices"] = devices
        if probe is None:
            return self._skip_pass(summary, started)
        self._logged_no_device = False
        summary["device"], summary["device_kind"] = devices[0], probe.device_kind
        summary["provenance_key"] = probe.provenance_key

        # 1. requests and stale decisions. Only the daemon's own policies are served: a request naming
        # any other (a file elsewhere, which a hook points at) is refused, as its workload is code the
        # daemon would run. Refused requests stay pending, and are served once such a policy appears.
        host_id = self.host_id
        requests = [r for r in unhandled_requests(self.db) if r.get("host_id") in (None, host_id)]
        summary["requests"] = len(requests)
        requested: dict[str, list[int]] = {}
        for req in requests:
            name = request_policy_name(req["policy"], by_name)
            if name is None:
                refusal = refused_request(req, self.cfg.policies, errors, policies)
                summary["unknown_requests"].append(refusal["policy"])
                summary["refused_requests"].append(refusal)
                if req["id"] not in self._logged_refusals:
                    self._logged_refusals.add(req["id"])
                    log.warning("request %s for policy %r refused: %s", req["id"], refusal["policy"],
                                refusal["reason"])
                continue
            requested.setdefault(name, []).append(req["id"])

        stale: dict[str, str] = {}
        for policy in policies:
            # Any state (`violated` too); a row the hook would refuse (dated in the future, ...) is passed over.
            decision, _refused = newest_sound_decision(self.db, policy, probe.device_kind)
            self._decision_seen[policy.name] = decision.id if decision is not None else 0
            reason = stale_reason(decision, policy_hash=policy.hash, provenance_key=probe.provenance_key,
                                  max_age_s=self.cfg.max_decision_age_s)
            if reason is None and policy.name in requested:
                reason = "a hook requested it"
            if reason is None and self._has_open_jobs(policy.name):
                reason = "its sweep is unfinished"
            if reason is not None:
                stale[policy.name] = reason
        summary["stale"] = [{"policy": n, "reason": r} for n, r in stale.items()]

        # 2. plan and queue
        from joulepilot.store import upsert_config
        from joulepilot.store.deployments import violated_config_ids

        violated_by_policy: dict[str, set[str]] = {}
        self._guided = {}
        self._exhaustive = {}
        for name, reason in stale.items():
            policy = by_name[name]
            violated = violated_config_ids(self.db, name, probe.device_kind)
            violated_by_policy[name] = violated
            if policy.search.strategy == "guided":
                # Planned from the store between jobs; a job queued before (by an earlier pass, or before
                # the file said "guided") is planned again rather than trusted.
                self._guided[name] = GuidedState(violated)
                drop_queued_jobs(self.db, name)
                continue
            self._exhaustive[name] = violated  # its contenders are measured again once the sweep is done
            keep = []
            # Planned and queued in one write: another host's run stored in between cannot be measured again.
            with transaction(self.db):
                plan = plan_policy(self.db, policy, reason=reason, provenance_key=probe.provenance_key,
                                   max_age_s=self.cfg.max_decision_age_s, violated=violated)
                for cfg in plan.to_measure:
                    upsert_config(self.db, cfg.to_row())
                    # each configuration under its own batch size's workload (the batch-size lever)
                    job_id, created = enqueue_job(self.db, policy=name, workload_id=config_workload_id(policy, cfg),
                                                  config_id=cfg.id, provenance_key=probe.provenance_key,
                                                  max_attempts=self.cfg.bench.max_attempts)
                    keep.append(job_id)
                    summary["enqueued"] += int(created)
                dropped = drop_queued_jobs(self.db, name, keep)
            log.info("policy %s: %s; %d to measure, %d already measured, %d excluded as violated%s", name, reason,
                     len(plan.to_measure), len(plan.already_measured), len(plan.excluded_violated),
                     f", {dropped} obsolete job(s) dropped" if dropped else "")

        # 3. measure while idle (a guided policy is planned one measurement at a time, between jobs)
        self._pass_model = None
        self._pass_model_fitted = False
        self._advance_guided(by_name, probe, summary, slots=len(devices))
        self._notify("jobs_planned", total=len(self._runnable_jobs(by_name, probe)), devices=len(devices),
                     open_ended=self._more_may_follow(by_name))
        self._run_queue(by_name, devices, probe, summary)

        # 4. decide the policies whose sweep is complete
        if not self.stop_event.is_set():
            self._decide(stale, by_name, probe, violated_by_policy, requested, summary)

        summary["finished_at"] = time.time()
        summary["duration_s"] = round(summary["finished_at"] - started, 2)
        summary["queue"] = queue_counts(self.db)
        summary["measuring"] = self._pass_bill.per_policy(self.db)
        for spent in summary["measuring"]:
            log.info("policy %s: measuring this pass cost %s", spent["policy"], spent["text"])
        self.last_pass = summary
        log.info("pass done in %.1fs: %d stale, %d queued, %d ok / %d failed runs, %d decided%s",
                 summary["duration_s"], len(stale), summary["enqueued"], summary["runs_ok"], summary["runs_failed"],
                 len(summary["decided"]), " (paused for production load)" if summary["paused"] else "")
        if not self.stop_event.is_set():
            self.heartbeat("paused" if summary["paused"] else "idle",
                           "paused: production load" if summary["paused"] else "pass finished")
        return summary

    def _skip_pass(self, summary: dict[str, Any], started: float) -> dict[str, Any]:
        """End a pass that has no device to measure on: nothing is measured or decided; the next pass tries
        the devices again."""
        summary["finished_at"] = time.time()
        summary["duration_s"] = round(summary["finished_at"] - started, 2)
        summary["queue"] = queue_counts(self.db)
        self.last_pass = summary
        if not self._logged_no_device:
            self._logged_no_device = True
            log.warning("passes skipped: no device of `devices` can be metered now; nothing is measured or decided "
                        "until one can")
        if not self.stop_event.is_set():
            self.heartbeat("idle", "pass skipped: no device can be metered")
        return summary

    def _policy_folders(self) -> tuple[Path, ...]:
        """The policy folders a pass reads. A folder named in the config or with --policies must exist (a
        missing one is a policy error); the default one (<JOULEPILOT_HOME>/policies), which a new install does
        not have yet, counts as no policies while it is missing, with a notice saying where to put them."""
        if self.cfg.policies_given:
            return self.cfg.policies
        present = tuple(folder for folder in self.cfg.policies if folder.is_dir())
        missing = [str(folder) for folder in self.cfg.policies if folder not in present]
        if missing and not self._logged_no_policy_folder:
            log.warning("no policies yet: the default policy folder %s does not exist; put policy files (*.toml, "
                        "see examples/policies) there, or name a folder with --policies DIR or `policies` in the "
                        "daemon config", ", ".join(missing))
        self._logged_no_policy_folder = bool(missing)
        return present

    def _log_policy_errors(self, errors: list[dict[str, str]]) -> None:
        """Each skipped file's error is logged when it first appears or changes, not every pass."""
        current = {e["file"]: e["error"] for e in errors}
        repeated = 0
        for file, error in current.items():
            if self._logged_policy_errors.get(file) == error:
                repeated += 1
            else:
                log.error("policy skipped: %s: %s", file, error)
        if repeated:
            log.info("%d policy file(s) still skipped as logged before (`joulepilot status` lists them)", repeated)
        self._logged_policy_errors = current

    def _import_pending(self) -> None:
        """Runs whose commit failed earlier (disk full) and windows a deployment could not write wait in side
        files; store them now."""
        for line, kept in import_side_files(self.db, stop=self.stop_event.is_set).notes():
            (log.warning if kept else log.info)("%s", line)

    def _has_open_jobs(self, policy: str) -> bool:
        return has_open_jobs(self.db, policy)

    def _runnable_jobs(self, by_name: dict[str, Any], probe: DeviceProbe) -> list[JobRow]:
        """Queued jobs this pass can run: of a loaded policy, under this host's provenance (which other hosts of the
        same device kind and software share), those of configurations this host has not measured first, so that a
        contender's repeats run on other hosts where one is free. A job whose host's lease ran out is queued again
        first."""
        recovered = recover_jobs(self.db)
        if recovered:
            log.info("job(s) %s re-queued: the host that claimed them stopped renewing its claim",
                     ", ".join(map(str, recovered)))
        jobs = [j for j in queued_jobs(self.db) if j.policy in by_name and j.provenance_key == probe.provenance_key]
        if len(jobs) < 2:
            return jobs
        mine = configs_measured_by(self.db, self.host_id, probe.provenance_key)
        return sorted(jobs, key=lambda j: j.config_id in mine)

    def _renew_leases(self, scheduler: GpuScheduler) -> None:
        """Extend the claims on this host's running jobs (every poll at most); a claim another host took over (this
        host stopped renewing for longer than the lease: the store was unreachable) is said once."""
        now = time.monotonic()
        if now - self._leases_renewed_at < min(self.cfg.idle.poll_s, self.cfg.fleet.lease_s / 3):
            return
        self._leases_renewed_at = now
        ids = [running.job.id for running in scheduler.running().values()]
        try:
            lost = renew_leases(self.db, self.host_id, ids, self.cfg.fleet.lease_s)
        except Exception as exc:
            problem = as_store_error(exc, self.cfg.db)
            if problem is None:
                raise
            if not self._renewal_failing:  # once until a renewal succeeds again
                log.warning("claims not renewed (%s); every poll tries again", problem)
            self._renewal_failing = True
            return
        self._renewal_failing = False
        for job_id in lost:
            log.warning("job %d: this host's claim ran out and the job went back to the queue; its run is still "
                        "stored when it ends", job_id)

    def _run_queue(self, by_name: dict[str, Any], devices: list[str], probe: DeviceProbe,
                   summary: dict[str, Any]) -> None:
        """Run the queue: a job on every idle device at once, each job's end stored here as it comes.

        Returns when the queue is empty, when the daemon stops (the running jobs killed and re-queued), or
        when jobs wait and no device is idle: at once if production load took a device back during this
        pass, else after waiting up to one interval (the pass is then `paused`)."""
        from joulepilot.compiler.device_pool import worker_env

        self._paused = False
        scheduler = GpuScheduler(devices, self._tracker, preempt_every_s=self.cfg.idle.poll_s)
        self.scheduler = scheduler
        if self.stop_event.is_set():
            scheduler.cancel_all(self.stop_reason or "stopped")
        env = worker_env(scheduler.concurrent, self.cfg.compile_cache.redis_url)
        wait_s = max(self.cfg.interval_s, self.cfg.idle.min_idle_s + self.cfg.idle.poll_s)
        plan_guided = True  # the guided searches may have a next measurement (again after each job's end)
        last_workload: dict[str, str] = {}  # each device's latest workload, whose zygote is up there
        waiting_since: float | None = None
        try:
            while True:
                runnable: list[JobRow] = []
                if not self.stop_event.is_set() and scheduler.free():
                    runnable = self._runnable_jobs(by_name, probe)
                    if not runnable and plan_guided:
                        plan_guided = False
                        guided = self._advance_guided(by_name, probe, summary, slots=len(devices))
                        repeats = self._advance_repeats(by_name, probe, summary)
                        if guided or repeats:
                            runnable = self._runnable_jobs(by_name, probe)
                            self._notify("jobs_planned", total=len(runnable), devices=len(devices),
                                         open_ended=self._more_may_follow(by_name))
                    if runnable:
                        ready = scheduler.ready_devices(own_process_tree())
                        started, left = assign_jobs(ready, runnable, last_workload)
                        for device, job in started:
                            last_workload[device] = job.workload_id
                            self._start_next_zygote(device, job, by_name, probe, env)
                            self._start_job(scheduler, job, by_name[job.policy], device, env, probe)
                        waiting = [d for d in scheduler.free() if d not in ready]
                        for device, job in assign_jobs(waiting, left, last_workload)[0]:
                            self._start_zygote_while_waiting(job, by_name[job.policy], device, env)
                if not scheduler.running():
                    if self.stop_event.is_set() or not runnable:
                        return
                    # Jobs wait and no device is idle.
                    now = time.monotonic()
                    if waiting_since is None:
                        waiting_since = now
                        reason = scheduler.waiting_reason()
                        log.info("waiting for an idle device (%s)", reason)
                        self.heartbeat("paused", f"waiting for an idle device: {reason}")
                    if scheduler.preempted or now - waiting_since >= wait_s:
                        summary["paused"] = self._paused = True
                        return
                    self.stop_event.wait(self.cfg.idle.poll_s)
                    continue
                waiting_since = None
                self._renew_leases(scheduler)
                event = scheduler.next_event(timeout=min(self.cfg.idle.poll_s, self.cfg.fleet.lease_s / 3))
                if event is None:
                    continue
                if isinstance(event, Finished):
                    plan_guided = True
                    self._job_finished(event, summary)
                elif event.what == WORKER_STARTED:
                    self._worker_started(event.key, event.value)
        finally:
            if scheduler.running():  # the pass failed: end its jobs, back in the queue
                scheduler.cancel_all("the pass failed")
                self._end_running(scheduler)
            self.scheduler = None

    def _end_running(self, scheduler: GpuScheduler, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while scheduler.running() and time.monotonic() < deadline:
            event = scheduler.next_event(timeout=0.5)
            if isinstance(event, Finished):
                try:
                    requeue_job(self.db, event.key.job.id)
                except Exception as exc:  # the store is what failed: a restart re-queues the job
                    problem = as_store_error(exc, self.cfg.db)
                    if problem is None:
                        log.exception("job %d not re-queued", event.key.job.id)
                    else:
                        log.error("job %d not re-queued (%s); the next start re-queues it", event.key.job.id,
                                  problem)
                with self._jobs_lock:
                    self._jobs_view.pop(event.key.job.id, None)

    def _model_for_pass(self) -> Any:
        """The trade-off model the guided searches of this pass plan with: fitted once per pass (the
        search corrects its predictions with every measurement itself)."""
        if not self._pass_model_fitted:
            self._pass_model_fitted = True
            self.heartbeat("fitting", "fitting the trade-off model to plan the guided searches")
            self._pass_model = fit_or_none(self.db)
        return self._pass_model

    def _guided_plan(self, policy: Any, probe: DeviceProbe, model: Any) -> GuidedPlan:
        state = self._guided[policy.name]
        return plan_guided(self.db, policy, probe.device_kind, model, provenance_key=probe.provenance_key,
                           max_age_s=self.cfg.max_decision_age_s, violated=state.violated,
                           blocked=repeat_blocked(self.db, policy, probe.provenance_key, self.cfg.bench.max_attempts))

    def _advance_guided(self, by_name: dict[str, Any], probe: DeviceProbe, summary: dict[str, Any],
                        slots: int = 1) -> bool:
        """Queue the next measurement of the guided searches that have none open; True when one was queued.
        A search whose next measurement cannot be queued (its job failed too often) stops for this pass.

        At most `slots` searches (one per device) run at once, each to its end before another starts: a
        workload's measurements then follow one another, forked from one zygote, where searches taking turns
        would close and start each workload's zygote again at every turn (seconds of imports and model
        build on every job)."""
        from joulepilot.store import upsert_config

        queued = False
        order = sorted(self._guided.items(), key=lambda item: not item[1].active)  # searches under way first
        in_flight = sum(1 for _, state in order if state.active and not state.stopped)
        for name, state in order:
            if state.stopped or self._has_open_jobs(name):
                continue
            if not state.active and in_flight >= slots:
                continue  # its turn comes when a search under way stops
            policy = by_name[name]
            model = self._model_for_pass()  # fitted before the write below, which other hosts wait for
            # Planned and queued in one write: another host may store a run, or queue this search's next
            # measurement, in between.
            with transaction(self.db):
                if self._has_open_jobs(name):
                    continue  # another host of the fleet queued it first
                plan = self._guided_plan(policy, probe, model)
                state.plan = plan
                if not plan.done:
                    step = plan.next[0]
                    upsert_config(self.db, step.config.to_row())
                    job_id, created = enqueue_job(self.db, policy=name,
                                                  workload_id=config_workload_id(policy, step.config),
                                                  config_id=step.config.id, provenance_key=probe.provenance_key,
                                                  max_attempts=self.cfg.bench.max_attempts,
                                                  windows=max(1, int(step.windows)))
                    drop_queued_jobs(self.db, name, [job_id])
            if plan.done:
                in_flight -= int(state.active)
                state.stopped = True
                log.info("policy %s: guided search stops after %d measurement(s), %.0f s: %s; %d skipped", name,
                         plan.measurements, plan.spent_s, plan.stop_reason, len(plan.skipped))
                continue
            if not created:
                in_flight -= int(state.active)
                state.stopped = True
                log.warning("policy %s: %s could not be queued again (its job failed %d times); the guided "
                            "search stops for this pass", name, step.config.label, self.cfg.bench.max_attempts)
                continue
            summary["enqueued"] += 1
            queued = True
            if not state.active:
                state.active = True
                in_flight += 1
            log.info("policy %s: guided search measures %s (%s): %s", name, step.config.label, step.kind, step.why)
        return queued

    def _advance_repeats(self, by_name: dict[str, Any], probe: DeviceProbe, summary: dict[str, Any]) -> bool:
        """Queue the repeats of the exhaustive policies whose sweep is done (no job open): one job per contender
        still to confirm (`controller.planner.plan_repeats`), each a fresh worker process taking the windows
        the contender still needs. True when one was queued. Called again after every job's end, so repeats
        go on until every contender is confirmed, reached the cap of runs, or its job failed `max_attempts`
        times (no longer queued); the policy is decided after that."""
        from joulepilot.store import upsert_config

        queued = False
        for name, violated in self._exhaustive.items():
            if self._has_open_jobs(name):
                continue
            policy = by_name[name]
            started = []
            with transaction(self.db):  # planned and queued in one write, as another host may store a run between
                plan = plan_repeats(self.db, policy, probe.device_kind, provenance_key=probe.provenance_key,
                                    max_attempts=self.cfg.bench.max_attempts, violated=violated)
                for repeat in plan.repeats:
                    upsert_config(self.db, repeat.config.to_row())
                    _job_id, created = enqueue_job(self.db, policy=name,
                                                   workload_id=config_workload_id(policy, repeat.config),
                                                   config_id=repeat.config.id, provenance_key=probe.provenance_key,
                                                   max_attempts=self.cfg.bench.max_attempts,
                                                   windows=max(1, repeat.windows))
                    if created:
                        started.append(repeat)
            if not started:
                continue
            queued = True
            summary["enqueued"] += len(started)
            summary["repeats"] += [{"policy": name, **r.to_dict()} for r in started]
            what = ", ".join(f"{r.config.label} ({r.why}; {r.windows} window{'s' if r.windows != 1 else ''} in a "
                             f"fresh process)" for r in started)
            log.info("policy %s: %s; %d to measure again: %s", name, plan.reason, len(started), what)
        return queued

    def _start_job(self, scheduler: GpuScheduler, job: JobRow, policy: Any, device: str,
                   env: dict[str, str], probe: DeviceProbe) -> None:
        """Claim `job` and start measuring it on `device` in a compiler worker (on a thread of its own)."""
        from joulepilot.compiler import measure_config, start_zygote_early, worker_job_key
        from joulepilot.compiler.bench import default_idle_s, describes_now

        if not claim_job(self.db, job.id, host_id=self.host_id, lease_s=self.cfg.fleet.lease_s):
            return  # another host of the fleet claimed it first
        row = config_row(self.db, job.config_id)
        if row is None:
            raise LookupError(f"job {job.id}: configuration {job.config_id} is not in the store")
        cfg = measured_config(row, policy)  # at its own batch size: the batch-size lever measures several
        running = scheduler.running().values()
        # One worker describes a workload (FLOPs through torch.export, once): not two at the same time.
        describes = (workload_needs_description(self.db, job.workload_id)
                     and not any(r.describes and r.job.workload_id == job.workload_id for r in running)
                     and describes_now(device, cfg, any(mode != "eager" for mode in policy.search.modes),
                                       next_job_planned_from_it=policy.search.strategy == "guided"))
        with self._jobs_lock:
            self._jobs_view[job.id] = {"id": job.id, "policy": policy.name, "workload": policy.workload,
                                       "config": cfg.label, "device": device, "started_at": time.time()}
        warm_from = self._warm_from(job, cfg, probe)
        log.info("job %d: %s %s on %s%s", job.id, policy.workload, cfg.label, device,
                 "" if warm_from is None else f", starting from the artifacts of run {warm_from}")
        purpose = self._job_purpose(job)
        self._notify("job_started", job_id=job.id, device=device,
                     label=f"{policy.name} {cfg.label} on {device}" + (f" ({purpose})" if purpose else ""))
        workload = policy.workload_args()
        columns = run_columns(self.db)
        bench_cfg = self.cfg.bench
        zygotes = self._zygotes
        windows = self._windows_for(job)
        gate = None
        if windows > 1 and policy.search.strategy == "guided":
            # each further window only while the judge still asks for the configuration (read from the store
            # here: the gate runs on the job's thread)
            state = self._guided.get(policy.name)
            gate = window_gate(self.db, policy, probe.device_kind, job.config_id, provenance_key=probe.provenance_key,
                               max_age_s=self.cfg.max_decision_age_s, violated=state.violated if state else ())
        if device.startswith("cuda") and not self._has_context(device):
            # the quiet period that just made the device ready, as its idle baseline (read here, before the
            # job's checks for production load start a new period)
            quiet = self._tracker(device).quiet_power_w(default_idle_s(device))
            with self._contexts_lock:
                self._quiet_baselines[device] = quiet
            if zygotes is not None:
                # the zygote's CPU work does not disturb the GPU's idle power, taken first on the job's thread
                start_zygote_early(zygotes, worker_job_key(policy.workload, cfg, device, **workload), env)

        def measure(stop_check: Any, on_start: Any) -> Any:  # on the job's thread: no store here
            context = self._pass_context(device)
            # the policy's workload whole: input shapes or its shape set, model options, a generation
            return measure_config(
                policy.workload, cfg, context=context, columns=columns, min_seconds=bench_cfg.min_seconds,
                budget_s=bench_cfg.budget_s, describe=describes, cancel=stop_check, on_start=on_start,
                worker_env=env, zygotes=zygotes, windows=windows, windows_max_rel_error=policy.limits.max_rel_error,
                window_gate=gate, warm_from_run=warm_from, **workload,
            )

        scheduler.start(device, RunningJob(job, policy, cfg.label, device, describes), measure)

    def _warm_from(self, job: JobRow, cfg: Any, probe: DeviceProbe) -> int | None:
        """The run whose saved artifacts a job of a compiled configuration starts from (`measure_config`'s
        `warm_from_run`), or None: its newest cold run on this host under this provenance, within the decision
        age limit, that saved them. A repeat in a fresh process then costs a warm start where a second cold
        compile would cost several times more (a max-autotune one, its autotuning again), and it runs the very
        kernels that a serving process loads."""
        if not cfg.compiles:
            return None
        age = self.cfg.max_decision_age_s
        return warm_start_source(self.db, job.workload_id, job.config_id, host_id=self.host_id,
                                 provenance_key=probe.provenance_key,
                                 min_finished_at=None if age is None else time.time() - age)

    def _guided_step(self, job: JobRow) -> Any:
        """The guided search's step that `job` measures, or None (not a guided policy's job)."""
        state = self._guided.get(job.policy)
        step = state.plan.next[0] if state is not None and state.plan is not None and state.plan.next else None
        return step if step is not None and step.config.id == job.config_id else None

    def _windows_for(self, job: JobRow) -> int:
        """How many energy windows the job's worker takes, as the host that queued it asked (`jobs.windows`): what
        its guided search asked for this measurement (a repeat takes the windows it still needs in one process,
        `controller.search.Step.windows`), or what an exhaustive policy's repeat still needs (`_advance_repeats`),
        else 1."""
        return max(1, int(job.windows or 1))

    def _job_purpose(self, job: JobRow) -> str:
        """What a job is for, for the progress line: '' for a job of an exhaustive sweep, else its guided search's
        step ('guided search: baseline', '... next candidate', '... repeat') or 'repeat, 2 windows'."""
        step = self._guided_step(job)
        if step is not None:
            return f"guided search: {'next candidate' if step.kind == 'guided' else step.kind}"
        if job.windows:
            windows = self._windows_for(job)
            return f"repeat, {windows} window{'s' if windows != 1 else ''}"
        return ""

    def _more_may_follow(self, by_name: dict[str, Any]) -> bool:
        """Whether this pass may still queue jobs it has not planned yet: a guided search that has not stopped
        plans its next measurement after each job, and an exhaustive policy that asks for more than one run of
        its contenders queues their repeats once its sweep is done."""
        return any(not state.stopped for state in self._guided.values()) or \
            any(by_name[name].search.min_repeats > 1 for name in self._exhaustive if name in by_name)

    def _worker_started(self, running: RunningJob, worker_pid: int) -> None:
        with self._jobs_lock:
            if running.job.id in self._jobs_view:
                self._jobs_view[running.job.id]["worker_pid"] = worker_pid
            others = len(self._jobs_view) - 1
        more = f" (and {others} more job{'s' if others > 1 else ''})" if others > 0 else ""
        self.heartbeat("sweeping", f"measuring {running.policy.name}: {running.label} on {running.device}{more}")

    def _job_finished(self, event: Finished, summary: dict[str, Any]) -> JobOutcome:
        """A job ended on its device: store its run and the job's end in one transaction, or put a stopped or
        pre-empted job back in the queue, or mark a job that could not be measured failed."""
        running: RunningJob = event.key
        job = running.job
        run_id: int | None = None
        outcome: JobOutcome | None = None
        note: str | None = None
        try:
            if event.error is not None:  # the device could not be metered, the workload not resolved ...
                exc = event.error
                log.error("job %d could not be measured: %s: %s", job.id, type(exc).__name__, exc)
                finish_job(self.db, job.id, state="failed", run_id=None)
                outcome = JobOutcome("error", reason=f"{type(exc).__name__}: {exc}")
                summary["runs_failed"] += 1
            else:
                outcome = event.result
                if outcome.kind == "measured":
                    run_id = self._store_measured(job, running.policy, outcome)
                    summary["runs_ok" if outcome.extra.get("status") == "ok" else "runs_failed"] += 1
                    note = self._stop_at_load_error(job, running.policy, outcome.result, summary)
                else:
                    requeue_job(self.db, job.id)
                    summary["requeued"] += 1
                    log.info("job %d re-queued: %s", job.id, outcome.reason)
        finally:
            with self._jobs_lock:
                self._jobs_view.pop(job.id, None)
            if outcome is not None:
                further = further_window_run_ids(self.db, run_id) if run_id is not None else []
                self._pass_bill.job_ended(running.policy.name, run_id, outcome.wall_s, further)
                self._notify("job_finished", job_id=job.id, kind=outcome.kind, status=outcome.extra.get("status"),
                             run_id=run_id, reason=outcome.reason, wall_s=outcome.wall_s, device=running.device,
                             note=note)
        return outcome

    def _stop_at_load_error(self, job: JobRow, policy: Any, measured: Any, summary: dict[str, Any]) -> str | None:
        """A run that failed building its workload (`MeasuredRun.load_error`), which every configuration of that
        workload would meet: its other queued jobs fail without running (each counting the attempt, as a run
        would have), the policy's guided search stops for this pass, and the policy's error is recorded once in
        the pass's summary (`joulepilot status` shows it). A configuration's own failure (a compile error) is left
        to the queue as before. Returns the line said of it, or None."""
        from joulepilot.store.daemon_state import fail_queued_jobs

        reason = measured.load_error
        if reason is None or (policy.name, job.workload_id) in self._load_errors:
            return None
        self._load_errors.add((policy.name, job.workload_id))
        skipped = fail_queued_jobs(self.db, workload_id=job.workload_id, provenance_key=job.provenance_key)
        state = self._guided.get(policy.name)
        if state is not None:
            state.stopped = True
        text = f"its workload cannot be built ({reason})"
        if skipped:
            text += (f"; its {skipped} other queued configuration{'s' if skipped != 1 else ''} failed without being "
                     f"measured")
        if state is not None:
            text += "; the guided search stops for this pass"
        text += "; fix the workload"
        summary["policy_errors"].append({"file": str(policy.path), "error": text})
        log.error("policy %s: %s", policy.name, text)
        return text

    def _start_zygote_while_waiting(self, job: JobRow, policy: Any, device: str,
                                    env: dict[str, str] | None = None) -> bool:
        """On a GPU, start the zygote of the job's workload before waiting for the GPU to be idle: it works on
        the CPU only, so the quiet period the daemon waits out is not disturbed, and the job does not wait
        for it afterwards. (On a CPU device it would be the very load the wait is about.) True when one was
        started."""
        row = config_row(self.db, job.config_id)
        if row is None:
            return False
        return self._start_zygote_early(policy, measured_config(row, policy), device, env)

    def _start_zygote_early(self, policy: Any, cfg: Any, device: str, env: dict[str, str] | None) -> bool:
        from joulepilot.compiler import start_zygote_early, worker_job_key

        if not device.startswith("cuda") or self._zygotes is None:
            return False
        return start_zygote_early(self._zygotes, worker_job_key(policy.workload, cfg, device,
                                                                **policy.workload_args()), env)

    def _start_next_zygote(self, device: str, started: JobRow, by_name: dict[str, Any], probe: DeviceProbe,
                           env: dict[str, str]) -> None:
        """On a GPU, start the zygote of the workload that comes after `started`'s there, while `started`'s
        workload measures: the next workload's first job then does not wait for its imports and model build
        (several seconds, against an eager job's 8). Next is the first queued job of another workload, else the
        first guided search of this pass that has not begun; a guess the queue proves wrong costs that zygote's
        CPU seconds only. One such zygote per GPU at a time, started before `started`'s job is handed over
        (whose thread then takes the device's zygote); not at the device's first job of the pass, which is
        waiting for its own."""
        if not device.startswith("cuda") or self._zygotes is None or not self._has_context(device):
            return
        for job in self._runnable_jobs(by_name, probe):
            if job.workload_id != started.workload_id:
                self._start_zygote_while_waiting(job, by_name[job.policy], device, env)
                return
        for name, state in self._guided.items():
            if not state.active and not state.stopped and name != started.policy:
                policy = by_name[name]
                self._start_zygote_early(policy, _first_config(policy), device, env)
                return

    def _has_context(self, device: str) -> bool:
        with self._contexts_lock:
            return device in self._contexts

    def _pass_context(self, device: str) -> Any:
        """Provenance, metered devices and idle baseline of `device`, taken at its first job of the pass
        (the device was found idle just before) and shared by the pass's other jobs on it. On a GPU whose
        quiet period (the wait for an idle device) spanned at least the baseline's seconds, the baseline is
        the GPU's average power over that period; else it is measured now. Called on the jobs' threads: each
        device's is taken under a lock of its own, so devices take theirs side by side."""
        from joulepilot.compiler import sweep_context
        from joulepilot.compiler.bench import default_idle_s

        with self._contexts_lock:
            lock = self._context_locks.setdefault(device, threading.Lock())
        with lock:
            with self._contexts_lock:
                context = self._contexts.get(device)
            if context is None:
                idle_s = default_idle_s(device)
                with self._contexts_lock:
                    quiet = self._quiet_baselines.pop(device, None)
                if quiet is not None:
                    log.info("%s: idle baseline %.1f W from the %.0f s quiet period just observed", device,
                             quiet[0], quiet[1])
                    context = sweep_context(device, quiet[1], quiet_power_w=quiet[0])
                else:
                    context = sweep_context(device, idle_s)
                with self._contexts_lock:
                    self._contexts[device] = context
            return context

    def _store_measured(self, job: JobRow, policy: Any, outcome: JobOutcome) -> int | None:
        """Store the job's run and end the job in one transaction (or set the run aside); the run's id."""
        from joulepilot.compiler.bench import flag_far_from_stored_runs, further_span_s

        measured = outcome.result
        try:
            flag_far_from_stored_runs(self.db, measured)
        except Exception as exc:  # the store is what failed: the run is kept all the same (the commit below)
            if as_store_error(exc, self.cfg.db) is None:
                raise
            log.warning("job %d: not compared with the configuration's stored runs (%s)", job.id,
                        as_store_error(exc, self.cfg.db))
        job_fields = {"job_id": job.id, "daemon_pid": os.getpid(), "policy": policy.name,
                      "job_provenance_key": job.provenance_key}
        for row, _ in measured.further:  # further windows of the worker: runs of the same job
            row["extra"].update(job_fields)
        # `job_wall_s`: the whole job (worker start-up, idle baseline, ...), which the tuning bill counts, less
        # the further windows, each billed as its own run.
        job_wall_s = outcome.wall_s - further_span_s(measured.further)
        measured.row["extra"].update({**job_fields, "job_wall_s": round(job_wall_s, 3)})
        outcome.extra["status"] = measured.status
        try:
            # A stop request ends the wait for a locked store at once: the run goes to its side file.
            stored = commit_run_or_set_aside(self.db, measured.row, measured.samples, **measured.references(),
                                             job_id=job.id, stop=self.stop_event.is_set)
        except RunNotStored as exc:
            log.error("job %d: %s; the job is measured again after a restart. Lost: %s", job.id, exc,
                      {k: measured.row.get(k) for k in ("status", "reason", "energy_j_per_inference",
                                                          "latency_ms_p50", "energy_source")})
            return None
        if stored.run_id is None:
            if isinstance(stored.failure, DatabaseCorrupt):  # no later job's run could be stored: the pass ends
                log.error("job %d: its run is kept in %s, to be imported once the database is whole again",
                          job.id, stored.pending_path)
                raise stored.failure
            log.error("job %d: the run could not be stored (%s); it is kept in %s and imported at the next "
                      "pass or start", job.id, stored.error, stored.pending_path)
            return None
        why = f": {measured.reason.splitlines()[0]}" if measured.status != "ok" and measured.reason else ""
        log.info("job %d: %s, run %d (%.1fs)%s", job.id, measured.status, stored.run_id, outcome.wall_s, why)
        return stored.run_id

    def _decide(self, stale: dict[str, str], by_name: dict[str, Any], probe: DeviceProbe,
                violated_by_policy: dict[str, set[str]], requested: dict[str, list[int]],
                summary: dict[str, Any]) -> None:
        """Decide the stale policies whose sweep is complete, then make sure every other policy's lock
        file holds its stored decision (a lock write that failed on an earlier pass is retried here).
        `violated_by_policy` was used to plan; `decide` reads the violated configurations itself."""
        from joulepilot.policies import LockWriteError, sync_lock

        ready = self._warm_zygote_first([n for n in stale if not self._has_open_jobs(n)], by_name, probe.device)
        stale_done: list[str] = []  # decided by another host during this pass: its lock file is written below
        if ready:
            self.heartbeat("fitting", f"refitting and deciding {len(ready)} polic{'y' if len(ready) == 1 else 'ies'}")
            model = fit_or_none(self.db)
        for index, name in enumerate(ready):
            policy = by_name[name]
            if index + 1 < len(ready):  # its warm starts' zygote, started while this policy's are timed
                following = by_name[ready[index + 1]]
                self._start_zygote_early(following, _first_config(following), probe.device, None)
            # A contender or a guided search's pick whose job failed as often as it may is not measured again.
            failed_out = repeat_blocked(self.db, policy, probe.provenance_key, self.cfg.bench.max_attempts)
            guided = policy.search.strategy == "guided"
            try:
                # Checked and decided in one write: a fleet's hosts decide a policy once between them.
                with transaction(self.db):
                    if self._decided_elsewhere(policy, probe):
                        log.info("policy %s: another host of the fleet decided it during this pass", name)
                        stale_done.append(name)
                        mark_requests_handled(self.db, requested.get(name, []))
                        continue
                    # A guided policy is decided with the model its search planned with this pass: one refitted on
                    # the runs the search just made can see another candidate worth measuring, and the search that
                    # stopped would then be left undecided.
                    planned_with = self._pass_model if guided and self._pass_model_fitted else model
                    decided, _plan = decide_now(self.db, policy, probe.device_kind, planned_with, decided_by="daemon",
                                                reason=stale[name], provenance_key=probe.provenance_key,
                                                max_age_s=self.cfg.max_decision_age_s, lock_dir=self.cfg.lock_dir,
                                                failed_out=failed_out, until_done=True)
            except Exception as exc:
                log.exception("policy %s: deciding failed", name)
                summary["policy_errors"].append({"file": str(policy.path), "error": f"deciding failed: {exc}"})
                continue
            if decided is None:  # its guided search stopped or paused between measurements: the next pass goes on
                continue
            decision = decided.decision
            summary["decided"].append({"policy": name, "config": decision.label, "state": decision.state,
                                       "reason": decision.reason, "decision_id": decision.id})
            if decided.lock_file:
                summary["lock_files"].append(str(decided.lock_file))
            if decided.lock_error:
                self._lock_failed(policy, decided.lock_error, summary)
            log.info("policy %s decided: %s (%s)", name, decision.label, decision.state)
            mark_requests_handled(self.db, requested.get(name, []))
            self._time_warm_starts(policy, decision, probe.device, summary)
        for name, policy in by_name.items():
            if name in stale and name not in stale_done:
                continue
            try:
                written = sync_lock(self.db, policy, probe.device_kind, lock_dir=self.cfg.lock_dir)
            except LockWriteError as exc:
                self._lock_failed(policy, str(exc), summary)
                continue
            if written:
                log.info("policy %s: lock file %s written", name, written)
                summary["lock_files"].append(str(written))

    def _decided_elsewhere(self, policy: Any, probe: DeviceProbe) -> bool:
        """Whether `policy` was decided for this device kind and provenance since this pass read its decision (by
        another host sharing the store: this one decides a policy once a pass), leaving nothing to decide. Told by
        the decisions' ids, which one database gives out in order, not by the hosts' clocks."""
        decision, _refused = newest_sound_decision(self.db, policy, probe.device_kind)
        return decision is not None and decision.id > self._decision_seen.get(policy.name, 0) and \
            stale_reason(decision, policy_hash=policy.hash, provenance_key=probe.provenance_key,
                         max_age_s=self.cfg.max_decision_age_s) is None

    def _warm_zygote_first(self, names: list[str], by_name: dict[str, Any], device: str) -> list[str]:
        """`names` with the policy whose workload's zygote is up on `device` (the last one measured) first: its
        warm starts are timed without starting that zygote again."""
        current = self._zygotes.zygote_on(device) if self._zygotes is not None else None
        if current is None:
            return names

        def is_current(name: str) -> bool:
            policy = by_name[name]
            return (policy.workload, policy.batch_size) == (current.key.spec, current.key.batch_size)

        return sorted(names, key=lambda name: not is_current(name))

    def _time_warm_starts(self, policy: Any, decision: Any, device: str, summary: dict[str, Any]) -> None:
        """Time the warm start (a worker with empty caches loading the saved compile artifacts, then its first
        call) of the decided configuration and the runner-up, once per run, while the device stays idle.
        Only those two: a warm start of every configuration would cost a worker per job for figures that no
        deployment uses. Each runs on a job thread of its own, stopped as a job is; the store is read and
        written here, on the pass's thread."""
        from joulepilot.compiler import time_warm_start, warm_start_fields
        from joulepilot.compiler.artifacts import recorded_artifacts
        from joulepilot.compiler.device_pool import worker_env
        from joulepilot.store import record_warm_start, run_warm_start_state

        from .redecide import warm_start_candidates

        if policy.generates:
            return  # a generation's warm start is not timed yet (as in bench)
        shape = policy.shape_args()
        tracker = self._tracker(device)
        bench_cfg = self.cfg.bench
        zygotes = self._zygotes
        env = worker_env(1, self.cfg.compile_cache.redis_url)
        for role, candidate in warm_start_candidates(decision):
            artifacts, timed = run_warm_start_state(self.db, candidate.run_id)
            if not artifacts or timed is not None:
                continue  # eager, or already timed
            if self.stop_event.is_set() or tracker.busy_now(own_process_tree()):
                return
            cfg = measured_config(candidate.config, policy)
            saved = recorded_artifacts(artifacts, config_workload_id(policy, cfg), cfg.id,
                                       self._pass_context(device).origin)
            if saved is None:
                continue  # saved elsewhere than this host saves them, or gone
            self.heartbeat("sweeping", f"timing the warm start of {policy.name}: {cfg.label} on {device}")

            def measure(stop_check: Any, on_start: Any, cfg: Any = cfg, artifacts: str = str(saved)) -> Any:
                return time_warm_start(policy.workload, cfg, artifacts, context=self._pass_context(device),
                                       min_seconds=bench_cfg.min_seconds, budget_s=bench_cfg.budget_s,
                                       seq_len=shape.get("seq_len"), image_size=shape.get("image_size"),
                                       shapes=policy.shapes, cancel=stop_check, on_start=on_start,
                                       zygotes=zygotes, worker_env=env)

            event = self._measure_alone(device, (policy.name, role), measure)
            outcome = event.result if event.error is None else None
            if outcome is None or outcome.kind != "measured":
                why = outcome.reason if outcome is not None else f"{type(event.error).__name__}: {event.error}"
                log.info("policy %s: warm start of %s not timed: %s", policy.name, cfg.label, why)
                return
            warm_s, details = warm_start_fields(outcome.result)
            record_warm_start(self.db, candidate.run_id, warm_s, {**details, "warm_start_role": role})
            summary["warm_starts"].append({"policy": policy.name, "config": cfg.label, "role": role,
                                           "run_id": candidate.run_id, "warm_start_s": warm_s})
            log.info("policy %s: %s %s warm start %s", policy.name, role, cfg.label,
                     f"{warm_s:.2f} s" if warm_s is not None else f"failed: {details.get('warm_start_error')}")

    def _measure_alone(self, device: str, key: Any, measure: Any) -> Finished:
        """Run `measure` as the only job, on `device` (a thread of its own that `request_stop` and production
        load returning stop, as any job's), and wait here for its end."""
        scheduler = GpuScheduler([device], self._tracker, preempt_every_s=self.cfg.idle.poll_s)
        self.scheduler = scheduler
        if self.stop_event.is_set():
            scheduler.cancel_all(self.stop_reason or "stopped")
        try:
            scheduler.start(device, key, measure)
            while True:
                event = scheduler.next_event(timeout=self.cfg.idle.poll_s)
                if isinstance(event, Finished):
                    return event
        finally:
            if scheduler.running():  # the pass failed while it ran: stop it
                scheduler.cancel_all("the pass failed")
                deadline = time.monotonic() + 60.0
                while scheduler.running() and time.monotonic() < deadline:
                    scheduler.next_event(timeout=0.5)
            self.scheduler = None

    def _lock_failed(self, policy: Any, error: str, summary: dict[str, Any]) -> None:
        log.error("policy %s: %s; the decision is stored and the write is retried next pass", policy.name, error)
        summary["policy_errors"].append({"file": str(policy.path), "error": f"{error}; retried next pass"})


def _first_config(policy: Any) -> Any:
    """A configuration naming the workload a policy's search measures first (its eager baseline at the policy's
    batch size): enough to start that workload's zygote ahead of its first job."""
    from joulepilot.compiler import CompileConfig

    return CompileConfig(mode="eager", batch_size=policy.batch_size)


def bounded_pass(summary: dict[str, Any]) -> dict[str, Any]:
    """The pass summary as a heartbeat keeps it: lists cut to a few entries (with their full count under
    `<key>_total`) and error texts shortened, so a folder of huge or numerous bad files cannot bloat
    every heartbeat."""
    from joulepilot.store.safeio import shorten

    bounded = dict(summary)
    for key, value in summary.items():
        if not isinstance(value, list):
            continue
        kept = value[:HEARTBEAT_LIST_ITEMS]
        if key == "policy_errors":
            kept = [{"file": shorten(str(e.get("file")), HEARTBEAT_ERROR_CHARS),
                     "error": shorten(str(e.get("error")), HEARTBEAT_ERROR_CHARS)} if isinstance(e, dict) else e
                    for e in kept]
        bounded[key] = kept
        if len(value) > len(kept):
            bounded[f"{key}_total"] = len(value)
    return bounded


def _end_leftover_worker(db: Any) -> None:
    """Workers of a daemon that died (SIGKILL) die with it (PR_SET_PDEATHSIG); make sure of it, for every job
    its last heartbeats name (one per device it measured on)."""
    from joulepilot.store.daemon_state import list_heartbeats

    pids: dict[int, None] = {}
    for hb in list_heartbeats(db, limit=5):
        for job in (hb.detail.get("job"), *(hb.detail.get("jobs") or [])):
            pid = (job.get("worker_pid") or job.get("child_pid")) if isinstance(job, dict) else None
            if pid:
                pids[int(pid)] = None
    for pid in pids:
        _end_orphan_worker(pid)


def _end_orphan_worker(pid: int) -> None:
    import psutil

    from .job_runner import kill_tree_of_pid

    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        if not any(name in part for part in cmdline
                   for name in ("joulepilot.compiler.worker", "joulepilot.controller.job_child")):
            return
        # A reused pid may belong to a live bench's worker (a child of it, or of its zygote): only an orphan,
        # whose bench or daemon is no longer among its ancestors, is ended.
        if _original_parent(cmdline) in {p.pid for p in proc.parents()}:
            return
        log.warning("ending benchmark worker %d left by a previous daemon", proc.pid)
        kill_tree_of_pid(proc.pid)
    except psutil.Error:
        pass


def _original_parent(cmdline: list[str]) -> int | None:
    """The parent pid a worker was started by, from its job file (the last argument)."""
    import json

    try:
        return int(json.loads(Path(cmdline[-1]).read_text()).get("parent_pid") or 0) or None
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _remove_stale_scratch(db_path: Path | str) -> None:
    """Scratch folders of workers whose daemon or bench died, and the job-child folder of older versions."""
    from joulepilot.compiler.runner import remove_stale_workdirs

    for folder in remove_stale_workdirs():
        log.info("removed %s, left by a worker whose bench or daemon was killed", folder)
    shutil.rmtree(Path(str(side_path(db_path)) + ".daemon-work"), ignore_errors=True)


def _configure_logging(level: str) -> None:
    root = logging.getLogger("joulepilot")
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s joulepilot-daemon[%(process)d] %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.propagate = False
