"""The configuration space: validation against the installed torch, ids, labels, mode/option merging."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from joulepilot.compiler import (
    FUSION_PRESETS,
    MODES,
    PRECISIONS,
    CompileConfig,
    ConfigError,
    apply_config,
    checked_config,
    plan_configs,
)
from joulepilot.compiler.inductor import (
    effective_key,
    inductor_options,
    mode_options,
    torch_compile_kwargs,
)
from joulepilot.compiler.options import parse_option_assignments
from joulepilot.compiler.precision import precision_scope, strict_fp32


def test_every_fusion_preset_exists_in_installed_torch():
    for name in ("default", "no-epilogue-fusion", "aggressive-fusion", "coordinate-descent", "benchmark-fusion"):
        assert name in FUSION_PRESETS
        config = CompileConfig("default", fusion=name)
        assert checked_config(config) == config  # each knob the preset sets is one this torch has
    assert MODES == ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
    assert PRECISIONS == ("fp32", "tf32", "bf16", "fp16")


def test_mistyped_inductor_option_names_the_closest_knob():
    with pytest.raises(ConfigError) as err:
        checked_config(CompileConfig(mode="default", options={"epilog_fusion": False}))
    assert "'epilog_fusion'" in str(err.value)
    assert "did you mean 'epilogue_fusion'" in str(err.value)


def test_wrong_option_type_is_refused_with_expected_type():
    with pytest.raises(ConfigError, match=r"'epilogue_fusion' takes bool.*got str 'no'"):
        checked_config(CompileConfig(mode="default", options={"epilogue_fusion": "no"}))
    with pytest.raises(ConfigError, match="did you mean 'epilogue_fusion'"):
        plan_configs(["default"], options={"epilog_fusion": False})  # `joulepilot bench --option` checks
    with pytest.raises(ConfigError, match="unknown Inductor option 'epilog_fusion'"):
        torch_compile_kwargs(CompileConfig(mode="default", options={"epilog_fusion": False}), "cpu")


def test_unknown_mode_precision_and_preset_name_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'max-autotune'"):
        CompileConfig(mode="max-autotun")
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        CompileConfig(mode="default", precision="bf61")
    with pytest.raises(ConfigError, match="did you mean 'aggressive-fusion'"):
        CompileConfig(mode="default", fusion="agressive-fusion")


def test_eager_refuses_fusion_and_options():
    with pytest.raises(ConfigError, match="eager"):
        CompileConfig(mode="eager", fusion="no-epilogue-fusion")


def test_options_accept_dict_and_dashes_and_are_hashable():
    a = CompileConfig(mode="default", options={"max-fusion-size": 32, "epilogue_fusion": False})
    b = CompileConfig(mode="default", options={"epilogue_fusion": False, "max_fusion_size": 32})
    assert a == b and hash(a) == hash(b)
    assert a.options == (("epilogue_fusion", False), ("max_fusion_size", 32))
    assert {a, b} == {a}
    assert effective_key(a, "cpu") == effective_key(b, "cpu") != effective_key(a.replace(batch_size=2), "cpu")


def test_configurations_are_named_without_importing_torch():
    # The vocabulary is what policies, the CLI and reports need; it must not cost a torch import.
    code = ("import sys; from joulepilot.compiler.config import CompileConfig; "
            "c = CompileConfig('max-autotune', fusion='no-epilogue-fusion', options={'max-fusion-size': 16}, "
            "precision='bf16', batch_size=4); print(c.id, c.label, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    here = CompileConfig("max-autotune", fusion="no-epilogue-fusion", options={"max_fusion_size": 16},
                         precision="bf16", batch_size=4)
    assert out == [here.id, here.label, "False"]


def test_ids_are_stable_and_labels_readable():
    cfg = CompileConfig(mode="default", fusion="no-epilogue-fusion", precision="bf16", batch_size=32)
    assert cfg.label == "default/no-epilogue-fusion/bf16/b32"
    # A fixed value: ids key stored runs across releases and hosts, so a change here breaks history.
    assert cfg.id == "ce703ec919204537"
    assert cfg.id == CompileConfig(mode="default", fusion="no-epilogue-fusion", precision="bf16", batch_size=32).id
    assert cfg.id != cfg.replace(batch_size=16).id
    assert CompileConfig(mode="eager").label == "eager/fp32/b1"
    dyn = CompileConfig(mode="default", options={"max_fusion_size": 8}, dynamic=True, batch_size=2)
    assert dyn.label == "default/max_fusion_size=8/fp32/dynamic/b2"


def test_row_round_trip():
    cfg = CompileConfig(mode="max-autotune-no-cudagraphs", fusion="benchmark-fusion",
                        options={"max_fusion_size": 16}, precision="tf32", dynamic=True, batch_size=4)
    row = cfg.to_row()
    assert set(row) == {"id", "label", "mode", "fusion", "options", "precision", "dynamic", "batch_size"}
    assert json.loads(row["options"]) == {"max_fusion_size": 16}
    assert row["dynamic"] == 1
    assert CompileConfig.from_row(row) == cfg
    # a list_runs row carries extra columns and options as JSON text
    assert CompileConfig.from_row({**row, "status": "ok", "config_label": row["label"]}).id == cfg.id


def test_plain_modes_pass_mode_to_torch_compile():
    assert torch_compile_kwargs(CompileConfig(mode="eager")) == {}
    assert torch_compile_kwargs(CompileConfig(mode="default")) == {"dynamic": False}
    assert torch_compile_kwargs(CompileConfig(mode="reduce-overhead"), "cuda:0") == {
        "dynamic": False, "mode": "reduce-overhead"}


def test_mode_is_expanded_into_options_when_merged_with_a_preset():
    from torch._inductor import list_mode_options

    cfg = CompileConfig(mode="max-autotune", fusion="no-epilogue-fusion", options={"max_fusion_size": 16})
    kwargs = torch_compile_kwargs(cfg, "cuda:0")
    assert "mode" not in kwargs  # torch refuses mode and options together
    expected = {**list_mode_options("max-autotune"), "epilogue_fusion": False, "max_fusion_size": 16}
    assert kwargs["options"] == expected
    assert kwargs["options"]["triton.cudagraphs"] is True
    # raw options win over the mode's own settings
    override = CompileConfig(mode="max-autotune", options={"coordinate_descent_tuning": False})
    assert torch_compile_kwargs(override, "cuda:0")["options"]["coordinate_descent_tuning"] is False


def test_cuda_graphs_are_left_out_on_cpu():
    assert mode_options("reduce-overhead") == {"triton.cudagraphs": True}
    assert torch_compile_kwargs(CompileConfig(mode="reduce-overhead"), "cpu") == {"dynamic": False}
    kwargs = torch_compile_kwargs(CompileConfig(mode="max-autotune"), "cpu")
    assert kwargs["options"] == {"max_autotune": True, "coordinate_descent_tuning": True}


def test_expansion_matches_what_torch_does_with_the_mode():
    for mode in MODES[1:]:
        by_torch = torch._TorchCompileInductorWrapper(mode, None, False).config
        assert inductor_options(CompileConfig(mode=mode), "cuda:0") == by_torch


def test_merged_options_are_accepted_by_torch():
    cfg = CompileConfig(mode="max-autotune", fusion="aggressive-fusion", options={"max_fusion_size": 16})
    kwargs = torch_compile_kwargs(cfg, "cuda:0")
    wrapper = torch._TorchCompileInductorWrapper(kwargs.get("mode"), kwargs.get("options"), kwargs["dynamic"])
    assert wrapper.config == inductor_options(cfg, "cuda:0")
    assert wrapper.config["aggressive_fusion"] is True and wrapper.config["max_autotune"] is True


def test_plan_configs_cross_product_without_meaningless_points():
    configs = plan_configs(["eager", "default", "max-autotune-no-cudagraphs"],
                           ["default", "coordinate-descent"], ["fp32", "bf16"], batch_size=8)
    labels = [c.label for c in configs]
    assert labels == [
        "eager/fp32/b8", "eager/bf16/b8",
        "default/fp32/b8", "default/bf16/b8",
        "default/coordinate-descent/fp32/b8", "default/coordinate-descent/bf16/b8",
        "max-autotune-no-cudagraphs/fp32/b8", "max-autotune-no-cudagraphs/bf16/b8",
    ]  # max-autotune-no-cudagraphs already tunes by coordinate descent, so that pair is dropped
    with pytest.raises(ConfigError, match="did you mean 'no-epilogue-fusion'"):
        plan_configs(["default"], ["no-epilog-fusion"])


def test_option_assignments_from_command_line():
    assert parse_option_assignments(["max_fusion_size=32", "epilogue_fusion=false", "x=abc"]) == {
        "max_fusion_size": 32, "epilogue_fusion": False, "x": "abc"}
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        parse_option_assignments(["epilogue_fusion"])


def test_precision_scopes_restore_every_switch():
    def state():
        return (torch.get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32(),
                torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)

    before = state()
    with precision_scope("tf32", "cpu"):
        assert torch.get_float32_matmul_precision() == "high"
    with strict_fp32():
        assert torch._C._get_cudnn_allow_tf32() is False
    assert state() == before
    with precision_scope("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_apply_eager_runs_under_precision_and_no_grad():
    model = torch.nn.Linear(4, 4)
    run = apply_config(CompileConfig(mode="eager", precision="bf16"), model, "cpu")
    out = run(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    assert not out.requires_grad


def test_builtin_workload_names_match_the_models():
    from joulepilot.compiler.builtin_models import BUILTIN
    from joulepilot.compiler.workloads import BUILTIN_NAMES, split_spec

    assert tuple(BUILTIN) == BUILTIN_NAMES  # named apart so that checking a spec does not import torch
    assert [split_spec(name) for name in BUILTIN_NAMES] == [("builtin", name) for name in BUILTIN]
