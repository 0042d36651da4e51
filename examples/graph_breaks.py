"""A model that `torch.compile` cannot capture whole, for `joulepilot doctor` (README: Why compile did not pay).

    joulepilot doctor examples/graph_breaks.py:build --batch-size 8
    joulepilot doctor examples/graph_breaks.py:build_fixed --batch-size 8      # the same model, both breaks fixed

`Gated.forward` breaks Dynamo's graph twice: a print() and a Python `if` on a tensor's value. `GatedFixed`
computes the same output without either: the print runs only outside compilation, and the branch is a
torch.where.
"""

from __future__ import annotations

import torch
from torch import nn


class Gated(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        print(f"activation norm {h.norm():.3f}")
        if h.mean() > 0:
            h = h * 0.5
        return self.head(torch.relu(h))


class GatedFixed(Gated):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        if not torch.compiler.is_compiling():
            print(f"activation norm {h.norm():.3f}")
        h = torch.where(h.mean() > 0, h * 0.5, h)
        return self.head(torch.relu(h))


def build(batch_size: int = 1) -> tuple[nn.Module, tuple[torch.Tensor]]:
    return Gated(), (torch.randn(batch_size, 64),)


def build_fixed(batch_size: int = 1) -> tuple[nn.Module, tuple[torch.Tensor]]:
    return GatedFixed(), (torch.randn(batch_size, 64),)
