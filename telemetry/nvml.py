"""NVIDIA GPUs through NVML (the `nvidia-ml-py` binding, imported as `pynvml`). Read-only: no nvmlDeviceSet*.

Energy comes from the driver's cumulative counter (nvmlDeviceGetTotalEnergyConsumption, mJ, Volta and
newer). Where a GPU lacks it, instant power is integrated (trapezoid) by a background thread. Instant
power comes from the field API (NVML_FI_DEV_POWER_INSTANT); nvmlDeviceGetPowerUsage is used only when
that field is unsupported, because on Hopper it is a 1-s running average.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .base import DeviceInfo, Meter
from .errors import (
    MeterUnavailable,
    NvmlNotSupported,
    TelemetryError,
    map_nvml_error,
    nvml_errors,
)

NVML_FI_DEV_POWER_INSTANT = 186  # nvml.h field id; read from the binding when it defines it
ENERGY_COUNTER = "counter"
ENERGY_INTEGRATED = "power-integration"
POWER_INSTANT_FIELD = "instant-field"
POWER_USAGE_AVG = "power-usage"  # nvmlDeviceGetPowerUsage: a 1-s average on Hopper
POWER_NONE = "none"

_UNSET: Any = object()


def load_pynvml() -> ModuleType:
    """Import the NVML binding (tests put a double in sys.modules['pynvml'])."""
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise map_nvml_error(exc, "import pynvml") from exc


def visible_nvml_indices(nvml: ModuleType, cuda_visible_devices: str | None) -> list[int]:
    """NVML indices of the GPUs this process sees, in CUDA order (position = torch's cuda index).

    Follows CUDA's parsing: a comma list of indices and/or UUIDs ('GPU-' plus a unique prefix);
    parsing stops at the first invalid, unknown or repeated entry; an empty value hides every GPU.
    NVML numbers GPUs in PCI bus order; set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA uses the same order.
    """
    with nvml_errors("nvmlDeviceGetCount"):
        count = int(nvml.nvmlDeviceGetCount())
    if cuda_visible_devices is None:
        return list(range(count))
    uuids: list[str] | None = None
    chosen: list[int] = []
    for raw in cuda_visible_devices.split(","):
        token = raw.strip()
        index: int | None = None
        if token.isdigit():
            index = int(token) if int(token) < count else None
        elif token.upper().startswith("GPU-"):
            if uuids is None:
                uuids = []
                for i in range(count):
                    with nvml_errors("nvmlDeviceGetUUID", f"nvml index {i}"):
                        uuids.append(str(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))))
            matches = [i for i, u in enumerate(uuids) if u.lower().startswith(token.lower())]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in chosen:
            break
        chosen.append(index)
    return chosen


def _field_value(value: Any) -> float:
    """The number inside an nvmlFieldValue_t, whatever its declared type."""
    kind = getattr(value, "valueType", 1)
    union = value.value
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(kind, "uiVal")
    return float(getattr(union, attr))


@dataclass
class _Gpu:
    info: DeviceInfo
    handle: Any
    energy_method: str
    power_method: str


class NvmlMeter(Meter):
    """Energy and instant power of the visible GPUs (all of them, or the given process indices)."""

    source = "nvml"

    def __init__(
        self,
        indices: Sequence[int] | None = None,
        *,
        nvml: ModuleType | None = None,
        cuda_visible_devices: str | None = _UNSET,
        integrate_hz: float = 10.0,
    ) -> None:
        self._nvml = nvml if nvml is not None else load_pynvml()
        if cuda_visible_devices is _UNSET:
            cuda_visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.cuda_visible_devices = cuda_visible_devices
        self._field_id = getattr(self._nvml, "NVML_FI_DEV_POWER_INSTANT", NVML_FI_DEV_POWER_INSTANT)
        self._gpus: list[_Gpu] = []
        self._integrator: _PowerIntegrator | None = None
        self._open = False
        with nvml_errors("nvmlInit"):
            self._nvml.nvmlInit()
        self._open = True
        try:
            self._discover(indices, integrate_hz)
        except BaseException:
            self.close()
            raise

    # -- discovery -------------------------------------------------------------------------------
    def _discover(self, indices: Sequence[int] | None, integrate_hz: float) -> None:
        nvml = self._nvml
        visible = visible_nvml_indices(nvml, self.cuda_visible_devices)
        if not visible:
            raise MeterUnavailable(
                "NVML: no GPU visible to this process"
                + (f" (CUDA_VISIBLE_DEVICES={self.cuda_visible_devices!r})" if self.cuda_visible_devices is not None else "")
            )
        wanted = list(range(len(visible))) if indices is None else list(indices)
        for proc_index in wanted:
            if not 0 <= proc_index < len(visible):
                raise MeterUnavailable(
                    f"NVML: cuda:{proc_index} does not exist; {len(visible)} GPU(s) visible"
                    + (f" with CUDA_VISIBLE_DEVICES={self.cuda_visible_devices!r}" if self.cuda_visible_devices is not None else "")
                )
        driver = self._optional(lambda: str(nvml.nvmlSystemGetDriverVersion()), "nvmlSystemGetDriverVersion") or ""
        for proc_index in wanted:
            device_id = f"gpu:{proc_index}"
            with nvml_errors("nvmlDeviceGetHandleByIndex", device_id):
                handle = nvml.nvmlDeviceGetHandleByIndex(visible[proc_index])
            limit_mw = self._optional(lambda h=handle: nvml.nvmlDeviceGetEnforcedPowerLimit(h), "nvmlDeviceGetEnforcedPowerLimit", device_id)
            memory = self._optional(lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h), "nvmlDeviceGetMemoryInfo", device_id)
            info = DeviceInfo(
                id=device_id,
                kind="gpu",
                source=self.source,
                name=str(self._optional(lambda h=handle: nvml.nvmlDeviceGetName(h), "nvmlDeviceGetName", device_id) or ""),
                index=proc_index,
                uuid=str(self._optional(lambda h=handle: nvml.nvmlDeviceGetUUID(h), "nvmlDeviceGetUUID", device_id) or ""),
                driver=driver,
                power_limit_w=None if limit_mw is None else float(limit_mw) / 1000.0,
                memory_bytes=None if memory is None else int(memory.total),
            )
            gpu = _Gpu(info, handle, ENERGY_COUNTER, POWER_INSTANT_FIELD)
            gpu.power_method = self._probe_power(gpu)
            gpu.energy_method = self._probe_energy(gpu)
            self._gpus.append(gpu)
        integrated = [g for g in self._gpus if g.energy_method == ENERGY_INTEGRATED]
        if integrated:
            self._integrator = _PowerIntegrator(self, integrated, integrate_hz)

    def _optional(self, fn, call: str, device: str = ""):
        """Descriptive fields: unsupported is fine (None); a lost GPU or missing driver is not."""
        try:
            with nvml_errors(call, device):
                return fn()
        except NvmlNotSupported:
            return None

    def _probe_energy(self, gpu: _Gpu) -> str:
        try:
            with nvml_errors("nvmlDeviceGetTotalEnergyConsumption", gpu.info.id):
                self._nvml.nvmlDeviceGetTotalEnergyConsumption(gpu.handle)
            return ENERGY_COUNTER
        except NvmlNotSupported:
            if gpu.power_method == POWER_NONE:
                raise NvmlNotSupported(
                    f"NVML {gpu.info.id} ({gpu.info.name}): neither the energy counter nor any power reading "
                    "is supported; this GPU cannot be metered") from None
            return ENERGY_INTEGRATED

    def _probe_power(self, gpu: _Gpu) -> str:
        try:
            self._read_instant_field(gpu)
            return POWER_INSTANT_FIELD
        except NvmlNotSupported:
            pass
        try:
            with nvml_errors("nvmlDeviceGetPowerUsage", gpu.info.id):
                self._nvml.nvmlDeviceGetPowerUsage(gpu.handle)
            return POWER_USAGE_AVG
        except NvmlNotSupported:
            return POWER_NONE

    # -- readings --------------------------------------------------------------------------------
    def _read_instant_field(self, gpu: _Gpu) -> float:
        with nvml_errors("nvmlDeviceGetFieldValues(NVML_FI_DEV_POWER_INSTANT)", gpu.info.id):
            values = self._nvml.nvmlDeviceGetFieldValues(gpu.handle, [self._field_id])
        status = int(getattr(values[0], "nvmlReturn", 0))
        if status != 0:  # the call succeeded but this field failed; map its own return code
            raise map_nvml_error(_Code(status), "NVML_FI_DEV_POWER_INSTANT", gpu.info.id)
        return _field_value(values[0]) / 1000.0

    def _read_power_w(self, gpu: _Gpu) -> float | None:
        if gpu.power_method == POWER_INSTANT_FIELD:
            return self._read_instant_field(gpu)
        if gpu.power_method == POWER_USAGE_AVG:
            with nvml_errors("nvmlDeviceGetPowerUsage", gpu.info.id):
                return float(self._nvml.nvmlDeviceGetPowerUsage(gpu.handle)) / 1000.0
        return None

    def devices(self) -> list[DeviceInfo]:
        return [g.info for g in self._gpus]

    def energy_j(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for gpu in self._gpus:
            if gpu.energy_method == ENERGY_COUNTER:
                with nvml_errors("nvmlDeviceGetTotalEnergyConsumption", gpu.info.id):
                    out[gpu.info.id] = float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(gpu.handle)) / 1000.0
            elif self._integrator is not None:
                out[gpu.info.id] = self._integrator.energy_j(gpu.info.id)
        return out

    def power_w(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for gpu in self._gpus:
            value = self._read_power_w(gpu)
            if value is not None:
                out[gpu.info.id] = value
        return out

    @property
    def has_instant_power(self) -> bool:
        return all(g.power_method != POWER_NONE for g in self._gpus)

    def methods(self) -> dict[str, dict[str, str]]:
        return {g.info.id: {"energy": g.energy_method, "power": g.power_method} for g in self._gpus}

    def sync(self) -> None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return  # never initialise CUDA just to synchronise it
        for gpu in self._gpus:
            cuda.synchronize(gpu.info.index)

    def close(self) -> None:
        if self._integrator is not None:
            self._integrator.stop()
            self._integrator = None
        if self._open:
            self._open = False
            try:
                with nvml_errors("nvmlShutdown"):
                    self._nvml.nvmlShutdown()
            except TelemetryError:
                pass


class _Code(Exception):
    """A bare NVML return code (from a field value) shaped like an NVMLError for map_nvml_error."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML return code {value}")
        self.value = value


class _PowerIntegrator:
    """Trapezoid integral of instant power for GPUs without an energy counter, on its own thread.

    NVML is called with no lock held; the lock only guards the accumulator update.
    """

    def __init__(self, meter: NvmlMeter, gpus: list[_Gpu], hz: float) -> None:
        self._meter = meter
        self._gpus = gpus
        self._period_s = 1.0 / hz
        self._lock = threading.Lock()
        self._energy_j = {g.info.id: 0.0 for g in gpus}
        self._last: dict[str, tuple[float, float]] = {}
        self._returned: dict[str, float] = {}
        self._stop = threading.Event()
        self.error: TelemetryError | None = None
        self._tick()
        self._thread = threading.Thread(target=self._run, name="joulepilot-nvml-integrator", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        for gpu in self._gpus:
            power = self._meter._read_power_w(gpu)
            now = time.perf_counter()
            if power is None:
                continue
            with self._lock:
                last = self._last.get(gpu.info.id)
                if last is not None:
                    t0, p0 = last
                    self._energy_j[gpu.info.id] += 0.5 * (p0 + power) * (now - t0)
                self._last[gpu.info.id] = (now, power)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self._tick()
            except TelemetryError as exc:
                self.error = exc

    def energy_j(self, device_id: str) -> float:
        if self.error is not None:
            raise self.error
        now = time.perf_counter()
        with self._lock:
            value = self._energy_j[device_id]
            last = self._last.get(device_id)
            if last is not None:  # hold the last power until now so short windows see energy
                value += last[1] * (now - last[0])
            value = max(value, self._returned.get(device_id, 0.0))
            self._returned[device_id] = value
        return value

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
