"""Plain-torch models made of repeated blocks, for the regional-compilation and warm-start tests.

`block_stack` is importable by a worker subprocess as `tests.block_models:block_stack`: a stem, a stack of
identical residual blocks (each a norm and a small MLP, so a block class with children) and a head.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 16


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class BlockStack(nn.Module):
    """`layers` identical Blocks between a stem and a head; `odd_block` makes the last one wider inside
    (another variant of the class)."""

    def __init__(self, layers: int = 4, width: int = WIDTH) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_stack(batch_size: int = 2, layers: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return BlockStack(layers), (torch.randn(batch_size, WIDTH),)


class BreakingBlock(Block):
    """A Block whose forward prints and branches on a tensor's value: two graph breaks per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print("block input", tuple(x.shape))
        y = self.mlp(self.norm(x))
        if y.sum() > 0:
            return x + y
        return x - y


def breaking_stack(batch_size: int = 2, layers: int = 3) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = BlockStack(layers)
    model.blocks = nn.ModuleList(BreakingBlock() for _ in range(layers))
    return model, (torch.randn(batch_size, WIDTH),)
