"""A slow background power sampler that runs only while at least one window is open.

It reads instant power where the meter has it, and otherwise derives power from the energy delta
between two ticks. Meters are called with no lock held; the lock only guards the sample buffer, so
a caller opening or closing a window never waits for an NVML call (each costs ~3-4 ms).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from .base import Meter
from .errors import TelemetryError

MAX_DEFAULT_HZ = 10.0


class PowerSampler:
    def __init__(self, meters: Sequence[Meter], hz: float) -> None:
        self._meters = list(meters)
        self.period_s = 1.0 / hz
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, str, float]] = deque()  # (perf_counter t, device, W)
        self._latest: dict[str, tuple[float, float]] = {}  # device -> (t, W)
        self._open_windows: list[float] = []  # start times of open windows
        self._active = threading.Event()
        self._stop = threading.Event()
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="joulepilot-power-sampler", daemon=True)
        self._thread.start()

    # -- windows ---------------------------------------------------------------------------------
    def open_window(self, t0: float) -> None:
        with self._lock:
            self._open_windows.append(t0)
        self._active.set()

    def close_window(self, t0: float, t1: float) -> list[tuple[float, str, float]]:
        """Samples taken in [t0, t1]; forgets samples no open window needs any more."""
        with self._lock:
            self._open_windows.remove(t0)
            picked = [s for s in self._samples if t0 <= s[0] <= t1]
            oldest = min(self._open_windows, default=None)
            if oldest is None:
                self._samples.clear()
                self._active.clear()
            else:
                while self._samples and self._samples[0][0] < oldest:
                    self._samples.popleft()
        return picked

    def latest_power_w(self, max_age_s: float) -> dict[str, float]:
        now = time.perf_counter()
        with self._lock:
            return {d: p for d, (t, p) in self._latest.items() if now - t <= max_age_s}

    # -- thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        previous: dict[int, tuple[float, dict[str, float]]] = {}
        while not self._stop.is_set():
            if not self._active.is_set():
                previous.clear()  # never spread an idle gap's energy over the next window's first sample
                self._active.wait(timeout=0.5)
                continue
            tick = time.perf_counter()
            readings: list[tuple[float, str, float]] = []
            for i, meter in enumerate(self._meters):
                try:
                    if meter.has_instant_power:
                        readings.extend((tick, d, p) for d, p in meter.power_w().items())
                    else:
                        before = time.perf_counter()
                        energy = meter.energy_j()
                        now = 0.5 * (before + time.perf_counter())  # when the reading was taken
                        if i in previous:
                            t_prev, e_prev = previous[i]
                            dt = now - t_prev
                            if dt > 0:
                                readings.extend((tick, d, (e - e_prev.get(d, e)) / dt) for d, e in energy.items())
                        previous[i] = (now, energy)
                except (TelemetryError, OSError, ValueError) as exc:
                    self.last_error = f"{type(exc).__name__}: {exc}"
            if readings:
                with self._lock:
                    if self._open_windows:
                        self._samples.extend(readings)
                    for t, d, p in readings:
                        self._latest[d] = (t, p)
            self._stop.wait(max(0.0, tick + self.period_s - time.perf_counter()))

    def stop(self) -> None:
        self._stop.set()
        self._active.set()
        self._thread.join(timeout=2.0)
