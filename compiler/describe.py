"""Describe a workload for the regression: size, FLOPs per forward call, graph size and op mix.

The graph is taken with torch.export (non-strict, ATen ops) and, where export refuses the model, with a
Dynamo capture backend (torch-level ops, summed over graph breaks). If both fail the graph fields are
None and the reason is kept under `graph_error`: a description never stops a benchmark.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def count_params(model: Any) -> int | None:
    if not hasattr(model, "parameters"):
        return None
    return sum(p.numel() for p in model.parameters())


def count_flops(model: Any, inputs: tuple) -> float | None:
    """FLOPs of one forward call on `inputs` (one batch), as torch.utils.flop_counter counts them."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(*inputs)
    return float(counter.get_total_flops())


def _op_family(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_function":
        overload = getattr(target, "overloadpacket", None)  # aten.addmm.default -> addmm
        if overload is not None:
            return getattr(overload, "__name__", str(overload))
        return getattr(target, "__name__", str(target))
    if node.op == "call_method":
        return str(target)
    return node.op


def op_mix_of(graphs: list[torch.fx.GraphModule]) -> tuple[int, dict[str, int]]:
    mix: Counter[str] = Counter()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module") and _op_family(node) != "getitem":
                mix[_op_family(node)] += 1
    return sum(mix.values()), dict(sorted(mix.items(), key=lambda kv: (-kv[1], kv[0])))


def _export_graph(model: Any, inputs: tuple) -> list[torch.fx.GraphModule]:
    import torch

    exported = torch.export.export(model, inputs, strict=False)
    return [exported.graph_module]


def _dynamo_graphs(model: Any, inputs: tuple) -> list[torch.fx.GraphModule]:
    import torch

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=capture)(*inputs)
    finally:
        torch._dynamo.reset()
    return graphs


def graph_summary(model: Any, inputs: tuple) -> dict[str, Any]:
    errors = []
    for method, capture in (("torch.export", _export_graph), ("dynamo", _dynamo_graphs)):
        try:
            graphs = capture(model, inputs)
        except Exception as exc:  # the model may be untraceable one way and fine the other
            errors.append(f"{method}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        nodes, mix = op_mix_of(graphs)
        return {"graph_nodes": nodes, "op_mix": mix, "graph_method": method, "graph_count": len(graphs)}
    return {"graph_nodes": None, "op_mix": None, "graph_error": "; ".join(errors)}


def describe_inputs(inputs: tuple) -> list[dict[str, Any]]:
    import torch

    described = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            described.append({"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")})
        else:
            described.append({"type": type(value).__name__})
    return described


def describe_workload(workload: Any, graph: bool = True, with_details: bool = False) -> dict[str, Any]:
    """A row for the workloads table; `with_details` adds `details` (how the graph was taken, or why
    it could not be) for a run's `extra`."""
    model, inputs = workload.model, workload.example_inputs
    details: dict[str, Any] = {}
    try:
        flops = count_flops(model, inputs)
    except Exception as exc:
        flops, details["flops_error"] = None, f"{type(exc).__name__}: {exc}"
    summary = graph_summary(model, inputs) if graph else {"graph_nodes": None, "op_mix": None}
    for key in ("graph_method", "graph_count", "graph_error"):
        if key in summary:
            details[key] = summary.pop(key)
    row = {
        "id": workload.id,
        "spec": workload.spec,
        "batch_size": workload.batch_size,
        "params": count_params(model),
        "flops_per_inference": flops,
        "graph_nodes": summary["graph_nodes"],
        "op_mix": summary["op_mix"],
        "inputs": describe_inputs(inputs),
    }
    if with_details:
        row["details"] = details
    return row
