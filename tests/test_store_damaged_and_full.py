"""A damaged database and a full disk, built for real: garbage written over pages of a file the store made
(store_factories.damage_pages), SQLite's own SQLITE_FULL from `PRAGMA max_page_count`, a file size limit.

Each is said the same way wherever it is met (`store.errors.database_error`): "the database FILE is damaged" with
the ways out, "the disk holding FILE is full", in one line and a non-zero exit; the daemon logs it without a
traceback (and stops on a damaged database), the exporter logs it once, the hook serves with the fallback after one
warning. `quick_check` finds damage at open in a file of at most QUICK_CHECK_MAX_BYTES."""

from __future__ import annotations

import io
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_factories import TESTS_DIR, write_daemon_config, write_policy
from joulepilot.controller.daemon import Daemon
from joulepilot.controller.exporter import start_exporter
from joulepilot.store import DatabaseCorrupt, DiskFull, database_error, import_runs, open_db, read_export
from joulepilot.store import db as db_module
from store_factories import damage_pages
from test_exporter_standalone import only, samples
from test_pending_runs import _make_full

from joulepilot.cli import main

SWEEP = TESTS_DIR / "data" / "gpu_sweep_h200.json"
DAMAGED = "is damaged (SQLite: "


def _seeded(path: Path) -> Path:
    db = open_db(path)
    import_runs(db, read_export(SWEEP))
    db.close()
    return path


@pytest.fixture
def unchecked(monkeypatch):
    """Files of any size are over the quick_check threshold: damage is met only where it is read, as in a store
    larger than QUICK_CHECK_MAX_BYTES."""
    monkeypatch.setattr(db_module, "QUICK_CHECK_MAX_BYTES", 0)


# --- a full disk ------------------------------------------------------------------------------------------


def test_a_full_database_is_a_full_disk_also_when_a_commit_follows_sqlites_own_rollback(tmp_path):
    path = tmp_path / "full.db"
    db = open_db(path)
    _make_full(db)
    conn = db.conn
    conn.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.Error) as err:
        try:
            for _ in range(100):
                conn.execute("INSERT INTO workloads (id, spec, batch_size, created_at) VALUES (hex(randomblob(600)),"
                             " 'mlp', 8, 1.0)")
        finally:  # SQLite ended the transaction itself: this COMMIT fails in turn, hiding why
            conn.execute("COMMIT")
    assert "cannot commit - no transaction is active" in str(err.value)
    db.close()
    error = database_error(path, err.value)
    assert isinstance(error, DiskFull)
    assert str(error) == (f"the disk holding {path} is full (SQLite: database or disk is full); free space on it "
                          "and retry")


def test_bench_says_a_run_it_could_not_store_was_not_stored_and_exits_1(tmp_path, monkeypatch, flow_worker):
    path = tmp_path / "full.db"

    def full_store(db):  # bench's own connection, made full as above
        database = open_db(db)
        _make_full(database)
        return database

    monkeypatch.setattr(sys.modules["joulepilot.compiler.bench"], "open_db", full_store)
    result = CliRunner().invoke(main, ["bench", "mlp", "--modes", "eager", "--device", "cpu", "--min-seconds", "0.2",
                                       "--db", str(path)])
    assert result.exit_code == 1, result.output
    (line,) = [line for line in result.stderr.splitlines() if "NOT stored" in line]
    assert line.startswith(f"eager/fp32/b1: its run was NOT stored: the disk holding {path} is full"), line
    side_file = Path(line.split("it is kept in ")[1].split(" and imported")[0])
    assert side_file.is_file() and side_file.parent == path.with_name("full.db.pending")


def test_a_store_that_cannot_grow_its_files_says_why_not_cannot_commit(tmp_path):
    """Under a file size limit SQLite cannot make the shared-memory file a read needs; the open's read transaction
    ended, and its COMMIT used to report "cannot commit - no transaction is active" instead."""
    path = _seeded(tmp_path / "jp.db")
    script = ("import resource, signal, sys\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))\n"
              "from joulepilot.cli import main\n"
              "main(['runs', 'import', sys.argv[2], '--db', sys.argv[1]])\n")
    export = tmp_path / "runs.json"
    export.write_text("[]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_PROCESS_")}
    proc = subprocess.run([sys.executable, "-c", script, str(path), str(export)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: database {path}: disk I/O error"), proc.stderr
    assert "cannot commit" not in proc.stderr and "free space on its disk" in lines[0]


# --- a damaged database -----------------------------------------------------------------------------------


def test_quick_check_finds_damage_at_open_that_no_read_would_meet(tmp_path):
    path = _seeded(tmp_path / "jp.db")
    damage_pages(path, "runs")
    for options in ({}, {"read_only": True}):
        with pytest.raises(DatabaseCorrupt, match=f"the database {path} {DAMAGED.replace('(', '[(]')}quick_check"):
            open_db(path, **options)


def test_over_the_threshold_damage_is_said_alike_where_it_is_read(tmp_path, unchecked):
    path = _seeded(tmp_path / "jp.db")
    damage_pages(path, "runs")
    open_db(path, read_only=True).close()  # not checked at open
    result = CliRunner().invoke(main, ["runs", "--db", str(path)])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: the database {path} {DAMAGED}database disk image is "
                                                   "malformed); restore it from a backup"), result.output
    assert f"`sqlite3 {path} .recover | sqlite3 {tmp_path / 'jp-recovered.db'}`" in lines[0]


def _daemon_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A store whose runs' pages are damaged and a policy folder whose pass reads them."""
    db = _seeded(tmp_path / "jp.db")
    damage_pages(db, "runs")
    policies = tmp_path / "policies"
    write_policy(policies, "svc", workload=f"{TESTS_DIR / 'workload_factories.py'}:steady")
    return db, policies


@pytest.fixture
def daemon_log(restore_logging):
    """The joulepilot log as the daemon writes it, caught here (the daemon keeps a handler it finds)."""
    text = io.StringIO()
    logger = logging.getLogger("joulepilot")
    logger.handlers[:] = [logging.StreamHandler(text)]
    logger.propagate = False
    return text


def test_a_daemon_pass_that_meets_damage_says_so_in_one_line_and_exits_1(tmp_path, unchecked, flow_worker,
                                                                         daemon_log):
    db, policies = _daemon_folder(tmp_path)
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once"])
    assert result.exit_code == 1, (result.output, daemon_log.getvalue())
    log = daemon_log.getvalue()
    assert "Traceback" not in log + result.output
    (line,) = [line for line in log.splitlines() if DAMAGED in line]
    assert line.startswith(f"pass stopped: the database {db} {DAMAGED}"), log


def test_a_daemon_started_on_a_damaged_database_says_so_in_one_line(tmp_path, daemon_log):
    db, policies = _daemon_folder(tmp_path)
    result = CliRunner().invoke(main, ["daemon", "--once", "--policies", str(policies), "--db", str(db)])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: the database {db} {DAMAGED}quick_check"), result.output
    assert "Traceback" not in result.output + daemon_log.getvalue()


def test_a_running_daemon_that_meets_damage_logs_it_and_stops_with_exit_code_1(tmp_path, unchecked, flow_worker,
                                                                             daemon_log):
    db, policies = _daemon_folder(tmp_path)
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=policies)
    daemon = Daemon.from_cli(config_path=str(config), db=None, policies=())
    box: list = []
    thread = threading.Thread(target=lambda: box.append(daemon.run()), daemon=True)
    thread.start()
    thread.join(120)
    if thread.is_alive():
        daemon.request_stop("the test gave up")
        thread.join(30)
        pytest.fail(f"the daemon kept running on a damaged database: {daemon_log.getvalue()}")
    assert box and box[0].exit_code == 1
    log = daemon_log.getvalue()
    assert "Traceback" not in log
    (line,) = [line for line in log.splitlines() if DAMAGED in line]
    assert line.startswith(f"the database {db} {DAMAGED}") and line.endswith("; the daemon stops"), log


def test_the_exporter_reports_damage_it_reads_once_naming_the_fix(tmp_path, unchecked, caplog):
    from test_exporter_metrics import populate

    db = tmp_path / "jp.db"
    populate(db)
    damage_pages(db, "deployment_samples", keep_root=False)
    exporter = start_exporter(db, port=0)
    try:
        with caplog.at_level(logging.WARNING, logger="joulepilot.controller.exporter"):
            for _ in range(2):
                assert only(samples(exporter.port), "joulepilot_exporter_scrape_error") == 1
    finally:
        exporter.stop()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"the database {db} {DAMAGED}" in warned[0] and ".recover" in warned[0], warned


def test_the_hook_serves_a_damaged_store_with_the_fallback_after_one_warning(tmp_path):
    import torch

    import joulepilot

    db = _seeded(tmp_path / "jp.db")
    damage_pages(db, "runs")
    policy = tmp_path / "svc.toml"
    policy.write_text('name = "svc"\nworkload = "mlp"\nbatch_size = 8\n')
    messages = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            served = joulepilot.compile(torch.nn.Linear(4, 2), policy=str(policy), db=db, deployment="svc")
        messages += [str(w.message) for w in caught]
        assert served.decision.state == "fallback" and served.decision.source == "none"
        served.close()
    assert len(messages) == 1 and f"the database {db} {DAMAGED}" in messages[0], messages
    assert "deployment 'svc' is not metered" in messages[0]
