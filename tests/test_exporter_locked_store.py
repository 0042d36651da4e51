"""A scrape of a database another program holds exclusively still answers, with the scrape-error gauge and the
reason logged, within the scrape timeout of the shipped Prometheus config (rather than after the store's 30 s
busy wait, when Prometheus has long given up and reports the target down)."""

from __future__ import annotations

import logging
import re
import sqlite3
import time
from pathlib import Path

from joulepilot.controller.exporter import start_exporter
from test_exporter_metrics import populate, scrape, value

REPO = Path(__file__).resolve().parents[1]


def shipped_scrape_timeout_s() -> float:
    text = (REPO / "deploy" / "prometheus.yml").read_text()
    return float(re.search(r"scrape_timeout:\s*(\d+)s", text).group(1))


def test_a_scrape_of_an_exclusively_locked_database_answers_within_the_scrape_timeout(tmp_path, caplog):
    path = tmp_path / "j.db"
    populate(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")  # e.g. the sqlite3 shell of an operator
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("COMMIT")  # exclusive locking mode keeps the lock after the transaction
    exp = start_exporter(path, port=0)
    try:
        with caplog.at_level(logging.WARNING, logger="joulepilot.controller.exporter"):
            started = time.monotonic()
            locked = scrape(exp.port)
            took_s = time.monotonic() - started
        holder.close()
        freed = scrape(exp.port)
    finally:
        exp.stop()
    assert took_s < shipped_scrape_timeout_s(), took_s  # the store's own busy timeout is 30 s
    assert value(locked, "joulepilot_exporter_scrape_error") == 1
    assert value(locked, "joulepilot_daemon_up") == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "locked" in warnings[0]
    assert value(freed, "joulepilot_exporter_scrape_error") == 0
    assert value(freed, "joulepilot_energy_joules_total", deployment="mlp-prod") > 0
