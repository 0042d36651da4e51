"""Meter the energy of an external command (what `joulepilot measure -- CMD` runs)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from typing import IO, Any

from .detect import detect_meters
from .monitor import EnergyMeter


def measure_command(
    argv: Sequence[str],
    *,
    device: Any = None,
    sample_hz: float = 10.0,
    sampler: bool = True,
    idle_s: float = 0.0,
    stdout: int | IO[Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run argv as a child process and return its energy per device.

    Keys: command, exit_code, duration_s, energy_j, energy_above_idle_j, avg_power_w, peak_power_w,
    primary_source, sources, estimated, started_at, idle_power_w, devices (list of {device, source,
    energy_j, avg_power_w, peak_power_w, idle_power_w, energy_above_idle_j, method, name}).
    Where CPU energy is estimated, only the child's process tree is counted (not this process).
    Raises FileNotFoundError / PermissionError when the command cannot be started.
    """
    argv = list(argv)
    if not argv:
        raise ValueError("no command given: use `joulepilot measure -- CMD [ARGS...]`")
    meters = detect_meters(device, estimate_include_root=False)
    with EnergyMeter(device, sample_hz=sample_hz, sampler=sampler, meters=meters) as meter:
        if idle_s > 0:
            meter.measure_idle(idle_s)
        names = {d.id: d.name for d in meter.devices}
        meter.begin("command")
        try:
            child = subprocess.Popen(argv, stdout=stdout, env=None if env is None else dict(env))
        except BaseException:
            meter.end("command")
            raise
        while True:
            try:
                exit_code = child.wait()
                break
            except KeyboardInterrupt:
                continue  # the child (same process group) got the signal too; report what it spent
        m = meter.end("command")
        result = {
            "command": argv,
            "exit_code": exit_code,
            "started_at": m.start_time,
            # The start is the window's one wall-clock reading; the end is derived from the perf_counter
            # duration, so a clock step mid-command cannot make the two stamps disagree with `duration_s`.
            "finished_at": m.start_time + m.duration_s,
            "duration_s": m.duration_s,
            "energy_j": m.energy_j,
            "energy_above_idle_j": m.energy_above_idle_j,
            "idle_power_w": m.idle_power_w,
            "avg_power_w": m.avg_power_w,
            "peak_power_w": m.peak_power_w,
            "primary_source": meter.primary_source,
            "sources": m.sources,
            "estimated": "estimate" in m.sources,
            "devices": [dict(d.to_dict(), name=names.get(d.device, "")) for d in m.devices],
        }
    return result
