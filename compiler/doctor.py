"""Why `torch.compile` did not pay for a model: its graph breaks, graphs, recompiles and eager time.

`doctor(spec, ...)` runs the analysis in a worker process of its own, like `bench` (a job of kind
"doctor", under the same budget model), and returns what `analyse_model` found there:

- graph_breaks: every place in the model's code where Dynamo breaks the graph, with Dynamo's reason,
  the file, line, function and source line, and a fix for known causes (see `graph_breaks.py`); taken
  over the first call, as `bench` counts them;
- graphs: each graph Dynamo compiled, its size (ops), the code lines it covers, and its share of the
  profiled time;
- recompiles: each recompilation over the calls made, with the guard that failed;
- eager_time_fraction: the share of forward time spent outside compiled graphs, from torch.profiler
  ranges around each forward call and each compiled graph's call (on a GPU, each range ends with a
  device synchronisation so that it covers the kernels it launched).

The model is compiled with Dynamo in front of `backend` (Inductor by default; "eager" finds the same
breaks without Inductor's compile time), in fp32, with the workload's example inputs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .graph_breaks import doctor_command, recording_graph_breaks

GRAPH_RANGE_PREFIX = "joulepilot.graph."
FORWARD_RANGE = "joulepilot.forward"
BACKENDS = ("inductor", "eager")
DEFAULT_PROFILE_CALLS = 10
DEFAULT_PROFILE_MIN_S = 0.5
PROFILE_CALLS_MAX = 500  # enough for a steady share; more only makes the profile slow to read
# The profile of a slow model (seconds a call on a CPU) stops after this long, at least one call in: ten calls
# of it could outlast the worker's allowance, and a kill then would lose the breaks already found.
PROFILE_MAX_S = 30.0
WARM_CALLS = 2
WARM_CALLS_MAX = 32  # above Dynamo's recompile limit (8), so a model that recompiles on every call settles
RECOMPILES_LISTED = 20
_RECOMPILE_PREFIX = re.compile(r"^\s*\d+/\d+:\s*")
_RECOMPILE_HINT = re.compile(r"\(HINT:\s*(?P<hint>.+?)\)\s*$", re.DOTALL)


class DoctorError(RuntimeError):
    """The analysis could not run (the worker failed, overran its budget, or was stopped); the message
    says why in one line."""


@dataclass
class GraphInfo:
    """One graph Dynamo compiled."""

    index: int
    function: str | None
    file: str | None
    first_line: int | None
    last_line: int | None
    ops: int  # calls of functions, methods and modules in the graph
    calls: int = 0  # calls while profiling
    time_ms: float = 0.0  # time inside the graph while profiling, over all calls

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _node_frames(gm: Any) -> list[dict[str, Any]]:
    """For each node of a graph with a stack trace, the user frame it was traced from."""
    from .graph_breaks import stack_frames, user_frame

    found = []
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") if hasattr(node, "meta") else None
        frame = user_frame(stack_frames(trace or ""))
        if frame is not None:
            found.append(frame)
    return found


def _graph_place(frames: list[dict[str, Any]]) -> tuple[str | None, str | None, int | None, int | None]:
    """(function, file, first line, last line) of the user code a graph was traced from: the file most of
    its nodes come from."""
    from .graph_breaks import function_name

    if not frames:
        return None, None, None, None
    files = [f["file"] for f in frames]
    file = max(dict.fromkeys(files), key=files.count)
    mine = [f for f in frames if f["file"] == file]
    lines = [f["line"] for f in mine]
    return function_name(mine[-1]["function"]), file, min(lines), max(lines)


class GraphTimer:
    """A Dynamo backend that hands each graph to `backend` and runs the compiled graph inside a profiler
    range named GRAPH_RANGE_PREFIX + its index, so the profile tells graph time from the rest."""

    def __init__(self, backend: str | Callable[..., Any], sync: Callable[[], None]) -> None:
        import torch._dynamo

        self.inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
        self.sync = sync
        self.graphs: list[GraphInfo] = []

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        import torch

        index = len(self.graphs)
        function, file, first, last = _graph_place(_node_frames(gm))
        ops = sum(1 for node in gm.graph.nodes if node.op in ("call_function", "call_method", "call_module"))
        self.graphs.append(GraphInfo(index=index, function=function, file=file, first_line=first, last_line=last,
                                     ops=ops))
        compiled = self.inner(gm, example_inputs)
        label = f"{GRAPH_RANGE_PREFIX}{index}"
        sync = self.sync

        def run(*args: Any) -> Any:
            sync()
            with torch.profiler.record_function(label):
                out = compiled(*args)
                sync()
            return out

        return run


def _metrics_now() -> list[Any]:
    from torch._dynamo.utils import get_compilation_metrics

    return get_compilation_metrics()


def _recompile_hint(guard: str) -> str:
    if "size mismatch" in guard or "stride mismatch" in guard:
        return ("an input's shape changed: mark that dimension dynamic (torch._dynamo.mark_dynamic(x, dim), or "
                "compile with dynamic=True), or pad inputs to a few fixed sizes")
    if "dtype mismatch" in guard or "device mismatch" in guard:
        return "an input's dtype or device changed between calls: keep it fixed"
    if "==" in guard or "id_match" in guard or "___check_obj_id" in guard:
        return ("a Python value or object the model reads changed between calls (guards treat them as constants): "
                "keep it fixed, or make it a tensor")
    return "see the guard: the value it checks changed between calls"


def _frame_of(metric: Any) -> dict[str, Any]:
    """The function a compilation was for: from its metrics, else from the user stack in its reason."""
    from .graph_breaks import function_name

    if metric.co_name:
        return {"function": function_name(metric.co_name), "file": metric.co_filename,
                "line": metric.co_firstlineno}
    found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(metric.recompile_reason or ""))
    if found:
        file, line, name = found[-1]
        return {"function": function_name(name), "file": file, "line": int(line)}
    return {"function": None, "file": None, "line": None}


def _recompile(metric: Any) -> dict[str, Any]:
    """One recompilation: where, the guard that failed (and the source line it guards), a fix."""
    text = str(metric.recompile_reason or "")
    first = _RECOMPILE_PREFIX.sub("", text.strip().splitlines()[0] if text.strip() else "")
    dynamo_hint = _RECOMPILE_HINT.search(first)
    check = first[: dynamo_hint.start()] if dynamo_hint else first
    guard, _, comment = check.partition("#")
    return {**_frame_of(metric), "guard": re.sub(r"\s+", " ", guard).strip(),
            "source": comment.split("#")[0].strip() or None,
            "compile_id": str(metric.compile_id) if metric.compile_id is not None else None,
            "hint": dynamo_hint.group("hint").strip() if dynamo_hint else _recompile_hint(guard)}


def _gave_up(metric: Any) -> dict[str, Any] | None:
    """A function Dynamo stopped compiling because it hit its recompile limit (it then runs eagerly)."""
    reason = str(getattr(metric, "fail_reason", None) or "")
    if "recompile limit" not in reason.lower() and "cache_size_limit" not in reason:
        return None
    return {**_frame_of(metric), "reason": reason.strip().splitlines()[0]}


def _frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def _warm_up(call: Callable[[], Any], sync: Callable[[], None]) -> int:
    """Call until a call compiles nothing new (recompiles settle, or Dynamo gives up at its limit), so the
    profile that follows times running, not compiling; returns the calls made."""
    calls = 0
    while calls < WARM_CALLS_MAX:
        before = _frames_compiled()
        call()
        sync()
        calls += 1
        if calls >= WARM_CALLS and _frames_compiled() == before:
            break
    return calls


def _profile(call: Callable[[], Any], sync: Callable[[], None], graphs: list[GraphInfo], *, min_calls: int,
             min_s: float, max_s: float = PROFILE_MAX_S) -> dict[str, Any]:
    """Forward and graph time over at least `min_calls` calls and `min_s` seconds, from torch.profiler; past
    `max_s`, no further call is started (one call at least is profiled)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    calls = 0
    started = time.perf_counter()

    def more() -> bool:
        elapsed = time.perf_counter() - started
        if calls >= PROFILE_CALLS_MAX or (calls >= 1 and elapsed >= max_s):
            return False
        return calls < min_calls or elapsed < min_s

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while more():
            with record_function(FORWARD_RANGE):
                call()
                sync()
            calls += 1
    forward_us = 0.0
    graph_us: dict[int, float] = {}
    graph_calls: dict[int, int] = {}
    for event in prof.events():
        if event.name == FORWARD_RANGE:
            forward_us += event.time_range.elapsed_us()
        elif event.name.startswith(GRAPH_RANGE_PREFIX):
            index = int(event.name[len(GRAPH_RANGE_PREFIX):])
            graph_us[index] = graph_us.get(index, 0.0) + event.time_range.elapsed_us()
            graph_calls[index] = graph_calls.get(index, 0) + 1
    for graph in graphs:
        graph.calls = graph_calls.get(graph.index, 0)
        graph.time_ms = graph_us.get(graph.index, 0.0) / 1000.0
    inside = sum(graph_us.values())
    fraction = None if forward_us <= 0 else min(1.0, max(0.0, (forward_us - inside) / forward_us))
    return {"eager_time_fraction": fraction, "profiled_calls": calls,
            "forward_ms": forward_us / 1000.0 / calls if calls else None,
            "graph_ms": inside / 1000.0 / calls if calls else None}


def analyse_model(model: Any, inputs: tuple, *, device: str = "cpu", backend: str | Callable[..., Any] = "inductor",
                  profile_calls: int = DEFAULT_PROFILE_CALLS, profile_min_s: float = DEFAULT_PROFILE_MIN_S,
                  profile_max_s: float = PROFILE_MAX_S, phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Compile `model` (Dynamo in front of `backend`), call it with `inputs`, and report its graph breaks,
    graphs, recompiles and the share of forward time outside compiled graphs (see the module doc).

    Resets Dynamo's caches in this process first, so what is found belongs to this model alone."""
    import torch

    from .measure import synchronizer, timed_call
    from .worker import untraced

    phase = phase or (lambda _name: None)
    torch._dynamo.reset()
    sync = synchronizer(device)
    timer = GraphTimer(backend, sync)
    compiled = torch.compile(model, backend=timer)

    def forward() -> Any:
        with torch.no_grad():
            return compiled(*inputs)

    call = untraced(forward)
    known = {id(m) for m in _metrics_now()}
    # The warm-up's calls stay in the "compile" phase: a recompiling call compiles again, and the budget
    # of the compiling calls (budget.FIRST_CALL_PHASES) is the one that should bound them.
    phase("compile")
    with recording_graph_breaks() as recorder:
        _, compile_s = timed_call(call, sync)
    _warm_up(call, sync)
    phase("profiling")
    profiled = _profile(call, sync, timer.graphs, min_calls=profile_calls, min_s=profile_min_s, max_s=profile_max_s)
    new = [m for m in _metrics_now() if id(m) not in known]
    recompiles = [_recompile(m) for m in new if getattr(m, "recompile_reason", None)]
    gave_up = [found for found in (_gave_up(m) for m in new) if found is not None]
    return {
        "graph_breaks": recorder.to_list(),
        "graph_break_count": len(recorder.breaks),
        "graphs": [g.to_dict() for g in timer.graphs],
        "graph_count": len(timer.graphs),
        "recompiles": recompiles[:RECOMPILES_LISTED],
        "recompile_count": len(recompiles),
        "recompile_limit_hit": gave_up,
        "eager_time_fraction": profiled["eager_time_fraction"],
        "forward_ms": profiled["forward_ms"],
        "graph_ms": profiled["graph_ms"],
        "profiled_calls": profiled["profiled_calls"],
        "compile_s": compile_s,
        "backend": backend if isinstance(backend, str) else getattr(backend, "__name__", str(backend)),
    }


def run_doctor_job(job: dict[str, Any], phases: Any) -> dict[str, Any]:
    """The worker side of a "doctor" job: build the workload, then `analyse_model` it."""
    import torch

    from .workloads import load_workload

    phases.enter("load")
    workload = load_workload(job["spec"], batch_size=int(job.get("batch_size") or 1), device=job["device"],
                             seq_len=job.get("seq_len"), image_size=job.get("image_size"),
                             seed=int(job.get("seed", 1234)))
    found = analyse_model(workload.model, workload.example_inputs, device=job["device"],
                          backend=job.get("backend") or "inductor",
                          profile_calls=int(job.get("profile_calls") or DEFAULT_PROFILE_CALLS),
                          profile_min_s=float(job.get("profile_min_s") or DEFAULT_PROFILE_MIN_S),
                          phase=phases.enter)
    return {"status": "ok", "torch_version": torch.__version__, **found}


def check_doctor_args(spec: str, device: str | None, backend: str) -> str:
    """The device the analysis runs on ('cpu' or 'cuda:N'); WorkloadError or ConfigError, naming the fix,
    for a spec, device or backend the doctor cannot use. Nothing is built or run."""
    from .bench import check_device, default_device
    from .options import ConfigError
    from .workloads import check_spec, split_spec

    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r} is not one the doctor runs: use {' or '.join(BACKENDS)}")
    split_spec(spec)
    check_spec(spec)
    return check_device(device or default_device())


def doctor(spec: str, *, batch_size: int = 1, seq_len: int | None = None, image_size: int | None = None,
           device: str | None = None, backend: str = "inductor", budget_s: float = 600.0,
           profile_calls: int = DEFAULT_PROFILE_CALLS, on_phase: Callable[[str, str], None] | None = None
           ) -> dict[str, Any]:
    """Analyse `spec` in a fresh worker process and return what it found (see the module doc), with
    `spec`, `batch_size`, `seq_len`, `image_size`, `device`, `command` (this analysis as a command line).

    Raises WorkloadError for a spec that cannot be resolved, ConfigError for a bad device or backend, and
    DoctorError when the worker fails or overruns `budget_s` (its first, compiling call; see
    `joulepilot.compiler.budget`). `on_phase(kind, phase)` hears each phase the worker enters."""
    from .budget import worker_budget
    from .runner import remove_stale_workdirs, run_worker_job

    device = check_doctor_args(spec, device, backend)
    remove_stale_workdirs()
    job = {"kind": "doctor", "spec": spec, "device": device, "batch_size": int(batch_size), "seq_len": seq_len,
           "image_size": image_size, "backend": backend, "profile_calls": int(profile_calls)}
    result = run_worker_job(job, budget=worker_budget(budget_s, DEFAULT_PROFILE_MIN_S), on_phase=on_phase)
    if result.get("status") != "ok":
        reason = str(result.get("reason") or "the worker gave no reason").strip()
        raise DoctorError(f"doctor {spec}: {reason.splitlines()[0]}")
    for key in ("started_at", "finished_at", "status"):
        result.pop(key, None)
    return {"spec": spec, "batch_size": int(batch_size), "seq_len": seq_len, "image_size": image_size,
            "device": device, "command": doctor_command(spec, batch_size, seq_len, image_size), **result}
