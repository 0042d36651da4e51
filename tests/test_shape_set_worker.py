"""A configuration measured over a shape set: recompiles counted over the sizes, the recompile limit marked,
J per call weighted by the sizes' shares, padding to buckets.

The worker runs in this process (`worker.run_job`) on a small plain-torch model whose sequence length varies
(tests/shape_workloads.py). Its compiles are real Dynamo compiles (guards, recompiles, the recompile limit)
handed to Dynamo's own `eager` backend instead of Inductor, which would spend seconds generating C++ per size
on this machine: these tests are about how Dynamo meets the sizes, not about Inductor's code. The test marked
slow runs `bench` with Inductor in the real worker process (on a one-layer model, `build_linear`).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

import pytest
import torch
import torch._dynamo
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.compiler import CompileConfig, ConfigError, ShapeSet, bench, inductor
from joulepilot.compiler import worker as worker_mod
from joulepilot.compiler.budget import measure_allowance_s
from joulepilot.compiler.compile_meter import summed_compile_fields
from joulepilot.compiler.shapes import ShapeSetRun, _weighted_percentile, pad_like
from joulepilot.compiler.workloads import workload_id
from joulepilot.controller.tradeoff import training_samples
from joulepilot.store import (
    commit_run,
    compile_energy_text,
    complete_compile_energy_j,
    host_identity,
    ok_runs,
    open_db,
    run_columns,
)
from joulepilot.telemetry import EnergyMeter

SPEC = "tests.shape_workloads:build"
LINEAR_SPEC = "tests.shape_workloads:build_linear"


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch, tmp_path):
    """Each test starts with Dynamo's caches empty (a worker process would), compiles with the eager backend,
    and meters the CPU as an estimate (no powercap tree, no GPU)."""
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "no-powercap"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    real_kwargs = inductor.torch_compile_kwargs

    def dynamo_only(config, device=None):
        kwargs = real_kwargs(config, device)
        return {**kwargs, "backend": "eager"} if config.compiles else kwargs

    monkeypatch.setattr(inductor, "torch_compile_kwargs", dynamo_only)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def measure(shapes: ShapeSet, **config) -> dict:
    job = {"device": "cpu", "spec": SPEC, "min_seconds": 0.1, "warmup_max_s": 0.05, "latency_s": 0.02,
           "config": CompileConfig(mode=config.pop("mode", "default"), batch_size=2, **config).to_row(),
           "shapes": shapes.to_dict(), shapes.dim: shapes.sizes[0]}
    result = worker_mod.run_job(job)
    assert result["status"] == "ok", result.get("reason")
    return result


def per_size(result: dict, key: str) -> list:
    return [entry[key] for entry in result["extra"]["shapes"]["sizes"]]


def test_a_static_compile_recompiles_for_every_new_size():
    shapes = ShapeSet("seq_len", (5, 6, 7, 9))
    result = measure(shapes, dynamic=False)
    assert per_size(result, "size") == [5, 6, 7, 9]
    assert per_size(result, "compiled_frames") == [1, 1, 1, 1]
    assert result["recompiles"] == 3
    assert result["extra"]["shapes"]["recompile_limit_hit"] is False and "recompile_limit_hit" not in result["extra"]
    # the run's compile time is every size's first call
    assert result["compile_s"] == pytest.approx(sum(per_size(result, "first_call_s")))


def test_a_dynamic_compile_compiles_once_or_twice_for_the_whole_set():
    shapes = ShapeSet("seq_len", (5, 6, 7, 9))
    result = measure(shapes, dynamic=True)
    compiled = per_size(result, "compiled_frames")
    assert compiled[0] == 1 and sum(compiled) <= 2
    assert result["recompiles"] <= 1


def test_padding_to_buckets_leaves_fewer_shapes_to_compile():
    shapes = ShapeSet("seq_len", (5, 6, 7, 9, 12))
    plain = measure(shapes, dynamic=False)
    torch._dynamo.reset()
    padded = measure(shapes, dynamic=False, padding="buckets")
    assert per_size(padded, "run_size") == [8, 8, 8, 16, 16]
    assert padded["extra"]["shapes"]["distinct_run_sizes"] == 2
    assert per_size(padded, "compiled_frames") == [1, 0, 0, 1, 0]
    assert padded["recompiles"] == 1 < plain["recompiles"] == 4
    # the padded model is compared with eager on the same padded inputs
    assert all(err is not None and err < 1e-5 for err in per_size(padded, "max_rel_error"))


def test_a_configuration_that_hits_the_recompile_limit_is_marked():
    shapes = ShapeSet("seq_len", (5, 6, 7, 9))
    # config.patch, not monkeypatch.setattr: pytest >= 9.1 deletes the key on undo (it is not in the config
    # module's __dict__), after which torch says recompile_limit "does not exist" to every later compile
    with torch._dynamo.config.patch(recompile_limit=2):
        static = measure(shapes, dynamic=False)
        torch._dynamo.reset()
        dynamic = measure(shapes, dynamic=True)  # one compiled version serves every size: under the limit
    extra = static["extra"]
    assert extra["recompile_limit_hit"] is True and extra["shapes"]["recompile_limit"] == 2
    assert per_size(static, "recompile_limit_hit") == [False, False, True, False]
    assert per_size(static, "compiled_frames") == [1, 1, 0, 0]  # from the limit on, Dynamo compiles nothing
    assert "recompile limit (2) at seq_len 7" in extra["recompile_warning"]
    assert "recompile_limit_hit" not in dynamic["extra"] and not any(per_size(dynamic, "recompile_limit_hit"))


def test_j_per_call_is_the_share_weighted_mean_of_each_sizes_window(monkeypatch):
    gpu = FakeGpu(power_w=200.0)
    fake_pynvml.install(monkeypatch, [gpu])
    # The model runs on the CPU; the meter reads the (fake) GPU at a constant 200 W, so every size's J per call
    # is 200 W x its time per call.
    monkeypatch.setattr(worker_mod, "_open_meter", lambda device, hz: EnergyMeter("cuda:0", sample_hz=hz))
    shapes = ShapeSet("seq_len", (4, 64, 1024), (6, 3, 1))
    result = measure(shapes, mode="eager")
    sizes = result["extra"]["shapes"]["sizes"]
    assert [s["share"] for s in sizes] == pytest.approx([0.6, 0.3, 0.1])
    weighted = sum(s["share"] * s["energy_j_per_inference"] for s in sizes)
    assert result["energy_j_per_inference"] == pytest.approx(weighted)
    assert result["energy_source"] == "nvml"
    for s in sizes:
        assert s["energy_j_per_inference"] == pytest.approx(s["energy_j"] / s["calls"])
        # the fake counter steps every 100 ms: allow one step either side of the window
        assert s["energy_j"] == pytest.approx(200.0 * s["window_s"], abs=200.0 * 0.1 + 1e-9)
    seconds_per_call = sum(s["share"] * s["window_s"] / s["calls"] for s in sizes)
    assert result["avg_power_w"] == pytest.approx(weighted / seconds_per_call)
    assert result["throughput_per_s"] == pytest.approx(2 / seconds_per_call)
    assert result["inferences"] == sum(s["calls"] for s in sizes)
    assert result["window_s"] == pytest.approx(sum(s["window_s"] for s in sizes))
    low = min(min(s["latency_ms_p50"] for s in sizes), result["latency_ms_p50"])
    assert low <= result["latency_ms_p50"] <= result["latency_ms_p95"] <= max(s["latency_ms_p95"] for s in sizes)


def test_weighted_percentiles_follow_the_shares():
    # 90 % of the calls take 1 ms, 10 % take 10 ms, however many samples each size's pass took
    samples = [(1.0, 0.9 / 50)] * 50 + [(10.0, 0.1 / 7)] * 7
    assert _weighted_percentile(samples, 50) == 1.0
    assert _weighted_percentile(samples, 89) == 1.0
    assert _weighted_percentile(samples, 95) == 10.0
    assert _weighted_percentile([], 50) is None


def test_inputs_are_zero_padded_to_the_bucket_shape():
    tokens = torch.arange(1, 11).reshape(2, 5)
    bucket = torch.zeros(2, 8, dtype=torch.long)
    padded = pad_like((tokens, {"mask": tokens > 0}), (bucket, {"mask": bucket > 0}))
    assert padded[0].shape == (2, 8) and torch.equal(padded[0][:, :5], tokens) and not padded[0][:, 5:].any()
    assert padded[1]["mask"].dtype == torch.bool and padded[1]["mask"][:, :5].all() and not padded[1]["mask"][:, 5:].any()
    with pytest.raises(ValueError, match="cannot be padded"):
        pad_like(torch.zeros(2, 9), torch.zeros(2, 8))


def test_bench_stores_a_shape_set_run_under_the_shape_sets_workload(tmp_path, fake_worker):
    # the fake worker: eager compiles nothing, and its shorter warm-up and latency pass change nothing checked here
    shapes = ShapeSet("seq_len", (4, 12), (3, 1))
    runs = bench(SPEC, [CompileConfig(mode="eager", batch_size=2)], device="cpu", min_seconds=0.2, idle_s=0,
                 db=tmp_path / "j.db", shapes=shapes, warm_start=False)
    (run,) = runs
    assert run["status"] == "ok", run.get("reason")
    assert run["workload_id"] == workload_id(SPEC, 2, shapes=shapes) != workload_id(SPEC, 2, 4)
    stored = run["extra"]["shapes"]
    assert [s["size"] for s in stored["sizes"]] == [4, 12] and stored["set"] == shapes.to_dict()
    assert run["energy_j_per_inference"] == pytest.approx(sum(s["share"] * s["energy_j_per_inference"]
                                                              for s in stored["sizes"]))
    # two sizes, each with its warm-up, latency pass and window: the allowance of a two-window worker
    assert run["extra"]["budget"]["allowance_s"] == pytest.approx(measure_allowance_s(2 * 0.2))


def test_padding_without_a_shape_set_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="needs a shape set"):
        bench(SPEC, [CompileConfig(mode="default", padding="buckets")], device="cpu", db=tmp_path / "j.db")


@pytest.mark.slow
def test_bench_with_inductor_recompiles_per_size_statically_and_once_dynamically(tmp_path):
    # One Linear layer over the sequence: every compile is a real Inductor one, with no C++ kernel to build per size
    shapes = ShapeSet("seq_len", (5, 6, 7))
    configs = [CompileConfig(mode="default", batch_size=2), CompileConfig(mode="default", dynamic=True, batch_size=2)]
    static, dynamic = bench(LINEAR_SPEC, configs, device="cpu", min_seconds=0.2, idle_s=0, db=tmp_path / "j.db",
                            shapes=shapes, warm_start=False, save_artifacts=False)
    assert static["status"] == dynamic["status"] == "ok", (static.get("reason"), dynamic.get("reason"))
    assert static["recompiles"] == 2 and [s["compiled_frames"] for s in static["extra"]["shapes"]["sizes"]] == [1, 1, 1]
    assert dynamic["recompiles"] <= 1 < static["recompiles"]


def test_the_warm_start_of_a_padded_configuration_runs_its_first_size_at_the_bucket(monkeypatch):
    bench_mod = importlib.import_module("joulepilot.compiler.bench")  # the module (the package exports bench())
    jobs = []

    def record(job, **_):  # stands in for the worker processes: this test is about the jobs they are given
        jobs.append(job)
        if job["kind"] == "bench":
            return {"status": "ok", "artifacts_path": "/nonexistent/artifacts.bin", "extra": {}}
        return {"status": "ok", "warm_start_s": 0.5}

    monkeypatch.setattr(bench_mod, "run_worker_job", record)
    context = bench_mod.SweepContext("cpu", {"device_name": "cpu", "torch_version": torch.__version__,
                                             "triton_version": "", "provenance_key": "p"}, [], {}, 0.0)
    shapes = ShapeSet("seq_len", (5, 9))
    for padding, warm_size in (("buckets", 8), ("none", 5)):
        jobs.clear()
        bench_mod.measure_config(SPEC, CompileConfig(mode="default", padding=padding, batch_size=2), context=context,
                                 columns=set(), min_seconds=0.2, budget_s=60, shapes=shapes, warm_start=True)
        first, warm = jobs
        assert first["shapes"] == shapes.to_dict() and first["seq_len"] == 5
        assert warm["kind"] == "warm_start" and warm["seq_len"] == warm_size


# --- compile energy over the sizes ---------------------------------------------------------------------------
RECOMPILE_CPU_S = 0.3  # CPU seconds each later size's first call spends in a child, as Inductor's compile workers do
W_PER_CORE = 10.0


def _later_first_calls_burn_in_a_child(monkeypatch) -> None:
    """Each size after the first spends RECOMPILE_CPU_S of CPU in a child process on its first call (where a real
    recompile would run Inductor's compile workers), and only there."""
    real = ShapeSetRun.measure_rest

    def measure_rest(self, *, make_call, **kwargs):
        def burning(args):
            call, first = make_call(args), [True]

            def first_burns():
                if first:
                    first.clear()
                    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                                    f"while time.process_time() - t < {RECOMPILE_CPU_S}: pass"], check=True)
                return call()
            return first_burns
        return real(self, make_call=burning, **kwargs)

    monkeypatch.setattr(ShapeSetRun, "measure_rest", measure_rest)


def _on_a_fake_gpu(monkeypatch) -> None:
    """The model runs on the CPU; the run's meter reads a fake GPU at a constant 200 W (NVML), so the compile
    window gets the CPU meter too: the labelled estimate, as no powercap tree can be read."""
    fake_pynvml.install(monkeypatch, [FakeGpu(power_w=200.0)])
    monkeypatch.setattr(worker_mod, "_open_meter", lambda device, hz: EnergyMeter("cuda:0", sample_hz=hz))


def _stored(result: dict, tmp_path, device: str):
    """The worker's result committed into a real database and read back as the consumers read it."""
    db = open_db(tmp_path / "j.db")
    columns = run_columns(db)
    host = host_identity()
    row = {k: v for k, v in result.items() if k in columns and k not in ("status", "reason")}
    row.update({"workload_id": "mixer-shapes", "config_id": "static", "host_id": host["id"], "device": device,
                "status": "ok", "started_at": time.time(), "energy_source": result.get("energy_source")})
    commit_run(db, row, host=host, workload={"id": "mixer-shapes", "spec": SPEC, "batch_size": 2},
               config=CompileConfig(mode="default", batch_size=2).to_row() | {"id": "static"})
    (run,) = ok_runs(db)
    return db, run


def test_a_gpu_shape_sets_compile_energy_is_every_sizes_first_call_on_the_gpu_and_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", str(W_PER_CORE))
    _on_a_fake_gpu(monkeypatch)
    _later_first_calls_burn_in_a_child(monkeypatch)
    result = measure(ShapeSet("seq_len", (5, 6, 7)), dynamic=False)

    # compile_energy_j is the sum of the parts stored beside it, each with its source
    assert result["compile_energy_j"] == pytest.approx(result["compile_energy_gpu_j"] + result["compile_energy_cpu_j"])
    assert (result["compile_energy_gpu_source"], result["compile_energy_cpu_source"]) == ("nvml", "estimate")
    sizes = result["extra"]["shapes"]["sizes"]
    for entry in sizes:
        assert entry["first_call_energy_gpu_source"] == "nvml"
        assert entry["first_call_energy_cpu_source"] == "estimate"
        assert entry["first_call_energy_j"] == pytest.approx(entry["first_call_energy_gpu_j"]
                                                             + entry["first_call_energy_cpu_j"])
    # a later size's recompile is metered on the CPU too, child processes included
    assert all(entry["first_call_energy_cpu_j"] >= RECOMPILE_CPU_S * W_PER_CORE for entry in sizes[1:])
    # the first size's parts are the worker's compile window
    devices = {d["device"]: d["energy_j"] for d in result["extra"]["compile_window"]["devices"]}
    assert sizes[0]["first_call_energy_cpu_j"] == pytest.approx(devices["cpu:0"])
    assert sizes[0]["first_call_energy_gpu_j"] == pytest.approx(devices["gpu:0"])

    # the run's parts are the sums over the sizes: the compile and every recompile
    assert result["compile_energy_gpu_j"] == pytest.approx(sum(e["first_call_energy_gpu_j"] for e in sizes))
    assert result["compile_energy_cpu_j"] == pytest.approx(sum(e["first_call_energy_cpu_j"] for e in sizes))
    assert result["compile_energy_j"] == pytest.approx(sum(e["first_call_energy_j"] for e in sizes))

    # every consumer reads the one figure: the stored row, its complete figure, the trade-off model's sample
    db, run = _stored(result, tmp_path, "cuda:0")
    assert run.compile_energy_j == pytest.approx(result["compile_energy_j"])
    assert complete_compile_energy_j(run) == pytest.approx(run.compile_energy_j)
    (sample,) = training_samples(db)
    assert sample.targets["compile_energy_j"] == pytest.approx(run.compile_energy_j)
    text = compile_energy_text(run)
    assert text.startswith(f"{run.compile_energy_j:,.0f} J (GPU ") and "nvml + CPU" in text and "estimate" in text


def test_a_cpu_shape_sets_compile_energy_is_its_cpu_part_summed_over_the_sizes(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", str(W_PER_CORE))
    _later_first_calls_burn_in_a_child(monkeypatch)
    result = measure(ShapeSet("seq_len", (5, 6, 7)), dynamic=False)

    assert result["compile_energy_j"] == result["compile_energy_cpu_j"]
    sizes = result["extra"]["shapes"]["sizes"]
    assert all(e["first_call_energy_gpu_j"] is None and e["first_call_energy_cpu_source"] == "estimate" for e in sizes)
    assert all(e["first_call_energy_cpu_j"] >= RECOMPILE_CPU_S * W_PER_CORE for e in sizes[1:])
    assert (result["compile_energy_gpu_j"], result["compile_energy_gpu_source"]) == (None, None)
    assert result["compile_energy_cpu_source"] == "estimate"
    assert result["compile_energy_cpu_j"] == pytest.approx(sum(e["first_call_energy_cpu_j"] for e in sizes))
    _, run = _stored(result, tmp_path, "cpu")
    assert complete_compile_energy_j(run) == pytest.approx(run.compile_energy_j)


def test_a_cpu_meter_that_cannot_open_leaves_the_sets_cpu_part_not_metered(monkeypatch, tmp_path):
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", "lots")
    _on_a_fake_gpu(monkeypatch)
    result = measure(ShapeSet("seq_len", (5, 6)), dynamic=False)

    sizes = result["extra"]["shapes"]["sizes"]
    assert all("JOULEPILOT_ESTIMATE_W_PER_CORE" in e["first_call_cpu_meter_error"] for e in sizes)
    assert (result["compile_energy_cpu_j"], result["compile_energy_cpu_source"]) == (None, None)
    assert result["compile_energy_gpu_j"] == pytest.approx(sum(e["first_call_energy_gpu_j"] for e in sizes))
    assert result["compile_energy_j"] == result["compile_energy_gpu_j"]
    _, run = _stored(result, tmp_path, "cuda:0")
    assert complete_compile_energy_j(run) is None  # the GPU part alone is not a complete compile energy


def test_first_calls_add_up_part_by_part_and_a_part_one_call_missed_is_not_metered():
    # the audit's case: a first compile of GPU 100 J + CPU 900 J, a later size's recompile of GPU 50 J + CPU 40 J
    compile_ = {"compile_energy_j": 1000.0, "compile_energy_gpu_j": 100.0, "compile_energy_gpu_source": "nvml",
                "compile_energy_cpu_j": 900.0, "compile_energy_cpu_source": "estimate"}
    recompile = {"compile_energy_j": 90.0, "compile_energy_gpu_j": 50.0, "compile_energy_gpu_source": "nvml",
                 "compile_energy_cpu_j": 40.0, "compile_energy_cpu_source": "estimate"}
    summed = summed_compile_fields([compile_, recompile])
    assert summed == {"compile_energy_gpu_j": 150.0, "compile_energy_gpu_source": "nvml",
                      "compile_energy_cpu_j": 940.0, "compile_energy_cpu_source": "estimate",
                      "compile_energy_j": 1090.0}
    run = {**summed, "device": "cuda:0"}
    assert complete_compile_energy_j(run) == summed["compile_energy_j"]
    assert compile_energy_text(run) == "1,090 J (GPU 150 J nvml + CPU 940 J estimate)"

    # a CPU part measured by RAPL for one size and estimated for another names both sources
    rapl = {**recompile, "compile_energy_cpu_source": "rapl"}
    assert summed_compile_fields([compile_, rapl])["compile_energy_cpu_source"] == "estimate+rapl"
    # a size whose CPU meter failed: the set's CPU part is not metered, and the total is what is left
    unmetered = {**recompile, "compile_energy_j": 50.0, "compile_energy_cpu_j": None, "compile_energy_cpu_source": None}
    partial = summed_compile_fields([compile_, unmetered])
    assert (partial["compile_energy_cpu_j"], partial["compile_energy_cpu_source"]) == (None, None)
    assert partial["compile_energy_j"] == partial["compile_energy_gpu_j"] == 150.0


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_a_workload_that_ignores_the_sets_dimension_fails_before_anything_runs(mode):
    """The built-in mlp takes no sequence length: its 'seq_len 4' and 'seq_len 64' are the same calls, which
    measured as a shape set would show a static compile meeting four sizes without a recompile."""
    shapes = ShapeSet("seq_len", (4, 16, 64))
    job = {"device": "cpu", "spec": "mlp", "min_seconds": 0.1, "warmup_max_s": 0.05, "latency_s": 0.02,
           "config": CompileConfig(mode=mode, batch_size=2).to_row(), "shapes": shapes.to_dict(), "seq_len": 4}
    result = worker_mod.run_job(job)
    assert result["status"] == "failed" and result["phase"] == "load", result
    assert "'mlp' builds the same inputs at seq_len 4 and 16" in result["reason"]
    assert "measure it without a shape set, or give its factory a seq_len argument" in result["reason"]
