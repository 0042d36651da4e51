"""The daemon's TOML configuration: defaults that work with no file, validation that names the fix.

Every key is optional. `deploy/daemon.toml` is the annotated example; the README lists each key.
"""

from __future__ import annotations

import codecs
import difflib
import math
import os
import stat
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from joulepilot.compiler.remote_cache import RemoteCacheError, check_url, redacted
from joulepilot.policies.lock import default_lock_dir
from joulepilot.store.db import database_target, default_home, shown
from joulepilot.store.safeio import QUOTE_CHARS, FileRefused, file_kind, read_regular_file, shorten
from joulepilot.store.urls import has_password, is_postgres_url

MAX_CONFIG_BYTES = 1 << 20  # the annotated example is 4 KB; a megabyte is a mistake, not a config
# Every key takes a plain value or a flat list: the document, a section and a list are three levels.
MAX_NESTING = 3


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
class CompileCacheConfig:
    # Inductor's remote compile caches in this Redis server, shared by the hosts of a fleet (keep a password
    # in this file only when only the daemon's user can read it, or in JOULEPILOT_REDIS_URL); "" = none.
    redis_url: str = ""


@dataclass(frozen=True)
class FleetConfig:
    # A job a host claims is its own for this long, renewed while its daemon measures (every `idle.poll_s` or a
    # third of the lease, whichever is shorter); a host that dies holds it no longer than this.
    lease_s: float = 120.0


@dataclass(frozen=True)
class DaemonConfig:
    db: Path | str = field(default_factory=database_target)  # a SQLite file, or a postgresql:// URL
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
    compile_cache: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    source: Path | None = None  # the file it was read from, None for defaults
    # True when the file or --policies named the folders (one that is missing is an error); False for the
    # default folder, which a new install does not have yet (no policies, with a notice).
    policies_given: bool = False

    def with_overrides(self, *, db: str | os.PathLike | None = None,
                       policies: tuple[str | os.PathLike, ...] | list | None = None) -> DaemonConfig:
        """Command-line values win over the file."""
        cfg = self
        if db:
            cfg = replace(cfg, db=database_target(db))
        if policies:
            cfg = replace(cfg, policies=tuple(Path(p).expanduser() for p in policies), policies_given=True)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {
            "db": shown(self.db),
            "policies": [str(p) for p in self.policies],
            "policies_given": self.policies_given,
            "lock_dir": str(self.lock_dir),
            "interval_s": self.interval_s,
            "max_decision_age_s": self.max_decision_age_s,
            "devices": list(self.devices),
            "log_level": self.log_level,
            "idle": vars(self.idle).copy(),
            "bench": vars(self.bench).copy(),
            "exporter": vars(self.exporter).copy(),
            "compile_cache": {"redis_url": redacted(self.compile_cache.redis_url)},
            "fleet": vars(self.fleet).copy(),
            "source": str(self.source) if self.source else None,
        }


_TOP = {"db", "policies", "lock_dir", "interval_s", "max_decision_age_s", "devices", "log_level", "idle", "bench", "exporter",
        "compile_cache", "fleet"}
_SECTIONS = {"idle": IdleConfig, "bench": BenchConfig, "exporter": ExporterConfig, "compile_cache": CompileCacheConfig,
             "fleet": FleetConfig}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Every number's range, inclusive, and its unit: finite, and within what the daemon can use (a pass at least
# daily, a poll that cannot spin, bench's own floor for the timed window). The README's table lists them.
NUMBER_RANGES: dict[str, tuple[float, float, str]] = {
    "interval_s": (1, 86_400, "seconds"),
    "max_decision_age_s": (60, 31_536_000, "seconds"),
    "idle.max_utilization_pct": (1, 100, "percent"),
    "idle.min_idle_s": (0, 86_400, "seconds"),
    "idle.poll_s": (0.1, 300, "seconds"),
    "idle.cpu_max_load_pct": (1, 100, "percent; 100 = never busy"),
    "bench.min_seconds": (0.05, 3_600, "seconds"),
    "bench.budget_s": (1, 86_400, "seconds"),
    "bench.max_attempts": (1, 100, "attempts"),
    "exporter.port": (0, 65_535, "a TCP port; 0 = any free one"),
    "fleet.lease_s": (3, 86_400, "seconds"),
}


def _quote(value: Any) -> str:
    """A value as an error may quote it: its repr, cut short (a config value may be a megabyte)."""
    return shorten(repr(value), QUOTE_CHARS)


def _unknown(where: str, key: str, valid: set[str], section: str = "") -> DaemonConfigError:
    """An unknown key of the document (`section` '') or of a section, with the closest valid key there; or, for a
    key of another place (TOML puts every key below a [section] header into that section), where it goes."""
    close = difflib.get_close_matches(key, sorted(valid), n=1) if len(key) <= 100 else []
    home = next((name for name, cls in _SECTIONS.items() if name != section and key in vars(cls())), None)
    if close and difflib.SequenceMatcher(None, key, close[0]).ratio() >= 0.8:  # a typo of a key here
        hint = f"; did you mean {close[0]!r}?"
    elif section and key in _TOP and key not in _SECTIONS:
        hint = f"; {key} is a top-level key: move it above the first [section] header"
    elif home is not None:
        hint = f"; did you mean '{home}.{key}'? move it under the [{home}] header"
    elif close:
        hint = f"; did you mean {close[0]!r}?"
    else:
        hint = f"; valid keys: {', '.join(sorted(valid))}"
    return DaemonConfigError(f"{where}: unknown key {_quote(key)}{hint}")


def _figure(value: float) -> str:
    """86400 -> '86,400', 0.05 -> '0.05'."""
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _default_of(label: str) -> Any:
    section, _, key = label.rpartition(".")
    return getattr(_SECTIONS[section]() if section else DaemonConfig, key)


def _number(where: str, label: str, value: Any, *, integer: bool = False) -> float | int:
    """`value` checked against NUMBER_RANGES[label]: a finite number (an integer where `integer`) in range."""
    low, high, unit = NUMBER_RANGES[label]
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    finite = ok_type and not isinstance(value, bool) and (isinstance(value, int) or math.isfinite(value))
    if not finite or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise DaemonConfigError(f"{where}: {label} must be {kind} from {_figure(low)} to {_figure(high)} ({unit}), "
                                f"found {_quote(value)}; set it in range, or remove it for the default "
                                f"{_figure(_default_of(label))}")
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
            out.append(str(int(item.split(":", 1)[1])))
        else:
            raise DaemonConfigError(
                f"{where}: devices must be \"auto\", \"cpu\" or a list of GPU indices like [0, 1], found {_quote(value)}"
            )
    if not out:
        raise DaemonConfigError(f"{where}: devices is empty; use \"auto\" to let the daemon use every visible GPU")
    repeated = list(dict.fromkeys(d for d in out if out.count(d) > 1))
    if repeated:
        names = ", ".join(d if d in ("auto", "cpu") else f"GPU {d}" for d in repeated)
        raise DaemonConfigError(f"{where}: devices names {names} more than once, found {_quote(value)}; list each "
                                "device once (one measurement per GPU at a time)")
    return tuple(out)


def _too_deep(data: dict[str, Any]) -> str | None:
    """The dotted key of the first value nested deeper than MAX_NESTING, if any (iteratively: a pathological
    document must not exhaust the stack)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, key, depth = stack.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_NESTING:
            return key
        if isinstance(value, dict):
            stack.extend((v, f"{key}.{k}" if key else str(k), depth + 1) for k, v in value.items())
        else:
            stack.extend((v, key, depth + 1) for v in value)
    return None


def parse_daemon_config(data: dict[str, Any], source: Path | None = None) -> DaemonConfig:
    where = str(source) if source else "daemon config"
    base = source.parent if source else Path.cwd()
    deep = _too_deep(data)
    if deep is not None:
        raise DaemonConfigError(f"{where}: {shorten(deep, QUOTE_CHARS)} nests tables or arrays too deeply; each key "
                                "takes a plain value or a flat list (see deploy/daemon.toml)")
    for key in data:
        if key not in _TOP:
            raise _unknown(where, key, _TOP)
    kwargs: dict[str, Any] = {"source": source}
    if "db" in data:
        if not isinstance(data["db"], str) or not data["db"]:
            raise DaemonConfigError(f"{where}: db must be a file path or a postgresql:// URL, found "
                                    f"{_quote(data['db'])}")
        if is_postgres_url(data["db"]):
            if has_password(data["db"]):
                _only_the_owner_reads(where, source, "db", shown(data["db"]),
                                      "leave the password out of the URL and give it in ~/.pgpass or PGPASSWORD, "
                                      "or the whole URL in JOULEPILOT_DB")
            kwargs["db"] = data["db"]
        else:
            kwargs["db"] = (base / Path(data["db"]).expanduser())
    if "policies" in data:
        value = data["policies"]
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(p, str) and p for p in items):
            raise DaemonConfigError(f"{where}: policies must be a folder path or a list of them, found {_quote(value)}")
        kwargs["policies"] = tuple(base / Path(p).expanduser() for p in items)
        kwargs["policies_given"] = True
    if "lock_dir" in data:
        kwargs["lock_dir"] = _lock_dir(where, data["lock_dir"], base)
    for key in ("interval_s", "max_decision_age_s"):
        if key in data:
            kwargs[key] = _number(where, key, data[key])
    if "devices" in data:
        kwargs["devices"] = _devices(where, data["devices"])
    if "log_level" in data:
        level = data["log_level"]
        if not isinstance(level, str) or level.upper() not in _LOG_LEVELS:
            raise DaemonConfigError(f"{where}: log_level must be one of {', '.join(_LOG_LEVELS)}, found "
                                    f"{_quote(level)}")
        kwargs["log_level"] = level.upper()
    for name, cls in _SECTIONS.items():
        if name in data:
            kwargs[name] = _section(where, name, cls, data[name])
    if "compile_cache" in kwargs and kwargs["compile_cache"].redis_url:
        url = kwargs["compile_cache"].redis_url
        try:
            check_url(url, f"{where}: compile_cache.redis_url")
        except RemoteCacheError as exc:
            raise DaemonConfigError(str(exc)) from None
        if has_password(url):
            _only_the_owner_reads(where, source, "compile_cache.redis_url", redacted(url),
                                  "give the whole URL in JOULEPILOT_REDIS_URL")
    return DaemonConfig(**kwargs)


def _only_the_owner_reads(where: str, source: Path | None, key: str, value_shown: str, elsewhere: str) -> None:
    """A password in the config file (`key`, shown as `value_shown`) is refused unless only the file's owner may read
    the file: a group or others could read it there (`elsewhere`: where else it may go)."""
    if source is None:
        return
    try:
        mode = os.stat(source).st_mode
    except OSError:
        return  # read a moment ago: what changed since is the next read's to say
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise DaemonConfigError(f"{where}: {key} ({value_shown}) holds a password, and the file may be read by "
                                f"{'its group' if mode & stat.S_IRWXG else 'other users'} (mode "
                                f"{stat.S_IMODE(mode):03o}); chmod 600 {source}, or {elsewhere}")


def _lock_dir(where: str, value: Any, base: Path) -> Path:
    """`lock_dir`: a folder, or a path where none is yet (created with the first lock file written there)."""
    if not isinstance(value, str) or not value:
        raise DaemonConfigError(f"{where}: lock_dir must be a folder path string, found {_quote(value)}")
    path = base / Path(value).expanduser()
    fix = "name a folder (created when missing) where the daemon writes the lock files a policy folder cannot hold"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise DaemonConfigError(f"{where}: lock_dir {shorten(str(path), QUOTE_CHARS)} cannot be used "
                                f"({exc.strerror or exc}); {fix}") from None
    if not stat.S_ISDIR(mode):
        kind = "a regular file" if stat.S_ISREG(mode) else file_kind(mode)
        raise DaemonConfigError(f"{where}: lock_dir {shorten(str(path), QUOTE_CHARS)} is {kind}, not a folder; {fix}")
    return path


def _section(where: str, name: str, cls: type, section: Any) -> Any:
    if not isinstance(section, dict):
        raise DaemonConfigError(f"{where}: [{name}] must be a table, found {_quote(section)}")
    defaults = cls()
    valid = set(vars(defaults))
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key not in valid:
            raise _unknown(f"{where} [{name}]", key, valid, name)
        default = getattr(defaults, key)
        label = f"{name}.{key}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise DaemonConfigError(f"{where}: {label} must be true or false, found {_quote(value)}")
            values[key] = value
        elif isinstance(default, int | float):
            values[key] = _number(where, label, value, integer=isinstance(default, int))
        else:
            if not isinstance(value, str) or not value:
                raise DaemonConfigError(f"{where}: {label} must be a string, found {_quote(value)}")
            values[key] = value
    return cls(**values)


def _decode(where: str, data: bytes) -> str:
    """TOML is UTF-8 (a UTF-8 byte-order mark is tolerated); anything else gets the fix spelled out."""
    fix = "save it as UTF-8 (in most editors: Save with Encoding -> UTF-8)"
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        raise DaemonConfigError(f"{where}: the file is UTF-32 text, not UTF-8; {fix}")
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise DaemonConfigError(f"{where}: the file is UTF-16 text, not UTF-8; {fix}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DaemonConfigError(f"{where}: byte 0x{data[exc.start]:02x} at line {line} is not UTF-8; {fix}") from None


def _deep_key(text: str) -> str:
    """Which key of a document too deep for the TOML parser nests: 'idle.allow_other_processes (line 2)', or
    'a value' when no one line shows it (a nesting spread over many lines)."""
    section = ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]") and "=" not in stripped:
            section = stripped.strip("[] ")
            continue
        if max(line.count("["), line.count("{")) > MAX_NESTING:
            key = line.split("=", 1)[0].strip() if "=" in line else ""
            dotted = f"{section}.{key}" if section and key else key
            return f"{shorten(dotted, 100)} (line {number})" if dotted else f"line {number}"
    return "a value"


def load_daemon_config(path: str | os.PathLike | None = None) -> DaemonConfig:
    """Read the TOML file at `path`; with no path, the defaults (no file is needed)."""
    if path is None:
        return DaemonConfig()
    source = Path(path).expanduser()
    try:
        data = read_regular_file(source, max_bytes=MAX_CONFIG_BYTES)
    except FileRefused as exc:
        raise DaemonConfigError(f"cannot read daemon config {source}: {exc.reason}; a daemon config is a short "
                                "TOML text file: pass that file to --config") from None
    except OSError as exc:
        raise DaemonConfigError(f"cannot read daemon config {source}: {exc.strerror or exc}; "
                                "pass an existing file to --config or leave it out for the defaults") from exc
    source = source.resolve()
    text = _decode(str(source), data)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DaemonConfigError(f"{source}: not valid TOML: {exc}") from exc
    except RecursionError:
        raise DaemonConfigError(f"{source}: {_deep_key(text)} nests tables or arrays too deeply; each key takes a "
                                "plain value or a flat list (see deploy/daemon.toml)") from None
    return parse_daemon_config(document, source)
