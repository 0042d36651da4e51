"""The meter interface shared by every device kind, and the null object for absent hardware."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import ClassVar

SOURCES = ("nvml", "rapl", "estimate")


@dataclass(frozen=True)
class DeviceInfo:
    """One metered device. `id` is stable within a host: `gpu:<index>`, `cpu:<socket>`, `dram:<socket>`."""

    id: str
    kind: str  # "gpu" | "cpu" | "dram"
    source: str  # "nvml" | "rapl" | "estimate"
    name: str = ""
    index: int = 0
    uuid: str = ""
    driver: str = ""
    power_limit_w: float | None = None
    memory_bytes: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class Meter(ABC):
    """Reads cumulative energy (and, where the hardware allows, instant power) for one device kind.

    `energy_j()` returns counters that only grow during the meter's life: wraparound of the
    underlying hardware counter is handled inside the meter, never by callers.
    """

    source: ClassVar[str] = ""

    @abstractmethod
    def devices(self) -> list[DeviceInfo]: ...

    @abstractmethod
    def energy_j(self) -> dict[str, float]:
        """Cumulative joules per device id since an arbitrary origin."""

    def power_w(self) -> dict[str, float]:
        """Instant power per device id; empty when the hardware has no instant reading."""
        return {}

    def sync(self) -> None:  # noqa: B027 - optional hook, a no-op for most meters
        """Wait for queued device work so a reading covers it (a GPU meter synchronises CUDA)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release handles."""

    def methods(self) -> dict[str, dict[str, str]]:
        """How each device's energy and power are obtained (provenance), e.g. {"gpu:0": {"energy": "counter"}}."""
        return {}

    @property
    def has_instant_power(self) -> bool:
        """True when `power_w()` reads the hardware; otherwise power is derived from energy deltas."""
        return False

    @property
    def active(self) -> bool:
        return bool(self.devices())


class NullMeter(Meter):
    """Stands in when a device kind is absent, so callers never branch on None."""

    source = "none"

    def __init__(self, reason: str = "no hardware") -> None:
        self.reason = reason

    def devices(self) -> list[DeviceInfo]:
        return []

    def energy_j(self) -> dict[str, float]:
        return {}


@dataclass
class DeviceEnergy:
    """What one device spent during one window."""

    device: str
    source: str
    energy_j: float
    duration_s: float
    idle_power_w: float | None = None
    peak_power_w: float | None = None
    samples: int = 0  # power samples taken for this device during the window
    method: str = ""  # how the energy was obtained, e.g. "counter", "power-integration", "cpu-time x 10 W/core"

    @property
    def avg_power_w(self) -> float:
        return self.energy_j / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def energy_above_idle_j(self) -> float | None:
        if self.idle_power_w is None:
            return None
        return max(0.0, self.energy_j - self.idle_power_w * self.duration_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["avg_power_w"] = self.avg_power_w
        d["energy_above_idle_j"] = self.energy_above_idle_j
        return d


@dataclass
class Measurement:
    """One closed window: its duration and the energy of every metered device."""

    name: str
    start_time: float
    duration_s: float
    devices: list[DeviceEnergy] = field(default_factory=list)
    # (seconds since the window opened, device id, watts) from the background sampler
    samples: list[tuple[float, str, float]] = field(default_factory=list)

    @property
    def energy_j(self) -> float:
        return sum(d.energy_j for d in self.devices)

    @property
    def sources(self) -> list[str]:
        return sorted({d.source for d in self.devices})

    @property
    def energy_above_idle_j(self) -> float | None:
        """Above-idle joules of all devices, or None unless every device has an idle baseline."""
        values = [d.energy_above_idle_j for d in self.devices]
        if not values or any(v is None for v in values):
            return None
        return sum(values)

    @property
    def idle_power_w(self) -> float | None:
        values = [d.idle_power_w for d in self.devices]
        if not values or any(v is None for v in values):
            return None
        return sum(values)

    @property
    def avg_power_w(self) -> float:
        return self.energy_j / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def peak_power_w(self) -> float | None:
        """Peak of the summed power of all devices: the highest sum at one sampler tick, at least any one
        device's peak and the window's mean power (which bound it from below); None without a sampler."""
        by_tick: dict[float, float] = {}
        for t_s, _device, power_w in self.samples:
            by_tick[t_s] = by_tick.get(t_s, 0.0) + power_w
        peaks = [*by_tick.values(), *(d.peak_power_w for d in self.devices if d.peak_power_w is not None)]
        return max(*peaks, self.avg_power_w) if peaks else None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "start_time": self.start_time,
            "duration_s": self.duration_s,
            "energy_j": self.energy_j,
            "energy_above_idle_j": self.energy_above_idle_j,
            "idle_power_w": self.idle_power_w,
            "avg_power_w": self.avg_power_w,
            "peak_power_w": self.peak_power_w,
            "sources": self.sources,
            "devices": [d.to_dict() for d in self.devices],
            "samples": [list(s) for s in self.samples],
        }
