"""Prometheus exporter: a collector that reads the database at scrape time (pull, no state of its own).

It runs inside the daemon (`[exporter] enabled`) or as its own process (`joulepilot exporter`, see
`serve_exporter`); the separate process keeps answering when the daemon dies, so
`joulepilot_daemon_up` can drop to 0. Each scrape opens the database read-only (never migrating it)
and reads one consistent snapshot. When the database cannot be read (missing, corrupt, too old or
new), the scrape still answers with `joulepilot_daemon_up` and `joulepilot_exporter_scrape_error` = 1. A
deployment whose stored record cannot be read (a GPU index that is not a number in `details.gpus`) is left out
alone: its series are missing, every other series is served, `joulepilot_exporter_scrape_error` is 1 and the log
names the deployment, the field and the fix.

Series (base units, Prometheus naming; the README's exporter table is the reference):
  joulepilot_policy_decision_info{policy,device,config,mode,fusion,precision,state}
  joulepilot_policy_decision_timestamp_seconds{policy,device}
  joulepilot_policy_energy_joules_per_inference{policy,device,source}
  joulepilot_policy_power_watts{policy,device,source,stat}
  joulepilot_policy_latency_p95_seconds{policy,device}
  joulepilot_energy_joules_total{deployment,policy,source,gpu,UUID}     one series per energy source
  joulepilot_inferences_total{deployment,policy,gpu,UUID}
  joulepilot_tokens_total{deployment,policy,gpu,UUID}                  a generation's generated tokens
  joulepilot_policy_energy_joules_per_token{policy,device,source}      a generation policy's
  joulepilot_deployment_power_watts{deployment,source,gpu,UUID,stat}   latest sample
  joulepilot_violations_total{policy,deployment}
  joulepilot_daemon_up
  joulepilot_daemon_last_heartbeat_timestamp_seconds
  joulepilot_daemon_state{state}
  joulepilot_daemon_queue_jobs{state}
  joulepilot_compile_cache_up
  joulepilot_exporter_scrape_error
`gpu` and `UUID` are spelled as dcgm-exporter spells them, so the series join its DCGM_FI_* series.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from joulepilot.store import StoreUnreachable, as_store_error, host_identity, open_db, shown
from joulepilot.store.daemon_state import HEARTBEAT_STATES, host_heartbeat, queue_counts
from joulepilot.store.db import database_target
from joulepilot.store.decisions import latest_decisions
from joulepilot.store.metrics import (
    decided_figures,
    deployment_totals,
    read_snapshot,
    recorded_gpu,
    require_current_schema,
    violation_counts,
)
from joulepilot.store.unreachable import waiting_runs
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from .instance_lock import lock_path_for, probe_lock

__all__ = ["Exporter", "JoulepilotCollector", "make_registry", "serve_exporter",
           "start_exporter"]

log = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1"
DEFAULT_PORT = 9464
NVML_RETRY_S = 300.0  # how long to wait before asking NVML again after it could not be loaded
# How long a scrape waits for a lock another process holds on the database. Readers never wait for the daemon's
# writes (WAL); only a program holding the file exclusively makes them wait, and a scrape must still answer
# (with joulepilot_exporter_scrape_error 1) well within Prometheus's scrape timeout (10 s by default).
SCRAPE_LOCK_WAIT_MS = 2_000
ENERGY_SOURCES = ("nvml", "rapl", "estimate")
FIX_DEPLOYMENT = "attach it again (that records its GPUs anew) or correct its row in the deployments table"


class MalformedDeployment(ValueError):
    """A deployment's stored record that the exporter cannot turn into series; the message names the field."""


def _gpu_index(value: Any) -> int:
    """A recorded CUDA index as an int: a whole number, or its digits as text (None or absent: 0)."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise MalformedDeployment(f"details.gpus[0].index is {value!r}, not a GPU index (a whole number >= 0)")


class NvmlIndexResolver:
    """GPU UUID -> the host's NVML index (dcgm-exporter's `gpu` label), cached; None where NVML is absent.

    A deployment records the CUDA index its process saw, which differs from the host index when
    CUDA_VISIBLE_DEVICES hides or reorders GPUs; the UUID identifies the card either way.
    Only read calls: nvmlInit, nvmlDeviceGetHandleByUUID, nvmlDeviceGetIndex, nvmlShutdown.
    """

    def __init__(self) -> None:
        self._known: dict[str, int] = {}
        self._failed_at: float | None = None
        self._lock = threading.Lock()

    def resolve(self, uuids: set[str]) -> dict[str, int]:
        with self._lock:
            missing = {u for u in uuids if u and u not in self._known}
            now = time.monotonic()
            if missing and (self._failed_at is None or now - self._failed_at >= NVML_RETRY_S):
                self._look_up(missing, now)
            return {u: self._known[u] for u in uuids if u in self._known}

    def _look_up(self, uuids: set[str], now: float) -> None:
        try:
            from joulepilot.telemetry.nvml import load_pynvml

            nvml = load_pynvml()
            nvml.nvmlInit()
        except Exception as exc:  # no driver, no binding, no permission: labels fall back to recorded indices
            if self._failed_at is None:
                log.info("exporter: NVML unavailable (%s); `gpu` labels use the CUDA index each deployment "
                         "recorded (join on UUID)", exc)
            self._failed_at = now
            return
        try:
            for uuid in uuids:
                try:
                    self._known[uuid] = int(nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(uuid)))
                except Exception:  # a GPU of another host, or one removed since: keep the recorded index
                    self._failed_at = now
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass


class JoulepilotCollector(Collector):
    """Reads the joulepilot database on every scrape (read-only, never migrating)."""

    def __init__(self, db_path: str | os.PathLike) -> None:
        self.db_path = database_target(db_path)
        self._gpu_index = NvmlIndexResolver()
        self._error_lock = threading.Lock()
        self._last_error: str | None = None

    def describe(self) -> list[Metric]:
        return []  # series are only known at scrape time

    def collect(self) -> Iterator[Metric]:
        errors: list[str] = []
        up = GaugeMetricFamily("joulepilot_daemon_up",
                               "1 while a joulepilot daemon holds this database's lock, else 0")
        try:
            up.add_metric([], 1.0 if probe_lock(lock_path_for(self.db_path)) else 0.0)
        except OSError as exc:  # unknown is not down: leave the series out rather than report 0
            errors.append(f"cannot probe the daemon lock {lock_path_for(self.db_path)}: {exc}; give the exporter "
                          f"read access to the database's folder")
        metrics: list[Metric] = []
        reached = GaugeMetricFamily("joulepilot_store_up",
                                    "1 when this scrape reached the database, 0 when its server could not be reached")
        try:
            metrics = self._read_database(errors)
            reached.add_metric([], 1.0)
        except Exception as exc:
            problem = as_store_error(exc, self.db_path)
            errors.append(str(problem or exc))
            if isinstance(problem, StoreUnreachable):  # another failure (a missing file, ...) says nothing of it
                reached.add_metric([], 0.0)
        waiting = GaugeMetricFamily("joulepilot_daemon_runs_waiting",
                                    "Measured runs this host's daemon keeps in side files until the database stores "
                                    "them (while it cannot be reached, or its disk is full)")
        waiting.add_metric([], float(waiting_runs(self.db_path)))
        failed = GaugeMetricFamily("joulepilot_exporter_scrape_error",
                                   "1 when this scrape could not read the database or the daemon lock, or left out "
                                   "a deployment whose record it could not read (the log names it)")
        failed.add_metric([], 1.0 if errors else 0.0)
        self._note_errors(errors)
        yield up
        yield failed
        if reached.samples:
            yield reached
        yield waiting
        yield from metrics

    def _note_errors(self, errors: list[str]) -> None:
        """Log a failure once (and again only when it changes), and the recovery."""
        message = "; ".join(errors) or None
        with self._error_lock:
            if message == self._last_error:
                return
            previous, self._last_error = self._last_error, message
        if message is not None:
            log.warning("exporter: %s", message)
        elif previous is not None:
            log.info("exporter: reading %s again", shown(self.db_path))

    def _read_database(self, errors: list[str]) -> list[Metric]:
        """Every series but the two `collect` adds; `errors` gets one line per deployment left out."""
        db = open_db(self.db_path, read_only=True, busy_timeout_ms=SCRAPE_LOCK_WAIT_MS)
        try:
            require_current_schema(db, self.db_path)
            with read_snapshot(db):
                return [*self._policy_metrics(db), *self._deployment_metrics(db, errors), *self._daemon_metrics(db)]
        finally:
            db.close()

    def _policy_metrics(self, db: Any) -> list[Metric]:
        info = InfoMetricFamily("joulepilot_policy_decision", "Latest decision per policy and device kind",
                                labels=["policy", "device"])
        decided_at = GaugeMetricFamily("joulepilot_policy_decision_timestamp_seconds",
                                       "When the latest decision was made (Unix time)", labels=["policy", "device"])
        energy = GaugeMetricFamily("joulepilot_policy_energy_joules_per_inference",
                                   "Measured joules per inference (one forward call) of the decided configuration",
                                   labels=["policy", "device", "source"])
        power = GaugeMetricFamily("joulepilot_policy_power_watts",
                                  "Measured average and peak power of the decided configuration",
                                  labels=["policy", "device", "source", "stat"])
        latency = GaugeMetricFamily("joulepilot_policy_latency_p95_seconds",
                                    "Measured p95 latency of the decided configuration",
                                    labels=["policy", "device"])
        per_token = GaugeMetricFamily("joulepilot_policy_energy_joules_per_token",
                                      "Measured joules per generated token of the decided configuration (a "
                                      "generation policy's)", labels=["policy", "device", "source"])
        for d in latest_decisions(db):
            labels = [d.policy, d.device_kind]
            info.add_metric(labels, {
                "config": d.config_label or d.config_id or "",
                "mode": d.mode or "",
                "fusion": d.fusion or "",
                "precision": d.precision or "",
                "state": d.state,
            })
            decided_at.add_metric(labels, d.decided_at)
            figures = decided_figures(db, d)  # on the decision's own device kind and torch, never another's
            if figures is None:
                continue
            source = figures.energy_source or "estimate"  # a run without a recorded source was not metered
            if figures.energy_j_per_inference is not None:
                energy.add_metric([*labels, source], figures.energy_j_per_inference)
            for stat in ("avg", "peak"):
                watts = getattr(figures, f"{stat}_power_w")
                if watts is not None:
                    power.add_metric([*labels, source, stat], watts)
            if figures.latency_ms_p95 is not None:
                latency.add_metric(labels, figures.latency_ms_p95 / 1000.0)
            if figures.energy_j_per_token is not None:
                per_token.add_metric([*labels, source], figures.energy_j_per_token)
        return [info, decided_at, energy, power, latency, per_token]

    def _deployment_gpu(self, db: Any, dep: dict[str, Any]) -> tuple[str, int] | None:
        """(UUID, recorded CUDA index) of the one GPU a deployment meters; None for CPU or several GPUs."""
        device = str(dep.get("device") or "")
        if not device.startswith("cuda"):
            return None
        gpus = dep["details"].get("gpus")
        if isinstance(gpus, list):
            if len(gpus) != 1 or not isinstance(gpus[0], dict) or not gpus[0].get("uuid"):
                return None
            return str(gpus[0]["uuid"]), _gpu_index(gpus[0].get("index"))
        # Deployments registered before their GPUs were recorded: the host's row for their CUDA index.
        index = int(device[5:]) if device[5:].isdigit() else 0
        row = recorded_gpu(db, dep.get("host_id"), f"gpu:{index}")
        return (str(row["uuid"]), index) if row and row.get("uuid") else None

    def _deployment_metrics(self, db: Any, errors: list[str]) -> list[Metric]:
        """The deployments' series. One whose record cannot be read is left out, with a line in `errors`; the others
        are served (each deployment's series are worked out whole before any is added)."""
        energy = CounterMetricFamily("joulepilot_energy_joules", "Energy metered for a deployment, by energy source",
                                     labels=["deployment", "policy", "source", "gpu", "UUID"])
        inferences = CounterMetricFamily("joulepilot_inferences", "Inferences (forward calls) served by a deployment",
                                         labels=["deployment", "policy", "gpu", "UUID"])
        tokens = CounterMetricFamily("joulepilot_tokens", "Tokens generated by a generation deployment (every "
                                     "sequence of each batch): divide energy by it for joules per token",
                                     labels=["deployment", "policy", "gpu", "UUID"])
        power = GaugeMetricFamily("joulepilot_deployment_power_watts",
                                  "Average and peak power in the deployment's latest sample",
                                  labels=["deployment", "source", "gpu", "UUID", "stat"])
        deployments = deployment_totals(db)
        gpus: dict[int, tuple[str, int] | None] = {}
        for dep in deployments:
            try:
                gpus[dep["id"]] = self._deployment_gpu(db, dep)
            except Exception as exc:  # noqa: BLE001 - one unreadable record costs its own series only
                errors.append(self._left_out(dep, exc))
        host_index = self._gpu_index.resolve({g[0] for g in gpus.values() if g})
        for dep in deployments:
            if dep["id"] not in gpus:
                continue
            try:
                series = self._deployment_series(dep, gpus[dep["id"]], host_index)
            except Exception as exc:  # noqa: BLE001
                errors.append(self._left_out(dep, exc))
                continue
            for family, labels, value in series:
                {"energy": energy, "inferences": inferences, "tokens": tokens,
                 "power": power}[family].add_metric(labels, value)
        violations = CounterMetricFamily("joulepilot_violations", "Envelope violations recorded by the guard",
                                         labels=["policy", "deployment"])
        for r in violation_counts(db):
            violations.add_metric([r["policy"], r["deployment"]], r["n"])
        return [energy, inferences, tokens, power, violations]

    @staticmethod
    def _left_out(dep: dict[str, Any], exc: Exception) -> str:
        why = str(exc) if isinstance(exc, MalformedDeployment) else f"its record cannot be read ({exc!r})"
        return f"deployment {dep.get('name')!r}: {why}; its series are left out of the scrape; {FIX_DEPLOYMENT}"

    @staticmethod
    def _deployment_series(dep: dict[str, Any], gpu: tuple[str, int] | None,
                           host_index: dict[str, int]) -> list[tuple[str, list[str], float]]:
        """(family, labels, value) for each series of one deployment."""
        gpu_labels = [str(host_index.get(gpu[0], gpu[1])), gpu[0]] if gpu else ["", ""]
        name, policy = str(dep["name"]), str(dep.get("policy") or "")
        series: list[tuple[str, list[str], float]] = []
        by_source = dict(dep["energy_by_source"])
        declared = dep["details"].get("energy_source")
        if not by_source and declared in ENERGY_SOURCES:
            by_source[declared] = 0.0  # a registered deployment starts its counter at 0
        for source, joules in sorted(by_source.items()):
            series.append(("energy", [name, policy, source, *gpu_labels], float(joules)))
        if by_source:
            series.append(("inferences", [name, policy, *gpu_labels], float(dep["inferences"])))
            if dep.get("tokens") is not None or dep["details"].get("task") == "generate":
                series.append(("tokens", [name, policy, *gpu_labels], float(dep.get("tokens") or 0)))
        last = dep["last_sample"]
        if last is not None:
            for stat in ("avg", "peak"):
                if last.get(f"{stat}_power_w") is not None:
                    series.append(("power", [name, last["energy_source"], *gpu_labels, stat],
                                   float(last[f"{stat}_power_w"])))
        return series

    def _daemon_metrics(self, db: Any) -> list[Metric]:
        hb = host_heartbeat(db, host_identity()["id"])  # this host's daemon: the exporter runs beside it
        last = GaugeMetricFamily("joulepilot_daemon_last_heartbeat_timestamp_seconds",
                                 "Unix time of the daemon's last heartbeat")
        state = GaugeMetricFamily("joulepilot_daemon_state", "1 for the state in the daemon's last heartbeat",
                                  labels=["state"])
        if hb is not None:
            last.add_metric([], hb.at)
            for s in HEARTBEAT_STATES:
                state.add_metric([s], 1.0 if s == hb.state else 0.0)
        queue = GaugeMetricFamily("joulepilot_daemon_queue_jobs", "Jobs in the daemon's queue by state",
                                  labels=["state"])
        for s, n in queue_counts(db).items():
            queue.add_metric([s], n)
        cache = GaugeMetricFamily("joulepilot_compile_cache_up",
                                  "1 when the fleet's remote compile cache answered the daemon's last check, 0 when "
                                  "not; absent without one")
        state_of_cache = hb.detail.get("compile_cache") if hb is not None else None
        if isinstance(state_of_cache, dict):
            cache.add_metric([], 1.0 if state_of_cache.get("answers") else 0.0)
        return [last, state, queue, cache]


class Exporter:
    """A running `/metrics` endpoint; `port` is the bound one (useful when asked for port 0)."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def address(self) -> str:
        return str(self._server.server_address[0])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def make_registry(db_path: str | os.PathLike) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JoulepilotCollector(db_path))
    return registry


def start_exporter(db_path: str | os.PathLike, *, port: int = DEFAULT_PORT, bind: str = DEFAULT_BIND) -> Exporter:
    """Serve `/metrics` for the database at `db_path` on bind:port from a background thread.

    Raises OSError when the address cannot be bound (in use, not local, privileged port).
    """
    server, thread = start_http_server(port, addr=bind, registry=make_registry(db_path))
    return Exporter(server, thread)


def serve_exporter(db_path: str | os.PathLike, *, port: int = DEFAULT_PORT, bind: str = DEFAULT_BIND,
                   stop: threading.Event | None = None,
                   on_ready: Callable[[Exporter], None] | None = None) -> None:
    """Serve `/metrics` until `stop` is set or, from the main thread, SIGTERM/SIGINT arrives; then return.

    The standalone exporter (`joulepilot exporter`): it needs only read access to the database and
    its folder, and keeps answering while the daemon is down. OSError when the address cannot be bound.
    """
    stop = stop or threading.Event()
    exporter = start_exporter(db_path, port=port, bind=bind)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    try:
        if on_ready is not None:
            on_ready(exporter)
        while not stop.wait(0.5):
            pass
    finally:
        exporter.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
