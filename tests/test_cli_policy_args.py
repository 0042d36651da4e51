"""Arguments of the policy, frontier and report commands that once slipped through or misled: a torch version
that cannot exist (stored, locked and shown as current), a plot format matplotlib cannot write (found out after
the work), a batch size of 0 (taken as the default), a report error naming no database, and policies given by
name (documented, refused)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from joulepilot.store import open_db
from joulepilot.store.decisions import list_decisions

from joulepilot.cli import main

POLICY = 'name = "{name}"\nworkload = "mlp"\nbatch_size = 8\n'


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A folder with svc.toml and an empty database, as the current directory."""
    (tmp_path / "svc.toml").write_text(POLICY.format(name="svc"))
    db = tmp_path / "j.db"
    open_db(db).close()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def decisions(db) -> list:
    database = open_db(db)
    try:
        return list_decisions(database)
    finally:
        database.close()


# --- --torch-version ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["not a version", "", "2", "2.x", "latest", "v2.11", "2.11.0 cu130",
                                     "2.11\n", "2." + "1" * 100])
@pytest.mark.parametrize("command", [["policy", "lock"], ["policy", "explain", "--record"], ["policy", "explain"]])
def test_a_torch_version_that_cannot_exist_is_refused_before_anything_is_stored(work, command, version):
    result = invoke(*command, "svc.toml", "--db", "j.db", "--device-name", "cpu", "--torch-version", version)
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines() or [""]
    assert line.startswith("Error: --torch-version ") and "2.11" in line and "2.11.0+cu130" in line
    assert len(line) < 250
    assert decisions(work / "j.db") == [] and not (work / "svc.lock.json").exists()


@pytest.mark.parametrize("version, minor", [("2.11", "2.11"), ("2.11.0", "2.11"), ("2.11.0+cu130", "2.11"),
                                            ("2.12.0a0+git1a2b3c4", "2.12"), ("2.10.0.dev20250101+cpu", "2.10"),
                                            ("2.9.1rc1", "2.9"), ("10.0", "10.0")])
def test_each_spelling_of_a_torch_version_decides_for_its_major_minor(work, version, minor):
    result = invoke("policy", "lock", "svc.toml", "--db", "j.db", "--device-name", "cpu", "--torch-version", version,
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["torch_version"] == minor
    [stored] = decisions(work / "j.db")
    assert stored.torch_version == minor
    assert list(json.loads((work / "svc.lock.json").read_text())["entries"]["cpu"]) == [minor]


# --- frontier --plot and --batch-size ----------------------------------------------------------------------------

MAGIC = {"png": b"\x89PNG", "pdf": b"%PDF", "svg": b"<?xml"}


@pytest.fixture
def measured(tmp_path):
    """A database with three runs of each of two configurations of the built-in mlp (batch 8)."""
    from bill_factories import store_run

    path = tmp_path / "runs.db"
    database = open_db(path)
    for mode, j_per_call in (("eager", 0.02), ("default", 0.01)):
        for _ in range(3):
            store_run(database, mode, "fp32", j_per_call)
    database.close()
    return str(path)


def test_every_plot_format_offered_is_written(measured, tmp_path):
    from joulepilot.cli_policy import PLOT_FORMATS

    assert set(PLOT_FORMATS) <= set(MAGIC)
    for extension in PLOT_FORMATS:
        plot = tmp_path / f"front.{extension}"
        result = invoke("frontier", "mlp", "--db", measured, "--no-predict", "--plot", str(plot), "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["plot"] == str(plot)
        assert plot.read_bytes().startswith(MAGIC[extension])


@pytest.mark.parametrize("name, found", [("fr.txt", "'.txt'"), ("fr", "no extension"), ("fr.pgf", "'.pgf'"),
                                         ("fr.png.bak", "'.bak'")])
def test_a_plot_file_of_no_known_format_is_refused_before_any_work(measured, tmp_path, name, found):
    from joulepilot.cli_policy import PLOT_FORMATS

    plot = tmp_path / name
    result = invoke("frontier", "mlp", "--db", measured, "--no-predict", "--plot", str(plot))
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"Error: --plot {plot}: ") and f"found {found}" in line
    assert all(f".{extension}" in line for extension in PLOT_FORMATS)
    assert not plot.exists()
    # before any work: a database that does not exist is not even looked at
    missing = tmp_path / "missing.db"
    result = invoke("frontier", "mlp", "--db", str(missing), "--plot", str(plot))
    assert result.exit_code == 1 and "--plot" in result.output and "does not exist" not in result.output
    assert not missing.exists()


def test_a_plot_into_a_folder_that_does_not_exist_is_refused_before_any_work(measured, tmp_path):
    plot = tmp_path / "nowhere" / "front.png"
    result = invoke("frontier", "mlp", "--db", measured, "--plot", str(plot))
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        f"Error: --plot {plot}: the folder {plot.parent} does not exist; create it or write the plot elsewhere"]


@pytest.mark.parametrize("batch_size", ["0", "-8"])
def test_frontier_refuses_a_batch_size_below_one_as_bench_does(measured, batch_size):
    assert invoke("frontier", "mlp", "--db", measured, "--no-predict").exit_code == 0
    for command in (["frontier", "mlp", "--db", measured, "--no-predict"], ["bench", "mlp"]):
        result = invoke(*command, "--batch-size", batch_size)
        assert result.exit_code == 1
        assert result.output.strip().splitlines() == [
            f"Error: --batch-size: {batch_size} is not in the range 1<=x<=1048576; give a whole number from 1 to "
            "1,048,576"]


# --- policies given by name ---------------------------------------------------------------------------------------


@pytest.fixture
def places(work, monkeypatch, _isolated_home):
    """The three places a name is looked up, in order: $JOULEPILOT_POLICIES, $JOULEPILOT_HOME/policies, the
    current directory (`work`, which holds svc.toml)."""
    env_dir, home_dir = work / "env", _isolated_home / "policies"
    env_dir.mkdir()
    home_dir.mkdir()
    monkeypatch.setenv("JOULEPILOT_POLICIES", str(env_dir))
    return env_dir, home_dir, work


def checked_file(given: str) -> str:
    result = invoke("policy", "check", given, "--json")
    assert result.exit_code == 0, result.output
    [report] = json.loads(result.output)
    return report["file"]


def test_explain_lock_and_check_take_a_policy_by_name(places):
    _, _, cwd = places
    explained = invoke("policy", "explain", "svc", "--db", "j.db", "--device-name", "cpu", "--json")
    assert explained.exit_code == 0, explained.output
    assert json.loads(explained.output)["policy"] == "svc"
    locked = invoke("policy", "lock", "svc", "--db", "j.db", "--device-name", "cpu", "--json")
    assert locked.exit_code == 0, locked.output
    assert json.loads(locked.output)["lock_file"] == str(cwd / "svc.lock.json")
    assert [d.policy for d in decisions(cwd / "j.db")] == ["svc"]
    assert checked_file("svc") == str(cwd / "svc.toml")
    text = invoke("policy", "check", "svc")
    assert text.exit_code == 0 and text.output.startswith(f"{cwd / 'svc.toml'}: ok (policy svc")


def test_frontier_takes_a_policy_by_name(places, measured):
    env_dir, _, _ = places
    (env_dir / "wide.toml").write_text(POLICY.format(name="wide") + '[search]\nmodes = ["eager", "default", '
                                                                     '"reduce-overhead"]\n')

    def predicted(*args: str) -> set[str]:
        result = invoke("frontier", "mlp", "--db", measured, "--json", *args)
        assert result.exit_code == 0, result.output
        return {p["label"] for p in json.loads(result.output)["points"] if p["source"] == "predicted"}

    assert predicted() == set()  # only the modes measured
    assert predicted("--policy", "wide") == {"reduce-overhead/fp32/b8"}  # the policy's search space, found by name


def test_a_name_is_looked_up_in_the_documented_order(places):
    env_dir, home_dir, cwd = places
    (home_dir / "svc.toml").write_text(POLICY.format(name="svc"))
    assert checked_file("svc") == str(home_dir / "svc.toml")  # the home's policies before the current directory
    (env_dir / "svc.toml").write_text(POLICY.format(name="svc"))
    assert checked_file("svc") == str(env_dir / "svc.toml")  # $JOULEPILOT_POLICIES before both
    locked = invoke("policy", "lock", "svc", "--db", "j.db", "--device-name", "cpu", "--json")
    assert json.loads(locked.output)["lock_file"] == str(env_dir / "svc.lock.json")
    assert not (cwd / "svc.lock.json").exists()


def test_a_file_given_as_a_path_is_that_file_and_a_bare_file_name_wins_over_the_name(places):
    env_dir, _, cwd = places
    (env_dir / "svc.toml").write_text(POLICY.format(name="svc"))
    assert checked_file("svc.toml") == "svc.toml"  # ends in .toml: a path, even with svc.toml on the search path
    assert checked_file(str(cwd / "svc.toml")) == str(cwd / "svc.toml")
    (cwd / "other").write_text(POLICY.format(name="other"))  # a policy file without the suffix, named as such
    (env_dir / "other.toml").write_text(POLICY.format(name="other"))
    assert checked_file("other") == "other"
    (cwd / "folder").mkdir()  # a folder of that name is no policy file: the name is looked up
    (env_dir / "folder.toml").write_text(POLICY.format(name="folder"))
    assert checked_file("folder") == str(env_dir / "folder.toml")
    (env_dir / "elsewhere.toml").write_text(POLICY.format(name="elsewhere"))
    result = invoke("policy", "check", "elsewhere.toml")  # a path: not looked up by name
    assert result.exit_code == 1 and "elsewhere.toml: 1 problem(s)" in result.output and "no such file" in result.output


@pytest.mark.parametrize("command", [["policy", "explain", "nope"], ["policy", "lock", "nope"],
                                     ["frontier", "mlp", "--policy", "nope"]])
def test_a_name_found_nowhere_is_one_line_listing_where_it_was_looked_up(places, command):
    env_dir, home_dir, cwd = places
    result = invoke(*command, "--db", "j.db")
    assert result.exit_code == 1
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: nope: (file): expected a policy file nope.toml in one of: ")
    assert f"{env_dir}, {home_dir}, {cwd}" in line and "JOULEPILOT_POLICIES" in line
    assert decisions(cwd / "j.db") == []


def test_check_of_a_name_found_nowhere_lists_where_it_was_looked_up(places):
    env_dir, home_dir, cwd = places
    result = invoke("policy", "check", "svc", "nope", "--json")
    assert result.exit_code == 1
    ok, missing = json.loads(result.output)
    assert ok["ok"] and ok["file"] == str(cwd / "svc.toml")
    assert not missing["ok"] and missing["file"] == "nope"
    [problem] = missing["problems"]
    assert problem["key"] == "(file)" and f"{env_dir}, {home_dir}, {cwd}" in problem["expected"]


def test_the_help_says_a_policy_may_be_given_by_name():
    for command in (["policy"], ["policy", "check"], ["policy", "explain"], ["policy", "lock"]):
        text = " ".join(invoke(*command, "--help").output.split())
        assert "POLICY is a policy file or a policy's name" in text
        assert "<name>.toml in $JOULEPILOT_POLICIES, then $JOULEPILOT_HOME/policies, then the current directory" \
            in text
