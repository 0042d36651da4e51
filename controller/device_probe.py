"""Which devices the daemon may use, and each one's kind and provenance, without a CUDA context.

The daemon process never initialises CUDA (a context would hold GPU memory on production GPUs):
GPU names and drivers come from NVML, as the compiler's sweep does, so the provenance key computed
here equals the one the benchmark worker stamps on its runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from joulepilot.store.devicekind import device_kind
from joulepilot.store.safeio import shorten

log = logging.getLogger(__name__)
DEVICE_ERROR_CHARS = 300  # what a device's error may take in a log line, a heartbeat or the pass summary


class DeviceUnavailable(RuntimeError):
    """A device of the config's `devices` that cannot be metered; the message names it, why, and the fix."""


@dataclass(frozen=True)
class DeviceProbe:
    device: str  # 'cuda:0' | 'cpu'
    device_kind: str  # the GPU's name, or 'cpu' (as the resolver and the deployment guard key decisions)
    provenance_key: str
    provenance: dict[str, Any]


def visible_gpu_count() -> int:
    """GPUs this process sees through NVML (CUDA_VISIBLE_DEVICES honoured); 0 without NVML."""
    try:
        from joulepilot.telemetry.nvml import load_pynvml, visible_nvml_indices

        nvml = load_pynvml()
        nvml.nvmlInit()
    except Exception:
        return 0
    try:
        return len(visible_nvml_indices(nvml, os.environ.get("CUDA_VISIBLE_DEVICES")))
    except Exception:
        return 0
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def allowed_devices(spec: Sequence[str]) -> list[str]:
    """Torch device strings from the config's `devices`: 'auto' is every visible GPU, else the CPU."""
    out: list[str] = []
    for item in spec:
        if item == "auto":
            count = visible_gpu_count()
            out.extend(f"cuda:{i}" for i in range(count)) if count else out.append("cpu")
        elif item == "cpu":
            out.append("cpu")
        else:
            out.append(f"cuda:{int(item)}")
    return list(dict.fromkeys(out)) or ["cpu"]


def _gpu_identity(device: str) -> tuple[str | None, str | None]:
    from joulepilot.telemetry import EnergyMeter

    meter = EnergyMeter(device=device, sampler=False)
    try:
        gpu = next((d for d in meter.devices if d.kind == "gpu"), None)
    finally:
        meter.close()
    return (gpu.name or None, gpu.driver or None) if gpu is not None else (None, None)


def probe_device(device: str) -> DeviceProbe:
    """Kind and provenance of `device` as the benchmark worker will record them."""
    from joulepilot.compiler.provenance import cpu_name, provenance

    if device.startswith("cuda"):
        name, driver = _gpu_identity(device)
        origin = provenance(device, name=name, driver=driver)
    else:
        origin = provenance(device, name=cpu_name())
    kind = device_kind({"device": device, "device_name": origin.get("device_name")})
    return DeviceProbe(device=device, device_kind=kind, provenance_key=origin["provenance_key"], provenance=origin)


def device_error(exc: BaseException) -> str:
    """Why a device cannot be probed, in one short line."""
    text = str(exc).strip().splitlines()
    return shorten(text[0] if text else type(exc).__name__, DEVICE_ERROR_CHARS)


def probe_devices(devices: Sequence[str]) -> tuple[list[DeviceProbe], dict[str, str]]:
    """Each device probed in order; those that cannot be (a GPU that NVML does not list, or that is lost) come
    back apart with the reason, never raised."""
    probes: list[DeviceProbe] = []
    errors: dict[str, str] = {}
    for device in devices:
        try:
            probes.append(probe_device(device))
        except Exception as exc:  # MeterUnavailable, an NVML error, a driver gone: the device is left out
            errors[device] = device_error(exc)
    return probes, errors


def check_devices(spec: Sequence[str], where: str) -> list[DeviceProbe]:
    """At the daemon's start: every device `spec` (the config's `devices`) names can be metered, else
    DeviceUnavailable naming the first one that cannot, why, and the fix. A GPU that "auto" finds but that
    cannot be metered (lost to an Xid error, still listed by NVML) is logged and left to the passes, which
    skip it until it can be metered again; only when no device at all can be metered does the start fail."""
    named = {"cpu" if item == "cpu" else f"cuda:{int(item)}" for item in spec if item != "auto"}
    probes, errors = probe_devices(allowed_devices(spec))
    refused = [device for device in errors if device in named] or ([] if probes else list(errors))
    if refused:
        device = refused[0]
        count = visible_gpu_count()
        seen = f"GPUs here: {', '.join(map(str, range(count)))}" if count else "no GPU is visible here"
        other = "" if "auto" in spec else ', or use "auto"'
        raise DeviceUnavailable(f"{where}: devices: {device} cannot be used: {errors[device]}; list only devices "
                                f"this host can meter in `devices` ({seen}){other}")
    for device, why in errors.items():
        log.warning("%s: devices: %s (found by \"auto\") cannot be metered now (%s); the passes skip it until it "
                    "can", where, device, why)
    return probes
