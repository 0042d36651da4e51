"""Measurements on several devices at once: one thread per running measurement, each worker's share of the
compile threads, and the device numbering every worker uses.

A measurement spends its time waiting for its worker process, so a thread per busy device keeps every GPU
working; each thread's result comes back through a queue to the thread that owns the database connection,
which stores it (the measuring threads never touch the store). Concurrent workers each compile with
`TORCHINDUCTOR_COMPILE_THREADS` = usable cores / concurrent workers, so two cold compiles at once do not
fight over every core (a value the user exported is left alone). Every worker numbers GPUs in PCI bus
order, as NVML does (`CUDA_DEVICE_ORDER=PCI_BUS_ID`), so torch's cuda:N is the GPU whose counter the
worker reads for cuda:N, and the GPU the scheduler found idle.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"
DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as Inductor counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


THREADS_ENV = "OMP_NUM_THREADS"


def cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """The intra-op threads torch runs a CPU measurement with, and where the number came from: `requested`
    (bench --threads); else OMP_NUM_THREADS when it is a whole number above 0 (a value the user exported is
    kept); else the cores this process may run on (`available_cores`: its affinity mask, so a `taskset` or a
    container's cpuset counts, which torch's own default may not)."""
    if requested is not None:
        return max(1, int(requested)), "--threads"
    exported = os.environ.get(THREADS_ENV, "").strip()
    if exported.isdigit() and int(exported) > 0:
        return int(exported), THREADS_ENV
    return available_cores(), "the cores this process may run on"


def compile_threads(concurrent: int, cores: int | None = None) -> int:
    """Each of `concurrent` workers' share of the cores for Inductor's compile workers (at least one)."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, concurrent))


def worker_env(concurrent: int, remote_cache_url: str | None = None) -> dict[str, str]:
    """Variables for a worker that runs beside `concurrent - 1` others: the GPU numbering, with others beside
    it its share of the compile threads, and the remote compile caches in `remote_cache_url` (a daemon
    config's; "" or None for none), else in `JOULEPILOT_REDIS_URL`, when that server answers (`remote_cache`)."""
    from .remote_cache import configured_url, usable_variables

    env = {DEVICE_ORDER_ENV: "PCI_BUS_ID"}
    if concurrent > 1 and not os.environ.get(COMPILE_THREADS_ENV):
        env[COMPILE_THREADS_ENV] = str(compile_threads(concurrent))
    env.update(usable_variables(configured_url(remote_cache_url)))
    return env


@dataclass
class Finished:
    """A measurement ended: its result, or the exception it raised."""

    device: str
    key: Any
    result: Any = None
    error: BaseException | None = None


@dataclass
class Notice:
    """Something a running measurement reports on the way (its worker started, it moved to a phase)."""

    device: str
    key: Any
    what: str
    value: Any = None


class DevicePool:
    """At most one running measurement per device, each in a thread of its own.

    `start`, `next_event`, `free` and `running` belong to one thread (the one that owns the store);
    measurements report through `post` from their own threads. A measurement's thread waits for its worker
    to end before it ends: a fresh worker dies with the thread that started it (PR_SET_PDEATHSIG), a forked
    one with its zygote, which the zygote pool's own thread starts (`zygote.py`) so that it outlives the job."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = list(dict.fromkeys(devices))
        self._running: dict[str, tuple[Any, threading.Thread]] = {}
        self._events: queue.Queue[Finished | Notice] = queue.Queue()

    @property
    def concurrent(self) -> int:
        """How many measurements may run at once: one per device."""
        return len(self.devices)

    def free(self) -> list[str]:
        """Devices with nothing running, in the pool's order."""
        return [d for d in self.devices if d not in self._running]

    def running(self) -> dict[str, Any]:
        """The key of the measurement running on each busy device."""
        return {device: key for device, (key, _thread) in self._running.items()}

    def start(self, device: str, key: Any, measure: Callable[[], Any]) -> None:
        """Run `measure()` on a thread for `device`; its return value or exception comes back as Finished."""
        if device in self._running:
            raise RuntimeError(f"{device} already has a measurement running")

        def run() -> None:
            try:
                result = measure()
            except BaseException as exc:  # noqa: BLE001 - handed to the owning thread, which decides
                self._events.put(Finished(device, key, error=exc))
                return
            self._events.put(Finished(device, key, result=result))

        thread = threading.Thread(target=run, name=f"joulepilot-measure-{device}", daemon=True)
        self._running[device] = (key, thread)
        thread.start()

    def post(self, device: str, key: Any, what: str, value: Any = None) -> None:
        """From a measurement's thread: tell the owning thread something (safe from any thread)."""
        self._events.put(Notice(device, key, what, value))

    def next_event(self, timeout: float | None) -> Finished | Notice | None:
        """The next thing a measurement reported, waiting up to `timeout` seconds; None if nothing did. A
        Finished frees its device."""
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, Finished):
            _key, thread = self._running.pop(event.device)
            thread.join(timeout=5)
        return event
