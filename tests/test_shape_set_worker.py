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

import pytest
import torch
import torch._dynamo
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.compiler import CompileConfig, ConfigError, ShapeSet, bench, inductor
from joulepilot.compiler import worker as worker_mod
from joulepilot.compiler.budget import measure_allowance_s
from joulepilot.compiler.shapes import _weighted_percentile, pad_like
from joulepilot.compiler.workloads import workload_id
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


def test_a_configuration_that_hits_the_recompile_limit_is_marked(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    shapes = ShapeSet("seq_len", (5, 6, 7, 9))
    static = measure(shapes, dynamic=False)
    extra = static["extra"]
    assert extra["recompile_limit_hit"] is True and extra["shapes"]["recompile_limit"] == 2
    assert per_size(static, "recompile_limit_hit") == [False, False, True, False]
    assert per_size(static, "compiled_frames") == [1, 1, 0, 0]  # from the limit on, Dynamo compiles nothing
    assert "recompile limit (2) at seq_len 7" in extra["recompile_warning"]

    torch._dynamo.reset()
    dynamic = measure(shapes, dynamic=True)  # one compiled version serves every size: under the limit
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
