"""Numeric precision as a scope around each call: autocast for bf16/fp16, the TF32 switches for tf32.

The scope is entered on every call (including the first, which compiles), so Inductor sees the same
autocast and matmul-precision state at compile time as at run time, and nothing leaks to the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(device: str | torch.device) -> str:
    return torch.device(device).type


def _precision_knobs() -> list[tuple[object, str]]:
    """Every switch that decides fp32 matmul/conv precision on this torch (newer releases have a
    per-backend `fp32_precision` tree next to the older allow_tf32 flags)."""
    backends = torch.backends
    knobs: list[tuple[object, str]] = []
    for path in ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                 "mkldnn.rnn"):
        obj: object = backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            knobs.append((obj, "fp32_precision"))
    return knobs


@contextmanager
def tf32_enabled(enabled: bool) -> Iterator[None]:
    """TF32 on (or off) for CUDA matmuls and cuDNN convolutions in the block, through the long-standing
    switches (set_float32_matmul_precision, cudnn.allow_tf32), then every precision switch back exactly
    as it was. Newer torch mirrors those switches into a per-backend `fp32_precision` tree, and
    Inductor's cache keys include it, so the tree is snapshot and restored too: a leak would make
    saved compile artifacts miss in the next process."""
    knobs = _precision_knobs()
    saved = [(obj, name, getattr(obj, name)) for obj, name in knobs]
    old_precision = torch.get_float32_matmul_precision()
    old_cudnn = torch._C._get_cudnn_allow_tf32()
    try:
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        torch._C._set_cudnn_allow_tf32(enabled)
        yield
    finally:
        torch.set_float32_matmul_precision(old_precision)
        torch._C._set_cudnn_allow_tf32(old_cudnn)
        for obj, name, value in saved:
            if getattr(obj, name) != value:
                setattr(obj, name, value)


@contextmanager
def precision_scope(precision: str, device: str | torch.device) -> Iterator[None]:
    """The numeric setting of one configuration; `fp32` leaves torch's defaults as users get them."""
    with ExitStack() as stack:
        if precision == "tf32":
            stack.enter_context(tf32_enabled(True))
        elif precision in AUTOCAST_DTYPES:
            stack.enter_context(torch.autocast(device_type=device_type(device), dtype=AUTOCAST_DTYPES[precision]))
        yield


@contextmanager
def strict_fp32() -> Iterator[None]:
    """The reference: plain fp32 everywhere (no TF32 in matmuls or cuDNN convolutions)."""
    with tf32_enabled(False):
        yield
