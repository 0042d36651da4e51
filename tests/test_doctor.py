"""`joulepilot doctor`: every graph break with its place in the code, its reason and a fix; the graphs;
recompiles with the guard that failed; the share of forward time outside compiled graphs. And the same
breaks counted by `bench`, summarised by `bench`, `policy explain` and reports.

The models are small plain-torch files written by the tests. Dynamo runs in front of its "eager" backend
(`--backend eager`): the breaks are Dynamo's, and Inductor would only add compile time."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from decision_factories import seed_runs, write_policy
from joulepilot.compiler import CompileConfig, inductor, load_workload, runner, workload_id
from joulepilot.compiler.doctor import analyse_model
from joulepilot.compiler.graph_breaks import break_summary, doctor_command
from joulepilot.compiler.provenance import cpu_name, provenance
from joulepilot.compiler.worker import run_job
from joulepilot.controller.report import build_report, render
from joulepilot.controller.report_markdown import md
from joulepilot.store import insert_run, open_db, upsert_config, upsert_host, upsert_workload
from joulepilot.store.deployments import insert_samples, register_deployment

from joulepilot.cli import main

real_run_worker_job = runner.run_worker_job

BREAKING_MODEL = '''"""A model with two graph breaks: a print() and a branch on a tensor's value."""
import torch
from torch import nn


class PrintAndBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x = self.linear(x)
        print("", end="")  # break: print
        if x.sum() > 0:  # break: branch
            x = x * 2
        return torch.relu(x) + 1


def make(batch_size=1):
    return PrintAndBranch(), (torch.randn(batch_size, 8),)
'''

CLEAN_MODEL = '''import torch
from torch import nn


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x)) + 1


def make(batch_size=1):
    return Clean(), (torch.randn(batch_size, 8),)
'''

# A print before any tensor work, then a print inside a loop: the first break has no graph before it, and
# the second makes Dynamo give up on the rest of the function; no graph is compiled at all.
GRAPHLESS_MODEL = '''import torch
from torch import nn


class PrintFirstAndInLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        print("", end="")  # break: first
        x = self.linear(x)
        for i in range(2):
            print("", end="")  # break: loop
            x = x + i
        return x


def make(batch_size=1):
    return PrintFirstAndInLoop(), (torch.randn(batch_size, 8),)
'''

RECOMPILING_MODEL = '''import torch
from torch import nn


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # guard: calls
        return self.linear(x) * self.calls


def make(batch_size=1):
    return CountsCalls(), (torch.randn(batch_size, 8),)
'''


def _write(folder: Path, text: str, name: str = "model.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def _line(path: Path, marker: str) -> tuple[int, str]:
    """(line number, stripped source) of the line carrying `# marker`."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if f"# {marker}" in line:
            return number, line.strip()
    raise AssertionError(f"no line marked {marker!r} in {path}")


@pytest.fixture
def fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def _analyse(path: Path) -> dict:
    workload = load_workload(f"{path}:make")
    return analyse_model(workload.model, workload.example_inputs, backend="eager", profile_calls=5,
                         profile_min_s=0.05)


@pytest.fixture(scope="module")
def doctored(tmp_path_factory):
    """`joulepilot doctor model.py:make --backend eager --json`, run once (a real worker process), with what its
    worker returned (`worker_result`), for the text test to give the same command again."""
    path = _write(tmp_path_factory.mktemp("doctor"), BREAKING_MODEL)
    returned: list[dict] = []

    def recording(job, **kwargs):
        result = real_run_worker_job(job, **kwargs)
        returned.append(copy.deepcopy(result))
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "run_worker_job", recording)
        result = CliRunner().invoke(main, ["doctor", f"{path}:make", "--backend", "eager", "--device", "cpu",
                                           "--json"])
    assert result.exit_code == 0, (result.output, result.stderr)
    (worker_result,) = returned
    return {"path": path, "found": json.loads(result.stdout), "stderr": result.stderr, "worker_result": worker_result}


def test_doctor_names_the_print_and_the_branch(doctored):
    path, found = doctored["path"], doctored["found"]
    print_line, print_source = _line(path, "break: print")
    branch_line, branch_source = _line(path, "break: branch")
    breaks = found["graph_breaks"]
    assert [(b["file"], b["line"], b["function"], b["source"]) for b in breaks] == [
        (str(path), print_line, "forward", print_source), (str(path), branch_line, "forward", branch_source)]
    for item in breaks:
        assert {"reason", "file", "line", "function", "source", "hint"} <= set(item)
        assert item["reason"] and item["hint"]
    printed, branch = breaks
    assert "print" in printed["reason"] and "torch.compiler.is_compiling()" in printed["hint"]
    assert "data-dependent" in branch["reason"].lower()
    assert "torch.where" in branch["hint"] and "torch.cond" in branch["hint"]


def test_doctor_json_has_graphs_recompiles_and_eager_time(doctored):
    found = doctored["found"]
    # two breaks split forward into three graphs: linear, the branch's condition, relu + 1
    assert found["graph_count"] == len(found["graphs"]) == len(found["graph_breaks"]) + 1
    for graph in found["graphs"]:
        assert graph["ops"] >= 1 and graph["function"] == "forward" and graph["file"] == str(doctored["path"])
        assert graph["calls"] == found["profiled_calls"] and graph["time_ms"] > 0
    assert found["recompiles"] == [] and found["recompile_count"] == 0
    assert 0.0 < found["eager_time_fraction"] < 1.0  # the print and the branch run outside the graphs
    assert found["forward_ms"] > found["graph_ms"] > 0
    assert found["spec"] == f"{doctored['path']}:make" and found["device"] == "cpu" and found["backend"] == "eager"
    assert found["command"] == doctor_command(found["spec"])
    assert "[1/1]" in doctored["stderr"] and "graph break(s)" in doctored["stderr"]


def test_doctor_text_names_both_lines_with_their_fixes(doctored, monkeypatch):
    # The same command without --json; its worker's analysis is the one the JSON tests read (the worker process,
    # whose start is most of the cost, is theirs): this test is about the text made of it.
    path = doctored["path"]
    jobs = []

    def replay(job, **_):
        jobs.append(job)
        return copy.deepcopy(doctored["worker_result"])

    monkeypatch.setattr(runner, "run_worker_job", replay)
    result = CliRunner().invoke(main, ["doctor", f"{path}:make", "--backend", "eager", "--device", "cpu"])
    assert [(j["kind"], j["spec"], j["backend"]) for j in jobs] == [("doctor", f"{path}:make", "eager")]
    assert result.exit_code == 0, (result.output, result.stderr)
    out = result.stdout
    for marker in ("break: print", "break: branch"):
        number, source = _line(path, marker)
        assert f"model.py:{number} in forward" in out
        assert source in out
    assert "fix: move the print() out of forward" in out and "torch.cond" in out
    assert "breaks     2" in out and "graphs     3" in out and "of forward time outside compiled graphs" in out


def test_a_clean_model_has_no_breaks(tmp_path, fresh_dynamo):
    found = _analyse(_write(tmp_path, CLEAN_MODEL))
    assert found["graph_breaks"] == [] and found["graph_break_count"] == 0
    assert found["graph_count"] == 1 and found["recompiles"] == []
    assert found["graphs"][0]["ops"] >= 3  # linear, relu, add


def test_breaks_that_compile_no_graph_are_found(tmp_path, fresh_dynamo):
    """Counting graphs (torch._dynamo.explain, and bench before the doctor) misses breaks with no graph
    around them; the doctor lists both, and says the function runs eagerly."""
    path = _write(tmp_path, GRAPHLESS_MODEL)
    workload = load_workload(f"{path}:make")
    explained = torch._dynamo.explain(workload.model)(*workload.example_inputs)
    torch._dynamo.reset()
    found = _analyse(path)
    lines = [b["line"] for b in found["graph_breaks"]]
    assert lines == [_line(path, "break: first")[0], _line(path, "break: loop")[0]]
    assert explained.graph_break_count < len(lines)
    first, loop = found["graph_breaks"]
    assert not first["falls_back_to_eager"] and loop["falls_back_to_eager"]
    assert "whole function eagerly" in loop["hint"]
    assert found["graph_count"] == 0 and found["eager_time_fraction"] == 1.0


def test_recompiles_name_the_guard_that_failed(tmp_path, fresh_dynamo):
    path = _write(tmp_path, RECOMPILING_MODEL)
    found = _analyse(path)
    assert found["recompile_count"] >= 1 and found["graph_breaks"] == []
    first = found["recompiles"][0]
    assert first["function"] == "forward" and first["file"] == str(path)
    assert "self.calls" in first["guard"] and first["source"] == _line(path, "guard: calls")[1].split("#")[0].strip()
    assert first["hint"]
    # the counter changes on every call, so Dynamo reaches its recompile limit and runs forward eagerly
    assert [hit["function"] for hit in found["recompile_limit_hit"]] == ["forward"]
    assert found["eager_time_fraction"] == 1.0


REPEATING_MODEL = '''import torch
from torch import nn


class PrintsEveryRecompile(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = self.linear(x) * self.calls
        print("", end="")  # break: repeated
        return x + 1


def make(batch_size=1):
    return PrintsEveryRecompile(), (torch.randn(batch_size, 8),)
'''


def test_a_break_met_again_is_listed_once(tmp_path, fresh_dynamo):
    """Each recompile meets the print again; Dynamo then logs it without its traceback, by place only."""
    from joulepilot.compiler.graph_breaks import recording_graph_breaks

    path = _write(tmp_path, REPEATING_MODEL)
    workload = load_workload(f"{path}:make")
    compiled = torch.compile(workload.model, backend="eager")
    with recording_graph_breaks() as recorder:
        for _ in range(3):
            compiled(*workload.example_inputs)
    assert [(b.line, b.function, b.kind, b.occurrences) for b in recorder.breaks] == [
        (_line(path, "break: repeated")[0], "forward", "print", 3)]


def _bench_job(spec: str) -> dict:
    return {"kind": "bench", "spec": spec, "device": "cpu", "config": CompileConfig(mode="default").to_row(),
            "min_seconds": 0.05, "warmup_max_s": 0.2, "latency_s": 0.05, "idle_power_w": {}, "sample_hz": 5.0}


@pytest.mark.parametrize("model", [BREAKING_MODEL, GRAPHLESS_MODEL], ids=["print_and_branch", "graphless"])
def test_bench_counts_the_breaks_the_doctor_lists(tmp_path, fresh_dynamo, monkeypatch, model):
    path = _write(tmp_path, model)
    listed = _analyse(path)["graph_breaks"]
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    monkeypatch.setattr(inductor, "torch_compile_kwargs", lambda config, device=None: {"backend": "eager"})
    result = run_job(_bench_job(f"{path}:make"))
    assert result["status"] == "ok", result.get("reason")
    assert result["graph_breaks"] == len(listed) == 2
    stored = result["extra"]["graph_breaks"]
    assert [(b["file"], b["line"], b["reason"]) for b in stored] == [(b["file"], b["line"], b["reason"])
                                                                     for b in listed]


def test_summary_names_each_break_and_the_doctor_command(tmp_path, fresh_dynamo):
    path = _write(tmp_path, BREAKING_MODEL)
    listed = _analyse(path)["graph_breaks"]
    command = doctor_command(f"{path}:make", 4)
    summary = break_summary(listed, command=command)
    print_line, branch_line = _line(path, "break: print")[0], _line(path, "break: branch")[0]
    assert summary == (f"2 graph breaks: print() at model.py:{print_line}; data-dependent branch at "
                       f"model.py:{branch_line} — run `joulepilot doctor {path}:make --batch-size 4`")
    assert break_summary([], 0) is None
    assert break_summary(None, 3) == "3 graph breaks"  # a run stored before places were recorded


@pytest.fixture(scope="module")
def recorded_breaks(tmp_path_factory):
    """The graph breaks of the breaking model, as bench stores them in a run's extra."""
    path = _write(tmp_path_factory.mktemp("recorded"), BREAKING_MODEL)
    torch._dynamo.reset()
    found = _analyse(path)
    torch._dynamo.reset()
    return found["graph_breaks"]


def test_bench_prints_a_summary_line_for_configurations_with_breaks(tmp_path, recorded_breaks):
    """A configuration already measured ok is not measured again: bench returns the stored run, and its
    summary line names the breaks stored with it."""
    db_path = tmp_path / "bench.db"
    spec = "mlp"
    config = CompileConfig(mode="default", batch_size=2)
    origin = provenance("cpu", name=cpu_name())
    database = open_db(db_path)
    try:
        host = upsert_host(database)
        wid = upsert_workload(database, {"id": workload_id(spec, 2), "spec": spec, "batch_size": 2})
        upsert_config(database, config.to_row())
        now = time.time()
        insert_run(database, {"workload_id": wid, "config_id": config.id, "host_id": host, "device": "cpu",
                              "status": "ok", "started_at": now, "finished_at": now + 1, "compile_s": 1.0,
                              "latency_ms_p50": 1.0, "latency_ms_p95": 1.1, "energy_j_per_inference": 0.01,
                              "energy_source": "estimate", "graph_breaks": len(recorded_breaks),
                              "extra": {"graph_breaks": recorded_breaks},
                              **{k: origin[k] for k in ("provenance_key", "torch_version", "device_name")}})
    finally:
        database.close()
    result = CliRunner().invoke(main, ["bench", spec, "--modes", "default", "--batch-size", "2", "--device", "cpu",
                                       "--db", str(db_path)])
    assert result.exit_code == 0, (result.output, result.stderr)
    expected = break_summary(recorded_breaks, command="joulepilot doctor mlp --batch-size 2")
    assert f"graph breaks in {config.label}: {expected}" in result.stdout.splitlines()


def test_policy_explain_summarises_the_breaks_of_measured_candidates(tmp_path, db, recorded_breaks):
    from decision_factories import db_file

    seed_runs(db, {("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 0.2},
                   ("default", "fp32"): {"energy_j_per_inference": 0.01, "avg_power_w": 0.2, "graph_breaks": 2,
                                         "extra": {"graph_breaks": recorded_breaks}}})
    policy = write_policy(tmp_path / "policies", limit_w=100.0)
    runner = CliRunner(env={"COLUMNS": "400"})
    text = runner.invoke(main, ["policy", "explain", str(policy), "--db", db_file(db)])
    assert text.exit_code == 0, text.output
    expected = break_summary(recorded_breaks, command="joulepilot doctor mlp --batch-size 8")
    label = CompileConfig(mode="default", batch_size=8).label
    assert f"breaks     {label}: {expected}" in text.stdout.splitlines()
    data = json.loads(runner.invoke(main, ["policy", "explain", str(policy), "--db", db_file(db), "--json"]).stdout)
    assert [(n["labels"], n["graph_breaks"], n["summary"]) for n in data["graph_breaks"]] == [([label], 2, expected)]


def test_report_shows_the_breaks_of_the_served_configuration(db, recorded_breaks):
    served = CompileConfig(mode="default", batch_size=8)
    host = upsert_host(db)
    wid = upsert_workload(db, {"id": workload_id("mlp", 8), "spec": "mlp", "batch_size": 8})
    upsert_config(db, served.to_row())
    insert_run(db, {"workload_id": wid, "config_id": served.id, "host_id": host, "device": "cpu", "status": "ok",
                    "started_at": 1_700_000_000.0, "energy_j_per_inference": 0.01, "energy_source": "estimate",
                    "graph_breaks": 2, "extra": {"graph_breaks": recorded_breaks}})
    dep = register_deployment(db, "svc", workload_id=wid, config_id=served.id, host_id=host, device="cpu")
    insert_samples(db, dep, [{"t_start": 1_700_000_100.0, "t_end": 1_700_000_101.0, "energy_j": 1.0,
                              "inferences": 100, "avg_power_w": 1.0, "peak_power_w": 1.2,
                              "energy_source": "estimate", "config_id": served.id}])
    report = build_report(db, "svc")
    expected = break_summary(recorded_breaks, command="joulepilot doctor mlp --batch-size 8")
    assert report.configuration.graph_breaks == 2 and report.configuration.graph_break_summary == expected
    assert any(expected in note for note in report.notes)
    assert md(expected) in render(report, "md") and expected in render(report, "html")
    assert json.loads(render(report, "json"))["configuration"]["graph_break_summary"] == expected


def test_bad_spec_and_device_are_one_line_errors(tmp_path):
    missing = CliRunner().invoke(main, ["doctor", str(tmp_path / "nothing.py") + ":make", "--backend", "eager"])
    assert missing.exit_code == 1 and "Traceback" not in missing.output
    assert len(missing.stderr.strip().splitlines()) == 1 and "nothing.py" in missing.stderr
    if not torch.cuda.is_available():
        gpu = CliRunner().invoke(main, ["doctor", "mlp", "--device", "cuda:0"])
        assert gpu.exit_code == 1 and "--device cpu" in gpu.stderr


@pytest.mark.slow
def test_bench_with_inductor_counts_and_summarises_the_breaks(tmp_path):
    """End to end with a real Inductor compile: the run stores both places and bench prints the line."""
    path = _write(tmp_path, BREAKING_MODEL)
    spec = f"{path}:make"
    result = CliRunner().invoke(main, ["bench", spec, "--modes", "default", "--device", "cpu", "--min-seconds", "0.1",
                                       "--no-warm-start", "--db", str(tmp_path / "b.db")])
    assert result.exit_code == 0, (result.output, result.stderr)
    print_line, branch_line = _line(path, "break: print")[0], _line(path, "break: branch")[0]
    label = CompileConfig(mode="default").label
    assert (f"graph breaks in {label}: 2 graph breaks: print() at model.py:{print_line}; data-dependent branch at "
            f"model.py:{branch_line} — run `{doctor_command(spec)}`") in result.stdout.splitlines()


SLOW_LOADING_MODEL = '''import os
import sys
import time

import torch
from torch import nn


def make(batch_size=1):
    with open(os.environ["DOCTOR_TEST_MARKER"], "w") as marker:
        marker.write(str(os.getpid()))
    time.sleep(120)
    return nn.Linear(8, 8), (torch.randn(batch_size, 8),)
'''


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_doctor_kills_its_worker_and_removes_its_scratch_folder(tmp_path):
    """SIGTERM (systemd, a job runner's timeout) unwinds like Ctrl-C: the worker dies and no scratch folder is
    left behind; the process exits 143 without a traceback."""
    import os
    import signal
    import subprocess
    import sys

    path = _write(tmp_path / "model", SLOW_LOADING_MODEL)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    marker = tmp_path / "worker.pid"
    env = {**os.environ, "TMPDIR": str(scratch), "DOCTOR_TEST_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, "-m", "joulepilot", "doctor", f"{path}:make", "--backend", "eager",
                             "--device", "cpu"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not (marker.is_file() and marker.read_text()) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        worker_pid = int(marker.read_text())
        assert [p.name for p in scratch.iterdir() if p.name.startswith("joulepilot-run-")]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err.decode() and out.decode() == ""
    deadline = time.time() + 5
    while _alive(worker_pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(worker_pid)
    assert [p.name for p in scratch.iterdir() if p.name.startswith("joulepilot-run-")] == []


SLOW_FORWARD_MODEL = '''import time

import torch
from torch import nn


class SlowForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(0.15)  # seconds a call, as a large model's forward on a CPU
        return self.linear(x)


def make(batch_size=1):
    return SlowForward(), (torch.randn(batch_size, 8),)
'''


# the slow model sleeps in its forward, which Dynamo (the doctor traces it) says it cannot trace: a graph break
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin `time.sleep:UserWarning")
def test_the_profile_of_a_slow_model_stops_at_its_time_limit(tmp_path, fresh_dynamo):
    """Ten profiled calls of a model that takes seconds a call would outlast the worker's allowance, and the
    kill would lose the breaks already found: past its time limit the profile starts no further call."""
    workload = load_workload(f"{_write(tmp_path, SLOW_FORWARD_MODEL)}:make")
    found = analyse_model(workload.model, workload.example_inputs, backend="eager", profile_calls=10,
                          profile_min_s=0.05, profile_max_s=0.2)
    assert 1 <= found["profiled_calls"] <= 2  # the call that crossed 0.2 s is the last
    assert found["forward_ms"] >= 150 and found["eager_time_fraction"] > 0.5


@pytest.mark.parametrize("option, value", [("--batch-size", "0"), ("--seq-len", "-5"),
                                           ("--seq-len", "99999999999999999999"), ("--image-size", "2097152")])
def test_sizes_out_of_range_are_refused_naming_the_option_before_a_worker_starts(monkeypatch, option, value):
    started = []
    monkeypatch.setattr(runner, "run_worker_job", lambda job, **_: started.append(job) or {"status": "ok"})
    result = CliRunner().invoke(main, ["doctor", "transformer", "--backend", "eager", "--device", "cpu", option, value])
    assert result.exit_code == 1 and started == [] and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: {option}: {value} is not in the range 1<=x<=1048576; give a whole number from 1 to 1,048,576"]
