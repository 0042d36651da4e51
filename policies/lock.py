"""Lock files: decisions shipped as JSON, for hosts without a database and for the hook's fast path.

`<stem>.lock.json` sits next to `<stem>.toml` and holds one entry per device kind and torch
major.minor:

    {"format": 1, "policy": "resnet50",
     "entries": {"NVIDIA H200": {"2.11": {"config": {...configs row...}, "config_id": ..., "state": ...,
                                          "reason": ..., "policy_hash": ..., "decided_at": ...,
                                          "measured": {...}}}}}

Where the policy's folder cannot be written (the daemon under systemd with `ProtectSystem=strict`
reads policies from /etc), the file goes to the lock directory instead, as `<policy name>.lock.json`:
`$JOULEPILOT_LOCK_DIR`, else `<JOULEPILOT_HOME>/locks` (the daemon's `lock_dir` key). The hook reads
both places and takes the newest entry made for the policy's current content.

A file of a newer `format` than LOCK_FORMAT (written by a newer joulepilot) is not read as if it were ours,
a file larger than MAX_LOCK_BYTES is not read at all, and an entry this version cannot use (an unknown mode or
precision, options that are not JSON, a decided_at that is not a time, ...) or that its policy does not allow
(`policies.allowed`: a lock file is data, never code) is not used: each is a problem naming the file and the fix,
and the other file is tried.

Writing merges with the entries already there (other device kinds and torch versions are kept, unless a reader
would refuse them; the oldest go when the file would pass MAX_LOCK_BYTES) and replaces the file atomically, with ordinary permissions (the umask decides), so a serving process
running as another user can read it. A file of a newer format is never replaced (that would drop the newer
version's entries): the write is refused with one line, and no lock file is written elsewhere instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from joulepilot.store.decisions import APPLICABLE_STATES
from joulepilot.store.files import write_file_atomic
from joulepilot.store.jsonvalues import strict_json_text
from joulepilot.store.safeio import shorten

from .allowed import UNREADABLE_FIX, Refusal, config_problem, decided_at_problem, decision_refusal
from .resolve import Decision
from .schema import Policy

LOCK_FORMAT = 1
LOCK_DIR_ENV = "JOULEPILOT_LOCK_DIR"
LOCK_SUFFIX = ".lock.json"
# A lock file holds an entry of a few kilobytes per device kind and torch version: a megabyte is hundreds of them.
# A larger file is refused unread (the writer drops the oldest entries to stay below it).
MAX_LOCK_BYTES = 1 << 20
# A warning about damaged lock data lists this many of the dropped entries, each quoting at most this much.
MAX_DROPPED_LISTED = 5
DROPPED_QUOTE_CHARS = 60

log = logging.getLogger("joulepilot.lock")


class LockFileError(ValueError):
    """A lock file exists but cannot be used; the message names the file and the fix."""


class LockFormatTooNew(LockFileError):
    """A lock file written by a newer joulepilot, in a format this one does not read."""

    def __init__(self, message: str, format_text: str = "") -> None:
        super().__init__(message)
        self.format_text = format_text  # 'lock file format 2; this one reads format 1'


class LockWriteError(RuntimeError):
    """No lock file could be written, beside the policy nor in the lock directory."""


class LockFileNewerThanWriter(LockWriteError):
    """The lock file to write into was written by a newer joulepilot: it is left as it is (replacing it would
    drop that version's entries), and no other lock file is written in its place."""


def default_lock_dir() -> Path:
    """`$JOULEPILOT_LOCK_DIR`, else `<JOULEPILOT_HOME>/locks`."""
    return _default_lock_dir(os.environ.get(LOCK_DIR_ENV), os.environ.get("JOULEPILOT_HOME"))


@functools.lru_cache(maxsize=16)
def _default_lock_dir(lock_dir_env: str | None, home_env: str | None) -> Path:
    if lock_dir_env:
        return Path(lock_dir_env).expanduser()
    from joulepilot.store import default_home

    return default_home() / "locks"


def lock_path(policy_path: str | os.PathLike) -> Path:
    """The lock file beside a policy file."""
    path = Path(policy_path)
    return path.with_name(path.stem + LOCK_SUFFIX)


def lock_dir_path(lock_dir: str | os.PathLike, policy_name: str) -> Path:
    """The lock file of a policy (by name) in a lock directory; the name cannot reach outside it."""
    return Path(lock_dir) / _lock_file_name(policy_name)


@functools.lru_cache(maxsize=1024)
def _lock_file_name(policy_name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", policy_name).lstrip(".") or "policy"
    if safe != policy_name:
        safe += "-" + hashlib.sha256(policy_name.encode()).hexdigest()[:8]
    return safe + LOCK_SUFFIX


def _regenerate_hint(path: str | os.PathLike) -> str:
    return f"delete {path} and run `joulepilot policy lock` on the policy (or let the daemon rewrite it)"


def _entry_problem(entry: Any) -> str | None:
    """Why a lock entry cannot be used, or None. Checked where the hook relies on it."""
    if not isinstance(entry, dict):
        return "is not a table"
    if entry.get("state") not in APPLICABLE_STATES:
        return f"has a state this joulepilot does not know ({entry.get('state')!r})"
    problem = config_problem(entry.get("config"))
    if problem:
        return problem
    problem = decided_at_problem(entry.get("decided_at"))
    if problem:
        return problem
    for key, kinds in (("policy_hash", str), ("reason", str), ("workload_id", str), ("decision_id", int),
                       ("measured", dict)):
        value = entry.get(key)
        if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)):
            return f"has a {key} of the wrong type ({type(value).__name__})"
    return None


def _check_format(document: dict[str, Any], file: str) -> None:
    """A document of a format this joulepilot reads (no `format` at all: the first one), else LockFileError."""
    if "format" not in document:
        return
    fmt = document["format"]
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise LockFileError(f"{file}: its format {fmt!r} is not a lock file format version; {_regenerate_hint(file)}")
    if fmt > LOCK_FORMAT:
        format_text = f"lock file format {fmt}; this one reads format {LOCK_FORMAT}"
        raise LockFormatTooNew(f"{file}: written by a newer joulepilot ({format_text}); upgrade joulepilot here, or "
                               f"re-lock the policy with this version (`joulepilot policy lock` on it)", format_text)


def read_lock_document(path: str | os.PathLike) -> dict[str, Any]:
    """One lock file's document ({} when there is none). An unreadable, non-UTF-8, corrupt or absurdly
    nested file raises LockFileError naming it and the fix."""
    file = os.fspath(path)
    try:
        # O_NONBLOCK: a FIFO in the lock file's place must not block the reader; it is refused below.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise LockFileError(f"{file}: not a regular file; remove it so a lock file can be written there")
            raw = fh.read(MAX_LOCK_BYTES + 1)  # a byte more than allowed tells that it is too large
        if len(raw) > MAX_LOCK_BYTES:
            raise LockFileError(f"{file}: larger than the {MAX_LOCK_BYTES:,} bytes a lock file may have (joulepilot "
                                f"writes none that large), so it is not read; {_regenerate_hint(file)}")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        return {}
    except PermissionError as exc:
        raise LockFileError(f"{file}: cannot be read by this user ({exc.strerror}); make it readable "
                            f"(chmod a+r {file}) or run the process as the daemon's user") from exc
    except OSError as exc:
        raise LockFileError(f"{file}: cannot be read ({exc.strerror or exc}); {_regenerate_hint(file)}") from exc
    except UnicodeDecodeError as exc:
        raise LockFileError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                            f"{_regenerate_hint(file)}") from exc
    try:
        data = json.loads(text)
    except RecursionError as exc:
        raise LockFileError(f"{file}: nested too deeply to be a lock file; {_regenerate_hint(file)}") from exc
    except ValueError as exc:
        raise LockFileError(f"{file}: not valid JSON ({exc}); {_regenerate_hint(file)}") from exc
    if isinstance(data, dict):  # the format first: a newer one may shape its entries otherwise
        _check_format(data, file)
    if not isinstance(data, dict) or not isinstance(data.get("entries", {}), dict):
        raise LockFileError(f"{file}: expected an object with an 'entries' table; {_regenerate_hint(file)}")
    return data


def _entry(document: dict[str, Any], device_kind: str, torch_version: str,
           file: str | os.PathLike, policy_hash: str | None = None) -> dict[str, Any] | None:
    """The entry for this device kind and torch (None: none, or one made for other policy content than
    `policy_hash`, which is never applied and so not checked); LockFileError when it cannot be used."""
    by_torch = document.get("entries", {}).get(device_kind)
    if by_torch is None:
        return None
    entry = by_torch.get(torch_version) if isinstance(by_torch, dict) else by_torch
    if entry is None:
        return None
    if policy_hash is not None and isinstance(entry, dict) and entry.get("policy_hash") != policy_hash:
        return None
    problem = _entry_problem(entry)
    if problem:
        raise LockFileError(f"{file}: the entry for {device_kind} / torch {torch_version} {problem}; {UNREADABLE_FIX}")
    return entry


@dataclass
class LockedEntry:
    path: str  # the lock file it was read from
    entry: dict[str, Any]


def lock_files(policy_path: str | os.PathLike | None, policy_name: str,
               lock_dir: str | os.PathLike | None) -> list[Path]:
    """Where a policy's decisions may be locked: beside the file, then in the lock directory."""
    return [Path(p) for p in _lock_file_paths(policy_path and os.fspath(policy_path), policy_name,
                                               lock_dir and os.fspath(lock_dir))]


@functools.lru_cache(maxsize=1024)
def _lock_file_paths(policy_path: str | None, policy_name: str, lock_dir: str | None) -> tuple[str, ...]:
    # Strings, cached: the hook looks these up on every compile, and building Paths costs more than reading.
    found = [str(lock_path(policy_path))] if policy_path else []
    if lock_dir is not None:
        found.append(str(lock_dir_path(lock_dir, policy_name)))
    return tuple(found)


def find_locked(policy_path: str | os.PathLike | None, policy_name: str, device_kind: str, torch_version: str,
                *, policy_hash: str | None = None, lock_dir: str | os.PathLike | None = None,
                policy: Policy | None = None, usable: Callable[[dict[str, Any]], str | None] | None = None,
                ) -> tuple[LockedEntry | None, list[str]]:
    """The newest locked entry for this device kind and torch (made for `policy_hash` when given), and
    the problems met on the way (each a line naming the file and the fix). Never raises for a bad file.

    `policy`: an entry must be one this policy allows (`policies.allowed.decision_refusal`: its configuration
    in the policy's grid, only searched Inductor knobs, not dated in the future). `usable(entry)` says why the
    caller cannot apply an entry (None: it can). An entry refused either way is passed over, named among the
    problems, and the next newest tried (the other file's). Entries are checked only until one passes, newest
    first, so an older entry that would lose anyway costs nothing."""
    found: list[LockedEntry] = []
    problems: list[str] = []
    for file in _lock_file_paths(policy_path and os.fspath(policy_path), policy_name,
                                 lock_dir and os.fspath(lock_dir)):
        try:
            entry = _entry(read_lock_document(file), device_kind, torch_version, file, policy_hash)
        except LockFileError as exc:
            problems.append(str(exc))
            continue
        if entry is not None:
            found.append(LockedEntry(file, entry))
    found.sort(key=lambda locked: locked.entry.get("decided_at") or 0, reverse=True)  # numbers: checked; stable
    for locked in found:
        refusal = decision_refusal(policy, locked.entry["config"], locked.entry.get("decided_at")) \
            if policy is not None else None
        if refusal is None and usable is not None and (problem := usable(locked.entry)) is not None:
            refusal = Refusal(problem, UNREADABLE_FIX)
        if refusal is None:
            return locked, problems
        problems.append(f"{locked.path}: the entry for {device_kind} / torch {torch_version} {refusal}")
    return None, problems


def read_lock(policy_path: str | os.PathLike, device_kind: str, torch_version: str) -> dict[str, Any] | None:
    """The entry for this device kind and torch major.minor in the lock file beside the policy, or None.
    A corrupt file raises LockFileError (a ValueError) naming it."""
    file = lock_path(policy_path)
    return _entry(read_lock_document(file), device_kind, torch_version, file)


def lock_entry(decision: Decision) -> dict[str, Any]:
    return {
        "config": decision.config,
        "config_id": decision.config_id,
        "label": decision.label,
        "state": decision.state,
        "reason": decision.reason,
        "policy_hash": decision.policy_hash,
        "decided_at": decision.decided_at,
        "decision_id": decision.id,
        "workload": decision.workload,
        "workload_id": decision.workload_id,
        "objective": decision.objective,
        "measured": decision.measured,
        "break_even_inferences": decision.break_even_inferences,
        "break_even_never": decision.break_even_never,
        "proposed": decision.proposed,
    }


def _write_into(file: Path, decision: Decision, policy: Policy | None = None) -> Path:
    """Merge the decision's entry into `file`. What cannot be read back as a lock entry (a damaged entry, one
    `policy` would refuse to apply, or the whole file when it is not a lock file at all) is dropped, and so are
    the oldest entries when the file would grow past MAX_LOCK_BYTES; a warning names the file and what went."""
    try:
        document = read_lock_document(file)
    except LockFormatTooNew as exc:
        raise LockFileNewerThanWriter(f"{file}: written by a newer joulepilot ({exc.format_text}), so it is left "
                                      f"as it is and no other lock file is written; upgrade joulepilot "
                                      f"here") from exc
    except LockFileError as exc:
        if isinstance(exc.__cause__, PermissionError):
            raise PermissionError(str(exc)) from exc
        entries: dict[str, dict[str, Any]] = {}  # nothing in it could be used; the new document replaces it
        dropped = [f"the whole file: {_why_unusable(exc, file)}"]
    else:
        entries, dropped = _sound_entries(document.get("entries", {}), policy)
    entries.setdefault(decision.device_kind, {})[decision.torch_version] = lock_entry(decision)
    text, oldest = _bounded_text(decision, entries)
    if oldest:
        dropped.append(f"the {oldest} oldest entr{'y' if oldest == 1 else 'ies'}, to keep the file within "
                       f"{MAX_LOCK_BYTES:,} bytes")
    file.parent.mkdir(parents=True, exist_ok=True)
    written = write_file_atomic(file, text.encode())
    if dropped:  # told once the new file is in place: a write that failed dropped nothing
        listed = dropped[:MAX_DROPPED_LISTED]
        if len(dropped) > MAX_DROPPED_LISTED:
            listed.append(f"{len(dropped) - MAX_DROPPED_LISTED} more")
        others = _entry_count(entries) - 1
        log.warning("%s: dropped damaged lock data (%s); wrote the new decision for %s / torch %s%s", written,
                    "; ".join(listed), _printable(decision.device_kind), decision.torch_version,
                    f" and kept the {others} other entr{'y' if others == 1 else 'ies'}" if others else "")
    return written


def _bounded_text(decision: Decision, entries: dict[str, dict[str, Any]]) -> tuple[str, int]:
    """The lock file's text, and how many of the other entries (oldest first) were left out of `entries` so that
    it stays within MAX_LOCK_BYTES, which readers refuse to go past. LockWriteError when the new entry alone does
    not fit."""
    others = sorted(((entry.get("decided_at") or 0, kind, version) for kind, by_torch in entries.items()
                     for version, entry in by_torch.items()
                     if (kind, version) != (decision.device_kind, decision.torch_version)), key=lambda o: o[0])
    left_out = 0
    while True:
        new = {"format": LOCK_FORMAT, "policy": decision.policy, "entries": entries}
        text = strict_json_text(new, indent=2, sort_keys=True, default=str) + "\n"
        if len(text.encode()) <= MAX_LOCK_BYTES:
            return text, left_out
        if left_out == len(others):
            raise LockWriteError(f"cannot write the lock file: the entry for {_printable(decision.device_kind)} / "
                                 f"torch {decision.torch_version} alone is larger than the {MAX_LOCK_BYTES:,} bytes "
                                 "a lock file may have")
        _, kind, version = others[left_out]
        del entries[kind][version]
        if not entries[kind]:
            del entries[kind]
        left_out += 1


def _sound_entries(entries: dict[str, Any], policy: Policy | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The well-formed entries, by device kind and torch version, and a description of each one left out: an
    entry a reader would refuse (`decision_refusal`; under `policy` when it was made for the policy's content)
    is not written again."""
    kept: dict[str, dict[str, Any]] = {}
    dropped: list[str] = []
    for kind, by_torch in entries.items():
        if not isinstance(by_torch, dict):
            dropped.append(f"the entry for {_printable(kind)}: {_json_kind(by_torch)}, not a table of entries "
                           f"by torch version")
            continue
        for torch_version, entry in by_torch.items():
            where = f"the entry for {_printable(kind)} / torch {_printable(torch_version)}"
            if not _well_formed(entry):
                what = "no configuration or an unknown state" if isinstance(entry, dict) else _json_kind(entry)
                dropped.append(f"{where}: {what}")
                continue
            same = policy if policy is not None and entry.get("policy_hash") == policy.hash else None
            refusal = decision_refusal(same, entry["config"], entry.get("decided_at"))
            if refusal is not None:
                dropped.append(f"{where}: it {shorten(refusal.problem, 200)}")
                continue
            kept.setdefault(kind, {})[torch_version] = entry
    return kept, dropped


def _well_formed(entry: Any) -> bool:
    """Whether a lock entry can be applied: a configuration with an id, in a state a caller may apply."""
    return (isinstance(entry, dict) and isinstance(entry.get("config"), dict) and bool(entry["config"].get("id"))
            and entry.get("state") in APPLICABLE_STATES)


def _entry_count(entries: dict[str, dict[str, Any]]) -> int:
    return sum(len(by_torch) for by_torch in entries.values())


def _why_unusable(exc: LockFileError, file: str | os.PathLike) -> str:
    """What was wrong with a lock file, from the reader's error, without its file name and its fix."""
    text = str(exc)
    prefix = f"{os.fspath(file)}: "
    return (text[len(prefix):] if text.startswith(prefix) else text).partition("; ")[0]


def _json_kind(value: Any) -> str:
    """'integer 5', 'array [1, 2]': a JSON value's type and a short quote of it."""
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    name = "null" if value is None else kinds.get(type(value), type(value).__name__)
    return name if value is None else f"{name} {shorten(json.dumps(value, default=str), DROPPED_QUOTE_CHARS)}"


def _printable(text: str) -> str:
    """A device kind or torch version from a file, fit for a one-line message."""
    return shorten(text if text.isprintable() else repr(text), DROPPED_QUOTE_CHARS)


def write_lock(policy_path: str | os.PathLike | None, decision: Decision, *,
               lock_dir: str | os.PathLike | None = None, policy: Policy | None = None) -> Path:
    """Add or replace this decision's (device kind, torch) entry and write the file atomically.

    Beside the policy when its folder can be written; otherwise (read-only file system, permissions)
    in `lock_dir` as `<policy name>.lock.json`. Raises LockWriteError when neither works, and at once
    (LockFileNewerThanWriter, nothing written anywhere) on a lock file written by a newer joulepilot: that
    version's hook reads the lock directory too, and would find there an entry it may prefer to its own.

    Nothing a reader would refuse is written (`policies.allowed.decision_refusal`, under `policy` when given and
    the decision was made for its content): such a decision raises LockWriteError, and such an entry already in
    the file is dropped."""
    same = policy if policy is not None and decision.policy_hash == policy.hash else None
    refusal = decision_refusal(same, decision.config, decision.decided_at)
    if refusal is not None:
        raise LockWriteError(f"cannot write the lock file: the decision for {_printable(decision.device_kind)} / "
                             f"torch {decision.torch_version} {refusal}")
    failures: list[str] = []
    for file in lock_files(policy_path, decision.policy, lock_dir):
        try:
            return _write_into(file, decision, same)
        except LockFileNewerThanWriter as exc:
            raise LockFileNewerThanWriter("cannot write the lock file: " + "; ".join([*failures, str(exc)])) from exc
        except OSError as exc:
            failures.append(f"{file}: {exc.strerror or exc}")
    if lock_dir is None and policy_path:
        failures.append("no lock directory to fall back on (set lock_dir in the daemon config or "
                        f"${LOCK_DIR_ENV})")
    raise LockWriteError("cannot write the lock file: " + "; ".join(failures))
