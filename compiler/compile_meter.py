"""The compile window metered on both sides: the GPU, and the CPU that Inductor compiles on.

A GPU run's meter reads the card alone (NVML), but the first call's compilation is CPU work: Dynamo
traces in the worker process and Inductor compiles kernels there and in its pool of compile-worker
processes (children of the worker). So the compile window gets a second meter for the CPU when the run's
meter has none: RAPL package and DRAM zones where they can be read, else the labelled estimate of the
worker's process tree (CPU seconds of the worker and every descendant x watts per busy core), which is
what the lent GPU machines give (their RAPL counters are root-only). A CPU run's meter already reads the
CPU, so its compile window needs no second one.

The result holds each part with its source (see `joulepilot.store.compile_energy`) and
`compile_energy_j`, their sum. `CompileWindow` meters one first call this way (the worker's compile, and each
later size's first call of a shape set); `summed_compile_fields` adds several such first calls part by part.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from types import TracebackType
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


class CompileWindow:
    """A first call metered as the module doc says: `with CompileWindow(meter) as window: call()`, then
    `window.columns` and `window.record` (see `compile_energy_fields`) and `window.run_window`, the run
    meter's own measurement. A call that raises leaves them unset and the run meter's window open."""

    def __init__(self, run_meter: Any, name: str = "compile") -> None:
        self._run_meter = run_meter
        self._name = name
        self._cpu_meter: EnergyMeter | None = None
        self._cpu_error: str | None = None
        self.run_window: Measurement | None = None
        self.columns: dict[str, Any] = {}
        self.record: dict[str, Any] = {}

    def __enter__(self) -> CompileWindow:
        self._cpu_meter, self._cpu_error = open_cpu_meter(self._run_meter)
        try:
            self._run_meter.begin(self._name)
            if self._cpu_meter is not None:
                self._cpu_meter.begin(self._name)
        except BaseException:
            self._close_cpu_meter()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is None:
                cpu_window = self._cpu_meter.end(self._name) if self._cpu_meter is not None else None
                self.run_window = self._run_meter.end(self._name)
                self.columns, self.record = compile_energy_fields(self.run_window, cpu_window, self._cpu_error)
        finally:
            self._close_cpu_meter()

    def _close_cpu_meter(self) -> None:
        if self._cpu_meter is not None:
            self._cpu_meter.close()
            self._cpu_meter = None


def _sources(parts: Iterable[str | None]) -> str | None:
    return "+".join(sorted({s for part in parts if part for s in part.split("+")})) or None


def summed_compile_fields(calls: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The compile-energy columns of several metered first calls (each as `compile_energy_fields` gives
    them) added part by part. A part that one of the calls did not meter is not metered for the whole
    (NULL: a partial sum would pass for a complete one); `compile_energy_j` is the sum of the parts kept."""
    columns: dict[str, Any] = {}
    for side in ("gpu", "cpu"):
        values = [call.get(f"compile_energy_{side}_j") for call in calls]
        metered = bool(values) and all(v is not None for v in values)
        columns[f"compile_energy_{side}_j"] = sum(values) if metered else None
        columns[f"compile_energy_{side}_source"] = (
            _sources(call.get(f"compile_energy_{side}_source") for call in calls) if metered else None)
    parts = [columns[f"compile_energy_{side}_j"] for side in ("gpu", "cpu")]
    kept = [p for p in parts if p is not None]
    columns["compile_energy_j"] = sum(kept) if kept else None
    return columns
