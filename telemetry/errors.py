"""Every vendor error becomes one of these typed exceptions here, and nowhere else.

NVML raises `pynvml.NVMLError` subclasses carrying an integer `.value` (codes from nvml.h, a stable
ABI); RAPL raises OSError from sysfs. Callers catch the classes below and never look at vendor codes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

# nvml.h return codes (identical in every nvidia-ml-py release).
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18


class TelemetryError(RuntimeError):
    """A meter cannot give a reading; the message says which device, which call and what to do."""


class MeterUnavailable(TelemetryError):
    """The hardware, driver or interface behind a meter is absent on this host (detection skips it)."""


class NvmlUnavailable(MeterUnavailable):
    """NVML cannot be used at all: no binding, no libnvidia-ml, or no loaded driver."""


class NvmlNotSupported(TelemetryError):
    """This GPU does not implement the call (e.g. the energy counter before Volta)."""


class NvmlNoPermission(TelemetryError):
    """NVML refused the call for lack of privileges."""


class GpuLost(TelemetryError):
    """The GPU fell off the bus or needs a reset; readings from it are no longer possible."""


class NvmlError(TelemetryError):
    """Any other NVML failure; `.code` holds the NVML return code."""


class RaplPermissionError(MeterUnavailable):
    """energy_uj of one or more RAPL zones is not readable by this user."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.paths = sorted(paths)
        super().__init__(rapl_permission_message(self.paths))


def rapl_permission_message(paths: Iterable[str]) -> str:
    paths = sorted(paths)
    return (
        f"RAPL energy counters not readable: {', '.join(paths)}. "
        "Since Linux 5.10 (and stable backports, 2020, CVE-2020-8694 'Platypus') energy_uj is readable "
        "by root only. Fix: run as root, or grant read access at boot with a udev rule, e.g. "
        "/etc/udev/rules.d/99-joulepilot-rapl.rules containing "
        "SUBSYSTEM==\"powercap\", ACTION==\"add\", RUN+=\"/bin/chmod o+r /sys%p/energy_uj\" "
        "(or give a group read access: chgrp <group> .../energy_uj && chmod g+r .../energy_uj), "
        "then `sudo udevadm trigger` or reboot. Readable zones are still metered."
    )


def nvml_error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def map_nvml_error(exc: BaseException, call: str = "", device: str = "") -> TelemetryError:
    """Translate a pynvml.NVMLError (or ImportError/OSError around it) into a typed TelemetryError."""
    where = " ".join(p for p in (device, call) if p)
    prefix = f"NVML {where}: " if where else "NVML: "
    if isinstance(exc, ImportError):
        return NvmlUnavailable(f"{prefix}the NVML binding is not installed (pip install nvidia-ml-py)")
    code = nvml_error_code(exc)
    text = str(exc) if code is not None else repr(exc)
    if code == NVML_ERROR_LIBRARY_NOT_FOUND:
        err: TelemetryError = NvmlUnavailable(
            f"{prefix}libnvidia-ml.so.1 not found: no NVIDIA driver installed on this host "
            "(or the container was started without the NVIDIA runtime / --gpus)")
    elif code == NVML_ERROR_DRIVER_NOT_LOADED:
        err = NvmlUnavailable(f"{prefix}the NVIDIA kernel driver is not loaded (check `nvidia-smi`, `lsmod | grep nvidia`)")
    elif code == NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        err = NvmlUnavailable(f"{prefix}driver/library version mismatch; reboot or reload the nvidia module after a driver upgrade")
    elif code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
        err = NvmlNotSupported(f"{prefix}not supported on this GPU or driver ({text})")
    elif code == NVML_ERROR_NO_PERMISSION:
        err = NvmlNoPermission(f"{prefix}insufficient permissions ({text})")
    elif code in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED):
        err = GpuLost(f"{prefix}GPU is lost or needs a reset ({text}); check `nvidia-smi` and dmesg for Xid errors")
    else:
        err = NvmlError(f"{prefix}{text}")
    err.code = code  # type: ignore[attr-defined]
    return err


@contextmanager
def nvml_errors(call: str = "", device: str = "") -> Iterator[None]:
    """Run NVML calls inside; any NVMLError leaves as a typed TelemetryError."""
    try:
        yield
    except TelemetryError:
        raise
    except Exception as exc:
        if nvml_error_code(exc) is None or not _is_nvml_error(exc):
            raise
        raise map_nvml_error(exc, call, device) from exc


def _is_nvml_error(exc: BaseException) -> bool:
    # Both the real binding and test doubles name their base class NVMLError.
    return any(cls.__name__ == "NVMLError" for cls in type(exc).__mro__)
