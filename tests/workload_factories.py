"""`package.module:factory` workloads for the tests, imported by the worker subprocess as
`tests.workload_factories:<name>` (the runner passes the parent's import roots on PYTHONPATH).

The misbehaving models misbehave from their second call on: the first call is the worker's eager
fp32 reference, the second is the configuration's first (timed, "compile") call. `hangs_on_first_call`
hangs in the very first forward call (the eager reference).
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn


class _Misbehaving(nn.Module):
    def __init__(self, action: str, only_under_autocast: bool = False, from_call: int = 2) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.action = action
        self.only_under_autocast = only_under_autocast
        self.from_call = from_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        triggered = self.calls >= self.from_call and (not self.only_under_autocast or torch.is_autocast_enabled(x.device.type))
        if triggered:
            if self.action == "exit":
                os._exit(3)
            if self.action == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.action == "hang":
                time.sleep(3600)
            if self.action == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (test double)")
        return self.linear(x)


def _inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 8),)


def exits(batch_size: int = 1):
    return _Misbehaving("exit"), _inputs(batch_size)


def segfaults(batch_size: int = 1):
    return _Misbehaving("segfault"), _inputs(batch_size)


def hangs(batch_size: int = 1):
    return _Misbehaving("hang"), _inputs(batch_size)


def hangs_on_first_call(batch_size: int = 1):
    return _Misbehaving("hang", from_call=1), _inputs(batch_size)


def runs_out_of_memory(batch_size: int = 1):
    return _Misbehaving("oom"), _inputs(batch_size)


def exits_under_autocast(batch_size: int = 1):
    return _Misbehaving("exit", only_under_autocast=True), _inputs(batch_size)


def raises(batch_size: int = 1):
    raise ValueError("weights file /nonexistent/model.pt is missing")


class WithExampleInputs(nn.Module):
    """A factory may return just a model that knows its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def example_inputs(self, batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 16)


def model_only():
    return WithExampleInputs()


def steady(batch_size: int = 1):
    """Forward calls of several milliseconds (fp32 or bf16): long enough that a busy machine slows the latency
    pass as much as the energy window, so that contention alone does not get a run flagged "repeat this run"
    (a sub-millisecond call is timed between preemptions in the latency pass but not in the window)."""
    torch.manual_seed(0)
    return nn.Linear(1024, 1024).eval(), (torch.randn(64 * batch_size, 1024),)


def linear(batch_size: int = 1, features: int = 32):
    return nn.Linear(features, features), (torch.randn(batch_size, features),)


class _Pointwise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2.0 + 1.0


def pointwise(batch_size: int = 1):
    """One fused pointwise kernel: on a CPU, Inductor generates and builds C++ for it (a Linear layer calls a
    library matmul and builds nothing), and so picks the CPU's vector instructions first."""
    return _Pointwise(), (torch.randn(batch_size, 64),)


not_callable = 42


def parallel_at_build(batch_size: int = 1):
    """Runs a multi-threaded matmul while it is built, as weight initialisation may: in a zygote that kept
    torch's OpenMP pool for this, a forked worker would hang in its first parallel region."""
    weight = torch.randn(512, 512)
    mixed = weight @ weight.T / 512.0
    linear = nn.Linear(512, 512)
    with torch.no_grad():
        linear.weight.copy_(mixed)
    return linear, (torch.randn(max(batch_size, 64), 512),)


def dict_inputs(batch_size: int = 1):
    """A factory that returns its inputs as keyword inputs (a dict), which joulepilot does not pass."""
    model = torch.nn.Linear(4, 2)
    return model, {"input": torch.randn(batch_size, 4)}
