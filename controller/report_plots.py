"""The report's plots as PNG bytes (matplotlib, Agg backend, no display needed).

Each plot takes the report's per-window samples, or, when the report lists only its newest windows, its
timeline: the whole period in spans that each sum the windows started in them (drawn the same way, a span's
figures being averages over it). Time runs along x as elapsed time from the first window, in a unit chosen for
the span (s, min or h), so a one-minute test and a month of serving both read well. When the energy source is an estimate the plot says so in its title and across
its face, and "partly estimate" when some windows were estimated and the others measured: an estimate must never
pass for a measurement.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - the backend is chosen before pyplot loads

from .report_format import estimate_part, per_sample  # noqa: E402

AVG_COLOUR = "#1f6fb4"
PEAK_COLOUR = "#e08a1e"
LIMIT_COLOUR = "#c62828"
ENERGY_COLOUR = "#2e7d32"
SIZE_IN = (9.0, 3.4)
DPI = 110


def time_axis(samples: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float], str]:
    """(window starts, window ends) as elapsed time in a readable unit, and that unit's label."""
    if not samples:
        return [], [], "s"
    t0 = samples[0]["t_start"]
    span = samples[-1]["t_end"] - t0
    scale, unit = (1.0, "s") if span < 300 else (60.0, "min") if span < 3 * 3600 else (3600.0, "h")
    return ([(s["t_start"] - t0) / scale for s in samples], [(s["t_end"] - t0) / scale for s in samples], unit)


def mark_estimate(ax: Any, title: str, estimate: bool, *, partly: bool = False) -> None:
    """Title the axes; when what they show rests on an estimate, say so in the title and across the face; when
    only in part (`partly`: some windows estimated, the others measured), say that."""
    if partly:
        ax.set_title(title + "  (PARTLY ESTIMATE: some windows estimated)", fontsize=11, loc="left")
        ax.text(0.5, 0.5, "PARTLY ESTIMATE", transform=ax.transAxes, fontsize=32, color="grey", alpha=0.15,
                ha="center", va="center", rotation=12)
        return
    ax.set_title(title + ("  (ESTIMATE, not measured)" if estimate else ""), fontsize=11, loc="left")
    if estimate:
        ax.text(0.5, 0.5, "ESTIMATE", transform=ax.transAxes, fontsize=40, color="grey", alpha=0.15,
                ha="center", va="center", rotation=12)


# Where a point's label may go, in points from the point, nearest first: right, left, above, below, then the
# diagonals, then the same farther out (a thin line then leads from the label to its point).
_LABEL_OFFSETS = [(dx * r, dy * r) for r in (1.0, 2.2, 3.6)
                  for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, 1), (1, -1), (-1, -1))]
_LABEL_STEP_PT = 5.0
NEAR_RING = 2.2  # the farthest ring of `_LABEL_OFFSETS` a label that is not required may take
MARKER_HALF_PX = 5.0  # the room a point's marker takes around it, in pixels


def place_labels(fig: Any, ax: Any, points: Sequence[tuple[float, float, str, bool]], *, fontsize: float = 7.0
                 ) -> list[Any]:
    """Label points `(x, y, text, required)` so that no label leaves the axes or covers another label, a point's
    marker or the legend: each label takes the nearest free place around its point (`_LABEL_OFFSETS`), with a
    thin leader line when it had to move away. Required labels (the frontier's) come first, in the order given,
    and take the least crowded place when none is free; a label that is not required is left out when it finds
    no free place. Call after the figure's layout is final (tight_layout); returns the labels drawn."""
    fig.canvas.draw()  # final limits and layout: the boxes below are measured in pixels
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    markers = [ax.transData.transform((x, y)) for x, y, _text, _required in points]
    taken = [(px - MARKER_HALF_PX, py - MARKER_HALF_PX, px + MARKER_HALF_PX, py + MARKER_HALF_PX)
             for px, py in markers]
    legend = ax.get_legend()
    if legend is not None:
        box = legend.get_window_extent(renderer)
        taken.append((box.x0, box.y0, box.x1, box.y1))

    def overlap(a: tuple[float, ...], b: tuple[float, ...]) -> float:
        return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))

    def align(label: Any, dx: float, dy: float) -> None:
        label.set_position((dx * _LABEL_STEP_PT, dy * _LABEL_STEP_PT))
        label.set_horizontalalignment("left" if dx > 0 else "right" if dx < 0 else "center")
        label.set_verticalalignment("bottom" if dy > 0 else "top" if dy < 0 else "center")

    drawn = []
    for i in sorted(range(len(points)), key=lambda i: not points[i][3]):  # required first, in their order
        x, y, text, required = points[i]
        trial = ax.annotate(text, (x, y), xytext=(0, 0), textcoords="offset points", fontsize=fontsize)
        best: tuple[float, tuple[float, float], tuple[float, ...]] | None = None
        for dx, dy in _LABEL_OFFSETS:
            if not required and max(abs(dx), abs(dy)) > NEAR_RING:
                break  # a label that is not required stays near its point or is left out
            align(trial, dx, dy)
            ext = trial.get_window_extent(renderer)
            box = (ext.x0, ext.y0, ext.x1, ext.y1)
            if box[0] < frame.x0 or box[1] < frame.y0 or box[2] > frame.x1 or box[3] > frame.y1:
                continue
            crowding = sum(overlap(box, other) for j, other in enumerate(taken) if j != i)
            if best is None or crowding < best[0]:
                best = (crowding, (dx, dy), box)
            if crowding == 0:
                break
        trial.remove()
        if best is None or (best[0] > 0 and not required):
            continue
        (dx, dy), box = best[1], best[2]
        far = max(abs(dx), abs(dy)) > 1
        # the leader line leaves the label from its side nearest the point
        relpos = (0.0 if dx > 0 else 1.0 if dx < 0 else 0.5, 0.0 if dy > 0 else 1.0 if dy < 0 else 0.5)
        label = ax.annotate(text, (x, y), xytext=(0, 0), textcoords="offset points", fontsize=fontsize, color="0.25",
                            annotation_clip=True,
                            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.6", "shrinkA": 0, "shrinkB": 3,
                                        "relpos": relpos} if far else None)
        align(label, dx, dy)
        taken.append(box)
        drawn.append(label)
    return drawn


def _finish(fig: Any, ax: Any, title: str, source: str | None) -> bytes:
    part = estimate_part(source)
    mark_estimate(ax, title, part == "whole", partly=part == "part")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # below the axes, so it never hides the data
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(3, len(handles)),
                  fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _empty(title: str) -> bytes:
    fig, ax = plt.subplots(figsize=SIZE_IN)
    ax.text(0.5, 0.5, "no samples in this period", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return _finish(fig, ax, title, None)


def _steps(starts: list[float], ends: list[float], values: list[float | None]) -> tuple[list[float], list[float]]:
    """Each window drawn flat over its own span (a window's figure is an average over that span)."""
    xs: list[float] = []
    ys: list[float] = []
    for a, b, v in zip(starts, ends, values, strict=True):
        if v is None:
            xs.append(a)
            ys.append(float("nan"))
            continue
        xs += [a, b]
        ys += [v, v]
    return xs, ys


def power_timeline(samples: Sequence[Mapping[str, Any]], *, max_avg_power_w: float | None,
                   max_peak_power_w: float | None, source: str | None, spans: bool = False) -> bytes:
    """`spans`: `samples` are a report's timeline spans, not windows: each span's average is drawn, and the
    highest average of one window in it as a thin line, so a window above the limit still shows."""
    title = "Power per span of windows against the envelope" if spans else "Power per window against the envelope"
    if not samples:
        return _empty(title)
    starts, ends, unit = time_axis(samples)
    fig, ax = plt.subplots(figsize=SIZE_IN)
    xs, ys = _steps(starts, ends, [s["avg_power_w"] for s in samples])
    ax.plot(xs, ys, color=AVG_COLOUR, lw=1.8, label="average power per span" if spans else "average power per window")
    highest: list[float] = []
    if spans:
        hx, highest = _steps(starts, ends, [s["max_window_avg_power_w"] for s in samples])
        ax.plot(hx, highest, color=AVG_COLOUR, lw=0.8, alpha=0.5, label="highest window average in span")
    mids = [(a + b) / 2 for a, b in zip(starts, ends, strict=True)]
    peaks = [s["peak_power_w"] for s in samples]
    if any(p is not None for p in peaks):
        ax.plot(mids, [float("nan") if p is None else p for p in peaks], ls="none", marker=".", ms=5,
                color=PEAK_COLOUR, label="peak power in span" if spans else "peak power in window")
    if max_avg_power_w is not None:
        ax.axhline(max_avg_power_w, color=LIMIT_COLOUR, ls="--", lw=1.4,
                   label=f"average-power limit {max_avg_power_w:g} W")
    if max_peak_power_w is not None:
        ax.axhline(max_peak_power_w, color=LIMIT_COLOUR, ls=":", lw=1.4,
                   label=f"peak-power limit {max_peak_power_w:g} W")
    top = max([v for v in ys + highest if v == v] + [p for p in peaks if p is not None]
              + [x for x in (max_avg_power_w, max_peak_power_w) if x is not None] + [1e-9])
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel(f"time since first window ({unit})")
    ax.set_ylabel("power (W)")
    return _finish(fig, ax, title, source)


def _baseline_level(baseline: Mapping[str, Any]) -> tuple[float | None, str]:
    """Where a baseline's line goes on the J-per-call axis, and its legend: its J per call, or, compared per
    sample (the deployment serves another batch size), its J per sample times the samples of a served call."""
    if per_sample(baseline) and baseline.get("j_per_sample") is not None:
        served = baseline["served_batch_size"]
        return (baseline["j_per_sample"] * served,
                f"{baseline['label']} (benchmark at batch {baseline['batch_size']}, per {served} samples)")
    return baseline.get("j_per_inference"), f"{baseline['label']} (benchmark)"


def j_per_inference_timeline(samples: Sequence[Mapping[str, Any]], *, source: str | None,
                             baselines: Mapping[str, Mapping[str, Any]] | None = None, spans: bool = False) -> bytes:
    """The deployment's J per call per window (per span with `spans`), with a line for each benchmarked baseline
    metered by the same source (one metered otherwise is not like for like and is left out)."""
    title = "Energy per inference per span of windows" if spans else "Energy per inference per window"
    if not samples:
        return _empty(title)
    starts, ends, unit = time_axis(samples)
    fig, ax = plt.subplots(figsize=SIZE_IN)
    values = [s["j_per_inference"] for s in samples]
    xs, ys = _steps(starts, ends, values)
    ax.plot(xs, ys, color=AVG_COLOUR, lw=1.8, label="this deployment")
    styles = iter([("#6d4c41", "--"), ("#7b1fa2", "-.")])
    lines = []
    for b in (baselines or {}).values():
        colour, style = next(styles, ("grey", ":"))
        level, label = _baseline_level(b)
        if b.get("measured") and level is not None and b.get("like_for_like") is not False:
            ax.axhline(level, color=colour, ls=style, lw=1.3, label=label)
            lines.append(level)
    finite = [v for v in ys if v == v] + lines
    ax.set_ylim(0, (max(finite) if finite else 1.0) * 1.15)
    ax.set_xlabel(f"time since first window ({unit})")
    ax.set_ylabel("energy per inference (J)")
    if any(v is None for v in values):
        ax.text(0.01, 0.02, f"gaps: {'spans' if spans else 'windows'} with no calls", transform=ax.transAxes,
                fontsize=8, color="grey")
    return _finish(fig, ax, title, source)


def cumulative_energy(samples: Sequence[Mapping[str, Any]], *, source: str | None) -> bytes:
    title = "Cumulative energy"
    if not samples:
        return _empty(title)
    _starts, ends, unit = time_axis(samples)
    total = samples[-1]["cumulative_energy_j"]
    scale, e_unit = (1.0, "J") if total < 1e4 else (1e3, "kJ") if total < 3.6e6 else (3.6e6, "kWh")
    fig, ax = plt.subplots(figsize=SIZE_IN)
    xs = [0.0] + ends
    ys = [0.0] + [s["cumulative_energy_j"] / scale for s in samples]
    ax.plot(xs, ys, color=ENERGY_COLOUR, lw=1.8, label="energy since first window")
    ax.fill_between(xs, ys, color=ENERGY_COLOUR, alpha=0.12)
    ax.set_ylim(0, max(ys) * 1.1 if max(ys) > 0 else 1.0)
    ax.set_xlabel(f"time since first window ({unit})")
    ax.set_ylabel(f"energy ({e_unit})")
    return _finish(fig, ax, title, source)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def report_plots(report: Mapping[str, Any]) -> dict[str, str]:
    """The three plots of a report, as data URIs, ready for an image tag's src attribute: of its windows, or of
    its timeline's spans when it lists only the newest windows."""
    timeline = report.get("timeline")
    spans = bool(timeline)
    samples = timeline if spans else report["samples"]
    source = report["totals"]["energy_source"]
    env = report["envelope"]
    return {
        "power": data_uri(power_timeline(samples, max_avg_power_w=env["max_avg_power_w"],
                                         max_peak_power_w=env["max_peak_power_w"], source=source, spans=spans)),
        "j_per_inference": data_uri(j_per_inference_timeline(samples, source=source,
                                                             baselines=report["baselines"], spans=spans)),
        "cumulative": data_uri(cumulative_energy(samples, source=source)),
    }
