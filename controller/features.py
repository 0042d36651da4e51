"""Feature vectors for the trade-off regression: workload, configuration and device, as numbers.

The vocabulary of categorical values (modes, fusion presets, precisions, devices, op families) is
learned from the training rows, so a value never seen in training becomes all-zero one-hot columns
rather than an error: the model then falls back on what the other columns say.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from joulepilot.store.devicekind import device_kind as device_kind  # the device kind a run is grouped by
from joulepilot.store.jsonvalues import json_column

CATEGORICAL = ("mode", "fusion", "precision")


def config_row(config: Any) -> dict[str, Any]:
    """A configs-table-shaped dict from a CompileConfig, a configs row or a list_runs row."""
    if hasattr(config, "to_row"):
        return dict(config.to_row())
    return dict(config)


# Coarse op families: graphs record ATen/torch op names (addmm, convolution, native_layer_norm, ...);
# grouping them lets what was learnt on one model's ops carry over to another's. First match wins.
OP_GROUPS = (
    ("attention", ("scaled_dot_product", "attention")),
    ("conv", ("conv",)),
    ("matmul", ("mm", "matmul", "linear", "einsum", "baddbmm")),
    ("norm", ("norm",)),
    ("softmax", ("softmax",)),
    ("activation", ("relu", "gelu", "silu", "tanh", "sigmoid", "hardswish", "elu", "mish")),
    ("pool", ("pool",)),
    ("shape", ("view", "reshape", "permute", "transpose", "expand", "cat", "stack", "split", "slice", "select",
               "unsqueeze", "squeeze", "flatten", "contiguous", "clone", "chunk", "_unsafe", "t")),
    ("elementwise", ("add", "mul", "div", "sub", "pow", "sqrt", "rsqrt", "exp", "neg", "where", "mean", "sum")),
)


@lru_cache(maxsize=4096)  # a few hundred op names recur in every feature vector of every fit and prediction
def op_group(name: str) -> str:
    low = name.lower()
    for group, needles in OP_GROUPS:
        if any(low == n or (len(n) > 1 and n in low) for n in needles):
            return group
    return "other"


def op_mix_fractions(workload: Mapping[str, Any]) -> dict[str, float]:
    """Share of graph nodes in each coarse op family (OP_GROUPS), from the workload's op_mix JSON."""
    raw = json_column(workload.get("op_mix"))
    if not isinstance(raw, Mapping):
        return {}
    counts: dict[str, float] = {}
    for name, count in raw.items():
        if isinstance(count, int | float) and count > 0:
            group = op_group(str(name))
            counts[group] = counts.get(group, 0.0) + float(count)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def work_scale(workload: Mapping[str, Any]) -> float:
    """FLOPs of one forward call, or 2 x params x batch when FLOPs were not counted."""
    flops = workload.get("flops_per_inference")
    if flops and flops > 0:
        return float(flops)
    params = workload.get("params") or 0
    return float(max(1.0, 2.0 * params * (workload.get("batch_size") or 1)))


def generation_numbers(workload: Mapping[str, Any]) -> dict[str, float]:
    """A generation workload's size: parameters, batch, prompt and new tokens, and the KV cache's positions (every
    sequence's prompt and new tokens: what attention reads at the last step)."""
    batch = max(1, int(workload.get("batch_size") or 1))
    prompt = max(1, int(workload.get("prompt_len") or 1))
    new = max(1, int(workload.get("new_tokens") or 1))
    return {"log_params": math.log10(max(1.0, float(workload.get("params") or 1))),
            "log2_batch_size": math.log2(batch), "log2_prompt_len": math.log2(prompt),
            "log2_new_tokens": math.log2(new), "log2_cache_positions": math.log2(batch * (prompt + new))}


def workload_numbers(workload: Mapping[str, Any]) -> dict[str, float]:
    return {
        "log_params": math.log10(max(1.0, float(workload.get("params") or 1))),
        "log_flops": math.log10(work_scale(workload)),
        "log_graph_nodes": math.log10(1.0 + float(workload.get("graph_nodes") or 0)),
        "log2_batch_size": math.log2(max(1, int(workload.get("batch_size") or 1))),
    }


GENERATION_NUMBERS = ("log_params", "log2_batch_size", "log2_prompt_len", "log2_new_tokens", "log2_cache_positions",
                      "static_cache", "compiled_prefill", "dynamic")


@dataclass
class FeatureSpace:
    """Column layout learned from training rows; `vector` turns one (workload, config, device) into numbers.
    A generation's space (`task` 'generate') has its own numeric columns (`GENERATION_NUMBERS`: parameters,
    batch, prompt and new tokens, the KV cache's size and kind, a compiled prefill) in place of a forward pass's
    (FLOPs of one call, graph size, op mix, padding, regional compilation)."""

    modes: list[str] = field(default_factory=list)
    fusions: list[str] = field(default_factory=list)
    precisions: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    op_families: list[str] = field(default_factory=list)
    task: str = "forward"

    @classmethod
    def learn(cls, rows: Iterable[tuple[Mapping[str, Any], Mapping[str, Any], str]],
              task: str = "forward") -> FeatureSpace:
        modes, fusions, precisions, devices, ops = set(), set(), set(), set(), set()
        for workload, config, device in rows:
            modes.add(config["mode"])
            fusions.add(config["fusion"])
            precisions.add(config["precision"])
            devices.add(device)
            if task == "forward":
                ops.update(op_mix_fractions(workload))
        return cls(sorted(modes), sorted(fusions), sorted(precisions), sorted(devices), sorted(ops), task)

    def _categorical(self, cfg: Mapping[str, Any], device: str) -> list[float]:
        return ([float(cfg["mode"] == m) for m in self.modes] + [float(cfg["fusion"] == f) for f in self.fusions]
                + [float(cfg["precision"] == p) for p in self.precisions] + [float(device == d) for d in self.devices])

    @property
    def names(self) -> list[str]:
        categorical = ([f"mode={m}" for m in self.modes] + [f"fusion={f}" for f in self.fusions]
                       + [f"precision={p}" for p in self.precisions] + [f"device={d}" for d in self.devices])
        if self.task == "generate":
            return list(GENERATION_NUMBERS) + categorical
        return (
            ["log_params", "log_flops", "log_graph_nodes", "log2_batch_size", "dynamic", "padded", "regional"]
            + [f"op:{o}" for o in self.op_families]
            + categorical
        )

    def vector(self, workload: Mapping[str, Any], config: Any, device: str) -> list[float]:
        cfg = config_row(config)
        if self.task == "generate":
            nums = generation_numbers(workload)
            flags = {"static_cache": float((cfg.get("cache") or "dynamic") == "static"),
                     "compiled_prefill": float(bool(cfg.get("compile_prefill"))),
                     "dynamic": float(bool(cfg.get("dynamic")))}
            return [nums.get(name, flags.get(name, 0.0)) for name in GENERATION_NUMBERS] + self._categorical(cfg, device)
        nums = workload_numbers(workload)
        mix = op_mix_fractions(workload)
        return (
            [nums["log_params"], nums["log_flops"], nums["log_graph_nodes"], nums["log2_batch_size"],
             float(bool(cfg.get("dynamic"))), float((cfg.get("padding") or "none") != "none"),
             float(bool(cfg.get("regional")))]
            + [mix.get(o, 0.0) for o in self.op_families]
            + self._categorical(cfg, device)
        )
