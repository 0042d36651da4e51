"""A deployment's figures over a period, summed in SQL: what a report needs without loading every window.

A deployment metered every 5 s writes 17,280 windows a day. Reports read its totals, per-source and
per-configuration split, power figures, envelope counts and payback progress from the aggregates here (one
pass over the index each), list only the newest windows (`recent_samples`), and draw their plots from at most a
few hundred spans of the period (`sample_timeline`). Every function takes the same period as `read_samples`:
the deployment's windows that end after `since` (all of them when `since` is None), in time order (`t_start`,
then `id`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .connection import Store

# A window's energy is (partly) an estimate when its source names `estimate` (`estimate`, `nvml+estimate`).
_ESTIMATED = "energy_source LIKE '%estimate%'"
_SHARED = "other_processes != 0"


def _period(deployment_id: int, since: float | None) -> tuple[str, list[Any]]:
    where = "deployment_id = ?"
    args: list[Any] = [deployment_id]
    if since is not None:
        where += " AND t_end > ?"
        args.append(since)
    return where, args


@dataclass(frozen=True)
class SampleTotals:
    """Sums over a deployment's windows in a period (see the module docstring).

    `busy_energy_j`: the energy of windows that served calls; `estimated_*`: of windows whose source names
    `estimate`; `shared_windows`: windows in which other processes used the device, `mean_share` this
    deployment's mean share of utilisation over those that recorded one; `attributed_energy_j`: energy x share
    (a whole window where no share was recorded); `windows_above_avg_limit` / `_peak_limit`: windows whose
    average / peak power (0 where none was read) exceeds the limits given (0 without a limit);
    `first_t_start`: the first window's start; `last_t_end`: the end of the last window in time order;
    `tokens`: a generation's generated tokens (None when no window counted any: forward calls) and
    `token_energy_j` the energy of the windows that counted them (J per token is the one over the other)."""

    windows: int
    energy_j: float
    inferences: int
    metered_s: float
    busy_energy_j: float
    peak_power_w: float | None
    sources: tuple[str, ...]
    estimated_energy_j: float
    estimated_windows: int
    shared_windows: int
    max_other_processes: int
    mean_share: float | None
    attributed_energy_j: float
    windows_above_avg_limit: int
    windows_above_peak_limit: int
    first_t_start: float | None
    last_t_end: float | None
    tokens: int | None = None
    token_energy_j: float = 0.0

    @property
    def j_per_token(self) -> float | None:
        return self.token_energy_j / self.tokens if self.tokens else None


def sample_totals(db: Store, deployment_id: int, *, since: float | None = None,
                  max_avg_power_w: float | None = None, max_peak_power_w: float | None = None) -> SampleTotals:
    """The sums of `SampleTotals` over the period."""
    where, args = _period(deployment_id, since)
    row = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(energy_j), 0), COALESCE(SUM(inferences), 0), "
        "COALESCE(SUM(t_end - t_start), 0), COALESCE(SUM(energy_j) FILTER (WHERE inferences != 0), 0), "
        "MAX(peak_power_w), "
        f"COALESCE(SUM(energy_j) FILTER (WHERE {_ESTIMATED}), 0), COUNT(*) FILTER (WHERE {_ESTIMATED}), "
        f"COUNT(*) FILTER (WHERE {_SHARED}), COALESCE(MAX(other_processes), 0), "
        f"AVG(share) FILTER (WHERE {_SHARED}), COALESCE(SUM(energy_j * COALESCE(share, 1.0)), 0), "
        "COUNT(*) FILTER (WHERE COALESCE(avg_power_w, 0) > ?), COUNT(*) FILTER (WHERE COALESCE(peak_power_w, 0) > ?), "
        "SUM(tokens), COALESCE(SUM(energy_j) FILTER (WHERE tokens IS NOT NULL), 0) "
        f"FROM deployment_samples WHERE {where}", [max_avg_power_w, max_peak_power_w, *args]).fetchone()
    sources = tuple(sorted(r[0] for r in db.execute(
        f"SELECT DISTINCT energy_source FROM deployment_samples WHERE {where}", args)))
    first = db.execute(f"SELECT t_start FROM deployment_samples WHERE {where} ORDER BY t_start, id LIMIT 1",
                       args).fetchone()
    last = db.execute(f"SELECT t_end FROM deployment_samples WHERE {where} ORDER BY t_start DESC, id DESC LIMIT 1",
                      args).fetchone()
    return SampleTotals(
        windows=row[0], energy_j=row[1], inferences=row[2], metered_s=row[3], busy_energy_j=row[4],
        peak_power_w=row[5], sources=sources, estimated_energy_j=row[6], estimated_windows=row[7],
        shared_windows=row[8], max_other_processes=row[9], mean_share=row[10], attributed_energy_j=row[11],
        windows_above_avg_limit=row[12], windows_above_peak_limit=row[13],
        first_t_start=first[0] if first else None, last_t_end=last[0] if last else None,
        tokens=row[14], token_energy_j=row[15])


@dataclass(frozen=True)
class ConfigTotals:
    """One configuration's share of a deployment's windows in a period."""

    config_id: str
    windows: int
    energy_j: float
    inferences: int
    tokens: int | None = None  # a generation's (None: forward calls)


def config_totals(db: Store, deployment_id: int, *,
                  since: float | None = None) -> list[ConfigTotals]:
    """Per configuration the windows recorded as served with it, by config id (windows recording none left out)."""
    where, args = _period(deployment_id, since)
    return [ConfigTotals(*r) for r in db.execute(
        "SELECT config_id, COUNT(*), SUM(energy_j), SUM(inferences), SUM(tokens) FROM deployment_samples "
        f"WHERE {where} AND config_id IS NOT NULL AND config_id != '' GROUP BY config_id ORDER BY config_id", args)]


def recent_samples(db: Store, deployment_id: int, limit: int, *,
                   since: float | None = None) -> tuple[list[dict[str, Any]], float]:
    """The last `limit` windows of the period in time order, and the energy of the period's windows before them
    (0.0 when none is left out), from which their cumulative energy counts."""
    if limit <= 0:
        return [], 0.0
    where, args = _period(deployment_id, since)
    rows = list(db.query(f"SELECT * FROM deployment_samples WHERE {where} ORDER BY t_start DESC, id DESC LIMIT ?",
                         [*args, limit]))
    rows.reverse()
    if not rows:
        return [], 0.0
    first = rows[0]
    before = db.execute(f"SELECT SUM(energy_j) FROM deployment_samples WHERE {where} "
                        "AND (t_start < ? OR (t_start = ? AND id < ?))",
                        [*args, first["t_start"], first["t_start"], first["id"]]).fetchone()[0]
    return rows, before or 0.0


@dataclass(frozen=True)
class TimelineSpan:
    """A stretch of the period in a report's plots: the windows that started in it, summed.

    Reads like a listed window (`t_start`, `t_end`, `avg_power_w`, `peak_power_w`, `j_per_inference`,
    `cumulative_energy_j`), so the plots draw either. `avg_power_w` is the span's energy over its metered
    seconds; `max_window_avg_power_w` the highest average of one window in it."""

    t_start: float
    t_end: float
    windows: int
    energy_j: float
    inferences: int
    duration_s: float
    avg_power_w: float | None
    max_window_avg_power_w: float | None
    peak_power_w: float | None
    j_per_inference: float | None
    cumulative_energy_j: float

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def sample_timeline(db: Store, deployment_id: int, spans: int, *,
                    since: float | None = None) -> list[TimelineSpan]:
    """The period cut into at most `spans` equal stretches of time by window start, each with its windows summed;
    stretches with no window are left out."""
    if spans <= 0:
        return []
    where, args = _period(deployment_id, since)
    bounds = db.execute(f"SELECT MIN(t_start), MAX(t_end) FROM deployment_samples WHERE {where}", args).fetchone()
    if bounds[0] is None:
        return []
    t0, t1 = bounds
    width = (t1 - t0) / spans if t1 > t0 else 1.0
    span = db.whole_part("(t_start - ?) / ?")  # never negative: t0 is the first window's start; the last span
    # takes the windows past it
    rows = db.execute(
        "SELECT MIN(t_start), MAX(t_end), COUNT(*), SUM(energy_j), SUM(inferences), SUM(t_end - t_start), "
        "MAX(avg_power_w), MAX(peak_power_w) "
        f"FROM deployment_samples WHERE {where} GROUP BY CASE WHEN {span} > ? THEN ? ELSE {span} END "
        "ORDER BY MIN(t_start)", [*args, t0, width, spans - 1, spans - 1, t0, width]).fetchall()
    out, cumulative = [], 0.0
    for start, end, windows, energy_j, inferences, duration_s, max_avg, peak in rows:
        cumulative += energy_j
        out.append(TimelineSpan(
            t_start=start, t_end=end, windows=windows, energy_j=energy_j, inferences=inferences,
            duration_s=duration_s, avg_power_w=energy_j / duration_s if duration_s > 0 else None,
            max_window_avg_power_w=max_avg, peak_power_w=peak,
            j_per_inference=energy_j / inferences if inferences else None, cumulative_energy_j=cumulative))
    return out


@dataclass(frozen=True)
class CallsProgress:
    """A deployment's calls served with one configuration, from its first window (for the tuning's payback).

    `metered_s` sums the windows' lengths (a negative one counted as 0); `crossing`: the first window whose calls
    brought the running count to `calls_needed` (t_start, t_end, its calls, the calls before it), None when the
    count never reached it or no count was asked for."""

    calls: int
    metered_s: float
    first_t_start: float | None
    crossing: tuple[float, float, int, int] | None


def calls_progress(db: Store, deployment_id: int, config_id: str, *,
                   calls_needed: float | None = None) -> CallsProgress:
    """Every window of the deployment served with `config_id` (or recording no configuration), whatever its
    time, summed; and where the running count of their calls reached `calls_needed`."""
    where = "deployment_id = ? AND (config_id IS NULL OR config_id = '' OR config_id = ?)"
    args: list[Any] = [deployment_id, config_id]
    calls, metered_s = db.execute(
        f"SELECT COALESCE(SUM(inferences), 0), "
        "COALESCE(SUM(CASE WHEN t_end > t_start THEN t_end - t_start ELSE 0.0 END), 0) "
        f"FROM deployment_samples WHERE {where}", args).fetchone()
    first = db.execute(f"SELECT t_start FROM deployment_samples WHERE {where} ORDER BY t_start, id LIMIT 1",
                       args).fetchone()
    crossing = None
    if calls_needed is not None and first is not None:
        row = db.execute(
            "SELECT t_start, t_end, inferences, running - inferences FROM ("
            "SELECT t_start, t_end, inferences, id, SUM(inferences) OVER (ORDER BY t_start, id) AS running "
            f"FROM deployment_samples WHERE {where}) AS windows WHERE inferences != 0 AND running >= ? "
            "ORDER BY t_start, id LIMIT 1", [*args, calls_needed]).fetchone()
        crossing = tuple(row) if row else None
    return CallsProgress(calls=calls, metered_s=metered_s, first_t_start=first[0] if first else None,
                         crossing=crossing)  # type: ignore[arg-type]


def sources_at(db: Store, deployment_id: int, moments: Iterable[float]) -> dict[float, str]:
    """{moment: the energy source of the window it falls in} (t_start < moment <= t_end: a guard trip's time is
    the end of the window that tripped it; where windows overlap, the one that started last); moments in no
    window are left out. One index seek per moment."""
    found: dict[float, str] = {}
    for moment in set(moments):
        row = db.execute("SELECT t_end, energy_source FROM deployment_samples WHERE deployment_id = ? "
                         "AND t_start < ? ORDER BY t_start DESC, id DESC LIMIT 1", [deployment_id, moment]).fetchone()
        if row is not None and row[0] >= moment:
            found[moment] = row[1]
    return found
