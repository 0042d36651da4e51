"""The CLI's error boundary: damaged, missing, too-new, read-only and full databases end every command
with one line `Error: ...` and exit code 1, never a traceback; read-only databases stay readable."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from joulepilot.store import SCHEMA_VERSION, import_runs, list_runs, open_db, read_export, schema_version
from joulepilot.store.connection import Store
from joulepilot.store.schema import MIGRATIONS
from store_factories import damage_pages

from joulepilot.cli import BoundaryGroup, main

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "tests" / "data" / "gpu_sweep_h200.json"
POLICY = REPO / "examples" / "policies" / "resnet50.toml"
H200 = ["--device-name", "NVIDIA H200", "--torch-version", "2.11"]


def _seeded(path: Path) -> Path:
    db = open_db(path)
    import_runs(db, read_export(SWEEP))
    db.close()
    return path


@pytest.fixture
def work(tmp_path):
    """A folder with a policy file (lock writes beside it) and an export file to import."""
    shutil.copy(POLICY, tmp_path / "resnet50.toml")
    return tmp_path


def _damaged(kind: str, folder: Path) -> Path:
    path = folder / f"{kind}.db"
    if kind == "garbage":
        path.write_bytes(b"these bytes were never a database\n" * 200)
    elif kind == "truncated":
        _seeded(path)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif kind == "future":
        open_db(path).close()
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA user_version = 99")
        conn.commit()
        conn.close()
    elif kind == "middle-pages":  # the runs' pages only: commands that do not read runs used to succeed
        damage_pages(_seeded(path), "runs")
    elif kind == "damaged-pages":  # the header and schema are fine; the rows are not
        _seeded(path)
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\xab" * (size // 2 - 4096))
    return path


def read_commands(folder: Path) -> list[list[str]]:
    return [["runs"], ["runs", "--json"], ["runs", "export", str(folder / "out.json")], ["status"],
            ["status", "--json"], ["fit"], ["frontier", "torchvision:resnet50"], ["report", "--all"],
            ["report", "-d", "svc"], ["policy", "explain", str(folder / "resnet50.toml"), *H200]]


def write_commands(folder: Path, export: Path) -> list[list[str]]:
    return [["policy", "explain", "--record", str(folder / "resnet50.toml"), *H200],
            ["policy", "lock", str(folder / "resnet50.toml"), *H200], ["runs", "import", str(export)]]


def assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # nothing escaped the CLI
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def export_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    src = _seeded(folder / "src.db")
    result = CliRunner().invoke(main, ["runs", "export", str(folder / "runs.json"), "--db", str(src)])
    assert result.exit_code == 0, result.output
    return folder / "runs.json"


DAMAGED = "is damaged (SQLite: "
RECOVER = ".recover | sqlite3 "


@pytest.mark.parametrize("kind,needles", [
    ("garbage", (DAMAGED, RECOVER)),
    ("truncated", (DAMAGED, RECOVER)),
    ("middle-pages", (DAMAGED, RECOVER)),
    ("damaged-pages", (DAMAGED, RECOVER)),
    ("future", ("schema version 99, newer than this joulepilot",)),
])
def test_every_command_reports_a_bad_database_in_one_line(work, export_file, kind, needles):
    path = _damaged(kind, work)
    before = path.read_bytes()
    runner = CliRunner()
    commands = read_commands(work) + write_commands(work, export_file)
    for command in commands:
        result = runner.invoke(main, [*command, "--db", str(path)])
        assert_one_line_error(result, *needles, str(path))
    assert path.read_bytes() == before  # nothing tried to "repair" it
    assert not (work / "out.json").exists() and not (work / "resnet50.lock.json").exists()


def test_read_commands_refuse_a_database_that_does_not_exist(work, export_file):
    typo = work / "joulepilot.dbb"
    runner = CliRunner()
    for command in read_commands(work) + write_commands(work, export_file)[:2]:
        result = runner.invoke(main, [*command, "--db", str(typo)])
        assert_one_line_error(result, f"database {typo} does not exist", "--db")
        assert not typo.exists(), command  # no empty database left behind
    # the default database too, when nothing ever created it
    result = runner.invoke(main, ["runs"])
    assert_one_line_error(result, "does not exist")


def test_import_creates_the_database_it_is_given(work, export_file):
    fresh = work / "jp.db"
    result = CliRunner().invoke(main, ["runs", "import", str(export_file), "--db", str(fresh)])
    assert result.exit_code == 0, result.output
    assert len(list_runs(open_db(fresh))) == len(read_export(export_file))


def test_a_database_in_a_folder_that_does_not_exist_is_refused_not_created(work, export_file, monkeypatch):
    """A mistyped --db (or JOULEPILOT_DB) used to leave a tree of new folders and an empty store behind."""
    typo = work / "srv" / "joulepilott" / "jp.db"
    runner = CliRunner()
    for command in (["runs", "import", str(export_file)], ["bench", "mlp", "--device", "cpu"], ["daemon", "--once"]):
        assert_one_line_error(runner.invoke(main, [*command, "--db", str(typo)]),
                              f"the folder of database {typo} does not exist ({typo.parent}); create it")
    monkeypatch.setenv("JOULEPILOT_DB", str(typo))
    assert_one_line_error(runner.invoke(main, ["runs", "import", str(export_file)]), "does not exist")
    assert not (work / "srv").exists()
    # the default database, under JOULEPILOT_HOME, is still created with its folder
    monkeypatch.delenv("JOULEPILOT_DB")
    home = work / "new-home"
    monkeypatch.setenv("JOULEPILOT_HOME", str(home))
    result = runner.invoke(main, ["runs", "import", str(export_file)])
    assert result.exit_code == 0, result.output
    assert (home / "joulepilot.db").is_file()


def folder_commands(folder: Path, export: Path) -> list[list[str]]:
    """Every command that opens the database, read or write."""
    return [*read_commands(folder), *write_commands(folder, export), ["bench", "mlp", "--device", "cpu"],
            ["daemon", "--once"], ["exporter", "--port", "0"]]


def test_a_folder_given_as_the_database_is_one_line_naming_where_it_came_from(work, export_file, monkeypatch):
    folder = work / "dir.db"
    folder.mkdir()
    runner = CliRunner()
    for command in folder_commands(work, export_file):
        line = assert_one_line_error(runner.invoke(main, [*command, "--db", str(folder)]),
                                     f"--db {folder} is a folder, not a database file",
                                     f"pass --db with a file's path, e.g. --db {folder / 'joulepilot.db'}")
        assert "JOULEPILOT" not in line, command
    monkeypatch.setenv("JOULEPILOT_DB", str(folder))
    for command in folder_commands(work, export_file):
        line = assert_one_line_error(runner.invoke(main, command), f"JOULEPILOT_DB={folder} is a folder",
                                     "set JOULEPILOT_DB to a file's path", "or unset it")
        assert "--db" not in line, command  # the variable is at fault, not an option nobody gave
    monkeypatch.delenv("JOULEPILOT_DB")
    home = work / "home"
    (home / "joulepilot.db").mkdir(parents=True)
    monkeypatch.setenv("JOULEPILOT_HOME", str(home))
    for command in folder_commands(work, export_file):
        line = assert_one_line_error(runner.invoke(main, command),
                                     f"database {home / 'joulepilot.db'} (joulepilot.db under JOULEPILOT_HOME={home}) "
                                     "is a folder, not a file", "set JOULEPILOT_HOME to another folder")
        assert "does not exist" not in line, command
    assert not any(folder.iterdir()) and not any((home / "joulepilot.db").iterdir())  # nothing written into them


def test_the_daemon_takes_its_database_from_its_config_over_a_default_that_is_a_folder(work, monkeypatch):
    home = work / "home"
    (home / "joulepilot.db").mkdir(parents=True)
    monkeypatch.setenv("JOULEPILOT_HOME", str(home))
    config = work / "daemon.toml"
    config.write_text(f'db = "{work / "daemon.db"}"\n')
    result = CliRunner().invoke(main, ["daemon", "--once", "--config", str(config)])
    assert "is a folder" not in result.output, result.output
    assert (work / "daemon.db").is_file(), result.output


def test_a_folder_or_a_missing_file_given_as_an_export_file_is_one_line(work, export_file):
    runner = CliRunner()
    db = _seeded(work / "jp.db")
    assert_one_line_error(runner.invoke(main, ["runs", "import", str(work), "--db", str(db)]),
                          f"export file {work} is a folder, not a file", "`joulepilot runs export` wrote")
    assert_one_line_error(runner.invoke(main, ["runs", "import", str(work / "nope.json"), "--db", str(db)]),
                          f"export file {work / 'nope.json'} does not exist", "`joulepilot runs export` wrote")
    assert_one_line_error(runner.invoke(main, ["runs", "export", str(work), "--db", str(db)]),
                          f"export file {work} is a folder, not a file", "the JSON file to write")
    assert_one_line_error(runner.invoke(main, ["daemon", "--once", "--config", str(work), "--db", str(db)]),
                          f"--config {work} is a folder, not a file", "the daemon's TOML file")


@contextmanager
def unwritable(folder: Path):
    """Make `folder` and its files unwritable: chmod for a normal user; root ignores permission bits, so
    there the immutable attribute (chattr +i), which stops root too; skipped where neither works."""
    items = [folder, *folder.iterdir()]
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in items}
        for p in items:
            p.chmod(0o555 if p.is_dir() else 0o444)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root, where chmod does not stop writes, and chattr is not installed")
    done = subprocess.run(["chattr", "+i", *map(str, items)], capture_output=True, text=True)
    if done.returncode != 0:
        subprocess.run(["chattr", "-i", *map(str, items)], capture_output=True)
        pytest.skip(f"running as root, where chmod does not stop writes, and chattr +i failed: {done.stderr.strip()}")
    try:
        with pytest.raises(OSError):
            (folder / "probe").write_text("x")
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, items)], check=True)


def test_a_read_only_database_is_still_readable(work, export_file):
    ro = work / "ro"
    ro.mkdir()
    path = _seeded(ro / "jp.db")
    assert sorted(p.name for p in ro.iterdir()) == ["jp.db"]  # WAL files gone after a clean close
    policy = str(work / "resnet50.toml")
    runner = CliRunner()
    with unwritable(ro):
        for command in [["runs"], ["runs", "--json", "--limit", "0"], ["runs", "export", "-"], ["status"],
                        ["status", "--json"], ["report", "--all"], ["fit"], ["frontier", "torchvision:resnet50"],
                        ["policy", "explain", policy, *H200]]:
            result = runner.invoke(main, [*command, "--db", str(path)])
            assert result.exit_code == 0, (command, result.output)
        listed = runner.invoke(main, ["runs", "--db", str(path), "--limit", "0", "--json"]).stdout
        assert len(json.loads(listed)) == len(read_export(SWEEP))  # every run
        explained = runner.invoke(main, ["policy", "explain", policy, *H200, "--db", str(path)]).stdout
        # a measured configuration is decided on (its sweep has fewer runs than a verified decision needs)
        assert re.search(r"^decision +\S+ +\[(verified|provisional)\]$", explained, re.M), explained
        assert "the fallback" not in explained
        # commands that write say so in one line, naming the file
        for command in (["runs", "import", str(export_file)], ["policy", "lock", policy, *H200],
                        ["policy", "explain", "--record", policy, *H200]):
            result = runner.invoke(main, [*command, "--db", str(path)])
            assert_one_line_error(result, str(path), "writable")
        assert sorted(p.name for p in ro.iterdir()) == ["jp.db"]


def test_a_read_only_database_of_an_older_schema_says_why_it_cannot_be_read(work):
    ro = work / "old"
    ro.mkdir()
    path = ro / "jp.db"
    conn = sqlite3.connect(path, isolation_level=None)
    MIGRATIONS[0](Store(conn))
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    with unwritable(ro):
        result = CliRunner().invoke(main, ["status", "--db", str(path)])
        assert_one_line_error(result, str(path), "schema version 1, older than this joulepilot's")
    # writable, the same command brings it forward and reads it
    result = CliRunner().invoke(main, ["status", "--db", str(path)])
    assert result.exit_code == 0, result.output
    assert schema_version(open_db(path, read_only=True)) == SCHEMA_VERSION


def _cli(*args: str, file_limit: int | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        # A real "disk full" for this process alone: writes past file_limit bytes fail (EFBIG).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    environ = {**os.environ, **(env or {})}
    if file_limit:
        # Coverage's own data file would hit the same limit at exit and print its traceback: a process
        # that cannot write files is not measured.
        environ = {k: v for k, v in environ.items() if not k.startswith("COVERAGE_PROCESS_")}
    return subprocess.run([sys.executable, "-m", "joulepilot", *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit if file_limit else None, env=environ)


def test_a_full_disk_during_import_is_one_line_and_imports_nothing(work, export_file):
    path = work / "full.db"
    open_db(path).close()
    size = path.stat().st_size
    proc = _cli("runs", "import", str(export_file), "--db", str(path), file_limit=size // 2)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: database {path}") and "free space" in lines[0]
    assert list_runs(open_db(path)) == []  # the import's one transaction rolled back


def test_an_export_that_does_not_fit_leaves_the_old_file_whole(work):
    path = _seeded(work / "jp.db")
    out = work / "runs.json"
    out.write_text("[]\n")  # an earlier, smaller export
    proc = _cli("runs", "export", str(out), "--db", str(path), file_limit=64 * 1024)  # the export is ~200 kB
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {out}: file too large"), proc.stderr
    assert out.read_text() == "[]\n"
    assert sorted(p.name for p in work.iterdir() if p.name.startswith(".")) == []  # no temporary file left


def test_an_export_to_a_device_writes_through_it(work):
    path = _seeded(work / "jp.db")
    result = CliRunner().invoke(main, ["runs", "export", "/dev/null", "--db", str(path)])
    assert result.exit_code == 0, result.output
    assert Path("/dev/null").is_char_device()  # written through, never replaced by a file


def test_unexpected_errors_are_one_line_unless_debugging(monkeypatch):
    @click.group(cls=BoundaryGroup)
    def app() -> None:
        pass

    @app.command()
    def boom() -> None:
        {}["no such key"]

    monkeypatch.delenv("JOULEPILOT_DEBUG", raising=False)
    line = assert_one_line_error(CliRunner().invoke(app, ["boom"]))
    assert line == "Error: unexpected KeyError: 'no such key'; run with JOULEPILOT_DEBUG=1 for the traceback"
    monkeypatch.setenv("JOULEPILOT_DEBUG", "1")
    assert isinstance(CliRunner().invoke(app, ["boom"]).exception, KeyError)


def test_debug_shows_the_traceback(work):
    path = _damaged("garbage", work)
    quiet = _cli("runs", "--db", str(path))
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
    for args, env in ((["--debug", "runs", "--db", str(path)], None), (["runs", "--db", str(path)],
                                                                      {"JOULEPILOT_DEBUG": "1"})):
        loud = _cli(*args, env=env)
        assert loud.returncode == 1 and "Traceback" in loud.stderr and "DatabaseCorrupt" in loud.stderr
