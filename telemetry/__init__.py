"""Meters: NVML for GPUs, RAPL for CPU packages and DRAM, a labelled estimate where nothing can be read."""

from .activity import GpuActivity, gpu_activity
from .base import SOURCES, DeviceEnergy, DeviceInfo, Measurement, Meter, NullMeter
from .command import measure_command
from .detect import MeterStatus, detect_meters, meter_status, open_meter, parse_device
from .errors import (
    GpuLost,
    MeterUnavailable,
    NvmlError,
    NvmlNoPermission,
    NvmlNotSupported,
    NvmlUnavailable,
    RaplPermissionError,
    TelemetryError,
)
from .estimate import DEFAULT_W_PER_CORE, EstimateMeter
from .monitor import EnergyMeter, WindowHandle
from .nvml import NvmlMeter
from .rapl import RaplMeter

__all__ = [
    "DEFAULT_W_PER_CORE",
    "SOURCES",
    "DeviceEnergy",
    "DeviceInfo",
    "EnergyMeter",
    "EstimateMeter",
    "GpuActivity",
    "GpuLost",
    "Measurement",
    "Meter",
    "MeterStatus",
    "MeterUnavailable",
    "NullMeter",
    "NvmlError",
    "NvmlMeter",
    "NvmlNoPermission",
    "NvmlNotSupported",
    "NvmlUnavailable",
    "RaplMeter",
    "RaplPermissionError",
    "TelemetryError",
    "WindowHandle",
    "detect_meters",
    "gpu_activity",
    "measure_command",
    "meter_status",
    "open_meter",
    "parse_device",
]
