"""`EnergyMeter`: named energy windows over the meters of one device choice."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .base import DeviceEnergy, DeviceInfo, Measurement, Meter
from .detect import detect_meters
from .sampler import MAX_DEFAULT_HZ, PowerSampler

SOURCE_PRIORITY = ("nvml", "rapl", "estimate")


@dataclass
class _Window:
    name: str
    t0: float
    start_time: float
    energy_j: dict[str, float]


@dataclass
class WindowHandle:
    """What `EnergyMeter.window()` yields; `measurement` is filled when the block exits."""

    name: str
    measurement: Measurement | None = field(default=None)


class EnergyMeter:
    """Energy windows for `device` ("cuda:N", "cpu", or None for every measured device).

    Windows may nest and overlap as long as their names differ. The device is synchronised before
    each window is opened and closed. A background sampler (default 10 Hz, at most 10 Hz unless
    `allow_fast_sampling=True`; `sampler=False` turns it off) gives peak power and power samples.
    """

    def __init__(
        self,
        device: Any = None,
        sample_hz: float = MAX_DEFAULT_HZ,
        sampler: bool = True,
        *,
        meters: Sequence[Meter] | None = None,
        allow_fast_sampling: bool = False,
        nvml: ModuleType | None = None,
    ) -> None:
        if not sample_hz > 0:
            raise ValueError(f"sample_hz must be positive, got {sample_hz}")
        if sample_hz > MAX_DEFAULT_HZ and not allow_fast_sampling:
            raise ValueError(
                f"sample_hz={sample_hz} is above {MAX_DEFAULT_HZ:g} Hz: each NVML read costs milliseconds and "
                "the energy counter only steps every ~100 ms; pass allow_fast_sampling=True to insist")
        self.device = device
        self._meters: list[Meter] = list(meters) if meters is not None else detect_meters(device, nvml=nvml)
        self._source_of = {d.id: m.source for m in self._meters for d in m.devices()}
        self._method_of = {dev: how.get("energy", "") for m in self._meters for dev, how in m.methods().items()}
        self._idle_w: dict[str, float] = {}
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()
        self._last_energy: tuple[float, dict[str, float]] | None = None
        self._sampler = PowerSampler(self._meters, sample_hz) if sampler else None
        self._closed = False

    # -- description ------------------------------------------------------------------------------
    @property
    def meters(self) -> list[Meter]:
        return list(self._meters)

    @property
    def devices(self) -> list[DeviceInfo]:
        return [d for m in self._meters for d in m.devices()]

    @property
    def sources(self) -> list[str]:
        return sorted({m.source for m in self._meters if m.devices()})

    @property
    def primary_source(self) -> str:
        present = self.sources
        return next((s for s in SOURCE_PRIORITY if s in present), "none")

    @property
    def idle_power_w(self) -> dict[str, float]:
        return dict(self._idle_w)

    @property
    def sampler_error(self) -> str | None:
        return self._sampler.last_error if self._sampler is not None else None

    def methods(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for m in self._meters:
            out.update(m.methods())
        return out

    def describe(self) -> dict:
        return {
            "device": None if self.device is None else str(self.device),
            "primary_source": self.primary_source,
            "sources": self.sources,
            "devices": [d.to_dict() for d in self.devices],
            "methods": self.methods(),
            "idle_power_w": self.idle_power_w,
        }

    # -- readings --------------------------------------------------------------------------------
    def sync(self) -> None:
        for m in self._meters:
            m.sync()

    def read_energy_j(self) -> dict[str, float]:
        """Cumulative joules per device id (monotonic, arbitrary origin)."""
        out: dict[str, float] = {}
        for m in self._meters:
            out.update(m.energy_j())
        self._last_energy = (time.perf_counter(), out)
        return dict(out)

    def read_power_w(self) -> dict[str, float]:
        """Watts per device: instant readings where the hardware has them; elsewhere the sampler's latest
        energy-derived value, or the average since the previous reading (blocking 0.1 s if there is none)."""
        out: dict[str, float] = {}
        derived = [m for m in self._meters if not m.has_instant_power]
        for m in self._meters:
            if m.has_instant_power:
                out.update(m.power_w())
        if not derived:
            return out
        ids = {d.id for m in derived for d in m.devices()}
        if self._sampler is not None:
            recent = {d: p for d, p in self._sampler.latest_power_w(3 * self._sampler.period_s).items() if d in ids}
            if ids <= set(recent):
                out.update(recent)
                return out
        previous = self._last_energy
        if previous is None or not 0.05 <= time.perf_counter() - previous[0] <= 10.0:
            self.read_energy_j()
            time.sleep(0.1)
            previous = self._last_energy
        assert previous is not None
        t0, e0 = previous
        e1 = self.read_energy_j()
        dt = time.perf_counter() - t0
        out.update({d: (e1[d] - e0.get(d, e1[d])) / dt for d in ids if d in e1})
        return out

    def measure_idle(self, seconds: float = 2.0) -> dict[str, float]:
        """Average watts per device over `seconds` of (what the caller promises is) idleness; later
        windows report `idle_power_w` and `energy_above_idle_j` against it."""
        self.sync()
        t0 = time.perf_counter()
        e0 = self.read_energy_j()
        time.sleep(seconds)
        self.sync()
        e1 = self.read_energy_j()
        dt = time.perf_counter() - t0
        self._idle_w = {d: max(0.0, (e1[d] - e0[d]) / dt) for d in e1 if d in e0}
        return dict(self._idle_w)

    def set_idle_power_w(self, idle_w: dict[str, float]) -> None:
        """Reuse a baseline measured earlier (e.g. stored by the daemon)."""
        self._idle_w = dict(idle_w)

    # -- windows ---------------------------------------------------------------------------------
    def begin(self, name: str) -> None:
        with self._lock:
            if name in self._windows:
                raise ValueError(f"energy window {name!r} is already open; close it with end({name!r}) first")
            self._windows[name] = _Window(name, 0.0, 0.0, {})  # reserve the name
        try:
            self.sync()
            t0 = time.perf_counter()
            start_time = time.time()
            energy = self.read_energy_j()
        except BaseException:
            with self._lock:
                self._windows.pop(name, None)
            raise
        with self._lock:
            self._windows[name] = _Window(name, t0, start_time, energy)
        if self._sampler is not None:
            self._sampler.open_window(t0)

    def end(self, name: str) -> Measurement:
        with self._lock:
            window = self._windows.get(name)
            if window is None or window.t0 == 0.0:
                raise ValueError(f"no open energy window named {name!r}; open: {sorted(self._windows)}")
            del self._windows[name]
        try:
            self.sync()
            t1 = time.perf_counter()
            energy = self.read_energy_j()
        finally:
            samples = self._sampler.close_window(window.t0, time.perf_counter()) if self._sampler is not None else []
        return self._measurement(window, t1, energy, samples)

    @contextmanager
    def window(self, name: str) -> Iterator[WindowHandle]:
        handle = WindowHandle(name)
        self.begin(name)
        try:
            yield handle
        finally:
            handle.measurement = self.end(name)

    def _measurement(self, window: _Window, t1: float, energy: dict[str, float],
                     samples: list[tuple[float, str, float]]) -> Measurement:
        duration_s = t1 - window.t0
        relative = [(t - window.t0, d, p) for t, d, p in samples if t <= t1]
        devices = []
        for device_id, e1 in energy.items():
            e0 = window.energy_j.get(device_id)
            if e0 is None:
                continue
            powers = [p for _, d, p in relative if d == device_id]
            energy_j = max(0.0, e1 - e0)
            peak_w = max(powers) if powers else None
            if self._sampler is not None and duration_s > 0:
                # The window's mean power bounds its peak from below. The samples alone can fall short of it:
                # they start at the sampler's first tick (its second for a power derived from energy) and end
                # at its last, and a derived one is itself a mean over a tick, quantised as its counter is.
                mean_w = energy_j / duration_s
                peak_w = mean_w if peak_w is None else max(peak_w, mean_w)
            devices.append(DeviceEnergy(
                device=device_id,
                source=self._source_of.get(device_id, ""),
                energy_j=energy_j,
                duration_s=duration_s,
                idle_power_w=self._idle_w.get(device_id),
                peak_power_w=peak_w,
                samples=len(powers),
                method=self._method_of.get(device_id, ""),
            ))
        return Measurement(window.name, window.start_time, duration_s, devices, relative)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sampler is not None:
            self._sampler.stop()
        for m in self._meters:
            m.close()

    def __enter__(self) -> EnergyMeter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort for forgotten meters
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
