"""Export runs with their workload, configuration and host rows, and import them elsewhere.

An export is a JSON list of records `{"run": {...}, "workload": {...}, "config": {...}, "host": {...}}`
whose dicts are rows of the matching tables, written in the shape of every joulepilot JSON output
(`jsonvalues.json_output`: objects, booleans, ISO 8601 times with `<name>_epoch` beside). Files with rows
exactly as stored (epoch floats, JSON text, 0/1) read the same. Importing keeps workload, config and host
ids, gives runs new ids, and skips a run already present (same workload, config, host, start time and
device), so importing a file twice, or a file that overlaps, adds each run once. A run exported before
compile energy was metered in a GPU and a CPU part gets its one figure as its device's part
(`store.compile_energy.legacy_parts`), as the schema migration does for stored runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .compile_energy import has_parts, legacy_parts
from .connection import Column, Store
from .db import transaction
from .errors import ExportFormatError
from .files import write_file_atomic
from .importcheck import checked_row
from .jsonvalues import json_output, row_from_json
from .records import insert_row, insert_run

PARTS = ("run", "workload", "config", "host")
_TABLES = {"run": "runs", "workload": "workloads", "config": "configs", "host": "hosts"}
# Which column of the run each other part must match.
_LINKS = {"workload": "workload_id", "config": "config_id", "host": "host_id"}
HOW_TO_EXPORT = "write one with `joulepilot runs export FILE`"
# Checks one configs row; raises ValueError (or TypeError) naming what the configuration vocabulary refuses.
ConfigCheck = Callable[[dict[str, Any]], object]


def export_runs(db: Store, where: str | None = None, params: Iterable[Any] = (), *,
                workload: str | None = None, since: float | None = None) -> list[dict]:
    """Runs with their workload, config and host rows, oldest first, as stored.

    `workload` keeps runs of that workload spec, `since` (epoch seconds) runs started at or after it.
    """
    clauses, args = [], list(params)
    if where:
        clauses.append(f"({where})")
    if workload is not None:
        clauses.append("workload_id IN (SELECT id FROM workloads WHERE spec = ?)")
        args.append(workload)
    if since is not None:
        clauses.append("started_at >= ?")
        args.append(float(since))
    sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY id"
    cache: dict[tuple[str, Any], Any] = {}

    def row(table: str, key: Any) -> Any:
        if (table, key) not in cache:
            cache[(table, key)] = next(db.query(f"SELECT * FROM {table} WHERE id = ?", [key]), None)
        return cache[(table, key)]

    return [{"run": run, "workload": row("workloads", run["workload_id"]), "config": row("configs", run["config_id"]),
             "host": row("hosts", run["host_id"])}
            for run in db.query(sql, args)]


def _required(columns: Sequence[Column], table: str) -> list[str]:
    return [c.name for c in columns if c.notnull and c.default_value is None and not
            (table == "runs" and c.name == "id")]


def _record_name(rec: Any, index: int, source: str) -> str:
    """'<file>: record <index> (run <id>)', the run's id as the file gives it."""
    run = rec.get("run") if isinstance(rec, Mapping) else None
    run_id = run.get("id") if isinstance(run, Mapping) else None
    return f"{source}: record {index}" + (f" (run {run_id})" if run_id is not None else "")


def _normalised(tables: Mapping[str, Sequence[Column]], rec: Any, index: int, source: str,
                check_config: ConfigCheck | None) -> dict[str, dict[str, Any]]:
    where = _record_name(rec, index, source)
    if not isinstance(rec, Mapping):
        raise ExportFormatError(f"{where} is a {type(rec).__name__}, not an object with {', '.join(PARTS)}; "
                                f"{HOW_TO_EXPORT}")
    out: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        table = _TABLES[part]
        value = rec.get(part)
        if not isinstance(value, Mapping):
            raise ExportFormatError(f"{where}: '{part}' is missing or not an object; {HOW_TO_EXPORT}")
        columns = tables[table]
        try:
            row = checked_row(table, row_from_json(value, [c.name for c in columns]), columns)
        except ValueError as exc:
            raise ExportFormatError(f"{where}: {part}.{exc}") from None
        required = (["id"] if part in _LINKS else []) + _required(columns, table)
        missing = [c for c in required if row.get(c) is None]
        if missing:
            raise ExportFormatError(f"{where}: {part}.{missing[0]} is missing (a {table} row needs "
                                    f"{', '.join(required)}); {HOW_TO_EXPORT}")
        out[part] = row
    run = out["run"]
    if not has_parts(rec["run"]):  # exported before the CPU part of compiles was metered
        run.update(legacy_parts(run.get("device"), run.get("compile_energy_j"), run.get("energy_source")))
    for part, column in _LINKS.items():
        if out["run"][column] != out[part]["id"]:
            raise ExportFormatError(f"{where}: run.{column} is {out['run'][column]!r} but {part}.id is "
                                    f"{out[part]['id']!r}; the record is inconsistent, export it again")
    if check_config is not None:
        try:
            check_config(dict(out["config"]))
        except (ValueError, TypeError) as exc:
            raise ExportFormatError(f"{where}: config {out['config']['id']}: {exc}; correct the configuration "
                                    f"or export the runs again") from None
    return out


def import_runs(db: Store, records: Iterable[Mapping[str, Any]], *, source: str = "import",
                check_config: ConfigCheck | None = None) -> list[int]:
    """Insert exported records in one transaction; returns the new run ids (skipped ones omitted).

    Every record is checked before anything is written: its structure, every value against the type of its
    column and a run's status (`store.importcheck`), and, when `check_config` is given, its configuration row
    (a function raising ValueError for a row the configuration vocabulary refuses; the store sits below the
    compiler that owns the vocabulary, so the caller passes it, e.g. `CompileConfig.from_row`). A bad record
    raises ExportFormatError naming `source`, the record's index and run id, the field and the problem, and
    nothing is imported.
    """
    tables = {table: db.columns(table) for table in _TABLES.values()}
    normalised = [_normalised(tables, rec, i, source, check_config) for i, rec in enumerate(records)]
    new_ids: list[int] = []
    with transaction(db):
        for rec in normalised:
            for part in ("host", "workload", "config"):
                insert_row(db, _TABLES[part], rec[part], on_conflict="nothing")
            run = {k: v for k, v in rec["run"].items() if k != "id"}
            exists = db.execute(
                "SELECT 1 FROM runs WHERE workload_id = ? AND config_id = ? AND host_id = ? AND started_at = ?"
                " AND device = ?",
                [run["workload_id"], run["config_id"], run["host_id"], run["started_at"], run["device"]],
            ).fetchone()
            if exists:
                continue
            new_ids.append(insert_run(db, run))
    return new_ids


def export_text(records: Sequence[Mapping[str, Any]]) -> str:
    """The export file's text for `records` (rows as stored, or already shaped)."""
    return json.dumps(json_output(list(records)), indent=1, sort_keys=True, default=str) + "\n"


def write_export(path: str | os.PathLike, records: Sequence[Mapping[str, Any]]) -> None:
    """Write an export file whole or not at all: a temporary file beside it, renamed over `path`.

    A path that exists and is not a regular file (a pipe, a device) is written through instead, never
    replaced; a symbolic link is followed, so the file it points to gets the export.
    """
    target = Path(path)
    text = export_text(records)
    if target.is_symlink():
        target = target.resolve()
    if target.exists() and not target.is_file():
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    try:
        write_file_atomic(target, text.encode("utf-8"))
    except OSError as exc:
        if exc.filename is None or str(exc.filename).endswith(".tmp"):  # name the user's file, not ours
            raise OSError(exc.errno, exc.strerror, str(target)) from exc
        raise


def parse_export(text: str, source: str) -> list[dict]:
    """The records of an export file's text, rows as stored; ExportFormatError names `source`."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ExportFormatError(f"{source} is not a joulepilot runs export: not JSON ({exc}); "
                                f"{HOW_TO_EXPORT}") from None
    if not isinstance(data, list):
        raise ExportFormatError(f"{source} is not a joulepilot runs export: expected a JSON list of records, "
                                f"found {type(data).__name__}; {HOW_TO_EXPORT}")
    records = []
    for index, rec in enumerate(data):
        if not isinstance(rec, Mapping) or not all(isinstance(rec.get(p), Mapping) for p in PARTS):
            missing = [p for p in PARTS if not isinstance(rec, Mapping) or not isinstance(rec.get(p), Mapping)]
            raise ExportFormatError(f"{source}: record {index} lacks {', '.join(missing)} (each record has "
                                    f"{', '.join(PARTS)} objects); {HOW_TO_EXPORT}")
        record = {}
        for part in PARTS:
            try:
                record[part] = row_from_json(rec[part], None)
            except ValueError as exc:
                raise ExportFormatError(f"{_record_name(rec, index, source)}: {part}.{exc}") from None
        records.append(record)
    return records


def read_export(path: str | os.PathLike) -> list[dict]:
    """The records of an export file, rows as stored (either file shape)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ExportFormatError(f"{path} is not a joulepilot runs export: not UTF-8 text; {HOW_TO_EXPORT}") from None
    return parse_export(text, str(path))
