"""Three small models in plain torch, sized so a cold Inductor compile on a laptop CPU takes seconds.

They stand in for the three shapes of real work (dense layers, convolutions, attention) in CI and in
the README's first command.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 256, hidden: int = 512, out_features: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self, channels: int = 3, width: int = 32, classes: int = 10) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.features = nn.Sequential(
            block(channels, width), nn.MaxPool2d(2),
            block(width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, 4 * width),
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class EncoderLayer(nn.Module):
    """Pre-norm attention + MLP block written out with scaled_dot_product_attention (no fast-path surprises)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 1000, d_model: int = 128, heads: int = 4, layers: int = 2,
                 max_len: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, max_len, d_model) / math.sqrt(d_model))
        self.layers = nn.ModuleList(EncoderLayer(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def build_mlp(batch_size: int, generator: torch.Generator, **_: object) -> tuple[nn.Module, tuple]:
    model = MLP()
    return model, (torch.randn(batch_size, 256, generator=generator),)


def build_convnet(batch_size: int, generator: torch.Generator, image_size: int | None = None,
                  **_: object) -> tuple[nn.Module, tuple]:
    size = image_size or 32
    return ConvNet(), (torch.randn(batch_size, 3, size, size, generator=generator),)


def build_transformer(batch_size: int, generator: torch.Generator, seq_len: int | None = None,
                      **_: object) -> tuple[nn.Module, tuple]:
    length = seq_len or 64
    model = TinyTransformer(max_len=max(512, length))
    return model, (torch.randint(0, 1000, (batch_size, length), generator=generator),)


BUILTIN = {"mlp": build_mlp, "convnet": build_convnet, "transformer": build_transformer}
