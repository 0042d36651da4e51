"""A custom workload for `joulepilot bench`: any importable `module:factory` (or `path/to/file.py:factory`).

    joulepilot bench examples/custom_workload.py:build --batch-size 16 --seq-len 64
    joulepilot bench examples.custom_workload:build_model_only --batch-size 16     # from the repository root

The factory is called with whichever of `batch_size`, `seq_len`, `image_size` and `device` it accepts,
and returns either `(model, example_inputs)` or a model with an `example_inputs(batch_size)` method.
joulepilot moves both to the benchmark device, puts the model in eval mode, and compares the
configured model's output with eager fp32 on the same inputs, so the forward should return tensors
(a tensor, or tuples/dicts of tensors). Build weights however you like; nothing is downloaded for you.
"""

from __future__ import annotations

import torch
from torch import nn


class TokenClassifier(nn.Module):
    """Token embedding, a residual MLP mixer and a classification head: small and compile-friendly."""

    def __init__(self, vocab: int = 4096, width: int = 256, classes: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.head = nn.Linear(width, classes)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.mix(x)
        return self.head(x.mean(dim=1))

    def example_inputs(self, batch_size: int, seq_len: int = 64) -> torch.Tensor:
        return torch.randint(0, self.vocab, (batch_size, seq_len))


def build(batch_size: int, seq_len: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return the model and its example inputs for one forward call of `batch_size` samples."""
    model = TokenClassifier()
    return model, (model.example_inputs(batch_size, seq_len or 64),)


def build_model_only() -> nn.Module:
    """Or return just the model; its `example_inputs(batch_size)` supplies the inputs."""
    return TokenClassifier()
