"""Which energy source a decision ranks: figures from different meters are never compared.

Every run names what metered it (`energy_source`: `nvml`, `rapl`, `estimate`, or several joined as
`nvml+estimate` when a window had parts metered differently). The resolver (`policies.resolve`), the guided
search's decision (`controller.search`) and the frontier (`controller.frontier`) apply one rule:

* A configuration's runs are grouped by their source. Candidates are compared only within one source:
  each configuration is judged on its runs of that source alone, so no median mixes meters either.
* Which source: the most trustworthy one (`trust_rank`: a measurement, `nvml` or `rapl`, before a partly
  estimated window, before `estimate`, before runs that record no source) that has a candidate within every
  limit; else the most trustworthy that has a candidate the power limits alone reject (the infeasible
  path); else the most trustworthy present (`pick_source`). Sources of equal trust: the one more
  configurations were measured with, then by name.
* A configuration with no run of that source is listed, not compared, on its own most trustworthy source's
  runs, with why (`not_compared_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

MEASURED = frozenset({"nvml", "rapl"})
ESTIMATE = "estimate"
UNKNOWN_SOURCE = "source unknown"  # what a run that records no energy source is grouped as
NOT_COMPARED = "not compared"  # a reason's head, as `_rejection_summary` counts reasons
UNCOMPARED = "uncompared"  # a candidate's status

T = TypeVar("T")


def joined_sources(*groups: Iterable[str | None]) -> str | None:
    """'nvml+estimate' from the sources of several figures: each named once, `estimate` last."""
    names: set[str] = set()
    for group in groups:
        for source in group:
            if source:
                names.update(part for part in str(source).split("+") if part)
    if not names:
        return None
    return "+".join(sorted(names - {ESTIMATE}) + ([ESTIMATE] if ESTIMATE in names else []))


def source_key(source: str | None) -> str:
    """The group a run's energy source falls in: its meters in one order ('nvml+estimate'), or
    UNKNOWN_SOURCE for a run that records none."""
    return joined_sources([source]) or UNKNOWN_SOURCE


def trust_rank(source: str) -> int:
    """0 measured (nvml, rapl), 1 partly estimated, 2 estimate, 3 unknown: lower is more trustworthy."""
    parts = set(source.split("+")) if source and source != UNKNOWN_SOURCE else set()
    if parts and parts <= MEASURED:
        return 0
    if ESTIMATE in parts and parts - {ESTIMATE} and parts - {ESTIMATE} <= MEASURED:
        return 1
    if parts == {ESTIMATE}:
        return 2
    return 3


def ranked_sources(configs_per_source: Mapping[str, int]) -> list[str]:
    """The sources present, most trustworthy first; `configs_per_source`: how many configurations each
    measured (the tie-break among equally trusted sources)."""
    return sorted(configs_per_source, key=lambda s: (trust_rank(s), -configs_per_source[s], s))


def group_by_source(runs_per_config: Mapping[str, Sequence[T]], source_of: Callable[[T], str | None]
                    ) -> dict[str, dict[str, list[T]]]:
    """{source: {config id: its runs of that source, in the order given}}."""
    out: dict[str, dict[str, list[T]]] = {}
    for config_id, runs in runs_per_config.items():
        for run in runs:
            out.setdefault(source_key(source_of(run)), {}).setdefault(config_id, []).append(run)
    return out


def pick_source(ranked: Sequence[str], tests: Iterable[Callable[[str], bool]]) -> str | None:
    """The first source of `ranked` that passes the first test any source passes, else the most trustworthy
    one (None when there is none)."""
    for test in tests:
        for source in ranked:
            if test(source):
                return source
    return ranked[0] if ranked else None


def own_sources(grouped: Mapping[str, Mapping[str, Any]], ranked: Sequence[str]) -> dict[str, str]:
    """config id -> the most trustworthy source it has runs of."""
    out: dict[str, str] = {}
    for source in ranked:
        for config_id in grouped.get(source, {}):
            out.setdefault(config_id, source)
    return out


def not_compared_text(own: str, ranked: str, ranker: str = "the decision") -> str:
    """A candidate's reason when its runs are of another source than the one `ranker` ranks."""
    return f"{NOT_COMPARED}: measured with {own}; {ranker} ranks {ranked} runs"


def left_out_text(others: Mapping[str, int], ranked: str, ranker: str = "the decision") -> str:
    """A compared candidate's note: its runs of other sources, which do not count."""
    parts = ", ".join(f"{n} run{'s' if n != 1 else ''} metered by {source}" for source, n in sorted(others.items()))
    return f"{parts} not counted: {ranker} ranks {ranked} runs"


def uncompared_summary(labels_by_source: Mapping[str, Sequence[str]], ranked: str,
                       ranker: str = "the decision") -> str:
    """The decision's note on what it did not compare: '2 candidates measured only with estimate
    (eager/fp32/b8, default/fp32/b8) are not compared: the decision ranks rapl runs'."""
    parts = []
    for source, labels in sorted(labels_by_source.items(), key=lambda item: (trust_rank(item[0]), item[0])):
        parts.append(f"{len(labels)} candidate{'s' if len(labels) != 1 else ''} measured only with {source} "
                     f"({', '.join(labels)})")
    verb = "is" if len(parts) == 1 and sum(len(v) for v in labels_by_source.values()) == 1 else "are"
    return f"{' and '.join(parts)} {verb} not compared: {ranker} ranks {ranked} runs"


def estimate_note(source: str | None) -> str | None:
    """What the decision says when the runs it ranks are estimated (wholly or in part), else None (runs that
    record no source, from before sources were stored, are left as they were)."""
    rank = trust_rank(source) if source else 0
    if rank == 1:
        return (f"its energy figures are partly estimated ({source}): the estimated part is CPU time x watts per "
                f"core, not a measurement")
    if rank == 2:
        return ("its energy figures are estimates (no energy counter was readable: CPU time x watts per core), "
                "not measurements")
    return None
