"""Every integer field of a policy has an upper bound, checked when the file is read: a value with a few digits
too many gets one line naming the file, the field and the fix from `policy check`, `policy lock` and
`policy explain --record` alike, where it once passed the check and then crashed storing the decision in SQLite
(whose integers are 64-bit). A number too large even for a float is a problem of the file, not an OverflowError."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from joulepilot.policies import PolicyError, load_policy
from joulepilot.policies.schema import (
    MAX_BATCH_SIZE,
    MAX_BUDGET_S,
    MAX_EXPECTED_INFERENCES,
    MAX_GUARD_WINDOWS,
    MAX_MEASUREMENTS,
    MAX_SHAPE_SIZE,
)
from joulepilot.store import open_db
from joulepilot.store.decisions import list_decisions

from joulepilot.cli import main

SQLITE_MAX_INT = 2**63 - 1
HUGE = 100000000000000000000000  # the audit's batch size: 10**23, past SQLite's 64-bit integers


def policy_text(top: str = "batch_size = 8", **tables: str) -> str:
    text = f'name = "svc"\nworkload = "mlp"\n{top}\n'
    return text + "".join(f"[{table}]\n{body}\n" for table, body in tables.items())


# (policy text with the value {v} in one field, the field's dotted key, its bound)
FIELDS = [
    (policy_text("batch_size = {v}"), "batch_size", MAX_BATCH_SIZE),
    (policy_text("batch_size = 8\nseq_len = {v}"), "seq_len", MAX_SHAPE_SIZE),
    (policy_text("batch_size = 8\nimage_size = {v}"), "image_size", MAX_SHAPE_SIZE),
    (policy_text(objective="expected_inferences = {v}"), "objective.expected_inferences", MAX_EXPECTED_INFERENCES),
    (policy_text(search="max_measurements = {v}"), "search.max_measurements", MAX_MEASUREMENTS),
    (policy_text(search="batch_sizes = [4, {v}]"), "search.batch_sizes", MAX_BATCH_SIZE),
    (policy_text(search="budget_s = {v}"), "search.budget_s", MAX_BUDGET_S),
    (policy_text(shapes="seq_len = [64, {v}]"), "shapes.seq_len", MAX_SHAPE_SIZE),
    (policy_text(shapes="image_size = [32, {v}]"), "shapes.image_size", MAX_SHAPE_SIZE),
    (policy_text(shapes="seq_len = [64]\nbuckets = [{v}]"), "shapes.buckets", MAX_SHAPE_SIZE),
    (policy_text(guard="windows = {v}"), "guard.windows", MAX_GUARD_WINDOWS),
]


def problems_of(path) -> dict:
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return {p.key: p for p in info.value.problems}


@pytest.mark.parametrize("text, key, bound", FIELDS, ids=[key for _, key, _ in FIELDS])
def test_each_integer_field_takes_its_bound_and_refuses_one_more(tmp_path, text, key, bound):
    assert bound < SQLITE_MAX_INT
    path = tmp_path / "svc.toml"
    path.write_text(text.format(v=bound))
    load_policy(path)  # the bound itself is allowed
    for too_many in (bound + 1, HUGE):
        path.write_text(text.format(v=too_many))
        found = problems_of(path)
        assert list(found) == [key]
        problem = found[key]
        assert problem.file == str(path)
        assert f"{bound:,}" in problem.expected and str(too_many) in problem.found
        assert problem.hint.startswith("e.g. ")


@pytest.mark.parametrize("field, table", [("max_avg_power_w", "limits"), ("margin_pct", "limits"),
                                          ("budget_s", "search")])
def test_a_number_too_large_for_a_float_is_a_problem_of_the_file(tmp_path, field, table):
    path = tmp_path / "svc.toml"
    path.write_text(policy_text(**{table: f"{field} = 1{'0' * 400}"}))
    found = problems_of(path)
    assert list(found) == [f"{table}.{field}"] and "integer 1000" in found[f"{table}.{field}"].found


def test_weights_too_large_for_a_float_are_a_problem_of_the_file(tmp_path):
    path = tmp_path / "svc.toml"
    path.write_text(policy_text(shapes=f"seq_len = [64, 128]\nweights = [1, 1{'0' * 400}]"))
    assert list(problems_of(path)) == ["shapes.weights"]


@pytest.fixture
def work(tmp_path):
    db = tmp_path / "j.db"
    open_db(db).close()
    return tmp_path, str(db)


@pytest.mark.parametrize("command", [["policy", "lock"], ["policy", "explain", "--record"]])
def test_a_huge_batch_size_is_one_line_and_stores_nothing(work, command):
    folder, db = work
    path = folder / "svc.toml"
    path.write_text(policy_text(f"batch_size = {HUGE}"))
    check = CliRunner().invoke(main, ["policy", "check", str(path)])
    assert check.exit_code == 1 and "batch_size" in check.output and f"{MAX_BATCH_SIZE:,}" in check.output
    result = CliRunner().invoke(main, [*command, str(path), "--db", db, "--device-name", "cpu"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert str(path) in lines[0] and "batch_size" in lines[0] and f"1 to {MAX_BATCH_SIZE:,}" in lines[0]
    assert "unexpected" not in lines[0] and "OverflowError" not in lines[0]
    database = open_db(db)
    try:
        assert list_decisions(database) == []
    finally:
        database.close()
    assert not (folder / "svc.lock.json").exists()


def test_a_policy_at_every_bound_is_decided_stored_and_locked(work):
    folder, db = work
    path = folder / "svc.toml"
    path.write_text(policy_text(f"batch_size = {MAX_BATCH_SIZE}",
                                objective=f"expected_inferences = {MAX_EXPECTED_INFERENCES}",
                                search=f"max_measurements = {MAX_MEASUREMENTS}\nbudget_s = {MAX_BUDGET_S}\n"
                                       f"batch_sizes = [{MAX_BATCH_SIZE}]",
                                guard=f"windows = {MAX_GUARD_WINDOWS}"))
    result = CliRunner().invoke(main, ["policy", "lock", str(path), "--db", db, "--device-name", "cpu"])
    assert result.exit_code == 0, result.output
    database = open_db(db)
    try:
        [decision] = list_decisions(database)
    finally:
        database.close()
    assert decision.policy == "svc" and (folder / "svc.lock.json").exists()
