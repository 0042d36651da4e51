"""All SQL lives in `store/`: no other part of joulepilot talks to the database directly.

Every .py file outside store/, tests/ and benchmarks/ is parsed; a database call in one of them fails
the test, naming file:line. Database calls are: `.execute(`, `.executemany(`, `.executescript(`,
`.query(`, `.table(`, subscripting a database object (`db[...]`, `database[...]`, `self.db[...]`),
`sqlite3.connect` and `sqlite_utils.Database(`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_THE_CHECK = {"store", "tests", "benchmarks"}

DB_METHODS = {"execute", "executemany", "executescript", "query", "table"}
DB_NAMES = {"db", "database"}


def _is_database(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in DB_NAMES
    return isinstance(node, ast.Attribute) and node.attr in DB_NAMES


def database_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) for each database call in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if func.attr in DB_METHODS:
                found.append((node.lineno, f".{func.attr}("))
            elif (owner, func.attr) in {("sqlite3", "connect"), ("sqlite_utils", "Database")}:
                found.append((node.lineno, f"{owner}.{func.attr}("))
        elif isinstance(node, ast.Subscript) and _is_database(node.value):
            found.append((node.lineno, f"{ast.unparse(node.value)}[...]"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("sqlite3", "sqlite_utils") \
                and any(alias.name in ("connect", "Database") for alias in node.names):
            found.append((node.lineno, f"from {node.module} import connect/Database"))
    return sorted(found)


def checked_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        top = relative.parts[0]
        if top in OUTSIDE_THE_CHECK or any(p.startswith(".") or p in ("build", "dist") or p.endswith(".egg-info")
                                           for p in relative.parts[:-1]):
            continue
        files.append(path)
    return files


def test_no_database_calls_outside_store():
    files = checked_files()
    assert ROOT / "controller" / "daemon.py" in files and ROOT / "policies" / "resolve.py" in files
    offences = [f"{path.relative_to(ROOT)}:{line}: {what}"
                for path in files for line, what in database_calls(path.read_text(encoding="utf-8"))]
    assert not offences, ("database calls outside store/ (put them behind a typed function in store/):\n"
                          + "\n".join(offences))


def test_the_check_recognises_each_kind_of_database_call():
    source = """
import sqlite3
import sqlite_utils
from sqlite3 import connect

def f(db, database, self, rows):
    db.execute("SELECT 1")
    database.query("SELECT 1")
    self.db.executemany("INSERT", [])
    db.conn.executescript("")
    db["configs"].get("x")
    self.db["runs"].count_where("1")
    database.table("jobs").insert({})
    sqlite3.connect("x.db")
    sqlite_utils.Database("x.db")
    rows["db"]          # a plain dict: not a database
    rows.get("execute")  # not a database call either
"""
    found = database_calls(source)
    assert found == [(4, "from sqlite3 import connect/Database"), (7, ".execute("), (8, ".query("),
                     (9, ".executemany("), (10, ".executescript("), (11, "db[...]"), (12, "self.db[...]"),
                     (13, ".table("), (14, "sqlite3.connect("), (15, "sqlite_utils.Database(")]
