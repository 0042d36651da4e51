"""The compile window metered on both sides: the GPU, and the CPU that Inductor compiles on.

A GPU run's meter reads the card alone (NVML), but the first call's compilation is CPU work: Dynamo
traces in the worker process and Inductor compiles kernels there and in its pool of compile-worker
processes (children of the worker). So the compile window gets a second meter for the CPU when the run's
meter has none: RAPL package and DRAM zones where they can be read, else the labelled estimate of the
worker's process tree (CPU seconds of the worker and every descendant x watts per busy core), which is
what the lent GPU machines give (their RAPL counters are root-only). A CPU run's meter already reads the
CPU, so its compile window needs no second one.

The result holds each part with its source (see `joulepilot.store.compile_energy`) and
`compile_energy_j`, their sum.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from joulepilot.telemetry import DeviceEnergy, EnergyMeter, Measurement, TelemetryError

log = logging.getLogger("joulepilot.bench")

CPU_KINDS = ("cpu", "dram")


def open_cpu_meter(run_meter: Any) -> tuple[EnergyMeter | None, str | None]:
    """(a CPU meter for the compile window, None) when `run_meter` meters no CPU; (None, None) when it does;
    (None, why) when no CPU meter can be opened, so the CPU part is left "not metered" with the reason."""
    if any(device.kind in CPU_KINDS for device in run_meter.devices):
        return None, None
    try:
        return EnergyMeter("cpu", sampler=False), None
    except (TelemetryError, OSError) as exc:
        log.warning("the CPU part of compile energy is not metered: %s", exc)
        return None, str(exc)


def _is_cpu(device: DeviceEnergy) -> bool:
    return device.device.split(":", 1)[0] in CPU_KINDS


def _part(devices: Iterable[DeviceEnergy]) -> tuple[float | None, str | None]:
    devices = list(devices)
    if not devices:
        return None, None
    return sum(d.energy_j for d in devices), "+".join(sorted({d.source for d in devices if d.source})) or None


def compile_energy_fields(run_window: Measurement, cpu_window: Measurement | None,
                          cpu_error: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run's compile-energy columns, the compile window's record for `extra`) from the window of the
    run's meter and, when one was opened, that of the CPU meter."""
    devices = list(run_window.devices) + (list(cpu_window.devices) if cpu_window is not None else [])
    gpu_j, gpu_source = _part(d for d in devices if not _is_cpu(d))
    cpu_j, cpu_source = _part(d for d in devices if _is_cpu(d))
    columns = {
        "compile_energy_j": sum(d.energy_j for d in devices),
        "compile_energy_gpu_j": gpu_j,
        "compile_energy_gpu_source": gpu_source,
        "compile_energy_cpu_j": cpu_j,
        "compile_energy_cpu_source": cpu_source,
    }
    record: dict[str, Any] = {
        "duration_s": run_window.duration_s,
        "sources": sorted({d.source for d in devices if d.source}),
        "devices": [d.to_dict() for d in devices],
    }
    if cpu_error:
        record["cpu_meter_error"] = cpu_error
    return columns, record
