"""Statistics over repeated measurements of one configuration: medians, intervals, comparisons, repeats.

One window is not a measurement of a configuration. Every figure the decision rests on is the median
of a configuration's counted runs, with an interval for that median:

* n >= 3 runs: median +- t(n-1) x 1.2533 x s / sqrt(n), s the runs' sample standard deviation: the
  normal-theory interval for a median (whose standard error is sqrt(pi/2) times a mean's) at
  `confidence` (default 80%: two such intervals of equal width that do not overlap differ at about
  the 93% level).
  s is moderated: shrunk towards the typical spread of the workload's other repeated configurations
  as if that came from `PRIOR_DOF` more runs, since s from three runs is itself very uncertain.
  Unlike an order-statistic interval, it narrows as runs are added, so a close call can be settled
  by measuring more. No random numbers: the same runs always give the same decision.
* n < 3 runs: no spread can be estimated, so a conservative one is assumed: +- `spread_rel`, which the
  caller sets from the typical spread of the same workload's repeated configurations
  (`assumed_spread_rel`), never below `DEFAULT_SPREAD_REL` (5%: repeats of one configuration in the
  committed H200 sweep differ by up to +-7% in J per call, about 4% typically). With two runs the
  interval also covers both.

Two configurations whose intervals overlap are a tie (`policies.judge` says how they stand against the
tolerance), broken by lower average power, then
the cheaper compile, then the simpler mode, each criterion deciding only where its own intervals do not
overlap (`break_tie`). A power envelope is checked on the upper end of the average power's interval
(`policies.judge.check_limits`), a peak limit on the highest instant power seen.

Repeats (`repeat_advice`): a configuration that contends for the decision is measured at least
`MIN_REPEATS` times, in at least two processes (a repeat starts a new process and takes the windows
still needed in it, which costs one compile instead of one per window); a close call (its interval
still overlaps a rival's, or straddles a limit) gets another process of two windows, up to `MAX_REPEATS`.
A run flagged with a window warning counts only once the configuration has a clean run (`counted`).

Verified (`confirmation`): a decision is `verified` only when the chosen configuration rests on at least
`min_repeats` counted runs (MIN_REPEATS unless the policy's `[search] min_repeats` says otherwise), at
least min(MIN_FRESH_PROCESSES, min_repeats) of them in a fresh worker process (`fresh_process_of`: a
further window of a process that was already measuring is not), unless the judge found it `separated`
from every rival (worse by more than the tolerance even at the unfavourable end of the difference's
interval), where one process does; with fewer it is `provisional`. The guided search and the resolver
both ask this one rule, through the judge.

Pure Python: no SQL, no torch, no numpy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Protocol

DEFAULT_SPREAD_REL = 0.05
DEFAULT_CONFIDENCE = 0.8
MIN_REPEATS = 3
MAX_REPEATS = 5
MIN_FRESH_PROCESSES = 2
# Standard error of a median is about sqrt(pi / 2) = 1.2533 times that of a mean (normal noise).
MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)
# Weight, in runs, of the workload's typical spread when moderating one configuration's spread.
PRIOR_DOF = 3
# Simplest first: the tie-break prefers a mode earlier in this list.
MODE_SIMPLICITY = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")



def median(values: Sequence[float]) -> float:
    """The median of `values` (the mean of the middle two for an even count); ValueError when empty."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def relative_std(values: Sequence[float]) -> float:
    """Sample standard deviation relative to the median (0 for fewer than two values or a zero median)."""
    if len(values) < 2:
        return 0.0
    mid = median(values)
    if mid == 0:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) / abs(mid)


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion around the normal's; within 1% for dof >= 2)."""
    z = NormalDist().inv_cdf(p)
    if dof <= 0:
        return math.inf
    if dof == 1:  # Cauchy, exactly
        return math.tan(math.pi * (p - 0.5))
    v = float(dof)
    return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))


@dataclass(frozen=True)
class Interval:
    """The median of n runs of one figure and an interval for it, in the figure's own units."""

    median: float
    low: float
    high: float
    n: int
    method: str

    @property
    def half_width_rel(self) -> float:
        """The larger side of the interval relative to the median (0 for a zero median)."""
        if self.median == 0:
            return 0.0
        return max(self.high - self.median, self.median - self.low) / abs(self.median)

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def to_dict(self) -> dict[str, float | int | str]:
        return {"median": self.median, "low": self.low, "high": self.high, "n": self.n, "method": self.method}


def median_interval(values: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE,
                    spread_rel: float = DEFAULT_SPREAD_REL, prior_rel_std: float = 0.0,
                    prior_dof: int = PRIOR_DOF) -> Interval:
    """The median of `values` with an interval for it (see the module's rules); ValueError when empty.

    `prior_rel_std`: the typical relative spread of the same workload's other repeated configurations;
    the runs' own spread is shrunk towards it as if it came from `prior_dof` more runs (a moderated
    variance), so three runs that happen to agree closely do not give a falsely narrow interval."""
    if not values:
        raise ValueError("no runs to summarise")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence!r}")
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    mid = median(ordered)
    if n < MIN_REPEATS:
        spread = max(spread_rel, DEFAULT_SPREAD_REL)
        half = abs(mid) * spread
        return Interval(mid, min(ordered[0], mid - half), max(ordered[-1], mid + half), n,
                        f"assumed +-{spread:.0%} (fewer than {MIN_REPEATS} runs)")
    own = relative_std(ordered)
    dof = n - 1
    if prior_rel_std > 0 and prior_dof > 0:
        own = math.sqrt((prior_dof * prior_rel_std ** 2 + dof * own ** 2) / (prior_dof + dof))
        dof += prior_dof
    half = t_quantile((1 + confidence) / 2, dof) * MEDIAN_EFFICIENCY * own * abs(mid) / math.sqrt(n)
    return Interval(mid, mid - half, mid + half, n, f"{confidence:.0%} interval of the median of {n} runs")


def distribution_free_high(values: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE) -> float | None:
    """The upper end of an interval for the median of `values` that assumes nothing of their distribution (order
    statistics: the k-th highest run, for the largest k whose two-sided interval still covers the median with
    `confidence`), or None with too few runs for one (at 80%: fewer than 4; at 4 or 5 runs it is the highest)."""
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    best = None
    for k in range(1, n // 2 + 1):  # the interval [k-th lowest, k-th highest]
        miss = 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n  # P(the median lies outside it)
        if 1 - miss >= confidence:
            best = ordered[n - k]
    return best


def typical_rel_std(runs_per_config: Sequence[Sequence[float]]) -> float:
    """The median relative spread among configurations with at least MIN_REPEATS runs (0 if none)."""
    spreads = [relative_std(v) for v in runs_per_config if len(v) >= MIN_REPEATS]
    return median(spreads) if spreads else 0.0


def assumed_spread_rel(typical_rel_std: float, *, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """The half-width assumed for a configuration with fewer than MIN_REPEATS runs: how far one run may
    lie from its median given the workload's typical relative spread (`typical_rel_std`), never below
    DEFAULT_SPREAD_REL."""
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    return max(DEFAULT_SPREAD_REL, z * typical_rel_std)


def mode_rank(mode: str) -> int:
    return MODE_SIMPLICITY.index(mode) if mode in MODE_SIMPLICITY else len(MODE_SIMPLICITY)


@dataclass(frozen=True)
class TieEntry:
    """A configuration in a tie: its objective, average power and compile seconds (intervals) and mode."""

    key: str
    objective: Interval
    avg_power_w: Interval | None
    compile_s: Interval | None
    mode: str


def break_tie(entries: Sequence[TieEntry]) -> tuple[TieEntry, str]:
    """The winner of a tie and the criterion that decided it.

    In order: lower average power, then cheaper compile, then simpler mode (MODE_SIMPLICITY), then the
    lower median objective. Each criterion is itself noisy, so it decides only between entries whose
    intervals do not overlap: the entries whose interval overlaps the lowest one's stay in the running
    for the next criterion. An entry lacking a figure loses on that criterion to one that has it."""
    if not entries:
        raise ValueError("no entries to break a tie between")
    pool = list(entries)
    for criterion, figure in (("lower average power", "avg_power_w"), ("cheaper compile", "compile_s")):
        known = [e for e in pool if getattr(e, figure) is not None]
        if not known:
            continue
        lowest = min(known, key=lambda e: getattr(e, figure).median)
        pool = [e for e in known if getattr(e, figure).overlaps(getattr(lowest, figure))]
        if len(pool) == 1:
            return pool[0], criterion
    simplest = min(mode_rank(e.mode) for e in pool)
    pool = [e for e in pool if mode_rank(e.mode) == simplest]
    if len(pool) == 1:
        return pool[0], "simpler mode"
    return min(pool, key=lambda e: (e.objective.median, e.key)), "lower median"


class Marked(Protocol):
    """What the repeat rules read of a run (`policies.judge.Run` has it): did it succeed, was it flagged
    "repeat this run", did it start its worker process."""

    ok: bool
    flagged: Any
    fresh_process: bool


def fresh_process_of(extra: Mapping[str, object] | None) -> bool:
    """Whether a run started its worker process, from the run's `extra`: every run does but a further
    window of a process that was already measuring (`extra.window_in_process` above 1)."""
    index = extra.get("window_in_process", 1) if isinstance(extra, Mapping) else 1
    return not (isinstance(index, int) and not isinstance(index, bool) and index > 1)


def counted(runs: Sequence[Marked]) -> list[int]:
    """Indexes of the runs that count: ok runs, flagged ones only once there is a clean ok run."""
    ok = [i for i, r in enumerate(runs) if r.ok]
    if any(not runs[i].flagged for i in ok):
        return ok
    return []


@dataclass(frozen=True)
class Confirmation:
    """How far one configuration's runs go towards a verified decision: `runs` counted runs (`counted`),
    `fresh` of them in a fresh worker process, against `min_repeats`; `separated`: no rival could change the
    answer (every one is worse by more than the tolerance even at the unfavourable end of the difference's
    interval), so a second worker process is not needed."""

    runs: int
    fresh: int
    min_repeats: int = MIN_REPEATS
    separated: bool = False

    @property
    def fresh_needed(self) -> int:
        return 1 if self.separated else min(MIN_FRESH_PROCESSES, self.min_repeats)

    @property
    def confirmed(self) -> bool:
        return self.runs >= self.min_repeats and self.fresh >= self.fresh_needed

    def shortfall(self) -> str:
        """What a decision on these runs lacks to be verified, as the decision's reason says it ('' when
        nothing): 'it has 1 of the 3 runs a verified decision needs'."""
        if self.runs < self.min_repeats:
            return f"it has {self.runs} of the {self.min_repeats} runs a verified decision needs"
        if self.fresh < self.fresh_needed:
            return (f"it has {self.runs} of the {self.min_repeats} runs a verified decision needs, but only "
                    f"{self.fresh} of them started its own worker process, and it needs {self.fresh_needed} "
                    f"while a rival could still change the answer")
        return ""


def confirmation(runs: Sequence[Marked], min_repeats: int = MIN_REPEATS, *, separated: bool = False
                 ) -> Confirmation:
    """Where a configuration's runs (every run of it, failed and flagged ones included) stand against the
    verified rule (see the module's rules)."""
    if min_repeats < 1:
        raise ValueError(f"min_repeats must be at least 1, got {min_repeats!r}")
    kept = [runs[i] for i in counted(runs)]
    return Confirmation(len(kept), sum(1 for r in kept if r.fresh_process), min_repeats, separated)


@dataclass(frozen=True)
class RepeatAdvice:
    """Whether to measure a contender again: `more` is how many runs it still needs at least (0: none),
    `fresh_process` whether the next one must start a new process, `why` a sentence for the log;
    `further_window`: whether a further window of the process measuring it now would serve too (False when
    what it lacks is a run that started its own process)."""

    more: int
    fresh_process: bool
    why: str
    further_window: bool = True


def repeat_advice(runs: Sequence[Marked], *, close_call: bool, min_repeats: int = MIN_REPEATS,
                  max_repeats: int = MAX_REPEATS, separated: bool = False) -> RepeatAdvice:
    """How many more runs a configuration that contends for the decision needs.

    At least `min_repeats` counted clean runs, from at least MIN_FRESH_PROCESSES processes; a close call
    two more (another process and a second window in it) up to `max_repeats` runs in all (flagged and
    failed runs included in that cap, so a noisy host cannot keep a configuration in the loop forever).
    A repeat always starts a new process (`fresh_process`); `more` runs are its windows, so the runs a
    contender still needs cost one process start and compile, not one each."""
    total = len(runs)
    if total >= max_repeats:
        return RepeatAdvice(0, False, f"cap of {max_repeats} runs reached")
    room = max_repeats - total
    clean = [r for r in runs if r.ok and not r.flagged]
    if not clean and any(r.ok for r in runs):
        return RepeatAdvice(min(room, max(1, min_repeats - 1)), True,
                            "its runs were flagged with a window warning; they count after a clean repeat")
    status = confirmation(runs, min_repeats, separated=separated)
    if status.runs < min_repeats:
        return RepeatAdvice(min(min_repeats - status.runs, room), True,
                            f"contender with {status.runs} of {min_repeats} runs")
    if status.fresh < status.fresh_needed:
        return RepeatAdvice(1, True, "no repeat in a fresh process yet", further_window=False)
    if close_call:
        return RepeatAdvice(min(2, room), True, f"close call, {total} of at most {max_repeats} runs")
    return RepeatAdvice(0, False, "enough runs")

