"""The one budget model for a benchmark worker, used by `bench`, the daemon and the docs alike.

- `budget_s` bounds the worker's first forward calls: the eager fp32 reference call and the
  configuration's first (cold-compile) call, together. A forward that hangs on its very first call is
  therefore killed `budget_s` after that call began, like a compile that never ends.
- Everything else (interpreter start, building the model, warm-up, latency pass, energy window,
  saving artifacts, describing the workload) shares an allowance derived from `min_seconds`:
  `allowance_s = SETUP_ALLOWANCE_S + MEASURE_ALLOWANCE_FACTOR * min_seconds`.
  The warm-up runs at most max(2, min_seconds), the latency pass at most 3 s, the window
  `min_seconds`; the factor leaves room for a slow last call in each of them.
- The whole worker is killed `budget_s + allowance_s` after it started.

A kill lands at most `KILL_GRACE_S` after the limit it enforces (the parent polls the worker's
phase file and then SIGKILLs its process group).
"""

from __future__ import annotations

from dataclasses import dataclass

SETUP_ALLOWANCE_S = 180.0
MEASURE_ALLOWANCE_FACTOR = 6.0
KILL_GRACE_S = 2.0

def windows_taken(asked: int, max_rel_error: float | None, bound: float | None) -> int:
    """The energy windows a worker takes of the `asked`: one alone when its numerical check (`max_rel_error`, one
    per process) is over `bound` (the policy's limit), since every further window would repeat a configuration the
    policy cannot apply. The worker and the guided search (which models it in replays) both decide by this."""
    if bound is not None and max_rel_error is not None and max_rel_error > bound:
        return 1
    return max(1, asked)


# Phases (as the worker names them) that are a first forward call and count against `budget_s`.
FIRST_CALL_PHASES = ("reference", "compile")
# The head of a failed run's reason when its compile overran the budget (the guided search reads it back).
COMPILE_OVERRUN = "compile exceeded budget"


@dataclass(frozen=True)
class WorkerBudget:
    first_call_s: float  # the eager reference plus the cold-compile call, together
    allowance_s: float  # everything else the worker does
    grace_s: float = KILL_GRACE_S

    @property
    def total_s(self) -> float:
        """Wall-clock limit of the whole worker, from its start."""
        return self.first_call_s + self.allowance_s

    def to_dict(self) -> dict[str, float]:
        return {"budget_s": self.first_call_s, "allowance_s": self.allowance_s, "total_s": self.total_s,
                "grace_s": self.grace_s}


def measure_allowance_s(min_seconds: float) -> float:
    """Time allowed for a worker's work outside its first forward calls (see the module doc)."""
    return SETUP_ALLOWANCE_S + MEASURE_ALLOWANCE_FACTOR * float(min_seconds)


def worker_budget(budget_s: float, min_seconds: float) -> WorkerBudget:
    """The limits of one worker measuring with an energy window of `min_seconds`."""
    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, found {budget_s!r}")
    return WorkerBudget(first_call_s=float(budget_s), allowance_s=measure_allowance_s(min_seconds))
