"""An *estimate* of CPU energy where no counter can be read (VMs, containers, CI, locked-down RAPL).

energy_j = CPU seconds (user + system) of the measured process tree x watts per busy core.

Default: DEFAULT_W_PER_CORE = 10 W, overridable with JOULEPILOT_ESTIMATE_W_PER_CORE. Why 10 W: the
all-core budget of current x86 server and desktop parts is 4-9 W per core (e.g. 350 W / 56 cores,
360 W / 96 cores, 125 W / 16 cores), but one busy core on an otherwise quiet package turbos higher and
wakes the uncore, which adds roughly 8-15 W of package power. 10 W sits in that range and errs high
rather than flattering a configuration. It is an estimate for comparing configurations on one host,
not a measurement; every figure it produces carries source "estimate".

The tree is the root process (this one by default) and all its descendants, recursively. Children
that already exited and were reaped are counted through the root's `children_user/system` times
(the kernel adds a reaped child's own reaped descendants there too). Descendants that were re-parented
away from the tree (daemonised grandchildren) are lost when they exit.
"""

from __future__ import annotations

import math
import os
import threading

import psutil

from .base import DeviceInfo, Meter
from .errors import TelemetryError

DEFAULT_W_PER_CORE = 10.0
ENV_W_PER_CORE = "JOULEPILOT_ESTIMATE_W_PER_CORE"


def w_per_core_from_env() -> float:
    """JOULEPILOT_ESTIMATE_W_PER_CORE, else DEFAULT_W_PER_CORE; anything but a finite number above 0 is refused."""
    raw = os.environ.get(ENV_W_PER_CORE)
    if raw is None or raw.strip() == "":
        return DEFAULT_W_PER_CORE
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise TelemetryError(f"{ENV_W_PER_CORE}={raw!r} is not a finite number of watts per busy core above 0; "
                             f"set it to one (e.g. {ENV_W_PER_CORE}=12.5) or unset it to use the default "
                             f"{DEFAULT_W_PER_CORE:g} W")
    return value


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _child_pids(pid: int) -> list[int] | None:
    """Direct children from /proc/<pid>/task/*/children (a few reads, unlike a scan of all of /proc,
    which matters when the sampler thread competes for the GIL with a busy caller); None if absent."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    pids: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids.extend(int(x) for x in f.read().split())
        except FileNotFoundError:
            if tid == str(pid):
                return None  # kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return pids


def descendants(root: psutil.Process) -> list[psutil.Process]:
    direct = _child_pids(root.pid)
    if direct is None:
        return root.children(recursive=True)
    out: list[psutil.Process] = []
    stack = list(direct)
    while stack:
        pid = stack.pop()
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
        stack.extend(_child_pids(pid) or [])
    return out


def process_tree_cpu_s(root: psutil.Process, include_root: bool = True) -> float:
    """User + system CPU seconds of root's tree, including reaped children (see module docstring)."""
    # The root is read before its live children: a child reaped in between is then missed for one
    # reading (made good by the next) rather than counted twice.
    times = root.cpu_times()
    total = times.children_user + times.children_system
    if include_root:
        total += times.user + times.system
    for child in descendants(root):
        try:
            t = child.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class EstimateMeter(Meter):
    """Estimated CPU energy of a process tree (device `cpu:0`, source `estimate`)."""

    source = "estimate"

    def __init__(self, pid: int | None = None, *, w_per_core: float | None = None, include_root: bool = True) -> None:
        self.w_per_core = float(w_per_core) if w_per_core is not None else w_per_core_from_env()
        self.pid = pid if pid is not None else os.getpid()
        self.include_root = include_root
        self._process = psutil.Process(self.pid)
        self._lock = threading.Lock()
        self._max_cpu_s = 0.0
        model = cpu_model_name()
        self._info = DeviceInfo(
            id="cpu:0", kind="cpu", source=self.source,
            name=f"{model} (estimate: {self.w_per_core:g} W per busy core)" if model else
            f"estimate: {self.w_per_core:g} W per busy core",
        )

    def cpu_s(self) -> float:
        """CPU seconds of the tree; never decreases (a transient undercount is held at the last maximum)."""
        value = process_tree_cpu_s(self._process, self.include_root)
        with self._lock:
            self._max_cpu_s = max(self._max_cpu_s, value)
            return self._max_cpu_s

    def devices(self) -> list[DeviceInfo]:
        return [self._info]

    def energy_j(self) -> dict[str, float]:
        return {self._info.id: self.cpu_s() * self.w_per_core}

    def methods(self) -> dict[str, dict[str, str]]:
        scope = "process tree" if self.include_root else "child processes"
        return {self._info.id: {"energy": f"cpu-time x {self.w_per_core:g} W/core ({scope} of pid {self.pid})",
                                "power": "energy-delta"}}
