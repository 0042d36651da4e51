"""Reading policy files from disk and finding them by name."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .schema import Policy, PolicyError, Problem, validate

POLICIES_ENV = "JOULEPILOT_POLICIES"


def policy_hash(raw: Mapping[str, Any]) -> str:
    """Content hash of a parsed policy: comments, whitespace and key order do not change it."""
    blob = json.dumps(raw, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    file = str(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise PolicyError([Problem(file, "(file)", "an existing policy file", "no such file")]) from None
    except OSError as exc:
        raise PolicyError([Problem(file, "(file)", "a readable file", str(exc))]) from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError([Problem(file, "(syntax)", "valid TOML", str(exc))]) from None


def load_policy(path: str | os.PathLike) -> Policy:
    """Parse and validate one policy file; raises PolicyError naming the file and every bad key."""
    raw = read_toml(path)
    policy = validate(raw, str(path))
    return dataclasses.replace(policy, path=str(Path(path).resolve()), hash=policy_hash(raw))


def policy_dirs() -> list[Path]:
    """Where policies are looked up by name: $JOULEPILOT_POLICIES (os.pathsep list), then
    <JOULEPILOT_HOME>/policies, then the current directory."""
    from joulepilot.store import default_home

    dirs = [Path(p).expanduser() for p in os.environ.get(POLICIES_ENV, "").split(os.pathsep) if p]
    dirs.append(default_home() / "policies")
    dirs.append(Path.cwd())
    return dirs


def find_policy(name_or_path: str | os.PathLike, dirs: Sequence[str | os.PathLike] | None = None) -> Path:
    """A policy file given as a path, or as a name looked up as `<name>.toml` in `dirs`
    (default: `policy_dirs()`)."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_file():
        return candidate
    text = str(name_or_path)
    if text.endswith(".toml") or os.sep in text:
        raise PolicyError([Problem(text, "(file)", "an existing policy file", "no such file")])
    searched = [Path(d) for d in (dirs if dirs is not None else policy_dirs())]
    for folder in searched:
        path = folder / f"{text}.toml"
        if path.is_file():
            return path
    where = ", ".join(str(d) for d in searched)
    raise PolicyError([Problem(text, "(file)", f"a policy file {text}.toml in one of: {where}",
                               "no such file", f"pass a path, or set {POLICIES_ENV}")])
