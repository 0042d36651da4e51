"""What a GPU is doing right now: utilisation, the processes on it and its energy counter (for idle checks,
attribution, and an idle baseline taken over a quiet period)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from types import ModuleType

from .errors import NvmlNotSupported, TelemetryError, nvml_errors
from .nvml import load_pynvml, visible_nvml_indices

NVML_ERROR_NOT_FOUND = 6  # nvmlDeviceGetProcessUtilization: no samples since the given timestamp


@dataclass
class GpuActivity:
    """Utilisation of one GPU. Without NVML it reports 0 % and no processes, with `available=False`
    and the reason, so callers never branch on None."""

    utilization_pct: float
    compute_pids: list[int] = field(default_factory=list)
    process_utilization: dict[int, float] | None = None  # pid -> SM %, None where unsupported
    available: bool = True
    reason: str = ""
    memory_utilization_pct: float | None = None
    energy_j: float | None = None  # NVML's energy counter (since the driver loaded), None where unsupported

    @classmethod
    def unavailable(cls, reason: str) -> GpuActivity:
        return cls(utilization_pct=0.0, compute_pids=[], process_utilization=None, available=False,
                   reason=f"no NVML: {reason}")

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_activity(index: int = 0, *, nvml: ModuleType | None = None, window_s: float = 2.0) -> GpuActivity:
    """Activity of cuda:<index> as this process numbers GPUs (CUDA_VISIBLE_DEVICES honoured)."""
    try:
        nvml = nvml if nvml is not None else load_pynvml()
        with nvml_errors("nvmlInit"):
            nvml.nvmlInit()
    except TelemetryError as exc:
        return GpuActivity.unavailable(str(exc))
    try:
        visible = visible_nvml_indices(nvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not 0 <= index < len(visible):
            return GpuActivity.unavailable(f"cuda:{index} is not visible ({len(visible)} GPU(s) visible)")
        device = f"gpu:{index}"
        with nvml_errors("nvmlDeviceGetHandleByIndex", device):
            handle = nvml.nvmlDeviceGetHandleByIndex(visible[index])
        with nvml_errors("nvmlDeviceGetUtilizationRates", device):
            rates = nvml.nvmlDeviceGetUtilizationRates(handle)
        with nvml_errors("nvmlDeviceGetComputeRunningProcesses", device):
            pids = sorted({int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)})
        return GpuActivity(
            utilization_pct=float(rates.gpu),
            compute_pids=pids,
            process_utilization=_process_utilization(nvml, handle, device, window_s),
            memory_utilization_pct=float(rates.memory),
            energy_j=_energy_j(nvml, handle, device),
        )
    except TelemetryError as exc:
        return GpuActivity.unavailable(str(exc))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a failed session must not mask the result
            pass


def _energy_j(nvml: ModuleType, handle, device: str) -> float | None:
    """The GPU's energy counter in joules (NVML counts millijoules), None where the GPU has none."""
    if not hasattr(nvml, "nvmlDeviceGetTotalEnergyConsumption"):
        return None
    try:
        with nvml_errors("nvmlDeviceGetTotalEnergyConsumption", device):
            return float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle)) / 1000.0
    except TelemetryError:
        return None


def _process_utilization(nvml: ModuleType, handle, device: str, window_s: float) -> dict[int, float] | None:
    if not hasattr(nvml, "nvmlDeviceGetProcessUtilization"):
        return None
    since_us = int((time.time() - window_s) * 1e6)
    try:
        with nvml_errors("nvmlDeviceGetProcessUtilization", device):
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except NvmlNotSupported:
        return None
    except TelemetryError as exc:
        if getattr(exc, "code", None) == NVML_ERROR_NOT_FOUND:
            return {}  # no process used the GPU during the window
        raise
    latest: dict[int, tuple[int, float]] = {}
    for s in samples:
        pid, stamp = int(s.pid), int(s.timeStamp)
        if pid not in latest or stamp >= latest[pid][0]:
            latest[pid] = (stamp, float(s.smUtil))
    return {pid: util for pid, (_, util) in latest.items()}
