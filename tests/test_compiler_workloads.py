"""Workload specs, built-in models, factories, descriptions and the numerical check."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from joulepilot.compiler import (
    WorkloadError,
    check_spec,
    count_flops,
    load_workload,
    max_rel_error,
    workload_id,
)
from joulepilot.compiler.workloads import split_spec


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch, request):
    monkeypatch.syspath_prepend(str(request.config.rootpath))


def test_flops_of_a_known_linear():
    layer = torch.nn.Linear(64, 32)
    flops = count_flops(layer, (torch.randn(8, 64),))
    assert flops == 2 * 8 * 64 * 32  # one multiply and one add per weight per sample


@pytest.mark.parametrize("spec, shape, dtype", [
    ("mlp", (4, 256), torch.float32),
    ("convnet", (4, 3, 32, 32), torch.float32),
    ("transformer", (4, 64), torch.int64),
])
def test_builtins_build_and_run(spec, shape, dtype):
    wl = load_workload(spec, batch_size=4)
    (x,) = wl.example_inputs
    assert tuple(x.shape) == shape and x.dtype == dtype
    assert not wl.model.training
    out = wl.model(x)
    assert isinstance(out, torch.Tensor) and out.shape[0] == 4


def test_shape_arguments_and_seed_make_identical_workloads():
    a = load_workload("transformer", batch_size=2, seq_len=16)
    b = load_workload("transformer", batch_size=2, seq_len=16)
    assert a.example_inputs[0].shape == (2, 16)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert torch.equal(a.model(*a.example_inputs), b.model(*b.example_inputs))
    assert a.id == workload_id("transformer", 2, 16, None) != workload_id("transformer", 2, 32, None)


def test_describe_mlp():
    wl = load_workload("mlp", batch_size=4)
    row = wl.describe()
    assert set(row) == {"id", "spec", "batch_size", "params", "flops_per_inference", "graph_nodes", "op_mix",
                        "inputs"}
    assert row["id"] == wl.id and row["spec"] == "mlp" and row["batch_size"] == 4
    assert row["params"] == sum(p.numel() for p in wl.model.parameters()) == 256 * 512 + 512 + 512 * 512 + 512 + 5130
    assert row["flops_per_inference"] == 2 * 4 * (256 * 512 + 512 * 512 + 512 * 10)
    assert row["op_mix"] == {"linear": 3, "gelu": 2}
    assert row["graph_nodes"] == 5
    assert row["inputs"] == [{"shape": [4, 256], "dtype": "float32"}]


def test_describe_falls_back_when_export_refuses():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: export refuses, Dynamo breaks the graph
                return x * 2
            return x - 1

    from joulepilot.compiler.describe import graph_summary

    summary = graph_summary(DataDependent(), (torch.ones(3),))
    assert summary["graph_method"] == "dynamo"
    assert summary["graph_nodes"] >= 2


def test_factory_returning_only_a_model_with_example_inputs():
    wl = load_workload("tests.workload_factories:model_only", batch_size=3)
    assert wl.example_inputs[0].shape == (3, 16)


def test_factory_from_a_file_path(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(textwrap.dedent("""
        import torch
        def build(batch_size, seq_len=None):
            return torch.nn.Linear(4, 2), (torch.randn(batch_size, 4),)
    """))
    wl = load_workload(f"{path}:build", batch_size=5)
    assert wl.model(*wl.example_inputs).shape == (5, 2)


def test_a_size_left_out_keeps_the_factorys_default_instead_of_none(tmp_path):
    path = tmp_path / "sized.py"
    path.write_text(textwrap.dedent("""
        import torch
        def build(batch_size=1, image_size=32):
            side = image_size // 2  # None // 2 raised TypeError here when image_size=None was passed
            return torch.nn.Flatten(), (torch.randn(batch_size, 3, side, side),)
    """))
    wl = load_workload(f"{path}:build", batch_size=2)
    assert wl.example_inputs[0].shape == (2, 3, 16, 16)
    assert load_workload(f"{path}:build", batch_size=2, image_size=8).example_inputs[0].shape == (2, 3, 4, 4)


def test_a_size_the_factory_does_not_take_is_refused_naming_it(tmp_path):
    path = tmp_path / "fixed.py"
    path.write_text(textwrap.dedent("""
        import torch
        def build(batch_size=1):
            return torch.nn.Linear(4, 2), (torch.randn(batch_size, 4),)
        def unsized():
            return torch.nn.Linear(4, 2), (torch.randn(1, 4),)
    """))
    with pytest.raises(WorkloadError) as err:
        load_workload(f"{path}:build", seq_len=128)
    assert "seq_len 128 was given (--seq-len, or seq_len in a policy), but build() takes no seq_len parameter" \
        in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(WorkloadError, match=r"batch_size 8 was given .* unsized\(\) takes no batch_size parameter"):
        load_workload(f"{path}:unsized", batch_size=8)
    assert load_workload(f"{path}:unsized").example_inputs[0].shape == (1, 4)


@pytest.mark.parametrize("spec, message", [
    ("nonexistent_pkg.models:build", "module 'nonexistent_pkg.models' is not importable"),
    ("tests.workload_factories:nope", "has no attribute 'nope'"),
    ("tests.workload_factories:not_callable", "is not callable"),
    ("resnet50", "is not a built-in"),
    ("torchvision:", "names nothing after ':'"),
])
def test_bad_specs_name_the_spec_and_the_cause(spec, message):
    with pytest.raises(WorkloadError) as err:
        check_spec(spec)
    assert repr(spec) in str(err.value)
    assert message in str(err.value)


def test_factory_that_raises_is_reported_with_its_error():
    with pytest.raises(WorkloadError, match=r"the factory raised ValueError: weights file"):
        load_workload("tests.workload_factories:raises")


def test_inputs_returned_as_a_dict_are_refused_not_passed_as_their_keys():
    with pytest.raises(WorkloadError, match=r"returned its example inputs as a dict \(input\); every call passes "
                                            r"them positionally"):
        load_workload("tests.workload_factories:dict_inputs")


def test_missing_library_says_how_to_install(monkeypatch):
    import importlib

    real = importlib.import_module

    def refuse(name, *args, **kwargs):
        if name == "timm":
            raise ImportError("No module named 'timm'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", refuse)
    with pytest.raises(WorkloadError, match=r"needs the 'timm' package.*pip install timm"):
        check_spec("timm:resnet18")


def test_spec_kinds():
    assert split_spec("mlp") == ("builtin", "mlp")
    assert split_spec("torchvision:resnet50") == ("torchvision", "resnet50")
    assert split_spec("transformers:BertConfig") == ("transformers", "BertConfig")
    assert split_spec("my.pkg:make") == ("factory", "my.pkg:make")


def test_max_rel_error_is_norm_wise_and_handles_structures():
    ref = torch.tensor([1.0, -4.0, 0.0])
    out = torch.tensor([1.0, -4.0, 0.04])  # an absolute error of 0.04 where the reference is 0
    assert max_rel_error(out, ref) == pytest.approx(0.01)  # 0.04 / max|ref| = 0.04 / 4
    assert max_rel_error((out, {"b": ref}), (ref, {"b": ref})) == pytest.approx(0.01)
    assert max_rel_error(out.to(torch.bfloat16), ref) == pytest.approx(0.04 / 4, rel=0.05)
    # An identically zero reference says nothing about the output: not measured, stored as NULL.
    assert max_rel_error(torch.zeros(2), torch.zeros(2)) is None
    assert max_rel_error((torch.zeros(2), ref), (torch.zeros(2), ref)) == 0.0
    assert math.isinf(max_rel_error(torch.zeros(3), torch.zeros(2)))
    assert math.isinf(max_rel_error(torch.tensor([float("nan")]), torch.tensor([1.0])))


def test_zero_initialised_weights_get_random_values():
    from joulepilot.compiler.workloads import _reinit_zero_weights

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    torch.nn.init.zeros_(model[1].weight)  # as torchvision does for the ViT head
    torch.nn.init.zeros_(model[1].bias)
    notes = _reinit_zero_weights(model, torch.Generator().manual_seed(0))
    assert notes == {"reinitialised_zero_weights": ["1.weight"]}
    assert bool(model[1].weight.ne(0).any())
    assert bool(model(torch.randn(3, 4)).ne(0).any())


def test_a_window_much_slower_than_the_latency_pass_is_flagged():
    from joulepilot.compiler.worker import _check_window_pace

    extra: dict = {}
    _check_window_pace(8.6, 5.9, extra)
    assert extra["window_ms_per_call"] == 8.6
    assert "1.46x the synchronised p50" in extra["window_warning"]
    calm: dict = {}
    _check_window_pace(5.5, 5.9, calm)
    assert "window_warning" not in calm
