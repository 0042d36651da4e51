"""Small plain-torch models for the tests of what a run reports about its output, used
as workload specs `<path>/tests/output_models.py:<factory>` (in the test process or in a worker)."""

from __future__ import annotations

import torch
from torch import nn


class PrintAndBranch(nn.Module):
    """Two graph breaks under Dynamo: a print() and a branch on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        print("", end="")  # prints nothing, but Dynamo cannot trace print
        if x.sum() > 0:
            x = x * 2
        return torch.relu(x) + 1


def print_and_branch(batch_size: int = 2):
    return PrintAndBranch(), (torch.randn(batch_size, 8),)


class ScalarOutput(nn.Module):
    """Returns Python numbers, no tensors: there is nothing for the numerical check to compare."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> dict[str, float]:
        y = self.linear(x)
        return {"total": float(y.sum()), "peak": float(y.max())}


def scalar_output(batch_size: int = 2):
    return ScalarOutput(), (torch.randn(batch_size, 8),)
