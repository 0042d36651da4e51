"""The exporter as its own process: daemon_up follows a real lock holder, read-only scrapes, the scrape-error
gauge, source/gpu/UUID labels, the documented series and their cardinality, and the alert rules."""

from __future__ import annotations

import errno
import logging
import os
import queue
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.controller.exporter import start_exporter
from joulepilot.runtime import attach
from joulepilot.store import (
    insert_samples,
    insert_violation,
    open_db,
    register_deployment,
    schema_version,
    upsert_devices,
    upsert_host,
)
from joulepilot.store.connection import Store
from joulepilot.store.decisions import write_decision
from joulepilot.store.schema import MIGRATIONS, SCHEMA_VERSION
from prometheus_client.parser import text_string_to_metric_families
from test_exporter_metrics import populate

from joulepilot.cli import main

REPO = Path(__file__).resolve().parents[1]
SERVING = re.compile(r"serving http://127\.0\.0\.1:(\d+)/metrics")
UUID_A = "GPU-aaaaaaaa-0000-1111-2222-333333333333"
UUID_B = "GPU-bbbbbbbb-4444-5555-6666-777777777777"


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def samples(port: int) -> list:
    return [s for fam in text_string_to_metric_families(scrape_text(port)) for s in fam.samples]


def only(found: list, name: str, **labels) -> float:
    matches = [s for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, [s for s in found if s.name == name])
    return matches[0].value


def names(found: list) -> set[str]:
    return {s.name for s in found}


class Lines:
    """Lines of a child's stream, read by a thread so a test can wait with a deadline."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern, timeout_s: float = 30.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            match = pattern.search(line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern.pattern!r}; saw {self.seen!r}")


def start_cli_exporter(db_path: Path, *extra: str) -> tuple[subprocess.Popen, Lines, int]:
    proc = subprocess.Popen([sys.executable, "-m", "joulepilot", "exporter", "--db", str(db_path), "--port", "0",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = Lines(proc.stderr)
    port = int(lines.wait_for(SERVING).group(1))
    return proc, lines, port


def hold_daemon_lock(db_path: Path) -> subprocess.Popen:
    """A process that takes the daemon's instance lock exactly as `joulepilot daemon` does, then waits."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from joulepilot.controller.instance_lock import InstanceLock
        InstanceLock({str(db_path)!r}).acquire()
        print("held", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("the process did not exit within 10 s of the signal") from None


# --- item 18: a separate exporter process that outlives the daemon -----------------------------------


def test_standalone_exporter_reports_a_real_daemon_lock_and_its_loss(tmp_path):
    db_path = tmp_path / "j.db"
    populate(db_path)
    exporter, lines, port = start_cli_exporter(db_path)
    holder = None
    try:
        found = samples(port)
        assert only(found, "joulepilot_daemon_up") == 0
        assert only(found, "joulepilot_exporter_scrape_error") == 0

        holder = hold_daemon_lock(db_path)
        found = samples(port)
        assert only(found, "joulepilot_daemon_up") == 1
        assert only(found, "joulepilot_energy_joules_total", deployment="mlp-prod") == pytest.approx(250.5)

        holder.kill()  # the daemon dies without cleaning up; the kernel drops its flock
        holder.wait()
        found = samples(port)  # the exporter is still there to say so
        assert only(found, "joulepilot_daemon_up") == 0
        assert only(found, "joulepilot_exporter_scrape_error") == 0
        assert only(found, "joulepilot_energy_joules_total", deployment="mlp-prod") == pytest.approx(250.5)

        holder = hold_daemon_lock(db_path)  # a restarted daemon takes the lock back despite the probes
        assert only(samples(port), "joulepilot_daemon_up") == 1
        holder.terminate()
        holder.wait()
        assert only(samples(port), "joulepilot_daemon_up") == 0
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        code = stop(exporter)
    assert code == 0
    assert not any("Traceback" in line for line in lines.seen)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_standalone_exporter_exits_cleanly_on_signals(tmp_path, sig):
    exporter, lines, port = start_cli_exporter(tmp_path / "j.db")
    assert "joulepilot_daemon_up" in names(samples(port))
    assert stop(exporter, sig) == 0
    rest = exporter.stderr.read() if exporter.stderr and not exporter.stderr.closed else ""
    assert "Traceback" not in "".join(lines.seen) + rest
    with pytest.raises(OSError):
        scrape_text(port)


def test_port_in_use_is_one_clean_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(main, ["exporter", "--db", str(tmp_path / "j.db"), "--port", str(port)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0] and "--port" in lines[0]
    assert "--bind" not in lines[0]  # the address is fine: the port is the fix
    assert not (tmp_path / "j.db").exists()


@pytest.mark.parametrize("bind", ["999.1.1.1", "no-such-host.invalid", "192.0.2.1"])  # 192.0.2.1: TEST-NET-1
def test_an_address_that_cannot_be_bound_names_bind_as_the_fix(tmp_path, bind):
    result = CliRunner().invoke(main, ["exporter", "--db", str(tmp_path / "j.db"), "--bind", bind, "--port", "0"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: cannot listen on {bind}:0: "), result.output
    assert "pass --bind with an address of this host" in lines[0] and "--port" not in lines[0]


def test_a_privileged_port_names_port_as_the_fix():
    from joulepilot.cli_exporter import listen_error

    denied = OSError(errno.EACCES, os.strerror(errno.EACCES))  # what bind() gives a user below port 1024
    line = listen_error("127.0.0.1", 80, denied)
    assert line.startswith("cannot listen on 127.0.0.1:80: Permission denied;") and "--port 1024 or above" in line
    assert "--bind" not in line


def test_a_missing_database_is_not_created_and_still_serves_up_and_the_error(tmp_path, caplog):
    db_path = tmp_path / "missing" / "j.db"
    exp = start_exporter(db_path, port=0)
    try:
        with caplog.at_level(logging.WARNING, logger="joulepilot.controller.exporter"):
            first, second = samples(exp.port), samples(exp.port)
    finally:
        exp.stop()
    for found in (first, second):
        # `joulepilot_store_up` is left out: a missing file says nothing of whether a server answers
        assert names(found) == {"joulepilot_daemon_up", "joulepilot_exporter_scrape_error",
                                "joulepilot_daemon_runs_waiting"}
        assert only(found, "joulepilot_exporter_scrape_error") == 1
        assert only(found, "joulepilot_daemon_up") == 0
    assert not db_path.exists() and not db_path.parent.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(db_path) in warnings[0] and "does not exist" in warnings[0]


def test_a_corrupt_database_gives_the_error_gauge_logged_once_then_recovers(tmp_path, caplog):
    db_path = tmp_path / "j.db"
    db_path.write_bytes(b"this is not a sqlite database" * 100)
    exp = start_exporter(db_path, port=0)
    try:
        with caplog.at_level(logging.INFO, logger="joulepilot.controller.exporter"):
            for _ in range(3):
                found = samples(exp.port)
                assert only(found, "joulepilot_exporter_scrape_error") == 1
                assert "joulepilot_daemon_up" in names(found)
                assert "joulepilot_energy_joules_total" not in names(found)
            db_path.unlink()
            populate(db_path)
            found = samples(exp.port)
    finally:
        exp.stop()
    assert only(found, "joulepilot_exporter_scrape_error") == 0
    assert only(found, "joulepilot_energy_joules_total", deployment="mlp-prod") == pytest.approx(250.5)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in messages if level == logging.WARNING and f"the database {db_path} is damaged" in m] \
        == [messages[0][1]]
    assert messages[-1][0] == logging.INFO and "again" in messages[-1][1]


def test_scrapes_never_migrate_an_older_database(tmp_path):
    db_path = tmp_path / "old.db"
    conn = sqlite3.connect(db_path)
    for step in MIGRATIONS[:-1]:
        step(Store(conn))
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    conn.commit()
    conn.close()
    before = db_path.read_bytes()
    exp = start_exporter(db_path, port=0)
    try:
        found = samples(exp.port)
    finally:
        exp.stop()
    assert only(found, "joulepilot_exporter_scrape_error") == 1
    assert db_path.read_bytes() == before
    ro = open_db(db_path, read_only=True)
    assert schema_version(ro) == SCHEMA_VERSION - 1
    ro.close()


def test_scrapes_read_committed_state_while_the_daemon_holds_a_write(tmp_path):
    db_path = tmp_path / "j.db"
    populate(db_path)
    writer = open_db(db_path)
    dep = writer.execute("SELECT id FROM deployments WHERE name = 'mlp-prod'").fetchone()[0]
    exp = start_exporter(db_path, port=0)
    try:
        writer.conn.execute("BEGIN IMMEDIATE")
        insert_samples(writer, dep, [{"t_start": 10, "t_end": 15, "energy_j": 49.5, "inferences": 1000,
                                      "energy_source": "estimate"}])
        t0 = time.monotonic()
        found = samples(exp.port)
        assert time.monotonic() - t0 < 5  # a reader never waits for the writer in WAL mode
        assert only(found, "joulepilot_energy_joules_total", deployment="mlp-prod") == pytest.approx(250.5)
        assert only(found, "joulepilot_exporter_scrape_error") == 0
        writer.conn.execute("COMMIT")
        found = samples(exp.port)
    finally:
        exp.stop()
        writer.close()
    assert only(found, "joulepilot_energy_joules_total", deployment="mlp-prod") == pytest.approx(300.0)


# --- item 19: source, gpu and UUID labels ------------------------------------------------------------


@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    """A host with two GPUs where the serving process sees only the second (CUDA_VISIBLE_DEVICES=1)."""
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    return fake_pynvml.install(monkeypatch, [FakeGpu(uuid=UUID_A, power_w=100.0, counter_step_s=0.01),
                                             FakeGpu(uuid=UUID_B, power_w=250.0, counter_step_s=0.01)])


def _serve_on_gpu(db_path: Path) -> tuple[int, int]:
    dep = attach(lambda x: x, "gpu-svc", db=db_path, device="cuda:0", interval_s=0.2, policy="mlp")
    calls, end = 0, time.monotonic() + 1.0
    while time.monotonic() < end:
        dep(1)
        calls += 1
        time.sleep(0.001)
    dep.close()
    db = open_db(db_path)
    dep_id = db.execute("SELECT id FROM deployments WHERE name = 'gpu-svc'").fetchone()[0]
    db.close()
    return dep_id, calls


def test_gpu_deployment_series_carry_source_and_dcgm_gpu_labels(tmp_path, two_gpus):
    db_path = tmp_path / "j.db"
    dep_id, calls = _serve_on_gpu(db_path)
    db = open_db(db_path)
    nvml_j = db.execute("SELECT SUM(energy_j) FROM deployment_samples WHERE deployment_id = ?", [dep_id]).fetchone()[0]
    # The GPU meter failed for a while and the deployment fell back to an estimate: kept apart, never summed.
    insert_samples(db, dep_id, [{"t_start": 100, "t_end": 105, "energy_j": 40.0, "inferences": 7, "avg_power_w": 8.0,
                                 "peak_power_w": 9.0, "energy_source": "estimate"}])
    db.close()
    exp = start_exporter(db_path, port=0)
    try:
        found = samples(exp.port)
    finally:
        exp.stop()
    gpu = {"gpu": "1", "UUID": UUID_B}  # dcgm-exporter's numbering: the host's NVML index, not cuda:0
    assert nvml_j > 0
    assert only(found, "joulepilot_energy_joules_total", deployment="gpu-svc", source="nvml", **gpu) == \
        pytest.approx(nvml_j)
    assert only(found, "joulepilot_energy_joules_total", deployment="gpu-svc", source="estimate", **gpu) == 40.0
    assert only(found, "joulepilot_inferences_total", deployment="gpu-svc", **gpu) == calls + 7
    assert only(found, "joulepilot_deployment_power_watts", deployment="gpu-svc", stat="avg", source="estimate",
                **gpu) == 8.0
    assert not [s for s in found if s.labels.get("deployment") == "gpu-svc" and s.labels.get("source") == "nvml"
                and s.name == "joulepilot_deployment_power_watts"]  # power is the latest sample's alone


def test_gpu_label_falls_back_to_the_recorded_index_without_nvml(tmp_path, two_gpus):
    db_path = tmp_path / "j.db"
    _serve_on_gpu(db_path)
    two_gpus.init_error = fake_pynvml.NVML_ERROR_DRIVER_NOT_LOADED  # the exporter's host cannot load NVML
    exp = start_exporter(db_path, port=0)
    try:
        found = samples(exp.port)
    finally:
        exp.stop()
    assert only(found, "joulepilot_energy_joules_total", deployment="gpu-svc", source="nvml") > 0
    assert only(found, "joulepilot_energy_joules_total", deployment="gpu-svc", gpu="0", UUID=UUID_B) > 0


def test_gpu_labels_are_per_deployment_not_per_host(tmp_path, monkeypatch, two_gpus):
    """Two serving processes, each seeing one GPU as cuda:0, keep their own UUID."""
    db_path = tmp_path / "j.db"
    _serve_on_gpu(db_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    dep = attach(lambda x: x, "gpu-svc-0", db=db_path, device="cuda:0", interval_s=0.2)
    dep(1)
    time.sleep(0.5)
    dep.close()
    exp = start_exporter(db_path, port=0)
    try:
        found = samples(exp.port)
    finally:
        exp.stop()
    assert only(found, "joulepilot_inferences_total", deployment="gpu-svc", gpu="1", UUID=UUID_B) > 0
    assert only(found, "joulepilot_inferences_total", deployment="gpu-svc-0", gpu="0", UUID=UUID_A) == 1


def test_deployments_from_before_gpus_were_recorded_use_the_hosts_device_row(tmp_path):
    db_path = tmp_path / "j.db"
    db = open_db(db_path)
    host = upsert_host(db)
    upsert_devices(db, host, [{"id": "gpu:1", "kind": "gpu", "uuid": UUID_B, "source": "nvml"}])
    dep = register_deployment(db, "older", policy="mlp", device="cuda:1", host_id=host,
                              details={"energy_source": "nvml"})
    insert_samples(db, dep, [{"t_start": 0, "t_end": 5, "energy_j": 12.5, "inferences": 3, "energy_source": "nvml"}])
    db.close()
    exp = start_exporter(db_path, port=0)
    try:
        found = samples(exp.port)
    finally:
        exp.stop()
    assert only(found, "joulepilot_energy_joules_total", deployment="older", source="nvml", UUID=UUID_B) == 12.5


def test_cpu_deployments_have_empty_gpu_labels(tmp_path):
    db_path = tmp_path / "j.db"
    populate(db_path)
    exp = start_exporter(db_path, port=0)
    try:
        found = samples(exp.port)
    finally:
        exp.stop()
    assert only(found, "joulepilot_energy_joules_total", deployment="mlp-prod", gpu="", UUID="") == 250.5


# --- the README table, the per-deployment bound, and the alert rules ---------------------------------


def _readme_table() -> dict[str, set[str]]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("**Prometheus exporter"):]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(joulepilot_[a-z0-9_]+)` \|[^|]+\|([^|]*)\|", line)
        if match:
            rows[match.group(1)] = {label.split("=")[0].strip() for label in match.group(2).split(",")
                                    if label.strip()}
    return rows


def _worst_case_store(db_path: Path) -> None:
    """The mlp store plus a GPU generation deployment metered by all three sources that broke its envelope, and a
    generation policy's decision with its measured J per token."""
    populate(db_path)
    db = open_db(db_path)
    write_decision(db, {"policy": "chat", "policy_hash": "h", "device_kind": "cpu", "torch_version": "2.13",
                        "config_id": "c-chat", "state": "verified", "reason": "best", "decided_at": time.time(),
                        "details": {"measured": {"energy_j_per_token": 0.6, "energy_source": "nvml"}}})
    dep = register_deployment(db, "worst", policy="mlp", device="cuda:0",
                              details={"energy_source": "nvml", "gpus": [{"index": 0, "uuid": UUID_A}]})
    insert_samples(db, dep, [
        {"t_start": t, "t_end": t + 5, "energy_j": 10.0, "inferences": 5, "avg_power_w": 2.0, "peak_power_w": 3.0,
         "energy_source": source, "tokens": 40} for t, source in ((0, "nvml"), (5, "rapl"), (10, "estimate"))])
    insert_violation(db, policy="mlp", deployment="worst", limit_name="max_avg_power_w", limit_value=1,
                     measured_value=2.0)
    db.close()


def test_readme_documents_every_series_with_its_labels_and_the_per_deployment_bound(tmp_path):
    db_path = tmp_path / "j.db"
    _worst_case_store(db_path)
    exp = start_exporter(db_path, port=0)
    try:
        found = samples(exp.port)
    finally:
        exp.stop()
    served: dict[str, set[str]] = {}
    for s in found:
        served.setdefault(s.name, set()).update(s.labels)
    documented = _readme_table()
    assert set(documented) == set(served), (set(documented) ^ set(served))
    for name, labels in served.items():
        assert documented[name] == labels, name
    per_deployment = [s for s in found if s.labels.get("deployment") == "worst"]
    readme = (REPO / "README.md").read_text()
    bound = int(re.search(r"at most (\d+) series per deployment", readme).group(1))
    assert len(per_deployment) == bound <= 10


def test_alert_rules_use_only_served_series(tmp_path):
    rules = (REPO / "deploy" / "joulepilot-rules.yml").read_text()
    config = (REPO / "deploy" / "prometheus.yml").read_text()
    assert "joulepilot-rules.yml" in config and 'job_name: joulepilot' in config
    db_path = tmp_path / "j.db"
    populate(db_path)
    exp = start_exporter(db_path, port=0)
    try:
        served = {fam.name for fam in text_string_to_metric_families(scrape_text(exp.port))}
        served |= {s.name for fam in text_string_to_metric_families(scrape_text(exp.port)) for s in fam.samples}
    finally:
        exp.stop()
    used = set(re.findall(r"\bjoulepilot_[a-z0-9_]+", "\n".join(re.findall(r"expr:\s*(.+)", rules))))
    assert "joulepilot_daemon_up" in used
    assert used <= served, used - served
    down = re.search(r"alert: JoulepilotDaemonDown\s+expr:\s*(.+)", rules).group(1)
    assert "joulepilot_daemon_up == 0" in down and "heartbeat" not in down


PROMTOOL = shutil.which("promtool")


def _without_annotations(rules: str) -> str:
    kept, skip_deeper_than = [], None
    for line in rules.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_deeper_than is not None and line.strip() and indent > skip_deeper_than:
            continue
        skip_deeper_than = indent if line.strip() == "annotations:" else None
        if skip_deeper_than is None:
            kept.append(line)
    return "\n".join(kept) + "\n"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_alert_rules_fire_with_promtool(tmp_path):
    rules = REPO / "deploy" / "joulepilot-rules.yml"
    check = subprocess.run([PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unannotated = tmp_path / "rules.yml"  # promtool compares annotations too; these cases are about firing
    unannotated.write_text(_without_annotations(rules.read_text()))
    cases = tmp_path / "rules_test.yml"
    cases.write_text(textwrap.dedent(f"""
        rule_files: [{unannotated}]
        evaluation_interval: 1m
        tests:
          - interval: 1m  # the daemon died; its separate exporter keeps answering
            input_series:
              - series: 'up{{job="joulepilot", instance="h:9464"}}'
                values: '1x20'
              - series: 'joulepilot_daemon_up{{job="joulepilot", instance="h:9464"}}'
                values: '1 1 0x18'
            alert_rule_test:
              - {{eval_time: 4m, alertname: JoulepilotDaemonDown, exp_alerts: []}}
              - eval_time: 10m
                alertname: JoulepilotDaemonDown
                exp_alerts:
                  - exp_labels: {{severity: warning, job: joulepilot, instance: "h:9464"}}
              - {{eval_time: 10m, alertname: JoulepilotExporterDown, exp_alerts: []}}
          - interval: 1m  # the exporter itself is down: no joulepilot_* series at all
            input_series:
              - series: 'up{{job="joulepilot", instance="h:9464"}}'
                values: '0x20'
            alert_rule_test:
              - eval_time: 10m
                alertname: JoulepilotExporterDown
                exp_alerts:
                  - exp_labels: {{severity: warning, job: joulepilot, instance: "h:9464"}}
          - interval: 1m  # the target vanished from the scrape config
            input_series:
              - series: 'node_load1{{job="node"}}'
                values: '1x20'
            alert_rule_test:
              - eval_time: 15m
                alertname: JoulepilotExporterAbsent
                exp_alerts:
                  - exp_labels: {{severity: warning, job: joulepilot}}
          - interval: 1m  # all is well
            input_series:
              - series: 'up{{job="joulepilot", instance="h:9464"}}'
                values: '1x20'
              - series: 'joulepilot_daemon_up{{job="joulepilot", instance="h:9464"}}'
                values: '1x20'
              - series: 'joulepilot_exporter_scrape_error{{job="joulepilot", instance="h:9464"}}'
                values: '0x20'
            alert_rule_test:
              - {{eval_time: 15m, alertname: JoulepilotDaemonDown, exp_alerts: []}}
              - {{eval_time: 15m, alertname: JoulepilotExporterDown, exp_alerts: []}}
              - {{eval_time: 15m, alertname: JoulepilotExporterAbsent, exp_alerts: []}}
              - {{eval_time: 15m, alertname: JoulepilotExporterScrapeError, exp_alerts: []}}
    """))
    result = subprocess.run([PROMTOOL, "test", "rules", str(cases)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    config = subprocess.run([PROMTOOL, "check", "config", "--syntax-only", str(REPO / "deploy" / "prometheus.yml")],
                            capture_output=True, text=True, cwd=REPO / "deploy")
    assert config.returncode == 0, config.stdout + config.stderr


def test_a_restarting_daemon_is_not_refused_by_a_probe_and_a_stale_pid(tmp_path):
    """SIGKILL leaves the dead daemon's pid in the lock file; an exporter probe at restart must not look like it."""
    import fcntl

    from joulepilot.controller.instance_lock import InstanceLock, lock_path_for, read_lock_pid

    db_path = tmp_path / "j.db"
    lock_file = lock_path_for(db_path)
    lock_file.write_text("999999\n")  # what a SIGKILLed daemon leaves behind
    probe_fd = os.open(lock_file, os.O_RDONLY)
    fcntl.flock(probe_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a slow probe (a loaded host) ...
    releaser = threading.Timer(0.3, os.close, args=[probe_fd])  # ... that lets go shortly
    releaser.start()
    try:
        with InstanceLock(db_path) as lock:
            assert lock.held and read_lock_pid(lock_file) == os.getpid()
    finally:
        releaser.join()
