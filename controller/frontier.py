"""The latency/energy Pareto frontier of one workload: measured points, and predicted ones for the
allowed configurations not measured yet."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from joulepilot.policies.judge import counted_rows, intervals
from joulepilot.policies.noise import median
from joulepilot.policies.sources import (
    UNKNOWN_SOURCE,
    group_by_source,
    left_out_text,
    not_compared_text,
    own_sources,
    ranked_sources,
    uncompared_summary,
)
from joulepilot.store import Store
from joulepilot.store.catalog import workload_row as stored_workload
from joulepilot.store.runs import RunRow, latest_per_config, ok_runs

from .tradeoff import TradeoffError, TradeoffModel, fit


def pareto_front(points: Sequence[Mapping[str, Any]], x: str = "latency_ms_p95",
                 y: str = "energy_j_per_inference") -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better), sorted by x."""
    usable = [(i, p[x], p[y]) for i, p in enumerate(points) if p.get(x) is not None and p.get(y) is not None]
    usable.sort(key=lambda t: (t[1], t[2]))
    front, best_y = [], float("inf")
    for i, _, yv in usable:
        if yv < best_y:
            front.append(i)
            best_y = yv
    return front


# The axes of a frontier: a forward pass's p95 latency per call and J per call; a generation's time per output
# token (p50, the latency its policies minimise) and J per generated token.
FORWARD_AXES = {"x": "latency_ms_p95", "y": "energy_j_per_inference"}
GENERATION_AXES = {"x": "tpot_ms_p50", "y": "energy_j_per_token"}
AXIS_WORDS = {"latency_ms_p95": "p95 latency per forward call (ms)", "energy_j_per_inference": "energy per forward call (J)",
              "tpot_ms_p50": "time per output token, p50 (ms)", "energy_j_per_token": "energy per generated token (J)"}


def _grid(runs: Sequence[RunRow], batch_size: int, search: Any = None, generates: bool = False) -> list[Any]:
    """Allowed configurations: the policy's search space, else every combination of the modes,
    precisions, fusion presets, dynamic and padding settings measured on this device (eager: only plain); for
    a generation, each with the KV caches and prefill settings searched (or measured)."""
    from joulepilot.compiler import CompileConfig
    from joulepilot.compiler.generation_workloads import generation_variants

    if search is not None:
        modes, precisions, fusions, dynamics = search.modes, search.precisions, search.fusion, search.dynamic
        paddings = getattr(search, "padding", ("none",))
        regionals = search.regional_settings()
    else:
        modes = sorted({r.mode for r in runs})
        precisions = sorted({r.precision for r in runs})
        fusions = sorted({r.fusion for r in runs})
        dynamics = sorted({bool(r.dynamic) for r in runs})
        paddings = sorted({r.padding or "none" for r in runs})
        regionals = sorted({r.regional or "" for r in runs})
    caches = getattr(search, "caches", None) if search is not None else \
        sorted({r.cache or "dynamic" for r in runs if r.mode != "eager"}) or None
    prefills = getattr(search, "compile_prefill", (False,)) if search is not None else \
        sorted({bool(r.compile_prefill) for r in runs}) or [False]
    seen, out = set(), []
    for mode, precision, fusion, dynamic, padding, regional in itertools.product(modes, precisions, fusions,
                                                                                 dynamics, paddings, regionals):
        eager = mode == "eager"
        cfg = CompileConfig(mode=mode, fusion="default" if eager else fusion, precision=precision,
                            dynamic=dynamic and not eager, padding="none" if eager else padding,
                            batch_size=batch_size, regional="" if eager else regional)
        for variant in generation_variants(cfg, caches, prefills) if generates else [cfg]:
            if variant.id not in seen:
                seen.add(variant.id)
                out.append(variant)
    return out


def _median_of(runs: Sequence[RunRow], figure: str) -> float | None:
    values = [getattr(r, figure) for r in runs if getattr(r, figure) is not None]
    return median(values) if values else None


def _measured_points(runs: Sequence[RunRow], latest: Mapping[str, RunRow],
                     axes: Mapping[str, str] = FORWARD_AXES) -> tuple[list[dict[str, Any]], list[str]]:
    """(one point per measured configuration, notes on what was not compared). Runs of different energy
    sources are never compared (`policies.sources`): the frontier ranks the points of the most trustworthy
    source measured (then the one more configurations were measured with); each configuration's point rests on
    its runs of that source alone, every one that counts (flagged runs once a clean one exists): median
    figures, and for J/inference the median's interval and the number of repeats. A configuration measured
    only otherwise gets a point from its own most trustworthy source's runs, `compared` false, off the
    frontier. `energy_source` names the meter(s) of the runs a point rests on."""
    per_config = {cid: [r for r in runs if r.config_id == cid] for cid in latest}
    grouped = group_by_source(per_config, lambda run: run.energy_source)
    order = ranked_sources({source: len(group) for source, group in grouped.items()})
    ranked = order[0] if order else None
    own = own_sources(grouped, order)
    counted_by_source = {source: {cid: counted_rows(rs) for cid, rs in group.items()}
                         for source, group in grouped.items()}
    energy = axes["y"]
    found = {source: intervals({cid: [getattr(r, energy) for r in rs if getattr(r, energy) is not None]
                                for cid, rs in counted.items()})
             for source, counted in counted_by_source.items()}
    points, notes, uncompared = [], [], {}
    for cid, newest in latest.items():
        source = ranked if cid in grouped.get(ranked or "", {}) else own[cid]
        mine, ci = counted_by_source[source][cid], found[source].get(cid)
        point = {
            "label": newest.config_label, "config_id": cid, "mode": newest.mode, "fusion": newest.fusion,
            "precision": newest.precision, "source": "measured", "run_id": mine[0].id if mine else newest.id,
            "run_ids": [r.id for r in mine], "repeats": len(mine),
            "latency_ms_p95": _median_of(mine, "latency_ms_p95"),
            energy: ci.median if ci else None,
            "median": ci.median if ci else None, "ci_low": ci.low if ci else None,
            "ci_high": ci.high if ci else None,
            "spread_pct": 100.0 * ci.half_width_rel if ci else None,
            "avg_power_w": _median_of(mine, "avg_power_w"), "compile_s": _median_of(mine, "compile_s"),
            "energy_source": None if source == UNKNOWN_SOURCE else source,
            "compared": source == ranked, "not_compared": None,
        }
        if axes is GENERATION_AXES:
            point.update({name: _median_of(mine, name) for name in ("tpot_ms_p50", "tpot_ms_p95", "ttft_ms_p50")})
        if source != ranked:
            point["not_compared"] = not_compared_text(source, str(ranked), "the frontier")
            uncompared.setdefault(source, []).append(point["label"])
        others = {other: len(group[cid]) for other, group in grouped.items() if other != source and cid in group}
        if others:
            notes.append(f"{point['label']}: {left_out_text(others, str(ranked), 'the frontier')}")
        points.append(point)
    if uncompared:
        notes.insert(0, uncompared_summary(uncompared, str(ranked), "the frontier"))
    return points, notes


def frontier(db: Store, workload: str, *, device_name: str | None = None,
             batch_size: int | None = None, model: TradeoffModel | None = None, search: Any = None,
             predict: bool = True) -> dict[str, Any]:
    """Measured and predicted (latency p95, J/inference) points of `workload` (a spec) on one device kind; for a
    generation (TPOT p50, J per generated token), with TTFT and TPOT p95 beside them (`axes` names the two).

    Defaults: the device kind and batch size with the most ok runs of the workload. Measured points are
    the medians over every counted ok run per configuration (`median`, `ci_low`, `ci_high`: J/inference
    (J/token) and its interval; `repeats`: how many runs); predicted points are allowed configurations never
    measured (with the model's uncertainty). `frontier` lists the Pareto-optimal labels over all points,
    `measured_frontier` over measured points only.
    """
    runs = ok_runs(db, workload=workload)  # newest first
    if not runs:
        raise TradeoffError(f"no successful runs of workload {workload!r} in the store; "
                            f"run `joulepilot bench {workload}` first")
    kinds = Counter(r.device_kind for r in runs)
    device_name = device_name or kinds.most_common(1)[0][0]
    on_device = [r for r in runs if r.device_kind == device_name]
    if not on_device:
        raise TradeoffError(f"workload {workload!r} has no successful runs on {device_name!r}; "
                            f"measured on: {', '.join(sorted(kinds))}")
    batch_size = batch_size or Counter(r.batch_size for r in on_device).most_common(1)[0][0]
    at_batch = [r for r in on_device if r.batch_size == batch_size]
    if not at_batch:
        raise TradeoffError(f"workload {workload!r} has no runs at batch size {batch_size} on {device_name!r}")
    workload_id = Counter(r.workload_id for r in at_batch).most_common(1)[0][0]

    mine = [r for r in at_batch if r.workload_id == workload_id]
    generates = any(r.task == "generate" for r in mine)
    axes = GENERATION_AXES if generates else FORWARD_AXES
    latest = latest_per_config(mine)
    points, notes = _measured_points(mine, latest, axes)
    if predict:
        same_task = [r for r in on_device if (r.task == "generate") == generates]
        unmeasured = [c for c in _grid(same_task, batch_size, search, generates) if c.id not in latest]
        if unmeasured:
            if model is None:
                try:
                    model = fit(db)
                except TradeoffError as exc:
                    notes.append(f"no predictions: {exc}")
            if model is not None:
                workload_row = stored_workload(db, workload_id)
                for cfg, pred in zip(unmeasured, model.predict_many(workload_row, unmeasured, device_name),
                                     strict=True):
                    point = {"label": cfg.label, "config_id": cfg.id, "mode": cfg.mode, "fusion": cfg.fusion,
                             "precision": cfg.precision, "source": "predicted", "energy_source": None}
                    for target, (mean, std) in pred.items():
                        point[target] = mean
                        point[target + "_std"] = std
                    points.append(point)

    # Only points of one energy source (and predictions) are ranked against each other.
    x, y = axes["x"], axes["y"]
    ranked_idx = [i for i, p in enumerate(points) if p["source"] == "predicted" or p["compared"]]
    front = [ranked_idx[i] for i in pareto_front([points[i] for i in ranked_idx], x, y)]
    measured_idx = [i for i, p in enumerate(points) if p["source"] == "measured" and p["compared"]]
    measured_front = [measured_idx[i] for i in pareto_front([points[i] for i in measured_idx], x, y)]
    for i, p in enumerate(points):
        p["pareto"] = i in front
        p["measured_pareto"] = i in measured_front
    points.sort(key=lambda p: (p.get(x) is None, p.get(x) or 0.0))
    return {
        "workload": workload, "workload_id": workload_id, "batch_size": batch_size, "device_kind": device_name,
        "task": "generate" if generates else "forward", "axes": dict(axes),
        "points": points,
        "frontier": [p["label"] for p in points if p["pareto"]],
        "measured_frontier": [p["label"] for p in points if p["measured_pareto"]],
        "notes": notes,
    }


def frontier_figure(result: Mapping[str, Any]) -> Any:
    """The frontier as a matplotlib figure: p95 latency against J/inference; measured points grouped by
    energy source (an estimate hollow and grey, and the whole plot marked ESTIMATE as the report's plots
    are), predicted hollow triangles with error bars, and the frontier line over all points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report_plots import mark_estimate, place_labels

    axes = result.get("axes") or FORWARD_AXES
    x, y = axes["x"], axes["y"]
    points = [p for p in result["points"] if p.get(x) is not None and p.get(y) is not None]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    measured = [p for p in points if p["source"] == "measured"]
    predicted = [p for p in points if p["source"] == "predicted"]
    by_source: dict[str, list[Mapping[str, Any]]] = {}
    for p in measured:
        by_source.setdefault(p.get("energy_source") or "no source", []).append(p)
    colours = iter(["tab:blue", "tab:purple", "tab:brown", "tab:cyan"])
    for source, group in sorted(by_source.items(), key=lambda item: "estimate" in item[0]):
        xs, ys = [p[x] for p in group], [p[y] for p in group]
        apart = ", not compared" if not any(p.get("compared", True) for p in group) else ""
        if "estimate" in source:
            ax.scatter(xs, ys, s=42, facecolors="none", edgecolors="0.35", linewidths=1.4, zorder=3,
                       label=f"measured ({source}): {'' if source == 'estimate' else 'partly '}ESTIMATE energy"
                             f"{apart}")
        else:
            ax.scatter(xs, ys, s=42, color=next(colours, "tab:blue"), zorder=3, label=f"measured ({source}){apart}")
    if predicted:
        ax.errorbar([p[x] for p in predicted], [p[y] for p in predicted],
                    xerr=[p.get(f"{x}_std", 0) for p in predicted],
                    yerr=[p.get(f"{y}_std", 0) for p in predicted],
                    fmt="^", mfc="none", color="tab:orange", ms=8, capsize=2, label="predicted (±1 std)",
                    zorder=2)
    front = sorted((p for p in points if p.get("pareto")), key=lambda p: p[x])
    if front:
        ax.step([p[x] for p in front], [p[y] for p in front],
                where="post", color="tab:green", lw=1.5, label="Pareto frontier", zorder=1)
    ax.set_xlabel(AXIS_WORDS[x])
    ax.set_ylabel(AXIS_WORDS[y])
    mark_estimate(ax, f"{result['workload']} (batch {result['batch_size']}) on {result['device_kind']}",
                  any("estimate" in source for source in by_source))
    ax.grid(alpha=0.3)
    ax.margins(x=0.06, y=0.08)  # room for the labels of the outermost points
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    # Every frontier point is labelled; the others where a label fits without covering anything (the table and
    # --json name every point).
    place_labels(fig, ax, [(p[x], p[y], p["label"], bool(p.get("pareto")))
                           for p in front + [p for p in points if not p.get("pareto")]])
    return fig


def plot_frontier(result: Mapping[str, Any], path: str | Path) -> Path:
    """Write `frontier_figure(result)` as a PNG at `path`."""
    import matplotlib.pyplot as plt

    fig = frontier_figure(result)
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
