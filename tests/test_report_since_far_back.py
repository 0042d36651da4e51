"""`report --since` with a duration reaching back past the year 1 (an operator's "everything": `--since 99999999d`)
covers every window instead of ending in a one-line `year ... is out of range` that does not name --since."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from joulepilot.store import open_db, upsert_host
from joulepilot.store.deployments import insert_samples, register_deployment
from joulepilot.store.timevalues import parse_since

from joulepilot.cli import main

T0 = 1_700_000_000.0


@pytest.fixture
def db_path(tmp_path):
    path = tmp_path / "jp.db"
    db = open_db(path)
    dep = register_deployment(db, "svc", device="cpu", host_id=upsert_host(db))
    insert_samples(db, dep, [{"t_start": T0 + i, "t_end": T0 + i + 1, "energy_j": 5.0, "inferences": 10,
                              "energy_source": "rapl"} for i in range(3)])
    db.close()
    return str(path)


@pytest.mark.parametrize("args", [["-d", "svc"], ["--all"]])
def test_a_duration_back_past_year_one_reports_every_window(db_path, args):
    result = CliRunner().invoke(main, ["report", "--db", db_path, *args, "--since", "300000000w", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["period"] if args[0] == "-d" else data)["since"] == "0001-01-01T00:00:00+00:00"
    samples = data["period"]["samples"] if args[0] == "-d" else data["deployments"][0]["samples"]
    assert samples == 3


def test_a_duration_never_reaches_before_the_earliest_time():
    from joulepilot.store.timevalues import EARLIEST_T

    assert parse_since("300000000w", now=T0) == EARLIEST_T
    assert parse_since("9" * 400 + "d", now=T0) == EARLIEST_T
    assert parse_since("1d", now=T0) == T0 - 86400
