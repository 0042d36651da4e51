"""Which meters can run on this host, and why the others cannot."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any

from .base import Meter, NullMeter
from .errors import MeterUnavailable, TelemetryError
from .estimate import ENV_W_PER_CORE, EstimateMeter
from .nvml import ENERGY_INTEGRATED, POWER_INSTANT_FIELD, NvmlMeter
from .rapl import RaplMeter

log = logging.getLogger("joulepilot.telemetry")


@dataclass
class MeterStatus:
    name: str  # "nvml" | "rapl" | "estimate"
    active: bool
    devices: list[str] = field(default_factory=list)
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def parse_device(device: Any) -> tuple[str, int | None]:
    """("all", None) for None, ("cpu", None) for "cpu", ("cuda", N) for "cuda:N" (also torch.device)."""
    if device is None:
        return "all", None
    text = str(device).strip().lower()
    if text == "cpu":
        return "cpu", None
    if text == "cuda":
        return "cuda", 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise ValueError(f"device {device!r} is not one of None, 'cpu', 'cuda', 'cuda:<index>'")


def _try(factory) -> tuple[Meter | None, str]:
    try:
        return factory(), ""
    except TelemetryError as exc:
        return None, str(exc)


def open_meter(kind: str, *, nvml: ModuleType | None = None) -> Meter:
    """The meter of one kind ("nvml", "rapl", "estimate"), or a NullMeter whose `reason` says why not."""
    factories = {"nvml": lambda: NvmlMeter(nvml=nvml), "rapl": RaplMeter, "estimate": EstimateMeter}
    if kind not in factories:
        raise ValueError(f"unknown meter kind {kind!r}; known: {sorted(factories)}")
    meter, reason = _try(factories[kind])
    return meter if meter is not None else NullMeter(reason)


def detect_meters(device: Any = None, *, nvml: ModuleType | None = None, estimate_pid: int | None = None,
                  estimate_include_root: bool = True) -> list[Meter]:
    """Meters for a device choice.

    - "cuda:N": NVML for that GPU only (raises MeterUnavailable with the reason when NVML can't).
    - "cpu": RAPL when any package zone is readable, else the estimate meter.
    - None: every measured meter (NVML GPUs + RAPL); the estimate only when nothing can be measured,
      so estimated and measured joules are never summed together.
    """
    kind, index = parse_device(device)
    if kind == "cuda":
        meter, reason = _try(lambda: NvmlMeter([index], nvml=nvml))
        if meter is None:
            raise MeterUnavailable(f"cannot meter cuda:{index}: {reason}")
        return [meter]
    meters: list[Meter] = []
    if kind == "all":
        gpu, _ = _try(lambda: NvmlMeter(nvml=nvml))
        if gpu is not None:
            meters.append(gpu)
    rapl, reason = _try(RaplMeter)
    if rapl is not None:
        if rapl.permission_message:
            log.warning(rapl.permission_message)
        meters.append(rapl)
    elif kind == "cpu" or not meters:
        log.info("CPU energy is estimated (%s)", reason)
        meters.append(EstimateMeter(estimate_pid, include_root=estimate_include_root))
    return meters


def meter_status(*, nvml: ModuleType | None = None) -> list[MeterStatus]:
    """One status per meter kind: active or not, its devices, and the reason in plain words."""
    statuses: list[MeterStatus] = []

    gpu, reason = _try(lambda: NvmlMeter(nvml=nvml))
    if gpu is None:
        statuses.append(MeterStatus("nvml", False, [], reason))
    else:
        try:
            parts = []
            for device_id, how in gpu.methods().items():
                energy = "power integration (no energy counter before Volta)" if how["energy"] == ENERGY_INTEGRATED \
                    else "energy counter"
                power = {POWER_INSTANT_FIELD: "instant power field"}.get(
                    how["power"], "nvmlDeviceGetPowerUsage (averaged)" if how["power"] != "none" else "no power reading")
                parts.append(f"{device_id}: {energy}, {power}")
            info = gpu.devices()
            statuses.append(MeterStatus("nvml", True, [d.id for d in info],
                                        f"{len(info)} GPU(s), driver {info[0].driver or '?'}; " + "; ".join(parts)))
        finally:
            gpu.close()

    rapl, reason = _try(lambda: RaplMeter(background=False))
    if rapl is None:
        statuses.append(MeterStatus("rapl", False, [], reason))
    else:
        try:
            text = "package and dram zones readable" if any(d.kind == "dram" for d in rapl.devices()) \
                else "package zones readable"
            if rapl.permission_message:
                text += "; partly: " + rapl.permission_message
            statuses.append(MeterStatus("rapl", True, [d.id for d in rapl.devices()], text))
        finally:
            rapl.close()

    estimate, reason = _try(EstimateMeter)
    if estimate is None:
        statuses.append(MeterStatus("estimate", False, [], reason))
    elif rapl is None:
        statuses.append(MeterStatus(
            "estimate", True, [d.id for d in estimate.devices()],
            f"CPU energy for device 'cpu' is ESTIMATED because RAPL is unavailable: CPU time of the process tree x "
            f"{estimate.w_per_core:g} W per busy core (set {ENV_W_PER_CORE}); figures are labelled 'estimate'"))
    else:
        statuses.append(MeterStatus("estimate", False, [], "not needed: RAPL measures the CPU"))
    return statuses
