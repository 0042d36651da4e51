"""CPU package and DRAM energy from the Linux powercap (RAPL) sysfs tree.

Zones used: `intel-rapl:<n>` whose name is `package-<socket>` and its `dram` subzone. The `core` and
`uncore` subzones lie inside the package figure and `psys` / `intel-rapl-mmio` overlap it, so they
are skipped: summing them would count the same joules twice.

`energy_uj` wraps to 0 after `max_energy_range_uj`. Each zone keeps a monotonic accumulator that is
advanced on every read and by a light background poll. The poll interval is a quarter of the
shortest wrap time at MAX_PLAUSIBLE_ZONE_POWER_W (1 kW, about twice the hottest server package sold
today), capped at 60 s: at most one wrap can happen between two polls, so any number of wraps
during one long window is counted. (Typical ranges: 262 kJ package -> 65 s; 65 kJ dram -> 16 s.)
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from .base import DeviceInfo, Meter
from .errors import MeterUnavailable, RaplPermissionError, rapl_permission_message

DEFAULT_POWERCAP_ROOT = "/sys/class/powercap"
MAX_PLAUSIBLE_ZONE_POWER_W = 1000.0
MAX_POLL_INTERVAL_S = 60.0
MIN_POLL_INTERVAL_S = 0.05
_TOP_ZONE = re.compile(r"^intel-rapl:(\d+)$")
_SUB_ZONE = re.compile(r"^intel-rapl:(\d+):(\d+)$")


def powercap_root() -> Path:
    return Path(os.environ.get("JOULEPILOT_POWERCAP_ROOT") or DEFAULT_POWERCAP_ROOT)


def _read_text(path: Path) -> str:
    with open(path) as f:
        return f.read().strip()


def _read_int(path: Path) -> int:
    return int(_read_text(path))


@dataclass
class _Zone:
    info: DeviceInfo
    path: Path
    max_range_uj: int
    last_raw_uj: int = 0
    total_uj: int = 0


@dataclass(frozen=True)
class ZoneScan:
    """What a scan of the powercap tree found: zones to meter, unreadable files, and skipped zones."""

    readable: list[tuple[DeviceInfo, Path, int]]
    denied: list[str]
    skipped: list[str]


def scan_powercap(root: Path | None = None, include_dram: bool = True) -> ZoneScan:
    root = Path(root) if root is not None else powercap_root()
    if not root.is_dir():
        raise MeterUnavailable(
            f"RAPL: no powercap tree at {root} (not an x86 RAPL host, a VM without RAPL, or the "
            "intel_rapl_common module is not loaded; set JOULEPILOT_POWERCAP_ROOT to use another path)")
    readable: list[tuple[DeviceInfo, Path, int]] = []
    denied: list[str] = []
    skipped: list[str] = []
    for top in sorted(root.iterdir(), key=lambda p: p.name):
        match = _TOP_ZONE.match(top.name)
        if not match:
            continue
        name = _safe_name(top)
        if not name.startswith("package-"):
            skipped.append(f"{top.name} ({name or 'unnamed'}: overlaps the package zones)")
            continue
        suffix = name.split("-", 1)[1]
        socket = int(suffix) if suffix.isdigit() else int(match.group(1))
        candidates = [(DeviceInfo(f"cpu:{socket}", "cpu", "rapl", name=name, index=socket), top)]
        for sub in sorted(top.iterdir(), key=lambda p: p.name):
            if not _SUB_ZONE.match(sub.name):
                continue
            sub_name = _safe_name(sub)
            if sub_name == "dram" and include_dram:
                candidates.append((DeviceInfo(f"dram:{socket}", "dram", "rapl", name="dram", index=socket), sub))
            elif sub_name != "dram":
                skipped.append(f"{sub.name} ({sub_name}: inside the package zone)")
        for info, path in candidates:
            try:
                _read_int(path / "energy_uj")
                max_range = _read_int(path / "max_energy_range_uj")
            except PermissionError:
                denied.append(str(path / "energy_uj"))
                continue
            except (OSError, ValueError) as exc:
                skipped.append(f"{path.name} (unreadable: {exc})")
                continue
            readable.append((info, path, max_range))
    return ZoneScan(readable, denied, skipped)


def _safe_name(zone: Path) -> str:
    try:
        return _read_text(zone / "name")
    except OSError:
        return ""


def poll_interval_s(max_ranges_uj: list[int], max_power_w: float = MAX_PLAUSIBLE_ZONE_POWER_W) -> float:
    """A quarter of the fastest wrap time at max_power_w, within [MIN_POLL_INTERVAL_S, MAX_POLL_INTERVAL_S]."""
    if not max_ranges_uj:
        return MAX_POLL_INTERVAL_S
    wrap_s = min(max_ranges_uj) / 1e6 / max_power_w
    return min(MAX_POLL_INTERVAL_S, max(MIN_POLL_INTERVAL_S, wrap_s / 4.0))


class RaplMeter(Meter):
    """Package and DRAM energy of every socket whose counters this user can read."""

    source = "rapl"

    def __init__(self, root: str | Path | None = None, *, include_dram: bool = True, background: bool = True,
                 max_power_w: float = MAX_PLAUSIBLE_ZONE_POWER_W) -> None:
        self.root = Path(root) if root is not None else powercap_root()
        scan = scan_powercap(self.root, include_dram)
        self.denied = scan.denied
        self.skipped = scan.skipped
        if not scan.readable:
            if scan.denied:
                raise RaplPermissionError(scan.denied)
            raise MeterUnavailable(f"RAPL: no package zone (intel-rapl:<n> named package-<n>) under {self.root}")
        self._zones = [_Zone(info, path, max_range) for info, path, max_range in scan.readable]
        self._lock = threading.Lock()
        for zone in self._zones:
            zone.last_raw_uj = _read_int(zone.path / "energy_uj")
        self.poll_interval_s = poll_interval_s([z.max_range_uj for z in self._zones], max_power_w)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="joulepilot-rapl-poll", daemon=True)
            self._thread.start()

    @property
    def permission_message(self) -> str | None:
        """The one message explaining unreadable zones and the fix, or None when all are readable."""
        return rapl_permission_message(self.denied) if self.denied else None

    def poll(self) -> None:
        """Advance every zone's accumulator; the lock keeps the read and the update in order."""
        with self._lock:
            for zone in self._zones:
                raw = _read_int(zone.path / "energy_uj")
                delta = raw - zone.last_raw_uj
                if delta < 0:
                    delta += zone.max_range_uj
                zone.total_uj += delta
                zone.last_raw_uj = raw

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.poll()
            except (OSError, ValueError):
                continue

    def devices(self) -> list[DeviceInfo]:
        return [z.info for z in self._zones]

    def energy_j(self) -> dict[str, float]:
        self.poll()
        return {z.info.id: z.total_uj / 1e6 for z in self._zones}

    def methods(self) -> dict[str, dict[str, str]]:
        return {z.info.id: {"energy": "counter", "power": "energy-delta", "zone": str(z.path)} for z in self._zones}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
