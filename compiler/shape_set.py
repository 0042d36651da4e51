"""A set of input shapes a model is served with, each with its share of the calls, and its padding buckets.

Torch-free, like the rest of the configuration vocabulary: a policy names its shape set, the planner and
the store key runs by it, and the worker (`compiler.shapes`) measures it. One workload argument varies
(`seq_len` or `image_size`); the others stay as the workload sets them.

Padding (`CompileConfig.padding = "buckets"`) runs each size as its bucket: the smallest bucket at least
as large, from the set's `buckets`, or the next power of two when it names none. A static compile then
sees one shape per bucket instead of one per size, and the padded positions are computed (and metered)
like any others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import CompileConfig
from .options import ConfigError

SHAPE_DIMS = ("seq_len", "image_size")
# Each size is measured on its own (first call, warm-up, latency pass, energy window), so a set is bounded.
MAX_SHAPES = 16
# A size or bucket past this can only be a typo (as a policy bounds them): refused before a worker builds it.
MAX_SHAPE_SIZE = 1 << 20


def next_power_of_two(size: int) -> int:
    return 1 << (int(size) - 1).bit_length()


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SHAPE_SIZE


@dataclass(frozen=True)
class ShapeSet:
    """`sizes` of the `dim` workload argument, ascending, with relative `weights` (default: equal) and the
    padding `buckets` (ascending; empty: powers of two). Raises ConfigError on anything else."""

    dim: str
    sizes: tuple[int, ...]
    weights: tuple[float, ...] = field(default=())
    buckets: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.dim not in SHAPE_DIMS:
            raise ConfigError(f"a shape set varies one of {', '.join(SHAPE_DIMS)}, not {self.dim!r}")
        sizes = list(self.sizes)
        if not sizes or not all(_positive_int(s) for s in sizes):
            raise ConfigError(f"shape set sizes must be positive integers of at most {MAX_SHAPE_SIZE:,}, "
                              f"got {self.sizes!r}")
        if len(set(sizes)) != len(sizes):
            raise ConfigError(f"shape set sizes must be distinct, got {self.sizes!r}")
        if len(sizes) > MAX_SHAPES:
            raise ConfigError(f"a shape set holds at most {MAX_SHAPES} sizes (each is measured on its own), "
                              f"got {len(sizes)}")
        weights = list(self.weights) or [1.0] * len(sizes)
        if len(weights) != len(sizes):
            raise ConfigError(f"a shape set needs one weight per size: {len(sizes)} sizes, {len(weights)} weights")
        if not all(isinstance(w, int | float) and not isinstance(w, bool) and 0 < w < float("inf") for w in weights):
            raise ConfigError(f"shape set weights must be positive numbers, got {self.weights!r}")
        buckets = sorted(self.buckets)
        if not all(_positive_int(b) for b in buckets) or len(set(buckets)) != len(buckets):
            raise ConfigError(f"padding buckets must be distinct positive integers of at most {MAX_SHAPE_SIZE:,}, "
                              f"got {self.buckets!r}")
        if buckets and buckets[-1] < max(sizes):
            raise ConfigError(f"the largest padding bucket ({buckets[-1]}) is below the largest size ({max(sizes)}); "
                              "every size needs a bucket at least as large")
        pairs = sorted(zip(sizes, weights, strict=True))
        object.__setattr__(self, "sizes", tuple(int(s) for s, _ in pairs))
        object.__setattr__(self, "weights", tuple(float(w) for _, w in pairs))
        object.__setattr__(self, "buckets", tuple(buckets))

    # --- what is run --------------------------------------------------------------------------------
    @property
    def shares(self) -> tuple[float, ...]:
        """Each size's share of the calls (the weights, normalised to sum to 1)."""
        largest = max(self.weights)  # scaled first: weights near the float maximum would sum to inf
        scaled = [w / largest for w in self.weights]
        total = sum(scaled)
        return tuple(w / total for w in scaled)

    def bucket_for(self, size: int) -> int:
        """The size `size` is padded up to: the smallest bucket >= size (the next power of two by default)."""
        if not self.buckets:
            return next_power_of_two(size)
        for bucket in self.buckets:
            if bucket >= size:
                return bucket
        raise ConfigError(f"{self.dim} {size} is larger than every padding bucket ({', '.join(map(str, self.buckets))})")

    def run_size(self, size: int, padding: str) -> int:
        """The size a configuration with this `padding` actually runs for `size`."""
        return self.bucket_for(size) if padding == "buckets" else int(size)

    def run_sizes(self, padding: str) -> tuple[int, ...]:
        return tuple(self.run_size(s, padding) for s in self.sizes)

    @property
    def padding_changes_anything(self) -> bool:
        """False when every size already sits on a bucket, so padding would run exactly the same calls."""
        return self.run_sizes("buckets") != self.sizes

    # --- identity and transport -----------------------------------------------------------------------
    def key(self) -> list[Any]:
        """What identifies the set in a workload id: the sizes, their shares (so [4, 1] and [0.8, 0.2] are one
        set) and the buckets."""
        return [self.dim, list(self.sizes), [round(s, 9) for s in self.shares], list(self.buckets)]

    @property
    def label(self) -> str:
        """'seq_len 64 (40%), 128 (30%), ...; buckets 128, 512'."""
        text = f"{self.dim} " + ", ".join(f"{s} ({share:.0%})" for s, share in zip(self.sizes, self.shares, strict=True))
        return text + (f"; buckets {', '.join(map(str, self.buckets))}" if self.buckets else "")

    def to_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, "sizes": list(self.sizes), "weights": list(self.weights), "buckets": list(self.buckets)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShapeSet:
        return cls(dim=data["dim"], sizes=tuple(data["sizes"]), weights=tuple(data.get("weights") or ()),
                   buckets=tuple(data.get("buckets") or ()))


def parse_shape_set(text: str, buckets: str | None = None) -> ShapeSet:
    """`seq_len=64:4,128:3,256:2,512:1` (size:weight; a size without a weight weighs 1) and optional buckets
    `128,512`, as `bench --shapes` and `--buckets` take them. Raises ConfigError saying what to write."""
    example = "write e.g. seq_len=64:4,128:3,256:2,512:1 (size:weight, weight optional)"
    dim, sep, rest = text.partition("=")
    dim = dim.strip()
    if not sep or dim not in SHAPE_DIMS:
        raise ConfigError(f"shape set {text!r} must start with seq_len= or image_size=; {example}")
    sizes: list[int] = []
    weights: list[float] = []
    for item in (part.strip() for part in rest.split(",")):
        size, _, weight = item.partition(":")
        try:
            sizes.append(int(size))
            weights.append(float(weight) if weight.strip() else 1.0)
        except ValueError:
            raise ConfigError(f"shape set {text!r}: {item!r} is not SIZE or SIZE:WEIGHT; {example}") from None
    try:
        bucket_sizes = tuple(int(b) for b in buckets.split(",") if b.strip()) if buckets else ()
    except ValueError:
        raise ConfigError(f"buckets {buckets!r} must be a comma list of sizes, e.g. 128,512") from None
    return ShapeSet(dim=dim, sizes=tuple(sizes), weights=tuple(weights), buckets=bucket_sizes)


def shape_set_variants(configs: list[CompileConfig], shapes: ShapeSet,
                       dynamics: tuple[bool, ...] = (False, True)) -> list[CompileConfig]:
    """Each compiled configuration static and dynamic, unpadded and padded to buckets (padded only when that
    changes some size); eager once, as it compiles nothing. Order kept, duplicates dropped."""
    paddings = ("none", "buckets") if shapes.padding_changes_anything else ("none",)
    seen: set[str] = set()
    out: list[CompileConfig] = []
    for config in configs:
        variants = [config.replace(dynamic=False, padding="none")] if not config.compiles else \
            [config.replace(dynamic=d, padding=p) for d in dynamics for p in paddings]
        for variant in variants:
            if variant.id not in seen:
                seen.add(variant.id)
                out.append(variant)
    return out
