"""Where and with what a run was measured: host, device, driver, torch, triton and joulepilot versions."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import platform
import sys
from pathlib import Path
from typing import Any

from joulepilot.store import host_identity, provenance_key


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
    if str(device).startswith("cuda"):
        import torch

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


def _literal_assignments(path: Path) -> dict[str, Any]:
    """Module-level `name = <literal>` (annotated or not) of a Python file, without running it."""
    values: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            target, value = node.target.id, node.value
        else:
            continue
        try:
            values[target] = ast.literal_eval(value)
        except ValueError:
            continue
    return values


def torch_versions() -> tuple[str, str | None]:
    """(torch.__version__, torch.version.cuda), without importing torch when it is not loaded yet.

    Both come from torch/version.py, which is read as text here: importing torch takes seconds, and the
    parent of a sweep (`bench`, the daemon) needs nothing else of it on a CPU; its workers import it."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return str(loaded.__version__), loaded.version.cuda
    found = importlib.util.find_spec("torch")
    for folder in (found.submodule_search_locations or []) if found is not None else []:
        try:
            values = _literal_assignments(Path(folder) / "version.py")
        except (OSError, SyntaxError, ValueError):
            continue
        if isinstance(values.get("__version__"), str):
            cuda = values.get("cuda")
            return values["__version__"], cuda if isinstance(cuda, str) else None
    import torch  # an unusual install: ask torch itself

    return str(torch.__version__), torch.version.cuda


def provenance(device: str, name: str | None = None, driver: str | None = None) -> dict[str, Any]:
    """The provenance columns of a run, and `provenance_key`: equal keys mean comparable measurements.

    `name`/`driver` may come from NVML (the sweep's parent passes them, so it never opens a CUDA
    context of its own); otherwise they are asked of torch and NVML here."""
    torch_version, cuda_version = torch_versions()
    host = host_identity()
    fields = {
        "host_id": host["id"],
        "device_name": name or device_name(device),
        "driver_version": driver or driver_version(device),
        "torch_version": torch_version,
        "triton_version": package_version("triton", "pytorch-triton", "triton-xpu"),
        "joulepilot_version": package_version("joulepilot"),
    }
    fields["provenance_key"] = provenance_key(fields["device_name"], fields["torch_version"],
                                              fields["triton_version"], fields["joulepilot_version"])
    fields["hostname"] = host["hostname"]
    fields["cuda_version"] = cuda_version
    fields["python_version"] = platform.python_version()
    return fields
