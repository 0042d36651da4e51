"""Builds a powercap sysfs tree like /sys/class/powercap on a two-socket Intel server, in a temp dir.

Layout (as the kernel exposes it): intel-rapl:<s> (package-<s>) with subzones core, uncore and dram,
top-level symlinks for the subzones, a psys zone and an intel-rapl-mmio zone (both overlap the
packages). Counters are advanced by writing energy_uj, wrapping modulo max_energy_range_uj.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_RANGE_UJ = 262_143_328_850
DRAM_RANGE_UJ = 65_712_999_613


class FakePowercap:
    def __init__(self, root: Path, sockets: int = 2, dram: bool = True,
                 package_range_uj: int = PACKAGE_RANGE_UJ, dram_range_uj: int = DRAM_RANGE_UJ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.zones: dict[str, Path] = {}
        for s in range(sockets):
            pkg = self._zone(self.root / f"intel-rapl:{s}", f"package-{s}", package_range_uj, 1_000_000 * (s + 1))
            self.zones[f"cpu:{s}"] = pkg
            subzones = [("core", package_range_uj), ("uncore", package_range_uj)]
            if dram:
                subzones.append(("dram", dram_range_uj))
            for i, (name, max_range) in enumerate(subzones):
                sub = self._zone(pkg / f"intel-rapl:{s}:{i}", name, max_range, 5_000)
                (self.root / sub.name).symlink_to(sub.relative_to(self.root))
                if name == "dram":
                    self.zones[f"dram:{s}"] = sub
                else:
                    self.zones[f"{name}:{s}"] = sub
        self.zones["psys"] = self._zone(self.root / f"intel-rapl:{sockets}", "psys", package_range_uj, 7)
        self.zones["mmio"] = self._zone(self.root / "intel-rapl-mmio:0", "package-0", package_range_uj, 9)

    @staticmethod
    def _zone(path: Path, name: str, max_range_uj: int, energy_uj: int) -> Path:
        path.mkdir()
        (path / "name").write_text(name + "\n")
        (path / "max_energy_range_uj").write_text(f"{max_range_uj}\n")
        (path / "energy_uj").write_text(f"{energy_uj}\n")
        (path / "enabled").write_text("1\n")
        return path

    def energy_uj(self, zone: str) -> int:
        return int((self.zones[zone] / "energy_uj").read_text())

    def max_range_uj(self, zone: str) -> int:
        return int((self.zones[zone] / "max_energy_range_uj").read_text())

    def set_energy_uj(self, zone: str, value: int) -> None:
        # Replace the file atomically: a sysfs read never sees a half-written value.
        tmp = self.zones[zone] / ".energy_uj.tmp"
        tmp.write_text(f"{value}\n")
        os.replace(tmp, self.zones[zone] / "energy_uj")

    def add_joules(self, zone: str, joules: float) -> None:
        """Advance a counter by `joules`, wrapping like the hardware register."""
        value = (self.energy_uj(zone) + round(joules * 1e6)) % self.max_range_uj(zone)
        self.set_energy_uj(zone, value)

    def energy_path(self, zone: str) -> Path:
        return self.zones[zone] / "energy_uj"
