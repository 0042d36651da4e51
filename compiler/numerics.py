"""The numerical check against eager fp32.

max_rel_error = max over output tensors of  max|out - ref| / max|ref|   (an infinity-norm relative error)

Element-wise relative error is dominated by reference values near zero (any ReLU output), so each
tensor's worst absolute deviation is scaled by its largest reference magnitude instead. Outputs may be
tensors or (nested) tuples, lists, dicts and dataclass-like objects with `to_tuple()` (Hugging Face);
non-tensor leaves are ignored. A shape mismatch or a NaN where the reference is finite counts as inf.
When every reference tensor is identically zero the check says nothing (any output scaled by zero), so
the error is NaN, stored as NULL: "not measured", which a policy's max_rel_error refuses.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in flatten_tensors(value[key])]
    if isinstance(value, tuple | list):
        return [t for item in value for t in flatten_tensors(item)]
    if hasattr(value, "to_tuple"):
        return flatten_tensors(value.to_tuple())
    return []


def tensor_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        return math.inf
    if out.numel() == 0:
        return 0.0
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(torch.float64)
    diff = (out64 - ref64).abs()
    finite_ref = torch.isfinite(ref64)
    if bool((~torch.isfinite(out64) & finite_ref).any()):
        return math.inf
    diff = torch.where(finite_ref, diff, torch.zeros_like(diff))
    scale = ref64.abs().where(finite_ref, torch.zeros_like(ref64)).max().item()
    worst = diff.max().item()
    if scale == 0.0:
        return 0.0 if worst == 0.0 else math.inf
    return worst / scale


def max_rel_error(output: Any, reference: Any) -> float:
    outs, refs = flatten_tensors(output), flatten_tensors(reference)
    if len(outs) != len(refs):
        return math.inf
    if not outs:
        return 0.0
    worst = max(tensor_rel_error(o, r) for o, r in zip(outs, refs, strict=True))
    if worst == 0.0 and all(not bool(r.detach().ne(0).any()) for r in refs):
        return math.nan
    return worst
