"""The adapter that gives a transformers model the workloads' calling convention: forward(x) -> one tensor.

It lives at module level, not inside the function that builds the model, so torch can save a compiled
frame of it by reference (Dynamo's precompile refuses classes defined in a function)."""

from __future__ import annotations

import torch
from torch import nn


class HiddenStates(nn.Module):
    """forward(x) returns one tensor (last_hidden_state), so outputs can be compared with eager."""

    def __init__(self, inner: nn.Module, input_name: str) -> None:
        super().__init__()
        self.inner = inner
        self.input_name = input_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(**{self.input_name: x}, return_dict=True)
        hidden = getattr(out, "last_hidden_state", None)
        return hidden if hidden is not None else out[0]
