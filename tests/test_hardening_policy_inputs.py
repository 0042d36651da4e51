"""Hostile or broken policy inputs: requests naming outside files, FIFOs, huge values, workloads that
cannot exist, files that are not UTF-8 or nest too deeply, and workload modules that kill their importer.

Each of these once hung, flooded the database and the log, ran code it should not have, or ended in a
traceback; each now gets one clean line naming the file and the fix, promptly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from daemon_factories import daemon_cmd, poll_query, query, wait_for, write_daemon_config
from joulepilot.compiler import WorkloadError, check_spec
from joulepilot.policies import PolicyError, find_policy, load_policy, read_lock
from joulepilot.policies.load import load_policy_folders
from joulepilot.store import open_db
from joulepilot.store.daemon_state import add_request, latest_heartbeat, write_heartbeat

from joulepilot.cli import main

REPO = Path(__file__).resolve().parent.parent
GOOD = 'name = "{name}"\nworkload = "{workload}"\nbatch_size = 8\n'


def policy_file(folder: Path, name: str, workload: str = "mlp", text: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(text if text is not None else GOOD.format(name=name, workload=workload))
    return path


def marker_module(folder: Path, name: str, marker: Path, body: str = "") -> Path:
    """A workload module that leaves `marker` behind when anything imports it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(f"""
        import pathlib
        pathlib.Path({str(marker)!r}).write_text("imported")
        import torch

        def build(batch_size=1):
            return torch.nn.Linear(4, 2), (torch.randn(batch_size, 4),)
    """) + body + "\n")
    return path


def cli(*args: str, timeout_s: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The real CLI in its own process (a hang is a TimeoutExpired, and the process is killed)."""
    return subprocess.run([sys.executable, "-m", "joulepilot", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=cwd, stdin=subprocess.DEVNULL)


def daemon_once(config: Path, timeout_s: float = 180) -> tuple[int, dict, str]:
    proc = subprocess.run(daemon_cmd("--config", str(config), "--once", "--json"), capture_output=True,
                          text=True, timeout=timeout_s, cwd=REPO, stdin=subprocess.DEVNULL)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


# --- 4. requests never bring in code from outside the daemon's folders ---------------------------


def test_request_for_a_policy_file_outside_the_folders_is_refused_and_runs_nothing(tmp_path):
    db = tmp_path / "j.db"
    folder = tmp_path / "policies"
    folder.mkdir()
    marker = tmp_path / "ran.txt"
    payload = marker_module(tmp_path / "app", "payload", marker)
    outside = policy_file(tmp_path / "app", "app", text=GOOD.format(name="app", workload=f"{payload}:build")
                          + '[search]\nmodes = ["eager"]\n')
    database = open_db(db)
    add_request(database, "app", workload="x", note=json.dumps({"policy_path": str(outside)}))
    database.close()
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=folder)

    code, summary, stderr = daemon_once(config, timeout_s=300)

    assert not marker.exists(), "the daemon imported a workload module named by a hook's request"
    assert not (tmp_path / "app" / "app.lock.json").exists()
    (refused,) = summary["refused_requests"]
    assert refused["policy"] == "app" and refused["policy_path"] == str(outside)
    assert "is not in the daemon's policy folders" in refused["reason"] and str(folder) in refused["reason"]
    assert summary["stale"] == [] and summary["decided"] == []
    assert "request 1 for policy 'app' refused" in stderr
    # The request stays pending: it is served once a policy of that name is in the daemon's folders.
    assert [r["handled_at"] for r in query(db, "SELECT handled_at FROM requests")] == [None]
    assert query(db, "SELECT * FROM jobs") == []
    assert code == 0


def test_requests_are_matched_by_policy_name_only():
    from joulepilot.controller.redecide import refused_request, request_policy_name

    class Loaded:
        path = "/srv/policies/resnet.toml"

    by_name = {"resnet50": Loaded()}
    assert request_policy_name("resnet50", by_name) == "resnet50"
    assert request_policy_name("/srv/policies/resnet.toml", by_name) is None
    assert request_policy_name("resnet", by_name) is None
    huge = refused_request({"id": 3, "policy": "p" * 100_000, "note": json.dumps({"policy_path": "/x" * 50_000})},
                           [Path("/srv/policies")])
    assert len(json.dumps(huge)) < 1500 and "(100,000 chars)" in huge["policy"]


# --- 5. FIFOs and other non-regular files ---------------------------------------------------------


def returns_promptly(call, fifo: Path, timeout_s: float = 10.0):
    """call() in a thread; if it is still blocked on `fifo` after timeout_s, release it and fail."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed back to the test below
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer that leaves: the reader sees EOF
        thread.join(5)
        pytest.fail(f"blocked on the FIFO {fifo} for {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_fifo_policy_is_refused_at_once_by_every_reader(tmp_path):
    folder = tmp_path / "policies"
    policy_file(folder, "good")
    fifo = folder / "jam.toml"
    os.mkfifo(fifo)

    with pytest.raises(PolicyError, match=r"jam\.toml: \(file\): .*not a regular file \(a FIFO"):
        returns_promptly(lambda: load_policy(fifo), fifo)
    with pytest.raises(PolicyError, match="a FIFO"):
        returns_promptly(lambda: find_policy(str(fifo)), fifo)
    with pytest.raises(PolicyError, match="a FIFO"):
        returns_promptly(lambda: find_policy("jam", dirs=[folder]), fifo)

    policies, errors = returns_promptly(lambda: load_policy_folders([folder]), fifo)
    assert [p.name for p in policies] == ["good"]
    assert errors == [{"file": str(fifo), "error": "skipped: not a regular file (a FIFO (named pipe)); "
                                                   "a policy must be a regular file"}]

    lock_fifo = folder / "good.lock.json"
    os.mkfifo(lock_fifo)
    with pytest.raises(ValueError, match=r"good\.lock\.json: not a regular file"):
        returns_promptly(lambda: read_lock(folder / "good.toml", "cpu", "2.0"), lock_fifo)


def test_policy_check_and_explain_on_a_fifo_print_one_line_and_exit(tmp_path):
    fifo = tmp_path / "jam.toml"
    os.mkfifo(fifo)
    for args in (["policy", "check", str(fifo)], ["policy", "explain", str(fifo), "--db", str(tmp_path / "j.db")]):
        proc = cli(*args, timeout_s=90)
        assert proc.returncode == 1, proc.stderr
        text = proc.stdout + proc.stderr
        assert "Traceback" not in text and "not a regular file (a FIFO" in text and str(fifo) in text


def test_daemon_skips_a_fifo_and_still_stops_on_sigterm_within_seconds(tmp_path):
    db = tmp_path / "j.db"
    folder = tmp_path / "policies"
    folder.mkdir()
    os.mkfifo(folder / "jam.toml")
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=folder)
    log = tmp_path / "daemon.log"
    daemon = subprocess.Popen(daemon_cmd("--config", str(config)), stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                              stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        beat = wait_for(lambda: [r for r in poll_query(db, "SELECT * FROM heartbeats WHERE detail LIKE "
                                                           "'%pass finished%' ORDER BY id DESC LIMIT 1")],
                        90, "a finished pass")[0]
        errors = json.loads(beat["detail"])["last_pass"]["policy_errors"]
        assert [e["file"] for e in errors] == [str(folder / "jam.toml")]
        assert errors[0]["error"].startswith("skipped: not a regular file")
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert query(db, "SELECT state FROM heartbeats ORDER BY id DESC LIMIT 1")[0]["state"] == "stopped"
    assert "policy skipped: " in log.read_text() and "not a regular file" in log.read_text()


# --- 6. huge values are never echoed whole --------------------------------------------------------


def test_a_huge_bad_value_is_quoted_short(tmp_path):
    path = policy_file(tmp_path, "huge", text='name = "huge"\nworkload = "mlp"\nbatch_size = "' + "A" * 500_000 + '"\n')
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    (problem,) = err.value.problems
    assert problem.key == "batch_size" and "500,002 chars" in problem.found
    assert len(str(err.value)) < 1000

    many = policy_file(tmp_path, "many", text=GOOD.format(name="many", workload="mlp")
                       + "".join(f"unknown_{i} = {i}\n" for i in range(5000)))
    with pytest.raises(PolicyError) as err:
        load_policy(many)
    assert len(err.value.problems) == 21 and err.value.problems[-1].found == "4980 more"
    assert str(err.value).startswith("5000 problems:") and len(str(err.value)) < 20_000

    big = policy_file(tmp_path, "big", text="# " + "x" * 1_500_000 + "\n" + GOOD.format(name="big", workload="mlp"))
    with pytest.raises(PolicyError, match=r"too large \(1,500,0\d\d bytes") as err:
        load_policy(big)
    assert len(str(err.value)) < 500


def test_heartbeats_stay_small_whatever_the_detail(db):
    write_heartbeat(db, "idle", {"doing": "x" * 2_000_000, "hostname": "h", "errors": ["e" * 10_000] * 10_000,
                                 "nested": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}}})
    stored = db.execute("SELECT detail FROM heartbeats").fetchone()[0]
    assert len(stored) <= 32_000
    detail = latest_heartbeat(db)["detail"]
    assert detail["hostname"] == "h" and detail["doing"].endswith("(2,000,000 chars)")


def test_daemon_log_and_heartbeats_stay_small_with_many_huge_bad_files(tmp_path):
    db = tmp_path / "j.db"
    folder = tmp_path / "policies"
    for i in range(30):
        policy_file(folder, f"bad{i:02d}", text=f'name = "bad{i}"\nworkload = "mlp"\nbatch_size = "'
                    + "B" * 100_000 + '"\n')
    config = write_daemon_config(tmp_path / "daemon.toml", db=db, policies=folder)
    code, summary, stderr = daemon_once(config)
    assert code == 1 and len(summary["policy_errors"]) == 30
    assert len(json.dumps(summary)) < 60_000 and len(stderr) < 60_000
    beats = query(db, "SELECT detail FROM heartbeats")
    assert beats and max(len(b["detail"]) for b in beats) < 16_000
    last = json.loads(beats[-1]["detail"])["last_pass"]
    assert len(last["policy_errors"]) == 10 and last["policy_errors_total"] == 30


# --- 7. workloads that cannot exist ---------------------------------------------------------------


def test_policy_check_refuses_workloads_that_cannot_exist(tmp_path):
    marker = tmp_path / "imported.txt"
    marker_module(tmp_path, "mymodels", marker)
    cases = {
        "typo": ("mlpp", ["is not a built-in", "did you mean 'mlp'?"]),
        "nomodule": ("no_such_models_pkg.zoo:build", ["module 'no_such_models_pkg.zoo' is not importable"]),
        "nofactory": (f"{tmp_path / 'mymodels.py'}:biuld", ["has no attribute 'biuld'", "did you mean 'build'?"]),
        "nofile": (f"{tmp_path / 'absent.py'}:build", ["absent.py does not exist"]),
    }
    runner = CliRunner()
    for name, (workload, messages) in cases.items():
        path = policy_file(tmp_path, name, workload)
        result = runner.invoke(main, ["policy", "check", str(path)])
        assert result.exit_code == 1, result.output
        assert "workload: expected a workload that exists here" in result.output
        assert all(m in result.output for m in messages), result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)

    ok = policy_file(tmp_path, "ok", f"{tmp_path / 'mymodels.py'}:build")
    result = runner.invoke(main, ["policy", "check", "--json", str(ok)])
    assert result.exit_code == 0 and json.loads(result.output)[0]["ok"] is True
    assert not marker.exists(), "policy check imported the workload module"

    # A library that is not installed here is a warning for check (this may not be the GPU host)...
    lib = policy_file(tmp_path, "lib", "timm:resnet18")
    result = runner.invoke(main, ["policy", "check", str(lib)])
    if importlib.util.find_spec("timm") is None:
        assert result.exit_code == 0 and "warning: workload:" in result.output and "pip install timm" in result.output


def test_daemon_skips_policies_whose_workload_cannot_exist(tmp_path):
    folder = tmp_path / "policies"
    policy_file(folder, "good")
    typo = policy_file(folder, "typo", "mlpp")
    missing = policy_file(folder, "missing", "no_such_models_pkg.zoo:build")
    policies, errors = load_policy_folders([folder])
    assert [p.name for p in policies] == ["good"]
    by_file = {e["file"]: e["error"] for e in errors}
    assert set(by_file) == {str(typo), str(missing)}
    assert "workload: expected a workload that exists here" in by_file[str(typo)]
    assert "did you mean 'mlp'?" in by_file[str(typo)]
    assert "'no_such_models_pkg.zoo' is not importable" in by_file[str(missing)]


# --- 10. files that are not UTF-8, or nest too deeply ---------------------------------------------


@pytest.mark.parametrize("content, message", [
    (GOOD.format(name="u16", workload="mlp").encode("utf-16"), "UTF-16 text (byte-order mark)"),
    (b'name = "caf\xe9"\nworkload = "mlp"\nbatch_size = 8\n', "byte 0xe9 at line 1 that is not UTF-8"),
    (("a = " + "[" * 5000 + "]" * 5000 + "\n").encode(), "nested at most 16 deep"),
    (("a = " + "[" * 40 + "]" * 40 + "\n").encode(), "nested at most 16 deep"),
], ids=["utf16", "invalid-utf8", "nested-5000", "nested-40"])
def test_unreadable_policy_files_get_one_clean_line_everywhere(tmp_path, content, message):
    path = tmp_path / "p.toml"
    path.write_bytes(content)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(path) in str(err.value) and message in str(err.value)
    if "UTF" in message:
        assert "save it as UTF-8" in str(err.value)
    runner = CliRunner()
    for args in (["policy", "check", str(path)], ["policy", "explain", str(path), "--db", str(tmp_path / "j.db")],
                 ["policy", "lock", str(path), "--db", str(tmp_path / "j.db")],
                 ["frontier", "mlp", "--policy", str(path), "--db", str(tmp_path / "j.db")]):
        result = runner.invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.output and "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.format(name="bom", workload="mlp").encode())
    assert load_policy(path).name == "bom"


# --- 12. checking a spec runs none of its code ----------------------------------------------------


def test_check_spec_executes_no_user_code(tmp_path, monkeypatch):
    marker = tmp_path / "imported.txt"
    marker_module(tmp_path, "flatmodels", marker)
    package = tmp_path / "zoo"
    package.mkdir()
    (package / "__init__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('pkg')\n")
    marker_module(package, "vision", marker, body="model_factory = build\nNOT_A_FACTORY = 3")
    monkeypatch.chdir(tmp_path)

    check_spec("flatmodels:build")
    check_spec(f"{tmp_path / 'flatmodels.py'}:build")
    check_spec("zoo.vision:build")
    check_spec("zoo.vision:model_factory")
    with pytest.raises(WorkloadError, match=r"'NOT_A_FACTORY' in module 'zoo.vision' is not callable \(in .*vision\.py"):
        check_spec("zoo.vision:NOT_A_FACTORY")
    with pytest.raises(WorkloadError, match="module 'zoo.nope' is not importable"):
        check_spec("zoo.nope:build")
    assert not marker.exists() and "flatmodels" not in sys.modules and "zoo" not in sys.modules


def test_bench_survives_a_workload_module_that_exits_at_import(tmp_path, fake_worker):
    # the fake worker (the real one with eager calls; nothing here compiles): its zygote and its fresh worker
    # import the module as the real ones do
    (tmp_path / "hostile.py").write_text("import os\nos._exit(7)\n\ndef build(batch_size=1):\n    pass\n")
    proc = cli("bench", f"{tmp_path / 'hostile.py'}:build", "--modes", "eager", "--device", "cpu",
               "--min-seconds", "0.1", "--db", str(tmp_path / "j.db"), "--json", timeout_s=300)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    (run,) = json.loads(proc.stdout)
    assert run["status"] == "failed" and "exited with code 7" in run["reason"] and "during load" in run["reason"]
    assert query(tmp_path / "j.db", "SELECT status FROM runs") == [{"status": "failed"}]
