"""Where and with what a run was measured: host, device, driver, torch, triton and joulepilot versions."""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

from joulepilot.store import host_identity, stable_id


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def driver_version(device: str) -> str | None:
    if not str(device).startswith("cuda"):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return None


def provenance(device: str, name: str | None = None, driver: str | None = None) -> dict[str, Any]:
    """The provenance columns of a run, and `provenance_key`: equal keys mean comparable measurements.

    `name`/`driver` may come from NVML (the sweep's parent passes them, so it never opens a CUDA
    context of its own); otherwise they are asked of torch and NVML here."""
    import torch

    host = host_identity()
    fields = {
        "host_id": host["id"],
        "device_name": name or device_name(device),
        "driver_version": driver or driver_version(device),
        "torch_version": torch.__version__,
        "triton_version": package_version("triton", "pytorch-triton", "triton-xpu"),
        "joulepilot_version": package_version("joulepilot"),
    }
    fields["provenance_key"] = stable_id("provenance", fields["host_id"], fields["device_name"],
                                         fields["driver_version"], fields["torch_version"],
                                         fields["triton_version"], fields["joulepilot_version"])
    fields["hostname"] = host["hostname"]
    fields["cuda_version"] = torch.version.cuda
    fields["python_version"] = platform.python_version()
    return fields
