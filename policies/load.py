"""Reading policy files from disk and finding them by name."""

from __future__ import annotations

import codecs
import dataclasses
import errno
import hashlib
import json
import os
import stat
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from joulepilot.store.safeio import FileRefused, file_kind, is_regular_file, read_regular_file, shorten

from .schema import NAME_RULE, Policy, PolicyError, Problem, name_problem, validate

POLICIES_ENV = "JOULEPILOT_POLICIES"
MAX_POLICY_BYTES = 1 << 20  # a policy file is a few hundred bytes; anything near a megabyte is a mistake
MAX_NESTING = 16


def policy_hash(raw: Mapping[str, Any]) -> str:
    """Content hash of a parsed policy: comments, whitespace and key order do not change it."""
    blob = json.dumps(raw, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed TOML document of a policy file; PolicyError (naming the file and the fix) for a file
    that is missing, not a regular file, too large, not UTF-8, not TOML, or nested too deeply."""
    file = str(path)
    try:
        data = read_regular_file(path, max_bytes=MAX_POLICY_BYTES)
    except FileNotFoundError:
        raise PolicyError([Problem(file, "(file)", "an existing policy file", "no such file")]) from None
    except FileRefused as exc:
        raise PolicyError([Problem(file, "(file)", f"a regular file of at most {MAX_POLICY_BYTES:,} bytes",
                                   exc.reason, "a policy file is a short text file; point at the real file")]) \
            from None
    except OSError as exc:
        raise PolicyError([Problem(file, "(file)", "a readable file", exc.strerror or str(exc))]) from None
    text = _decode(file, data)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError([Problem(file, "(syntax)", "valid TOML", str(exc))]) from None
    except RecursionError:
        raise _too_deep(file) from None
    if _depth(document) > MAX_NESTING:
        raise _too_deep(file)
    return document


def _decode(file: str, data: bytes) -> str:
    """TOML is UTF-8 (a UTF-8 byte-order mark is tolerated); anything else gets the fix spelled out."""
    fix = "save it as UTF-8 (in most editors: Save with Encoding -> UTF-8)"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        encoding = "UTF-32" if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)) else "UTF-16"
        raise PolicyError([Problem(file, "(encoding)", "UTF-8 text", f"{encoding} text (byte-order mark)", fix)])
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PolicyError([Problem(file, "(encoding)", "UTF-8 text",
                                   f"byte 0x{data[exc.start]:02x} at line {line} that is not UTF-8", fix)]) from None


def _depth(document: Any) -> int:
    """How deeply tables and arrays nest (iteratively: the document may be pathological)."""
    deepest = 0
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, depth)
            if depth <= MAX_NESTING:
                stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def _too_deep(file: str) -> PolicyError:
    return PolicyError([Problem(file, "(syntax)", f"tables and arrays nested at most {MAX_NESTING} deep",
                                "deeper nesting", "a policy file uses a few flat tables; see the README")])


def load_policy(path: str | os.PathLike, *, check_workload: bool = False) -> Policy:
    """Parse and validate one policy file; raises PolicyError naming the file and every bad key.

    `check_workload` also checks the workload as `checked_policy` does, a library missing here included (as
    for the daemon, which must run the workload).
    """
    policy, warning = checked_policy(path) if check_workload else (_load_policy(path), None)
    if warning is not None:
        raise PolicyError([warning])
    return policy


def checked_policy(path: str | os.PathLike) -> tuple[Policy, Problem | None]:
    """The policy file validated as `policy check` validates it, for every command that decides or shows a
    policy: its keys, and its workload spec resolving here (a built-in name, an installed library, a module file
    that defines the factory, nothing of Python's standard library) without importing the user's code. Raises
    PolicyError for any error; a library that is not installed here comes back as a warning (the policy may be
    decided here for a host that has it)."""
    policy = _load_policy(path)
    problem = workload_problem(policy.workload, str(path), policy)
    if problem is not None and problem.severity == "error":
        raise PolicyError([problem])
    return policy, problem


def _load_policy(path: str | os.PathLike) -> Policy:
    """The validated policy; a relative `path/to/file.py:factory` workload is read against the policy file's
    folder (as a relative path in any file is), not against the current directory of whoever reads it."""
    from joulepilot.compiler.workloads import anchored_spec

    raw = read_toml(path)
    policy = validate(raw, str(path))
    resolved = os.path.realpath(path)  # not Path.resolve(), which raises on a link that loops
    return dataclasses.replace(policy, workload=anchored_spec(policy.workload, Path(resolved).parent), path=resolved,
                               hash=policy_hash(raw))


def workload_problem(spec: str, file: str, policy: Policy | None = None) -> Problem | None:
    """The problem with a policy's `workload`, or None when it resolves here. Executes no user code.
    A library that is not installed here is a problem of severity `warning`. With `policy`, also what its task
    and [model_options] ask of the workload, as `bench` checks them (`check_workload_request`): a generation
    needs a causal language model whose positions hold prompt_len + new_tokens, a forward pass a workload that is
    not a generation spec, and every model option an attribute of the model's config."""
    from joulepilot.compiler import ConfigError
    from joulepilot.compiler.generation_workloads import check_workload_request
    from joulepilot.compiler.workloads import LibraryMissing, WorkloadError, check_spec

    try:
        check_spec(spec)
    except WorkloadError as exc:
        return Problem(file, "workload", "a workload that exists here (mlp, convnet, transformer, "
                       "torchvision:<name>, timm:<name>, transformers:<ConfigClass> or module:factory)",
                       exc.message, exc.hint, "warning" if isinstance(exc, LibraryMissing) else "error")
    if policy is None:
        return None
    task = 'task = "generate"' if policy.generates else "a forward pass"
    try:
        check_workload_request(spec, generation=policy.generation, model_options=policy.model_options_dict)
    except WorkloadError as exc:
        options = "--model-option" in exc.message
        return Problem(file, "model_options" if options else "workload",
                       "attributes the model's config has" if options else f"a workload that can do {task}",
                       _policy_words(exc.message), _policy_words(exc.hint),
                       "warning" if isinstance(exc, LibraryMissing) else "error")
    except ConfigError as exc:
        return Problem(file, "workload", f"a workload that can do {task}", _policy_words(str(exc)))
    return None


# The workload checks are bench's, worded for its options; a policy names the same things as keys.
_POLICY_WORDS = (("add --task generate", 'add task = "generate"'), ("--task generate", 'task = "generate"'),
                 ("--prompt-len", "prompt_len"), ("--new-tokens", "new_tokens"),
                 ("--model-option ", "[model_options] "), ("--model-option", "[model_options]"))


def _policy_words(text: str) -> str:
    for option, key in _POLICY_WORDS:
        text = text.replace(option, key)
    return text


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
    (default: `policy_dirs()`). Only regular files count: a FIFO or a folder of that name is an error."""
    candidate = Path(name_or_path).expanduser()
    text = str(name_or_path)
    looks_like_path = text.endswith(".toml") or os.sep in text
    if looks_like_path:
        _refuse_non_regular(candidate)
    if is_regular_file(candidate):
        return candidate
    if looks_like_path:
        raise PolicyError([Problem(text, "(file)", "an existing policy file", "no such file")])
    if name_problem(text) is not None:
        raise PolicyError([Problem(shorten(repr(text), 80), "(policy name)", NAME_RULE, "a name outside that rule",
                                   "give the policy's name, or the path of its file")])
    searched = [Path(d) for d in (dirs if dirs is not None else policy_dirs())]
    for folder in searched:
        path = folder / f"{text}.toml"
        _refuse_non_regular(path)
        if path.is_file():
            return path
    where = ", ".join(str(d) for d in searched)
    raise PolicyError([Problem(text, "(file)", f"a policy file {text}.toml in one of: {where}",
                               "no such file", f"pass a path, or set {POLICIES_ENV}")])


def _refuse_non_regular(path: Path) -> None:
    """PolicyError for a path that exists but is not a regular file, or a symbolic link that loops (stat only:
    never opens it). Nothing there is left to the caller."""
    try:
        problem = file_problem(path)
    except (FileNotFoundError, ValueError):
        return
    if problem is not None:
        found, fix = problem
        raise PolicyError([Problem(str(path), "(file)", "a regular policy file", found, fix)])


def file_problem(path: str | os.PathLike) -> tuple[str, str] | None:
    """Why `path` is not a policy file to open, and the fix (stat only: never opens it); None for a regular
    file. FileNotFoundError when nothing is there (a dangling link included)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # Path.resolve() would raise RuntimeError on it
            return "a symbolic link that loops (it leads back to itself)", "point it at a policy file or remove it"
        return f"cannot stat it ({exc.strerror or exc})", "check its permissions"
    if not stat.S_ISREG(mode):
        return f"not a regular file ({file_kind(mode)})", "a policy must be a regular file"
    return None


def policy_file_names(folder: str | os.PathLike) -> list[str]:
    """The names of the policy files in `folder` (`*.toml`), sorted; OSError when it cannot be listed (not
    Path.glob, which on Python 3.11 takes a folder it may not read for an empty one)."""
    with os.scandir(folder) as entries:
        return sorted(entry.name for entry in entries if entry.name.endswith(".toml"))


def load_policy_folders(folders: Sequence[str | os.PathLike]) -> tuple[list[Policy], list[dict[str, str]]]:
    """Every `*.toml` policy in the folders; invalid files come back as errors, never raised.

    Only regular files are opened (a FIFO would block the daemon for good); a symbolic link that loops is one
    file's error like any other. A policy whose workload does not resolve is an error too, found without running
    any of its code. Two files with the same policy name: the first folder wins and the other is reported. A
    folder named twice (or through a symbolic link to it), and a file reached twice, is read once: it is not a
    second policy of that name.
    """
    policies: dict[str, Policy] = {}
    errors: list[dict[str, str]] = []
    seen_folders: set[str] = set()
    seen_files: set[str] = set()
    for folder in map(Path, folders):
        if not folder.is_dir():
            errors.append({"file": str(folder), "error": _not_a_folder(folder)})
            continue
        resolved = os.path.realpath(folder)
        if resolved in seen_folders:
            continue
        seen_folders.add(resolved)
        try:
            names = policy_file_names(folder)
        except OSError as exc:
            errors.append({"file": str(folder), "error": f"cannot list the policy folder "
                                                         f"({exc.strerror or exc}); let the daemon's user "
                                                         "read and enter it (chmod, chown or its group)"})
            continue
        for path in (folder / name for name in names):
            try:
                problem = file_problem(path)
            except FileNotFoundError as exc:  # a dangling link, or removed since the listing
                problem = f"cannot stat it ({exc.strerror or exc})", "point the link at a policy file or remove it"
            if problem is not None:
                errors.append({"file": str(path), "error": "skipped: {}; {}".format(*problem)})
                continue
            real = os.path.realpath(path)
            if real in seen_files:
                continue
            seen_files.add(real)
            try:
                policy = load_policy(path, check_workload=True)
            except PolicyError as exc:
                errors.append({"file": str(path), "error": str(exc)})
                continue
            except Exception as exc:  # a policy naming an unknown knob, etc.: report, keep going
                errors.append({"file": str(path), "error": shorten(f"{type(exc).__name__}: {exc}", 500)})
                continue
            if policy.name in policies:
                errors.append({"file": str(path), "error": f"policy name {shorten(policy.name)!r} is already "
                                                           f"defined by {policies[policy.name].path}; names must "
                                                           "be unique"})
                continue
            policies[policy.name] = policy
    return list(policies.values()), errors


def _not_a_folder(folder: Path) -> str:
    """Why a policy folder named in the config or with --policies cannot be read, and the fix."""
    fix = "fix `policies` in the daemon config / --policies"
    try:
        os.stat(folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"a symbolic link that loops (it leads back to itself); point it at the policy folder or {fix}"
        return f"policy folder does not exist; create it or {fix}"
    # a policy file given where its folder belongs, most often
    return f"not a folder: `policies` names folders of *.toml files; name the folder that holds this file, or {fix}"
