"""The daemon's TOML configuration: defaults that work with no file, validation that names the fix.

Every key is optional. `deploy/daemon.toml` is the annotated example; the README lists each key.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from joulepilot.policies.lock import default_lock_dir
from joulepilot.store.db import default_db_path, default_home


class DaemonConfigError(ValueError):
    """The daemon configuration is invalid; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class IdleConfig:
    max_utilization_pct: float = 10.0  # a GPU counts as busy at or above this utilisation
    min_idle_s: float = 60.0  # ... and must stay below it this long before the daemon starts work
    allow_other_processes: bool = False  # True: other compute processes on the GPU do not make it busy
    poll_s: float = 5.0  # how often load is checked while waiting and during a job
    cpu_max_load_pct: float = 100.0  # CPU device: system CPU use (%) at or above which it is busy; 100 = never


@dataclass(frozen=True)
class BenchConfig:
    min_seconds: float = 5.0  # timed window of each measurement
    # Budget of one configuration's first forward calls (eager reference + cold compile); the worker's
    # other phases get joulepilot.compiler.budget's allowance from min_seconds, as in `bench`.
    budget_s: float = 900.0
    max_attempts: int = 3  # a job that failed this many times is left failed


@dataclass(frozen=True)
class ExporterConfig:
    enabled: bool = True
    bind: str = "127.0.0.1"
    port: int = 9464


@dataclass(frozen=True)
class DaemonConfig:
    db: Path = field(default_factory=default_db_path)
    policies: tuple[Path, ...] = field(default_factory=lambda: (default_home() / "policies",))
    # Lock files of policies whose folder is read-only go here (the hook reads it too).
    lock_dir: Path = field(default_factory=default_lock_dir)
    interval_s: float = 300.0
    max_decision_age_s: float = 7 * 86400.0
    devices: tuple[str, ...] = ("auto",)  # "auto" | "cpu" | GPU indices as strings
    log_level: str = "INFO"
    idle: IdleConfig = field(default_factory=IdleConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    source: Path | None = None  # the file it was read from, None for defaults

    def with_overrides(self, *, db: str | os.PathLike | None = None,
                       policies: tuple[str | os.PathLike, ...] | list | None = None) -> DaemonConfig:
        """Command-line values win over the file."""
        cfg = self
        if db:
            cfg = replace(cfg, db=Path(db).expanduser())
        if policies:
            cfg = replace(cfg, policies=tuple(Path(p).expanduser() for p in policies))
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {
            "db": str(self.db),
            "policies": [str(p) for p in self.policies],
            "lock_dir": str(self.lock_dir),
            "interval_s": self.interval_s,
            "max_decision_age_s": self.max_decision_age_s,
            "devices": list(self.devices),
            "log_level": self.log_level,
            "idle": vars(self.idle).copy(),
            "bench": vars(self.bench).copy(),
            "exporter": vars(self.exporter).copy(),
            "source": str(self.source) if self.source else None,
        }


_TOP = {"db", "policies", "lock_dir", "interval_s", "max_decision_age_s", "devices", "log_level", "idle", "bench", "exporter"}
_SECTIONS = {"idle": IdleConfig, "bench": BenchConfig, "exporter": ExporterConfig}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _unknown(where: str, key: str, valid: set[str]) -> DaemonConfigError:
    close = difflib.get_close_matches(key, sorted(valid), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return DaemonConfigError(f"{where}: unknown key {key!r}{hint}")


def _number(where: str, key: str, value: Any, *, minimum: float = 0.0, integer: bool = False) -> float | int:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or value < minimum:
        kind = "an integer" if integer else "a number"
        raise DaemonConfigError(f"{where}: {key} must be {kind} >= {minimum:g}, found {value!r}")
    return int(value) if integer else float(value)


def _devices(where: str, value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    out: list[str] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out.append(str(item))
        elif isinstance(item, str) and item.lower() in ("auto", "all", "cpu"):
            out.append("auto" if item.lower() in ("auto", "all") else "cpu")
        elif isinstance(item, str) and item.startswith(("cuda:", "gpu:")) and item.split(":", 1)[1].isdigit():
            out.append(item.split(":", 1)[1])
        else:
            raise DaemonConfigError(
                f"{where}: devices must be \"auto\", \"cpu\" or a list of GPU indices like [0, 1], found {value!r}"
            )
    if not out:
        raise DaemonConfigError(f"{where}: devices is empty; use \"auto\" to let the daemon use every visible GPU")
    return tuple(out)


def parse_daemon_config(data: dict[str, Any], source: Path | None = None) -> DaemonConfig:
    where = str(source) if source else "daemon config"
    base = source.parent if source else Path.cwd()
    for key in data:
        if key not in _TOP:
            raise _unknown(where, key, _TOP)
    kwargs: dict[str, Any] = {"source": source}
    if "db" in data:
        if not isinstance(data["db"], str) or not data["db"]:
            raise DaemonConfigError(f"{where}: db must be a file path string, found {data['db']!r}")
        kwargs["db"] = (base / Path(data["db"]).expanduser())
    if "policies" in data:
        value = data["policies"]
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(p, str) and p for p in items):
            raise DaemonConfigError(f"{where}: policies must be a folder path or a list of them, found {value!r}")
        kwargs["policies"] = tuple(base / Path(p).expanduser() for p in items)
    if "lock_dir" in data:
        if not isinstance(data["lock_dir"], str) or not data["lock_dir"]:
            raise DaemonConfigError(f"{where}: lock_dir must be a folder path string, found {data['lock_dir']!r}")
        kwargs["lock_dir"] = base / Path(data["lock_dir"]).expanduser()
    if "interval_s" in data:
        kwargs["interval_s"] = _number(where, "interval_s", data["interval_s"], minimum=1)
    if "max_decision_age_s" in data:
        kwargs["max_decision_age_s"] = _number(where, "max_decision_age_s", data["max_decision_age_s"], minimum=1)
    if "devices" in data:
        kwargs["devices"] = _devices(where, data["devices"])
    if "log_level" in data:
        level = str(data["log_level"]).upper()
        if level not in _LOG_LEVELS:
            raise DaemonConfigError(f"{where}: log_level must be one of {', '.join(_LOG_LEVELS)}, found {data['log_level']!r}")
        kwargs["log_level"] = level
    for name, cls in _SECTIONS.items():
        if name not in data:
            continue
        section = data[name]
        if not isinstance(section, dict):
            raise DaemonConfigError(f"{where}: [{name}] must be a table, found {section!r}")
        defaults = cls()
        valid = set(vars(defaults))
        values: dict[str, Any] = {}
        for key, value in section.items():
            if key not in valid:
                raise _unknown(f"{where} [{name}]", key, valid)
            default = getattr(defaults, key)
            label = f"{name}.{key}"
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise DaemonConfigError(f"{where}: {label} must be true or false, found {value!r}")
                values[key] = value
            elif isinstance(default, int):
                values[key] = _number(where, label, value, minimum=1 if key != "port" else 0, integer=True)
                if key == "port" and values[key] > 65535:
                    raise DaemonConfigError(f"{where}: {label} must be a TCP port 0-65535, found {value!r}")
            elif isinstance(default, float):
                values[key] = _number(where, label, value)
            else:
                if not isinstance(value, str) or not value:
                    raise DaemonConfigError(f"{where}: {label} must be a string, found {value!r}")
                values[key] = value
        if name == "idle":
            for key in ("max_utilization_pct", "cpu_max_load_pct"):
                if values.get(key, 0) > 100:
                    raise DaemonConfigError(f"{where}: idle.{key} is a percentage 0-100, found {values[key]!r}")
        kwargs[name] = cls(**values)
    return DaemonConfig(**kwargs)


def load_daemon_config(path: str | os.PathLike | None = None) -> DaemonConfig:
    """Read the TOML file at `path`; with no path, the defaults (no file is needed)."""
    if path is None:
        return DaemonConfig()
    source = Path(path).expanduser()
    try:
        text = source.read_text()
    except OSError as exc:
        raise DaemonConfigError(f"cannot read daemon config {source}: {exc.strerror or exc}; "
                                "pass an existing file to --config or leave it out for the defaults") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DaemonConfigError(f"{source}: not valid TOML: {exc}") from exc
    return parse_daemon_config(data, source.resolve())
