"""Numeric precision as a scope around each call: autocast for bf16/fp16, the TF32 switches for tf32.

The scope is entered on every call (including the first, which compiles), so Inductor sees the same
autocast and matmul-precision state at compile time as at run time, and nothing leaks to the caller.

Autocast is thread-local in torch, so bf16/fp16 scopes of concurrent calls cannot disturb each other. The
TF32 switches are process-wide: `tf32_enabled` shares them among the threads that are inside a scope at the
same time (see `_Frame`), so that concurrent calls of a served tf32 model cannot leave TF32 on after the last
of them returns.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(device: str | torch.device) -> str:
    return torch.device(device).type


@functools.cache
def _precision_knobs() -> tuple[tuple[object, str], ...]:
    """Every switch that decides fp32 matmul/conv precision on this torch (newer releases have a
    per-backend `fp32_precision` tree next to the older allow_tf32 flags). Looked up once: finding them
    took half the time of a scope, and torch.backends' objects live as long as the process."""
    backends = torch.backends
    knobs: list[tuple[object, str]] = []
    for path in ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                 "mkldnn.rnn"):
        obj: object = backends
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            knobs.append((obj, "fp32_precision"))
    return tuple(knobs)


class _Switches:
    """The process-wide precision switches as they were: the long-standing ones and the `fp32_precision` tree."""

    __slots__ = ("cudnn_allow_tf32", "knobs", "matmul_precision")

    def __init__(self) -> None:
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.cudnn_allow_tf32 = torch._C._get_cudnn_allow_tf32()
        self.knobs = [(obj, name, getattr(obj, name)) for obj, name in _precision_knobs()]

    def restore(self) -> None:
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch._C._set_cudnn_allow_tf32(self.cudnn_allow_tf32)
        for obj, name, value in self.knobs:
            if getattr(obj, name) != value:
                setattr(obj, name, value)


def _set_tf32(enabled: bool) -> None:
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch._C._set_cudnn_allow_tf32(enabled)


class _Frame:
    """One setting of the TF32 switches, shared by every thread inside a scope that asked for it: the first
    to enter saved the switches and set them, and they are restored when the last holder has left."""

    __slots__ = ("enabled", "holders", "saved")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.saved = _Switches()
        self.holders: dict[int, int] = {}  # thread id -> how deeply it is nested in this frame


# The settings in force, innermost last. A thread asking for the setting in force joins it; one asking for the
# other waits until the frame in force is left by all (so a strict fp32 reference never runs with another
# thread's TF32 on); a thread that already holds a frame never waits (it would wait on itself): it sets its
# own frame on top, as nested scopes in one thread always did (the other holders then run under it until it is
# left: the switches are the process's). While threads wait for one setting, newcomers asking for the other
# queue behind them, so a stream of overlapping tf32 calls cannot keep a strict fp32 reference waiting forever.
_switch = threading.Condition(threading.Lock())
_frames: list[_Frame] = []
_waiting = {True: 0, False: 0}  # threads waiting, by the setting they asked for


def _may_enter(enabled: bool, thread: int) -> bool:
    if not _frames or any(thread in frame.holders for frame in _frames):
        return True
    return _frames[-1].enabled == enabled and not _waiting[not enabled]


def _enter(enabled: bool, thread: int) -> _Frame:
    with _switch:
        if _frames and not _may_enter(enabled, thread):
            _waiting[enabled] += 1
            try:
                _switch.wait_for(lambda: _may_enter(enabled, thread))
            finally:
                _waiting[enabled] -= 1
        if _frames and _frames[-1].enabled == enabled:
            frame = _frames[-1]
        else:
            frame = _Frame(enabled)
            _set_tf32(enabled)
            _frames.append(frame)
        holders = frame.holders
        holders[thread] = holders.get(thread, 0) + 1
        return frame


def _pop_left_frames() -> None:
    """Restore and drop the innermost frames nobody holds any more (caller holds `_switch`)."""
    popped = False
    while _frames and not _frames[-1].holders:
        _frames.pop().saved.restore()
        popped = True
    if popped and (_waiting[True] or _waiting[False]):
        _switch.notify_all()


def _leave(frame: _Frame, thread: int) -> None:
    with _switch:
        holders = frame.holders
        depth = holders[thread] - 1
        if depth:
            holders[thread] = depth
        else:
            del holders[thread]
        _pop_left_frames()


def _after_fork_in_child() -> None:
    """A forked child has only the thread that forked: the lock may have been held by another thread, and the
    frames held by other threads would never be left."""
    global _switch
    _switch = threading.Condition(threading.Lock())
    thread = threading.get_ident()
    for frame in _frames:
        frame.holders = {thread: frame.holders[thread]} if thread in frame.holders else {}
    _waiting.update({True: 0, False: 0})
    with _switch:
        _pop_left_frames()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextmanager
def tf32_enabled(enabled: bool) -> Iterator[None]:
    """TF32 on (or off) for CUDA matmuls and cuDNN convolutions in the block, through the long-standing
    switches (set_float32_matmul_precision, cudnn.allow_tf32), then every precision switch back exactly
    as it was. Newer torch mirrors those switches into a per-backend `fp32_precision` tree, and
    Inductor's cache keys include it, so the tree is snapshot and restored too: a leak would make
    saved compile artifacts miss in the next process.

    The switches are process-wide, so concurrent scopes share them (`_Frame`): the first thread in saves and
    sets them, the last one out restores them, and a thread asking for the other setting waits for them. On
    the single-threaded hot path (a served model's every call) the sharing costs two acquires of an
    uncontended lock and a few dict operations over the save/set/restore it always did: about 1.5 us on the
    2-core CPU VM against that 11 us, which the knob lookup done once (`_precision_knobs`) more than pays for
    (a scope took 20 us before)."""
    thread = threading.get_ident()
    frame = _enter(enabled, thread)
    try:
        yield
    finally:
        _leave(frame, thread)


@contextmanager
def precision_scope(precision: str, device: str | torch.device) -> Iterator[None]:
    """The numeric setting of one configuration; `fp32` leaves torch's defaults as users get them."""
    with ExitStack() as stack:
        if precision == "tf32":
            stack.enter_context(tf32_enabled(True))
        elif precision in AUTOCAST_DTYPES:
            # autocast's state is the calling thread's own: nothing to share with other threads
            stack.enter_context(torch.autocast(device_type=device_type(device), dtype=AUTOCAST_DTYPES[precision]))
        yield


@contextmanager
def strict_fp32() -> Iterator[None]:
    """The reference: plain fp32 everywhere (no TF32 in matmuls or cuDNN convolutions)."""
    with tf32_enabled(False):
        yield
