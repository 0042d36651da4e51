"""Prometheus exporter: a collector that reads the database at scrape time (pull, no state of its own).

Series (base units, Prometheus naming):
  joulepilot_policy_decision_info{policy,device,config,mode,fusion,precision,state}  1 per latest decision
  joulepilot_policy_decision_timestamp_seconds{policy,device}
  joulepilot_policy_energy_joules_per_inference{policy,device}     measured, for the decided config
  joulepilot_policy_power_watts{policy,device,stat="avg"|"peak"}
  joulepilot_policy_latency_p95_seconds{policy,device}
  joulepilot_energy_joules_total{deployment,policy}                sum of deployment samples
  joulepilot_inferences_total{deployment,policy}
  joulepilot_deployment_power_watts{deployment,stat="avg"|"peak"}  latest sample
  joulepilot_violations_total{policy,deployment}
  joulepilot_daemon_up                                              1 while a daemon holds the database lock
  joulepilot_daemon_last_heartbeat_timestamp_seconds
  joulepilot_daemon_state{state}                                    1 for the state of the last heartbeat
  joulepilot_daemon_queue_jobs{state}
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from joulepilot.store import open_db
from joulepilot.store.daemon_state import HEARTBEAT_STATES, latest_heartbeat, queue_counts
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from .instance_lock import lock_is_held, lock_path_for

log = logging.getLogger(__name__)

LATEST_DECISIONS_SQL = """
SELECT d.*, c.label AS config_label, c.mode, c.fusion, c.precision
FROM decisions d
LEFT JOIN configs c ON c.id = d.config_id
WHERE d.id = (SELECT MAX(id) FROM decisions d2 WHERE d2.policy = d.policy AND d2.device_kind = d.device_kind)
ORDER BY d.policy, d.device_kind
"""


def _details(row: dict[str, Any]) -> dict[str, Any]:
    try:
        value = json.loads(row.get("details") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def decision_workload_id(db: Any, decision: dict[str, Any]) -> str | None:
    """The workload a decision is about: recorded in its details, else the daemon's jobs for the policy."""
    details = _details(decision)
    for key in ("workload_id",):
        if details.get(key):
            return str(details[key])
    row = db.execute("SELECT workload_id FROM jobs WHERE policy = ? ORDER BY id DESC LIMIT 1",
                     [decision["policy"]]).fetchone()
    if row:
        return row[0]
    row = db.execute("SELECT workload_id FROM deployments WHERE policy = ? AND workload_id IS NOT NULL "
                     "ORDER BY id DESC LIMIT 1", [decision["policy"]]).fetchone()
    return row[0] if row else None


def decided_run(db: Any, decision: dict[str, Any]) -> dict[str, Any] | None:
    """The latest successful measurement of the decided configuration (None when only predicted)."""
    if not decision.get("config_id"):
        return None
    workload_id = decision_workload_id(db, decision)
    sql = "SELECT * FROM runs WHERE config_id = ? AND status = 'ok'"
    args: list[Any] = [decision["config_id"]]
    if workload_id:
        sql += " AND workload_id = ?"
        args.append(workload_id)
    rows = list(db.query(sql + " ORDER BY id DESC LIMIT 1", args))
    return rows[0] if rows else None


class JoulepilotCollector(Collector):
    """Reads the joulepilot database on every scrape; a database it cannot read gives no series."""

    def __init__(self, db_path: str | os.PathLike) -> None:
        self.db_path = Path(db_path)

    def describe(self) -> list[Metric]:
        return []  # series are only known at scrape time

    def collect(self) -> Iterator[Metric]:
        try:
            db = open_db(self.db_path)
        except Exception as exc:
            log.warning("exporter cannot open %s: %s", self.db_path, exc)
            return
        try:
            yield from self._policy_metrics(db)
            yield from self._deployment_metrics(db)
            yield from self._daemon_metrics(db)
        finally:
            db.close()

    def _policy_metrics(self, db: Any) -> Iterator[Metric]:
        info = InfoMetricFamily("joulepilot_policy_decision", "Latest decision per policy and device kind",
                                labels=["policy", "device"])
        decided_at = GaugeMetricFamily("joulepilot_policy_decision_timestamp_seconds",
                                       "When the latest decision was made (Unix time)", labels=["policy", "device"])
        energy = GaugeMetricFamily("joulepilot_policy_energy_joules_per_inference",
                                   "Measured joules per inference (one forward call) of the decided configuration",
                                   labels=["policy", "device"])
        power = GaugeMetricFamily("joulepilot_policy_power_watts",
                                  "Measured average and peak power of the decided configuration",
                                  labels=["policy", "device", "stat"])
        latency = GaugeMetricFamily("joulepilot_policy_latency_p95_seconds",
                                    "Measured p95 latency of the decided configuration",
                                    labels=["policy", "device"])
        for d in db.query(LATEST_DECISIONS_SQL):
            labels = [d["policy"], d["device_kind"]]
            info.add_metric(labels, {
                "config": d.get("config_label") or d.get("config_id") or "",
                "mode": d.get("mode") or "",
                "fusion": d.get("fusion") or "",
                "precision": d.get("precision") or "",
                "state": d["state"],
            })
            decided_at.add_metric(labels, d["decided_at"])
            run = decided_run(db, d)
            if run is None:
                continue
            if run.get("energy_j_per_inference") is not None:
                energy.add_metric(labels, run["energy_j_per_inference"])
            for stat in ("avg", "peak"):
                if run.get(f"{stat}_power_w") is not None:
                    power.add_metric([*labels, stat], run[f"{stat}_power_w"])
            if run.get("latency_ms_p95") is not None:
                latency.add_metric(labels, run["latency_ms_p95"] / 1000.0)
        yield from (info, decided_at, energy, power, latency)

    def _deployment_metrics(self, db: Any) -> Iterator[Metric]:
        energy = CounterMetricFamily("joulepilot_energy_joules", "Energy metered for a deployment",
                                     labels=["deployment", "policy"])
        inferences = CounterMetricFamily("joulepilot_inferences", "Inferences (forward calls) served by a deployment",
                                         labels=["deployment", "policy"])
        power = GaugeMetricFamily("joulepilot_deployment_power_watts",
                                  "Average and peak power in the deployment's latest sample",
                                  labels=["deployment", "stat"])
        rows = db.query(
            "SELECT dep.name, dep.policy, COALESCE(SUM(s.energy_j), 0) AS energy_j, "
            "COALESCE(SUM(s.inferences), 0) AS inferences, MAX(s.id) AS last_id "
            "FROM deployments dep LEFT JOIN deployment_samples s ON s.deployment_id = dep.id "
            "GROUP BY dep.id ORDER BY dep.name"
        )
        for r in rows:
            labels = [r["name"], r["policy"] or ""]
            energy.add_metric(labels, float(r["energy_j"]))
            inferences.add_metric(labels, float(r["inferences"]))
            if r["last_id"] is not None:
                last = db.execute("SELECT avg_power_w, peak_power_w FROM deployment_samples WHERE id = ?",
                                  [r["last_id"]]).fetchone()
                for stat, value in zip(("avg", "peak"), last, strict=True):
                    if value is not None:
                        power.add_metric([r["name"], stat], value)
        violations = CounterMetricFamily("joulepilot_violations", "Envelope violations recorded by the guard",
                                         labels=["policy", "deployment"])
        for r in db.query("SELECT policy, deployment, COUNT(*) AS n FROM violations GROUP BY policy, deployment"):
            violations.add_metric([r["policy"], r["deployment"]], r["n"])
        yield from (energy, inferences, power, violations)

    def _daemon_metrics(self, db: Any) -> Iterator[Metric]:
        up = GaugeMetricFamily("joulepilot_daemon_up", "1 while a joulepilot daemon holds this database's lock")
        up.add_metric([], 1.0 if lock_is_held(lock_path_for(self.db_path)) else 0.0)
        yield up
        hb = latest_heartbeat(db)
        last = GaugeMetricFamily("joulepilot_daemon_last_heartbeat_timestamp_seconds",
                                 "Unix time of the daemon's last heartbeat")
        state = GaugeMetricFamily("joulepilot_daemon_state", "1 for the state in the daemon's last heartbeat",
                                  labels=["state"])
        if hb is not None:
            last.add_metric([], hb["at"])
            for s in HEARTBEAT_STATES:
                state.add_metric([s], 1.0 if s == hb["state"] else 0.0)
        yield from (last, state)
        queue = GaugeMetricFamily("joulepilot_daemon_queue_jobs", "Jobs in the daemon's queue by state",
                                  labels=["state"])
        for s, n in queue_counts(db).items():
            queue.add_metric([s], n)
        yield queue


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


def start_exporter(db_path: str | os.PathLike, *, port: int = 9464, bind: str = "127.0.0.1") -> Exporter:
    """Serve `/metrics` for the database at `db_path` on bind:port from a background thread."""
    server, thread = start_http_server(port, addr=bind, registry=make_registry(db_path))
    return Exporter(server, thread)
