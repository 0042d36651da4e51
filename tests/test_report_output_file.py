"""`report -o FILE` writes the report whole or not at all: a full disk (here a file size limit, which fails a write
the same way) or a kill in the middle of the write leaves the report that was there, or none, never half of one."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

import pytest
from joulepilot.store import open_db, upsert_host
from joulepilot.store.deployments import insert_samples, register_deployment

T0 = 1_700_000_000.0
LIMIT_BYTES = 512 * 1024  # above what starting joulepilot writes, below the report (about 1.3 MB of JSON)
OLD = '{"the report": "of yesterday"}\n'


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "jp.db"
    db = open_db(path)
    dep = register_deployment(db, "svc", device="cpu", host_id=upsert_host(db))
    insert_samples(db, dep, [{"t_start": T0 + i, "t_end": T0 + i + 1, "energy_j": 30.0, "inferences": 100,
                              "avg_power_w": 30.0, "peak_power_w": 33.0, "energy_source": "rapl"} for i in range(3000)])
    db.close()
    return path


# Python ignores SIGXFSZ from its start; `killed` puts the default action back, so the kernel kills the process at
# the write that crosses the limit: a kill in the middle of writing the report.
KILLED_AT_THE_LIMIT = ("import signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); "
                       "from joulepilot.cli import main; sys.argv[0] = 'joulepilot'; main()")


def _report(db, out, *, killed: bool) -> subprocess.CompletedProcess:
    """`joulepilot report` writing all 3000 windows as JSON to `out` under a file size limit: a write past it fails
    with EFBIG, or (`killed`) the kernel kills the process with SIGXFSZ in the middle of the write."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, LIMIT_BYTES))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    start = ["-c", KILLED_AT_THE_LIMIT] if killed else ["-m", "joulepilot"]
    return subprocess.run([sys.executable, *start, "report", "--db", str(db), "-d", "svc", "--json",
                           "--windows", "3000", "-o", str(out)], preexec_fn=limit, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_full_disk_leaves_the_report_that_was_there_and_says_so_in_one_line(store, tmp_path):
    out = tmp_path / "reports" / "svc.json"
    out.parent.mkdir()
    out.write_text(OLD)
    result = _report(store, out, killed=False)
    assert result.returncode == 1, result.stderr
    assert out.read_text() == OLD
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0] == (f"Error: cannot write the report to {out}: file too large (a file size limit was reached); "
                        f"free space or raise the limit (ulimit -f); nothing was written; {out} is as it was")
    assert os.listdir(out.parent) == ["svc.json"]  # no temporary file left behind


def test_a_kill_in_the_middle_of_the_write_leaves_no_half_report(store, tmp_path):
    out = tmp_path / "svc.json"
    out.write_text(OLD)
    result = _report(store, out, killed=True)
    assert result.returncode == -signal.SIGXFSZ, result.stderr
    assert out.read_text() == OLD

    fresh = tmp_path / "new" / "svc.json"
    fresh.parent.mkdir()
    assert _report(store, fresh, killed=True).returncode == -signal.SIGXFSZ
    assert not fresh.exists()  # at most a temporary file beside it, never a report cut short
    assert all(name.endswith(".tmp") for name in os.listdir(fresh.parent))


def test_the_report_is_written_whole(store, tmp_path):
    out = tmp_path / "svc.json"
    out.write_text(OLD)
    result = subprocess.run([sys.executable, "-m", "joulepilot", "report", "--db", str(store), "-d", "svc", "--json",
                             "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and f"wrote json report to {out}" in result.stderr
    assert '"kind": "joulepilot.deployment_report"' in out.read_text() and os.listdir(tmp_path).count("svc.json") == 1
