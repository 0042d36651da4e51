"""A run's compile energy in two parts, each with its source.

The first call of a configuration compiles it. Inductor compiles on the CPU (in this process and its pool
of compile workers) while a GPU run's card idles or runs the first kernels, so the compile window is
metered twice: the GPU part (`compile_energy_gpu_j`, source `nvml`) and the CPU part
(`compile_energy_cpu_j`: package and DRAM by RAPL, source `rapl`, or where RAPL cannot be read the
labelled estimate of the compiling process tree, source `estimate`). `compile_energy_j` is their sum,
the figure amortised over a policy's expected inferences. A CPU run has no GPU part.

Runs stored before the CPU part was metered (schema version 4 and older, and exports without the part
fields) hold one figure, read from the meter of the run's device. It becomes that device's part (a GPU
run's figure the GPU part, a CPU run's the CPU part, with the run's `energy_source`); the other part stays
NULL, "not metered". Such a GPU run's `compile_energy_j` is therefore the GPU alone, and
`complete_compile_energy_j` says so by returning None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

PART_COLUMNS = ("compile_energy_gpu_j", "compile_energy_gpu_source", "compile_energy_cpu_j",
                "compile_energy_cpu_source")


def is_gpu_device(device: Any) -> bool:
    """Whether a run's torch device ('cuda:0', 'cpu') is a GPU."""
    return str(device or "").strip().lower().startswith("cuda")


def legacy_parts(device: Any, compile_energy_j: Any, energy_source: Any) -> dict[str, Any]:
    """The part columns of a run stored with one compile figure: that figure as its device's part."""
    parts: dict[str, Any] = dict.fromkeys(PART_COLUMNS)
    if not _number(compile_energy_j):
        return parts
    side = "gpu" if is_gpu_device(device) else "cpu"
    parts[f"compile_energy_{side}_j"] = float(compile_energy_j)
    parts[f"compile_energy_{side}_source"] = energy_source
    return parts


def has_parts(run: Mapping[str, Any]) -> bool:
    """Whether a run record names any part field (written by a joulepilot that meters both parts)."""
    return any(key in run for key in PART_COLUMNS)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _get(run: Any, key: str) -> Any:
    return run.get(key) if isinstance(run, Mapping) else getattr(run, key, None)


def complete_compile_energy_j(run: Any) -> float | None:
    """GPU + CPU compile joules of a run (a mapping or a row) when every part its device has was metered;
    None when one is missing (a GPU run from before the CPU part was metered, or a failed CPU meter)."""
    cpu = _get(run, "compile_energy_cpu_j")
    if not _number(cpu):
        return None
    if not is_gpu_device(_get(run, "device")):
        return float(cpu)
    gpu = _get(run, "compile_energy_gpu_j")
    return float(gpu) + float(cpu) if _number(gpu) else None


def compile_energy_sources(run: Any) -> str | None:
    """'nvml+estimate': the sources of the parts summed in `compile_energy_j`, GPU first."""
    sources = [str(_get(run, f"compile_energy_{side}_source")) for side in ("gpu", "cpu")
               if _number(_get(run, f"compile_energy_{side}_j")) and _get(run, f"compile_energy_{side}_source")]
    return "+".join(sources) or None


def _joules(value: float) -> str:
    return f"{value:,.0f} J" if abs(value) >= 100 else f"{value:.3g} J"


def compile_energy_text(run: Any) -> str | None:
    """'812 J (GPU 120 J nvml + CPU 692 J estimate)' for output; names a part that was not metered."""
    total = _get(run, "compile_energy_j")
    if not _number(total):
        return None
    parts = []
    for side, name in (("gpu", "GPU"), ("cpu", "CPU")):
        value = _get(run, f"compile_energy_{side}_j")
        if _number(value):
            parts.append(f"{name} {_joules(value)} {_get(run, f'compile_energy_{side}_source') or 'source unknown'}")
        elif side == "cpu" or is_gpu_device(_get(run, "device")):
            parts.append(f"{name} not metered")
    return f"{_joules(total)} ({' + '.join(parts)})" if parts else _joules(total)
