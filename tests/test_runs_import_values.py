"""`runs import` checks every value before writing: numbers where the column holds numbers, a known run
status, and configurations the configuration vocabulary accepts. A bad value is one line naming the file, the
record (index and run id), the field and the problem, and nothing of any file is imported."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from joulepilot.compiler.config import CompileConfig
from joulepilot.store import ExportFormatError, import_runs, list_runs, open_db, read_export

from joulepilot.cli import main

SWEEP = Path(__file__).parent / "data" / "synthetic_sweep.json"
RECORDS = json.loads(SWEEP.read_text())
# A record past the first whose configuration compiles, so fusion and options may be set on it.
INDEX = next(i for i, r in enumerate(RECORDS) if i > 0 and r["config"]["mode"] == "default")
RUN_ID = RECORDS[INDEX]["run"]["id"]

BAD_VALUES = [
    ("run", "energy_j_per_inference", "abc", "run.energy_j_per_inference: 'abc' is not a number"),
    ("run", "energy_j_per_inference", math.nan, "run.energy_j_per_inference: nan is not a finite number"),
    ("run", "latency_ms_p50", True, "run.latency_ms_p50: True is not a number"),
    ("run", "avg_power_w", [250.0], "run.avg_power_w: [250.0] is not a number"),
    ("run", "inferences", 12.5, "run.inferences: 12.5 is not a whole number"),
    ("run", "status", "weird", "run.status: 'weird' is not a run status; write one of ok, failed"),
    ("run", "device", 0, "run.device: 0 is not text"),
    ("workload", "batch_size", "32", "workload.batch_size: '32' is not a whole number"),
    ("host", "hostname", 7, "host.hostname: 7 is not text"),
    ("config", "dynamic", 3, "config.dynamic: 3 is not true or false"),
    ("config", "options", "fusion=yes", "config.options: 'fusion=yes' is not a JSON object"),
    ("config", "mode", "bogus", "unknown mode 'bogus'"),
    ("config", "precision", "fp64", "unknown precision 'fp64'"),
    ("config", "fusion", "max-fusion", "unknown fusion preset 'max-fusion'"),
    ("config", "padding", "zeros", "unknown padding 'zeros'"),
    ("config", "regional", "two words", "regional must be"),
    ("config", "batch_size", 0, "config.batch_size: 0 is not a batch size"),
    ("config", "batch_size", True, "config.batch_size: True is not a whole number"),
]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records))  # json writes NaN as NaN, which json (and the import) reads back
    return path


@pytest.mark.parametrize("part,field,value,needle", BAD_VALUES, ids=[f"{p}.{f}={v!r}" for p, f, v, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_file_record_field_and_nothing_is_imported(tmp_path, part, field, value,
                                                                                   needle):
    good = _write(tmp_path / "good.json", RECORDS[:2])
    records = copy.deepcopy(RECORDS)
    records[INDEX][part][field] = value
    bad = _write(tmp_path / "bad.json", records)
    target = tmp_path / "t.db"
    result = CliRunner().invoke(main, ["runs", "import", str(good), str(bad), "--db", str(target)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"Error: {bad}: record {INDEX} (run {RUN_ID}): "), lines[0]
    assert needle in lines[0], lines[0]
    assert list_runs(open_db(target, read_only=True), limit=None) == []  # not even the good file


def test_nulls_where_the_schema_allows_them_and_whole_floats_import(tmp_path):
    records = copy.deepcopy(RECORDS[:3])
    records[0]["run"]["energy_j_per_inference"] = None
    records[1]["config"]["padding"] = None  # a column with a default: the default applies
    records[2]["workload"]["batch_size"] = 32.0
    records[2]["run"]["inferences"] = float(RECORDS[2]["run"]["inferences"])
    path = _write(tmp_path / "runs.json", records)
    target = tmp_path / "t.db"
    result = CliRunner().invoke(main, ["runs", "import", str(path), "--db", str(target), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["imported"] == 3
    db = open_db(target, read_only=True)
    by_start = {r["started_at"]: r for r in list_runs(db, limit=None)}
    assert by_start[RECORDS[0]["run"]["started_at"]]["energy_j_per_inference"] is None
    assert by_start[RECORDS[1]["run"]["started_at"]]["padding"] == "none"
    third = by_start[RECORDS[2]["run"]["started_at"]]
    assert third["inferences"] == RECORDS[2]["run"]["inferences"] and isinstance(third["inferences"], int)
    assert db.execute("SELECT typeof(batch_size) FROM workloads").fetchall() == [("integer",)]


def test_the_store_checks_types_itself_and_configurations_through_the_callers_check(tmp_path):
    db = open_db(tmp_path / "t.db")
    records = read_export(SWEEP)
    wrong_type = copy.deepcopy(records)
    wrong_type[INDEX]["run"]["energy_j_per_inference"] = "abc"
    with pytest.raises(ExportFormatError, match=r"sweep: record \d+ \(run \d+\): run.energy_j_per_inference: 'abc'"):
        import_runs(db, wrong_type, source="sweep")
    unknown_mode = copy.deepcopy(records)
    unknown_mode[INDEX]["config"]["mode"] = "bogus"
    with pytest.raises(ExportFormatError, match="unknown mode 'bogus'"):
        import_runs(db, unknown_mode, source="sweep", check_config=CompileConfig.from_row)
    assert db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0
    assert len(import_runs(db, records, source="sweep", check_config=CompileConfig.from_row)) == len(records)
