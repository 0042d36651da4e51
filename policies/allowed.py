"""What a decision read back as data may apply: the one check for lock entries and stored decisions alike.

A lock file and a stored decision are data, never code. Whoever can write the file or the database must not
be able to make a serving process run a program (Inductor's `cpp.cxx` names a compiler it runs), apply a
configuration its policy never allowed, or pin a decision in force for good. So a decision read back (the
hook's lookup, the daemon's lock upkeep, the lock writer keeping other entries) is applied only when
`decision_refusal` finds nothing wrong with it:

  - its configuration parses (a mode, precision, fusion preset ... this joulepilot knows), and its id is the id
    of its settings;
  - its raw Inductor options are only knobs joulepilot searches (`compiler.options.SEARCHED_OPTIONS`: those of
    the fusion presets), each true or false;
  - apart from those options, it is a configuration of the policy's `[search]` grid (mode, precision, fusion
    preset, batch size, regional setting, dynamic shapes, padding) or the policy's `[fallback]`;
  - its `decided_at` is a time in seconds no later than this host's clock plus CLOCK_SKEW_S (a decision made on
    a host whose clock runs a few minutes ahead still applies; one dated in the future cannot outrank every
    decision made after it).

Anything else is refused with a `Refusal`: what is wrong and the fix, for a one-line warning that names the
file or database it came from; the caller then tries the next source, else applies the fallback.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from joulepilot.store.safeio import shorten

from .batches import grid_batch_sizes
from .resolve import candidate_configs, fallback_config
from .schema import Policy

# How far ahead of this host's clock a decision may be dated: the clock of the host that decided may run ahead.
CLOCK_SKEW_S = 300.0
QUOTE_CHARS = 60

# The fix for a decision this joulepilot cannot read (a newer version may have written it), and for one that
# no joulepilot writes (someone edited the file or the database).
UNREADABLE_FIX = ("re-lock the policy with this joulepilot (`joulepilot policy lock` on it, or let the daemon "
                  "rewrite the file), or upgrade joulepilot here if a newer version wrote it")
NOT_ALLOWED_FIX = ("joulepilot never writes such a decision: decide the policy again (`joulepilot policy lock` on "
                   "it, or let the daemon do it), and find out who edited it")


@dataclass(frozen=True)
class Refusal:
    """Why a decision read back is not applied (`problem`, worded to follow 'the entry ...' or 'decision 5
    ...') and what to do about it (`fix`)."""

    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.problem}; {self.fix}"


def config_problem(row: Any) -> str | None:
    """Why this joulepilot cannot read a decided configuration row (a lock entry's or a stored decision's
    `config`), or None when it can. Torch-free: whether the installed torch knows its options is checked where
    it is applied."""
    return _parsed(row)[1]


def _parsed(row: Any) -> tuple[Any, str | None]:
    """(the row's CompileConfig, None), or (None, why this joulepilot cannot read it)."""
    if not isinstance(row, dict) or not row.get("id"):
        return None, "names no configuration"
    if "mode" not in row:
        return None, "names a configuration with no mode"
    batch = row.get("batch_size")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)):
        return None, f"names a configuration whose batch_size {shorten(repr(batch), QUOTE_CHARS)} is not a whole number"
    options = row.get("options")
    if isinstance(options, str) and options.strip():
        try:
            decoded = json.loads(options)
        except ValueError as exc:  # RecursionError included: nothing decoded that deep is an options table
            return None, f"names a configuration whose options are not JSON ({exc})"
        if not isinstance(decoded, dict):
            return None, "names a configuration whose options are not a JSON object"
    from joulepilot.compiler import CompileConfig  # here: reading a lock file loads no compiler

    try:
        return CompileConfig.from_row(row), None
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as exc:  # ConfigError is a ValueError
        return None, f"names a configuration this joulepilot cannot use ({' '.join(str(exc).split())[:300]})"


def decision_refusal(policy: Policy | None, config: Any, decided_at: Any = None, *,
                     now: float | None = None) -> Refusal | None:
    """Why a decision read back from a lock file or the store must not be applied under `policy`, or None (see
    the module docstring). `policy` None: the checks that need no policy (an entry made for other policy
    content, which is never applied, is still kept only when it is sound)."""
    parsed, problem = _parsed(config)
    if problem is not None:
        return Refusal(problem, UNREADABLE_FIX)
    config_id = parsed.id
    if config["id"] != config_id:
        return Refusal(f"names a configuration whose id {shorten(repr(config['id']), QUOTE_CHARS)} is not the id of "
                       f"its settings ({shorten(parsed.label, 120)})", NOT_ALLOWED_FIX)
    problem = _options_problem(parsed.options)
    if problem is None and policy is not None:
        problem = _grid_problem(policy, parsed, config_id if not parsed.options else parsed.replace(options=()).id)
    if problem is not None:
        return Refusal(f"names {shorten(parsed.label, 120)}, which {problem}", NOT_ALLOWED_FIX)
    return time_refusal(decided_at, now)


def decided_at_problem(decided_at: Any) -> str | None:
    """Why a decision's `decided_at` is no time in seconds, or None (no time at all: an old lock entry, which
    sorts as the oldest)."""
    if decided_at is None or (isinstance(decided_at, int | float) and not isinstance(decided_at, bool)
                              and math.isfinite(decided_at)):
        return None
    return f"has a decided_at that is not a time in seconds ({shorten(repr(decided_at), QUOTE_CHARS)})"


def time_refusal(decided_at: Any, now: float | None = None) -> Refusal | None:
    """Why a decision's `decided_at` cannot order it among the others (not a time, or later than this host's
    clock allows), or None."""
    problem = decided_at_problem(decided_at)
    if problem is not None:
        return Refusal(problem, UNREADABLE_FIX)
    now = time.time() if now is None else now
    if decided_at is not None and decided_at > now + CLOCK_SKEW_S:
        return Refusal(f"is dated {_when(decided_at)}, {_ahead(decided_at - now)} ahead of this host's clock (at most "
                       f"{CLOCK_SKEW_S:g} s of clock skew is allowed), so it would outrank every later decision",
                       NOT_ALLOWED_FIX)
    return None


def _options_problem(options: tuple[tuple[str, Any], ...]) -> str | None:
    from joulepilot.compiler.options import SEARCHED_OPTIONS

    foreign = [name for name, value in options if name not in SEARCHED_OPTIONS or not isinstance(value, bool)]
    if not foreign:
        return None
    named = ", ".join(shorten(repr(name), QUOTE_CHARS) for name in foreign[:5])
    more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
    return (f"sets the Inductor option(s) {named}{more}: a decision may set only the knobs joulepilot searches "
            f"({', '.join(sorted(SEARCHED_OPTIONS))}), each true or false")


@functools.lru_cache(maxsize=64)
def _allowed_ids(policy: Policy) -> frozenset[str]:
    """The ids of every configuration of the policy's grid, and of its fallback (cached: the hook's hot path)."""
    return frozenset({config.id for config in candidate_configs(policy)} | {fallback_config(policy).id})


def _grid_problem(policy: Policy, config: Any, plain_id: str) -> str | None:
    """None when `config` (`plain_id`: its id without raw options) is one of the policy's grid or its fallback;
    else which of its settings the policy's [search] table does not list."""
    try:
        allowed = _allowed_ids(policy)
    except TypeError:  # a Policy built in code with a list somewhere cannot be a cache key
        allowed = _allowed_ids.__wrapped__(policy)
    if plain_id in allowed:
        return None
    search = policy.search
    settings = [("mode", config.mode, search.modes, "modes"),
                ("precision", config.precision, search.precisions, "precisions"),
                ("batch size", config.batch_size, grid_batch_sizes(policy), "batch_sizes (and batch_size)")]
    if config.compiles:
        settings += [("fusion preset", config.fusion, search.fusion, "fusion"),
                     ("regional setting", config.regional, search.regional_settings(), "regional"),
                     ("dynamic setting", config.dynamic, search.dynamic, "dynamic")]
    grid = [c for c in candidate_configs(policy) if c.compiles == config.compiles]  # eager has its own cache
    settings += [("KV cache", config.cache, tuple(dict.fromkeys(c.cache for c in grid)), "caches"),
                 ("compiled prefill", config.compile_prefill, tuple(dict.fromkeys(c.compile_prefill for c in grid)),
                  "compile_prefill")]
    detail = next((f"its {what} {shorten(repr(value), QUOTE_CHARS)} is not in [search] {key} "
                   f"({', '.join(map(repr, allowed))})"
                   for what, value, allowed, key in settings if value not in allowed),
                  "it is no configuration of the [search] grid")
    return (f"policy {shorten(policy.name, QUOTE_CHARS)!r} does not allow: {detail}, and it is not the [fallback] "
            f"{fallback_config(policy).label}")


def _when(seconds: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:.0f} s after 1970"


def _ahead(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:,.0f} days" if days >= 2 else f"{seconds:,.0f} s"
