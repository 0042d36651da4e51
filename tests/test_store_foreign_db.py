"""Opening a SQLite file that another program wrote: every open refuses it with one true line and leaves the
file as it was; new paths and empty files still become joulepilot databases, and joulepilot's own databases of
every older schema version still open and are brought forward."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.store import (
    SCHEMA_VERSION,
    DatabaseCorrupt,
    list_runs,
    open_db,
    open_for_reading,
    schema_version,
)
from store_factories import database_at

from joulepilot.cli import main

SWEEP = Path(__file__).parent / "data" / "synthetic_sweep.json"


def _browser_history(path: Path, user_version: int = 0) -> Path:
    """Another program's database: one table with a row and an index."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE moz_places (id INTEGER PRIMARY KEY, url TEXT)")
    conn.execute("CREATE INDEX moz_places_url ON moz_places(url)")
    conn.execute("INSERT INTO moz_places (url) VALUES ('https://example.org/')")
    conn.execute(f"PRAGMA user_version = {user_version}")
    conn.close()
    return path


def _state(path: Path) -> tuple[bytes, list[str], str]:
    """The file's bytes, the files beside it and its journal mode."""
    conn = sqlite3.connect(path)
    try:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        conn.close()
    return path.read_bytes(), sorted(p.name for p in path.parent.iterdir()), mode


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def test_runs_import_refuses_another_programs_database_and_leaves_it_unchanged(tmp_path):
    other = _browser_history(tmp_path / "other.db")
    before = _state(other)
    result = CliRunner().invoke(main, ["runs", "import", str(SWEEP), "--db", str(other)])
    line = _one_line_error(result)
    assert f"{other} is not a joulepilot database" in line and "moz_places" in line and "--db" in line
    assert _state(other) == before  # no joulepilot tables, no WAL switch, no -wal/-shm files
    assert before[2] == "delete"


def test_a_read_command_says_what_the_file_holds_instead_of_no_tables(tmp_path):
    other = _browser_history(tmp_path / "other.db")
    line = _one_line_error(CliRunner().invoke(main, ["runs", "--db", str(other)]))
    assert f"{other} is not a joulepilot database" in line and "moz_places" in line
    assert "no tables" not in line


@pytest.mark.parametrize("options", [{}, {"migrate_schema": False}, {"must_exist": True}, {"read_only": True}],
                         ids=["write", "no-migrate", "must-exist", "read-only"])
@pytest.mark.parametrize("user_version", [0, 3, SCHEMA_VERSION, SCHEMA_VERSION + 5])
def test_every_open_refuses_another_programs_database(tmp_path, options, user_version):
    other = _browser_history(tmp_path / "other.db", user_version)
    before = _state(other)
    with pytest.raises(DatabaseCorrupt, match="is not a joulepilot database") as caught:
        open_db(other, **options)
    message = str(caught.value)
    assert "\n" not in message and str(other) in message and "moz_places" in message
    assert _state(other) == before


def test_a_new_path_and_an_empty_file_become_joulepilot_databases(tmp_path):
    new = tmp_path / "new.db"
    empty = tmp_path / "empty.db"
    empty.touch()
    for path in (new, empty):
        db = open_db(path)
        assert schema_version(db) == SCHEMA_VERSION and "runs" in db.table_names()
        db.close()
    # an empty file is still no database to read from
    unread = tmp_path / "unread.db"
    unread.touch()
    for options in ({"must_exist": True}, {"read_only": True}):
        with pytest.raises(DatabaseCorrupt, match=f"{unread} is an empty SQLite file, not a joulepilot database"):
            open_db(unread, **options)
    assert unread.stat().st_size == 0


@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION + 1))
def test_joulepilot_databases_of_every_schema_version_still_open(tmp_path, version):
    read = database_at(tmp_path / "read.db", version, user_table=True)
    db = open_for_reading(read)  # read-only first, then brought forward where it is older
    assert schema_version(db) == SCHEMA_VERSION
    assert [r["energy_j_per_inference"] for r in list_runs(db)] == [0.25]
    db.close()
    written = database_at(tmp_path / "write.db", version, user_table=True)
    db = open_db(written)
    assert schema_version(db) == SCHEMA_VERSION and "my_notes" in db.table_names()
    assert [r["energy_j_per_inference"] for r in list_runs(db)] == [0.25]
    db.close()


def test_a_file_claiming_a_schema_version_without_its_tables_is_refused(tmp_path):
    path = database_at(tmp_path / "half.db", 2, user_table=True)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA user_version = 3")  # version 3 adds the daemon's tables, which this file lacks
    conn.close()
    before = _state(path)
    with pytest.raises(DatabaseCorrupt, match="without joulepilot's heartbeats, jobs, requests, violations of "
                                              "schema version 3"):
        open_db(path)
    assert _state(path) == before
