"""The numerical check against eager fp32.

max_rel_error = max over output tensors of  max|out - ref| / max|ref|   (an infinity-norm relative error)

Element-wise relative error is dominated by reference values near zero (any ReLU output), so each
tensor's worst absolute deviation is scaled by its largest reference magnitude instead. Outputs may be
tensors or (nested) tuples, lists, dicts and dataclass-like objects with `to_tuple()` (Hugging Face);
non-tensor leaves are ignored. A shape mismatch, a different number of tensors, or a NaN where the
reference is finite counts as inf.

When nothing can be compared the error is None (stored as NULL: "not measured", which a policy's
max_rel_error refuses) and `NumericCheck.note` says why: the output holds no tensors, every tensor in it
is empty, or every reference tensor is identically zero (any output scaled by zero says nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NumericCheck:
    """The outcome of comparing a configuration's output with the eager fp32 reference."""

    max_rel_error: float | None
    note: str | None = None  # why nothing was compared, or what did not match


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    import torch

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
    import torch

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


def numeric_check(output: Any, reference: Any) -> NumericCheck:
    """Compare `output` with the eager fp32 `reference`; see the module docstring for the measure."""
    outs, refs = flatten_tensors(output), flatten_tensors(reference)
    if len(outs) != len(refs):
        return NumericCheck(math.inf, f"the output holds {len(outs)} tensor(s), the eager reference {len(refs)}")
    if not refs:
        return NumericCheck(None, "no tensors in the output: nothing to compare")
    pairs = [(o, r) for o, r in zip(outs, refs, strict=True) if o.numel() or r.numel()]
    if not pairs:
        return NumericCheck(None, "every tensor in the output is empty: nothing to compare")
    errors = [tensor_rel_error(o, r) for o, r in pairs]
    worst = max(errors)
    if math.isinf(worst):
        shapes = [(tuple(o.shape), tuple(r.shape)) for o, r in pairs if o.shape != r.shape]
        if shapes:
            return NumericCheck(worst, f"output shape {shapes[0][0]} differs from the reference's {shapes[0][1]}")
        return NumericCheck(worst)
    if worst == 0.0 and all(not bool(r.detach().ne(0).any()) for _, r in pairs):
        return NumericCheck(None, "the eager reference output is identically zero: nothing to compare")
    return NumericCheck(worst)


def max_rel_error(output: Any, reference: Any) -> float | None:
    """The error of `numeric_check`: None when nothing could be compared."""
    return numeric_check(output, reference).max_rel_error
