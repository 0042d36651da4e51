"""A small plain-torch model over token sequences of any length, for the shape-set tests.

`build(batch_size, seq_len)` is a `package.module:factory` workload (`tests.shape_workloads:build`): an
embedding, a mean over the sequence mixed back into every position, and a linear head, so its compute
grows with the sequence length and a static compile needs one graph per length. `build_linear` is one Linear
layer over float sequences, for the test that compiles a shape set with real Inductor.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 50
WIDTH = 16


class SequenceMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.mix(x.mean(dim=1, keepdim=True))
        return self.head(torch.relu(x))


def build(batch_size: int, seq_len: int | None = None) -> tuple[nn.Module, tuple]:
    length = seq_len or 8
    generator = torch.Generator().manual_seed(7)
    return SequenceMixer(), (torch.randint(0, VOCAB, (batch_size, length), generator=generator),)


def build_linear(batch_size: int, seq_len: int | None = None) -> tuple[nn.Module, tuple]:
    """One Linear layer over float sequences of any length (`tests.shape_workloads:build_linear`). Inductor
    compiles it to a matrix multiply from its library with no C++ kernel to build, so a test of how real Inductor
    compiles meet a shape set pays for the compiles' passes, not for a C++ build per size."""
    length = seq_len or 8
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    return nn.Linear(WIDTH, 4), (torch.randn(batch_size, length, WIDTH, generator=generator),)
