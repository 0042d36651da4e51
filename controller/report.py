"""Energy reports per deployment: what it spent, against what envelope, and what the policy saved.

`build_report(db, name)` gathers every figure from the store into one JSON-ready dict; `render`
turns it (or `build_summary(db)` for all deployments) into HTML, Markdown, JSON or CSV. The figures
and their sources are identical in every format.

Where figures come from:
- energy, inferences and power: the deployment's samples (each carries its energy source);
- the envelope: the policy file found by name (`policies.find_policy`), else the limits recorded by
  `attach` (`deployments.details`, where the schema has it), else the newest decision's details,
  else the limit cited by recorded violations;
- the configuration and why: the newest decision of the policy for the configuration served;
- baselines: `runs` of the same workload (same id, hence same batch and shapes) on the same device
  kind, for eager fp32 and stock `torch.compile` (mode default, fp32);
- peak efficiency: the datasheet table `DEVICE_PEAKS` below.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

import sqlite_utils
from joulepilot.store.deployments import get_deployment, list_deployments, list_violations, read_samples
from joulepilot.store.jsonvalues import json_output
from joulepilot.store.timevalues import iso_utc, parse_since

from .features import device_kind as features_device_kind

J_PER_KWH = 3.6e6
FORMATS = ("html", "md", "json", "csv")
GRID_ENV = "JOULEPILOT_GRID_GCO2_PER_KWH"
REPORT_KIND = "joulepilot.deployment_report"
SUMMARY_KIND = "joulepilot.deployments_summary"

# Peak throughput and board power from NVIDIA's datasheets. "tensor_16bit" is dense BF16/FP16 Tensor
# Core FLOP/s (the datasheets print the 2:4-sparsity figure, twice this); "fp32" is non-tensor FP32,
# which is what PyTorch fp32 matmuls use unless TF32 is enabled. tdp_w is the maximum board power
# (configurable parts: the top of the range).
DEVICE_PEAKS: list[dict[str, Any]] = [
    {"match": ("h200", "nvl"), "name": "NVIDIA H200 NVL", "fp32": 60e12, "tensor_16bit": 835.5e12, "tdp_w": 600,
     "source": "NVIDIA H200 Tensor Core GPU datasheet"},
    {"match": ("h200",), "name": "NVIDIA H200 SXM", "fp32": 67e12, "tensor_16bit": 989.5e12, "tdp_w": 700,
     "source": "NVIDIA H200 Tensor Core GPU datasheet"},
    {"match": ("h100", "nvl"), "name": "NVIDIA H100 NVL", "fp32": 60e12, "tensor_16bit": 835.5e12, "tdp_w": 400,
     "source": "NVIDIA H100 Tensor Core GPU datasheet"},
    {"match": ("h100", "pcie"), "name": "NVIDIA H100 PCIe", "fp32": 51e12, "tensor_16bit": 756.5e12,
     "tdp_w": 350, "source": "NVIDIA H100 Tensor Core GPU datasheet"},
    {"match": ("h100",), "name": "NVIDIA H100 SXM", "fp32": 67e12, "tensor_16bit": 989.5e12, "tdp_w": 700,
     "source": "NVIDIA H100 Tensor Core GPU datasheet"},
    {"match": ("a100", "pcie", "40gb"), "name": "NVIDIA A100 PCIe 40GB", "fp32": 19.5e12,
     "tensor_16bit": 312e12, "tdp_w": 250, "source": "NVIDIA A100 Tensor Core GPU datasheet"},
    {"match": ("a100", "pcie"), "name": "NVIDIA A100 PCIe 80GB", "fp32": 19.5e12, "tensor_16bit": 312e12,
     "tdp_w": 300, "source": "NVIDIA A100 Tensor Core GPU datasheet"},
    {"match": ("a100",), "name": "NVIDIA A100 SXM", "fp32": 19.5e12, "tensor_16bit": 312e12, "tdp_w": 400,
     "source": "NVIDIA A100 Tensor Core GPU datasheet"},
    {"match": ("l40s",), "name": "NVIDIA L40S", "fp32": 91.6e12, "tensor_16bit": 366e12, "tdp_w": 350,
     "source": "NVIDIA L40S datasheet"},
    {"match": ("nvidia l4",), "exact": True, "name": "NVIDIA L4", "fp32": 30.3e12, "tensor_16bit": 121e12,
     "tdp_w": 72, "source": "NVIDIA L4 Tensor Core GPU datasheet"},
]


def device_peak(device_name: str | None, precision: str | None) -> dict[str, Any] | None:
    """Datasheet peak FLOP/s, TDP and peak FLOPs per joule for a GPU name, or None when unknown."""
    if not device_name:
        return None
    name = device_name.lower()
    for entry in DEVICE_PEAKS:
        hit = name.strip() == entry["match"][0] if entry.get("exact") else all(m in name for m in entry["match"])
        if not hit:
            continue
        key = "tensor_16bit" if precision in ("bf16", "fp16") else "fp32"
        flops = entry[key]
        return {"device": entry["name"], "precision_basis": "dense BF16/FP16 tensor" if key == "tensor_16bit"
                else "FP32 (non-tensor)", "peak_flops_per_s": flops, "tdp_w": entry["tdp_w"],
                "peak_flops_per_j": flops / entry["tdp_w"], "source": entry["source"]}
    return None


# -- time arguments: one parser for every command's --since (joulepilot.store.timevalues) ------------
iso = iso_utc


def grid_intensity(value: float | None) -> float | None:
    """The grid's gCO2/kWh: the argument, else $JOULEPILOT_GRID_GCO2_PER_KWH, else None."""
    import os

    if value is not None:
        return float(value)
    raw = os.environ.get(GRID_ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{GRID_ENV}={raw!r} is not a number of grams CO2 per kWh; unset it or fix it") from None


# -- gathering ------------------------------------------------------------------------------------
def _one(db: sqlite_utils.Database, sql: str, args: Sequence[Any]) -> dict[str, Any] | None:
    rows = list(db.query(sql, list(args)))
    return rows[0] if rows else None


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _device_name(db: sqlite_utils.Database, dep: Mapping[str, Any]) -> str | None:
    device = str(dep.get("device") or "")
    meter_id = "gpu:" + device.split(":", 1)[1] if device.startswith("cuda:") else "cpu:0"
    row = _one(db, "SELECT name FROM devices WHERE host_id = ? AND device = ?", [dep.get("host_id"), meter_id])
    return row["name"] if row else None


def _device_kind(db: sqlite_utils.Database, dep: Mapping[str, Any]) -> str:
    details = dep.get("details") if isinstance(dep.get("details"), Mapping) else {}
    if details.get("device_kind"):
        return str(details["device_kind"])
    return features_device_kind({"device": dep.get("device"), "device_name": _device_name(db, dep)})


def _decision_for(db: sqlite_utils.Database, dep: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    if not dep.get("policy"):
        return None
    base = "SELECT * FROM decisions WHERE policy = ? AND device_kind = ?"
    order = " ORDER BY decided_at DESC, id DESC LIMIT 1"
    row = None
    if dep.get("config_id"):
        row = _one(db, base + " AND config_id = ?" + order, [dep["policy"], kind, dep["config_id"]])
    row = row or _one(db, base + order, [dep["policy"], kind])
    if row:
        row["details"] = _json(row.get("details"))
    return row


def _limits(db: sqlite_utils.Database, dep: Mapping[str, Any], decision: Mapping[str, Any] | None,
            violations: list[dict[str, Any]]) -> tuple[dict[str, float], str | None]:
    names = ("max_avg_power_w", "max_peak_power_w")
    if dep.get("policy"):
        try:
            from joulepilot.policies.load import find_policy, load_policy

            policy = load_policy(find_policy(dep["policy"]))
            found = {k: getattr(policy.limits, k) for k in names if getattr(policy.limits, k) is not None}
            return found, f"policy file {policy.path}"
        except Exception:  # noqa: BLE001 - a missing or broken policy file only costs the envelope lines
            pass
    details = dep.get("details") if isinstance(dep.get("details"), Mapping) else {}
    recorded = details.get("limits") if isinstance(details.get("limits"), Mapping) else None
    if recorded:
        return {k: recorded[k] for k in names if recorded.get(k) is not None}, "limits recorded at attach"
    dd = (decision or {}).get("details")
    if isinstance(dd, Mapping) and isinstance(dd.get("limits"), Mapping):
        return {k: dd["limits"][k] for k in names if dd["limits"].get(k) is not None}, "decision details"
    cited = {v["limit_name"]: v["limit_value"] for v in violations if v["limit_name"] in names}
    if cited:
        return cited, "recorded violations"
    return {}, None


def _config_row(db: sqlite_utils.Database, config_id: str | None) -> dict[str, Any] | None:
    return _one(db, "SELECT * FROM configs WHERE id = ?", [config_id]) if config_id else None


BASELINES = {
    "eager_fp32": ("eager fp32", "c.mode = 'eager' AND c.precision = 'fp32'"),
    "compile_default_fp32": ("torch.compile default fp32",
                             "c.mode = 'default' AND c.fusion = 'default' AND c.precision = 'fp32' "
                             "AND c.options IN ('{}', '') AND c.dynamic = 0"),
}


def _baseline(db: sqlite_utils.Database, key: str, workload_id: str | None, kind: str,
              deployment_j: float | None, inferences: int, source: str,
              served_config_ids: set[str] | None = None) -> dict[str, Any]:
    label, where = BASELINES[key]
    out: dict[str, Any] = {"label": label, "measured": False, "j_per_inference": None, "runs": 0,
                           "energy_source": None, "saving_fraction": None, "saving_j": None, "note": None,
                           "served_is_baseline": False}
    if not workload_id:
        out["note"] = "no baseline measured: the deployment's workload is unknown"
        return out
    runs = list(db.query(
        "SELECT r.energy_j_per_inference, r.energy_source, r.device, r.device_name, r.id, r.config_id FROM runs r "
        f"JOIN configs c ON c.id = r.config_id WHERE r.workload_id = ? AND r.status = 'ok' "
        f"AND r.energy_j_per_inference IS NOT NULL AND {where} ORDER BY r.id", [workload_id]))
    runs = [r for r in runs if features_device_kind(r) == kind]
    out["served_is_baseline"] = bool(served_config_ids) and served_config_ids <= {r["config_id"] for r in runs}
    if not runs:
        out["note"] = f"no baseline measured for this workload on {kind}"
        return out
    values = [r["energy_j_per_inference"] for r in runs]
    sources = sorted({r["energy_source"] for r in runs if r["energy_source"]})
    out.update(measured=True, j_per_inference=statistics.median(values), runs=len(runs),
               run_ids=[r["id"] for r in runs], energy_source="+".join(sources) or None)
    if deployment_j is not None and out["j_per_inference"]:
        out["saving_fraction"] = 1.0 - deployment_j / out["j_per_inference"]
        out["saving_j"] = (out["j_per_inference"] - deployment_j) * inferences
    notes = []
    if out["served_is_baseline"]:
        notes.append("the deployment serves this very configuration: the difference is live serving "
                     "against the benchmark (load, idle time, contention), not a saving by the policy")
    if sources and sources != [source]:
        notes.append(f"baseline measured with {'+'.join(sources)}, deployment with {source}: not like for like")
    out["note"] = "; ".join(notes) or None
    return out


def _sample_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows, cumulative = [], 0.0
    for s in samples:
        cumulative += s["energy_j"]
        duration_s = s["t_end"] - s["t_start"]
        rows.append({
            "t_start": s["t_start"], "t_end": s["t_end"], "duration_s": duration_s,
            "energy_j": s["energy_j"], "cumulative_energy_j": cumulative, "inferences": s["inferences"],
            "j_per_inference": s["energy_j"] / s["inferences"] if s["inferences"] else None,
            "avg_power_w": s["avg_power_w"], "peak_power_w": s["peak_power_w"],
            "energy_source": s["energy_source"], "config_id": s.get("config_id"),
            "other_processes": s.get("other_processes") or 0, "share": s.get("share"),
        })
    return rows


def build_report(db: sqlite_utils.Database, deployment: str, since: float | str | None = None, *,
                 grid_gco2_per_kwh: float | None = None) -> dict[str, Any]:
    """Every figure of one deployment's report as a JSON-ready dict (see the module docstring)."""
    dep = get_deployment(db, deployment)
    if dep is None:
        known = [d["name"] for d in list_deployments(db)]
        raise LookupError(f"no deployment named {deployment!r} in the store"
                          + (f"; known: {', '.join(known)}" if known else "; none recorded yet"))
    since_t = parse_since(since)
    samples = _sample_rows(read_samples(db, dep["id"], since=since_t))
    violations = list_violations(db, deployment=deployment, since=since_t)
    kind = _device_kind(db, dep)
    decision = _decision_for(db, dep, kind)
    limits, limits_from = _limits(db, dep, decision, violations)
    workload = _one(db, "SELECT * FROM workloads WHERE id = ?", [dep.get("workload_id")]) \
        if dep.get("workload_id") else None

    energy_j = sum(s["energy_j"] for s in samples)
    inferences = sum(s["inferences"] for s in samples)
    metered_s = sum(s["duration_s"] for s in samples)
    sources = sorted({s["energy_source"] for s in samples})
    source = sources[0] if len(sources) == 1 else ("+".join(sources) if sources else None)
    j_per_inf = energy_j / inferences if inferences else None
    peaks = [s["peak_power_w"] for s in samples if s["peak_power_w"] is not None]
    busy = [s for s in samples if s["inferences"]]
    busy_j = sum(s["energy_j"] for s in busy)
    shared = [s for s in samples if s["other_processes"]]
    shares = [s["share"] for s in shared if s["share"] is not None]
    attributed_j = sum(s["energy_j"] * (s["share"] if s["share"] is not None else 1.0) for s in samples) \
        if shared else energy_j

    totals = {
        "energy_j": energy_j, "energy_kwh": energy_j / J_PER_KWH, "inferences": inferences,
        "j_per_inference": j_per_inf,
        "busy_j_per_inference": busy_j / inferences if inferences else None,
        "avg_power_w": energy_j / metered_s if metered_s > 0 else None,
        "peak_power_w": max(peaks) if peaks else None,
        "metered_s": metered_s, "energy_source": source, "is_estimate": "estimate" in sources,
        "attributed_energy_j": attributed_j if shared else None,
    }

    served = {s["config_id"] for s in samples if s.get("config_id")} | ({dep["config_id"]} if dep.get("config_id") else set())
    config = _config_row(db, dep.get("config_id"))
    configuration = {
        "config_id": dep.get("config_id"), "label": (config or {}).get("label"),
        "precision": (config or {}).get("precision"),
        "decision_state": (decision or {}).get("state"), "decision_reason": (decision or {}).get("reason"),
        "decided_at": iso((decision or {}).get("decided_at")),
        "served_config_ids": sorted(served),
        "history": [
            {"config_id": cid, "label": (_config_row(db, cid) or {}).get("label"),
             "samples": sum(1 for s in samples if s.get("config_id") == cid),
             "energy_j": sum(s["energy_j"] for s in samples if s.get("config_id") == cid),
             "inferences": sum(s["inferences"] for s in samples if s.get("config_id") == cid)}
            for cid in sorted({s.get("config_id") for s in samples if s.get("config_id")})
        ],
    }
    if decision is None:
        configuration["decision_reason"] = ("no decision recorded for this policy on " + kind
                                            if dep.get("policy") else "deployed without a policy")

    envelope = {
        "max_avg_power_w": limits.get("max_avg_power_w"), "max_peak_power_w": limits.get("max_peak_power_w"),
        "limits_from": limits_from,
        "windows_above_avg_limit": sum(1 for s in samples if limits.get("max_avg_power_w") is not None
                                       and (s["avg_power_w"] or 0) > limits["max_avg_power_w"]),
        "windows_above_peak_limit": sum(1 for s in samples if limits.get("max_peak_power_w") is not None
                                        and (s["peak_power_w"] or 0) > limits["max_peak_power_w"]),
        "violations": [{**v, "at_iso": iso(v["at"])} for v in violations],
    }

    served_ids = {s["config_id"] for s in samples if s.get("config_id")}
    baselines = {key: _baseline(db, key, dep.get("workload_id"), kind, j_per_inf, inferences, source or "",
                                served_ids)
                 for key in BASELINES}

    intensity = grid_intensity(grid_gco2_per_kwh)
    co2 = None if intensity is None else {"grid_gco2_per_kwh": intensity,
                                          "co2_g": energy_j / J_PER_KWH * intensity,
                                          "energy_source": source}

    flops = (workload or {}).get("flops_per_inference")
    peak = device_peak(kind if kind != "cpu" else None, configuration["precision"])
    achieved = flops / j_per_inf if flops and j_per_inf else None
    efficiency = {
        "flops_per_inference": flops, "flops_per_j": achieved, "energy_source": source, "device_peak": peak,
        "fraction_of_peak_flops_per_j": achieved / peak["peak_flops_per_j"] if achieved and peak else None,
        "note": None if peak else ("no datasheet peak for CPUs (the table covers data-centre GPUs)"
                                   if kind == "cpu" else f"device peak unknown for {kind}"),
    }
    if not flops:
        efficiency["note"] = "workload FLOPs unknown" if dep.get("workload_id") else "workload unknown"

    sharing = {
        "windows": len(samples), "windows_shared": len(shared),
        "max_other_processes": max((s["other_processes"] for s in samples), default=0),
        "mean_share": statistics.fmean(shares) if shares else None,
        "attributed_energy_j": totals["attributed_energy_j"],
    }

    notes = _notes(totals, sharing, baselines, samples, source)
    return {
        "kind": REPORT_KIND, "version": 1, "generated_at": iso(time.time()),
        "deployment": {
            "name": dep["name"], "policy": dep.get("policy"), "device": dep.get("device"), "device_kind": kind,
            "host_id": dep.get("host_id"),
            "hostname": (_one(db, "SELECT hostname FROM hosts WHERE id = ?", [dep.get("host_id")]) or {}).get("hostname"),
            "workload_id": dep.get("workload_id"), "workload": (workload or {}).get("spec"),
            "batch_size": (workload or {}).get("batch_size"), "created_at": iso(dep.get("created_at")),
        },
        "period": {"since": iso(since_t), "start": iso(samples[0]["t_start"]) if samples else None,
                   "end": iso(samples[-1]["t_end"]) if samples else None,
                   "start_t": samples[0]["t_start"] if samples else None,
                   "end_t": samples[-1]["t_end"] if samples else None,
                   "samples": len(samples)},
        "totals": totals, "envelope": envelope, "configuration": configuration, "baselines": baselines,
        "co2": co2, "efficiency": efficiency, "sharing": sharing, "notes": notes, "samples": samples,
    }


def _notes(totals: Mapping[str, Any], sharing: Mapping[str, Any], baselines: Mapping[str, Any],
           samples: list[dict[str, Any]], source: str | None) -> list[str]:
    notes = []
    if not samples:
        notes.append("no samples in this period: the deployment served nothing metered yet")
    if totals["is_estimate"]:
        notes.append("ESTIMATE: no energy counter could be read on this host; energy is CPU time x watts per "
                     "core, not a measurement")
    if sharing["windows_shared"]:
        share = sharing["mean_share"]
        notes.append(
            f"shared device: other processes used it in {sharing['windows_shared']} of {sharing['windows']} "
            f"windows (up to {sharing['max_other_processes']}); energy figures are the whole device's"
            + (f"; this deployment's mean share of utilisation was {share:.0%}, about "
               f"{sharing['attributed_energy_j']:.4g} J attributed to it" if share is not None else
               "; per-process utilisation was unavailable, so no share could be attributed"))
    if any(b["measured"] for b in baselines.values()) and totals["busy_j_per_inference"] is not None \
            and totals["j_per_inference"] and totals["busy_j_per_inference"] < 0.9 * totals["j_per_inference"]:
        notes.append("idle windows raise this deployment's J/inference above the benchmark's, which measures "
                     "back-to-back calls; J/inference over windows that served calls is "
                     f"{totals['busy_j_per_inference']:.4g} J")
    return notes


def build_summary(db: sqlite_utils.Database, since: float | str | None = None, *,
                  grid_gco2_per_kwh: float | None = None) -> dict[str, Any]:
    """One row per deployment with its headline figures (the same figures as its full report)."""
    rows = []
    for dep in list_deployments(db):
        r = build_report(db, dep["name"], since, grid_gco2_per_kwh=grid_gco2_per_kwh)
        t, e, c = r["totals"], r["envelope"], r["configuration"]
        eager, stock = r["baselines"]["eager_fp32"], r["baselines"]["compile_default_fp32"]
        rows.append({
            "name": dep["name"], "policy": dep.get("policy"), "device_kind": r["deployment"]["device_kind"],
            "config": c["label"] or c["config_id"], "decision_state": c["decision_state"],
            "start": r["period"]["start"], "end": r["period"]["end"], "samples": r["period"]["samples"],
            "energy_j": t["energy_j"], "energy_kwh": t["energy_kwh"], "inferences": t["inferences"],
            "j_per_inference": t["j_per_inference"], "avg_power_w": t["avg_power_w"],
            "peak_power_w": t["peak_power_w"], "max_avg_power_w": e["max_avg_power_w"],
            "violations": len(e["violations"]),
            "saving_vs_eager_fp32": eager["saving_fraction"],
            "saving_vs_compile_default_fp32": stock["saving_fraction"],
            "co2_g": (r["co2"] or {}).get("co2_g"), "energy_source": t["energy_source"],
            "shared_windows": r["sharing"]["windows_shared"],
        })
    return {"kind": SUMMARY_KIND, "version": 1, "generated_at": iso(time.time()),
            "since": iso(parse_since(since)), "deployments": rows}


# -- rendering ------------------------------------------------------------------------------------
def fmt(value: Any, unit: str = "", digits: int = 4) -> str:
    """A number for people: 4 significant digits, thousands grouped, unit after a space."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = f"{value:,.0f}" if abs(value) >= 10 ** digits else f"{value:.{digits}g}"
    else:
        text = str(value)
    return f"{text} {unit}".strip()


def pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}"


def saving_text(fraction: float | None) -> str:
    """'21.4% less' / '3.0% more' energy per inference than a baseline."""
    if fraction is None:
        return "–"
    return f"{fraction:.1%} less" if fraction >= 0 else f"{-fraction:.1%} more"


SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(value: float | None, unit: str) -> str:
    """131457512 FLOP/J -> '131.5 MFLOP/J'."""
    if value is None:
        return "–"
    for scale, prefix in SI_PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def human_time(iso_text: str | None) -> str:
    """'2024-05-01T12:00:00+00:00' -> '2024-05-01 12:00:00 UTC'."""
    if not iso_text:
        return "–"
    return iso_text.replace("T", " ").replace("+00:00", " UTC")


def render(report: Mapping[str, Any], format: str = "md") -> str | bytes:
    """The report (from build_report or build_summary) as html, md, json or csv text."""
    if format not in FORMATS:
        raise ValueError(f"unknown report format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "json":
        return json.dumps(json_output(report), indent=2, sort_keys=False, default=str) + "\n"
    summary = report.get("kind") == SUMMARY_KIND
    if format == "csv":
        return _summary_csv(report) if summary else _report_csv(report)
    if format == "md":
        return _summary_md(report) if summary else _report_md(report)
    return render_html(report)


def headline_figures(report: Mapping[str, Any]) -> list[tuple[str, str, Any, str, str | None]]:
    """(section, metric, value, unit, source) for every summary figure: the rows of CSV and the tables."""
    t, e, c = report["totals"], report["envelope"], report["configuration"]
    src = t["energy_source"]
    rows: list[tuple[str, str, Any, str, str | None]] = [
        ("totals", "energy_j", t["energy_j"], "J", src),
        ("totals", "energy_kwh", t["energy_kwh"], "kWh", src),
        ("totals", "inferences", t["inferences"], "calls", None),
        ("totals", "j_per_inference", t["j_per_inference"], "J/call", src),
        ("totals", "busy_j_per_inference", t["busy_j_per_inference"], "J/call", src),
        ("totals", "avg_power_w", t["avg_power_w"], "W", src),
        ("totals", "peak_power_w", t["peak_power_w"], "W", src),
        ("totals", "metered_s", t["metered_s"], "s", None),
        ("totals", "attributed_energy_j", t["attributed_energy_j"], "J", src),
        ("envelope", "max_avg_power_w", e["max_avg_power_w"], "W", e["limits_from"]),
        ("envelope", "max_peak_power_w", e["max_peak_power_w"], "W", e["limits_from"]),
        ("envelope", "windows_above_avg_limit", e["windows_above_avg_limit"], "windows", src),
        ("envelope", "windows_above_peak_limit", e["windows_above_peak_limit"], "windows", src),
        ("envelope", "violations", len(e["violations"]), "count", None),
        ("configuration", "config", c["label"] or c["config_id"], "", None),
        ("configuration", "decision_state", c["decision_state"], "", None),
        ("configuration", "decision_reason", c["decision_reason"], "", None),
    ]
    for key, b in report["baselines"].items():
        rows += [
            (f"baseline.{key}", "j_per_inference", b["j_per_inference"], "J/call", b["energy_source"]),
            (f"baseline.{key}", "saving_fraction", b["saving_fraction"], "fraction", src),
            (f"baseline.{key}", "saving_j", b["saving_j"], "J", src),
            (f"baseline.{key}", "note", b["note"], "", None),
        ]
    if report["co2"]:
        rows += [("co2", "grid_gco2_per_kwh", report["co2"]["grid_gco2_per_kwh"], "gCO2/kWh", "configured"),
                 ("co2", "co2_g", report["co2"]["co2_g"], "g", src)]
    eff = report["efficiency"]
    peak = eff["device_peak"] or {}
    rows += [
        ("efficiency", "flops_per_inference", eff["flops_per_inference"], "FLOP", "torch flop counter"),
        ("efficiency", "flops_per_j", eff["flops_per_j"], "FLOP/J", src),
        ("efficiency", "device_peak_flops_per_j", peak.get("peak_flops_per_j"), "FLOP/J", peak.get("source")),
        ("efficiency", "fraction_of_peak_flops_per_j", eff["fraction_of_peak_flops_per_j"], "fraction", src),
        ("sharing", "windows_shared", report["sharing"]["windows_shared"], "windows", None),
        ("sharing", "mean_share", report["sharing"]["mean_share"], "fraction", "nvml process utilisation"),
    ]
    return rows


SAMPLE_METRICS = (("energy_j", "J"), ("inferences", "calls"), ("j_per_inference", "J/call"),
                  ("avg_power_w", "W"), ("peak_power_w", "W"), ("other_processes", "count"),
                  ("share", "fraction"))


def _report_csv(report: Mapping[str, Any]) -> str:
    """Tidy (long) CSV: one figure per row; samples carry their window in t_start/t_end."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["deployment", "section", "metric", "value", "unit", "source", "t_start", "t_end", "config_id"])
    name = report["deployment"]["name"]
    for section, metric, value, unit, source in headline_figures(report):
        w.writerow([name, section, metric, "" if value is None else value, unit, source or "", "", "", ""])
    for s in report["samples"]:
        for metric, unit in SAMPLE_METRICS:
            value = s[metric]
            w.writerow([name, "sample", metric, "" if value is None else value, unit,
                        s["energy_source"] if unit in ("J", "J/call", "W") else "",
                        iso(s["t_start"]), iso(s["t_end"]), s.get("config_id") or ""])
    return out.getvalue()


SUMMARY_COLUMNS = ("name", "policy", "device_kind", "config", "decision_state", "start", "end", "samples",
                   "energy_j", "energy_kwh", "inferences", "j_per_inference", "avg_power_w", "peak_power_w",
                   "max_avg_power_w", "violations", "saving_vs_eager_fp32", "saving_vs_compile_default_fp32",
                   "co2_g", "energy_source", "shared_windows")


def _summary_csv(summary: Mapping[str, Any]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=SUMMARY_COLUMNS, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for row in summary["deployments"]:
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return out.getvalue()


def source_label(source: str | None) -> str:
    if not source:
        return "–"
    return f"{source} (ESTIMATE, not measured)" if "estimate" in source else f"{source} (measured)"


def _report_md(r: Mapping[str, Any]) -> str:
    d, t, e, c, p = r["deployment"], r["totals"], r["envelope"], r["configuration"], r["period"]
    lines = [f"# Energy report: deployment `{d['name']}`", ""]
    if t["is_estimate"]:
        lines += ["> **ESTIMATE** — no energy counter was readable on this host. Energy here is CPU time × "
                  "watts per core, not a measurement.", ""]
    lines += [
        f"- Policy: {d['policy'] or '–'} · device {d['device']} ({d['device_kind']}) · host {d['hostname'] or '–'}",
        f"- Workload: {d['workload'] or '–'}" + (f" (batch {d['batch_size']})" if d["batch_size"] else ""),
        f"- Period: {p['start'] or '–'} → {p['end'] or '–'} ({p['samples']} windows, "
        f"{fmt(t['metered_s'], 's')} metered)" + (f", since {p['since']}" if p["since"] else ""),
        f"- Energy source: {source_label(t['energy_source'])}",
        "",
        "## Headline",
        "",
        "| figure | value |",
        "|---|---|",
        f"| total energy | {fmt(t['energy_j'], 'J')} ({fmt(t['energy_kwh'], 'kWh')}) |",
        f"| inferences (forward calls) | {fmt(t['inferences'])} |",
        f"| energy per inference | {fmt(t['j_per_inference'], 'J')} |",
        f"| average power | {fmt(t['avg_power_w'], 'W')} (limit {fmt(e['max_avg_power_w'], 'W')}) |",
        f"| peak power | {fmt(t['peak_power_w'], 'W')} (limit {fmt(e['max_peak_power_w'], 'W')}) |",
    ]
    if r["co2"]:
        lines.append(f"| CO2 | {fmt(r['co2']['co2_g'], 'g')} at {fmt(r['co2']['grid_gco2_per_kwh'], 'g/kWh')} |")
    lines += ["", "## Configuration", "",
              f"- In use: `{c['label'] or c['config_id'] or 'unknown'}`",
              f"- Decision: {c['decision_state'] or '–'}" + (f" ({c['decided_at']})" if c["decided_at"] else ""),
              f"- Why: {c['decision_reason'] or '–'}", ""]
    if len(c["history"]) > 1:
        lines += ["Configurations served in this period:", ""]
        lines += [f"- `{h['label'] or h['config_id']}`: {h['samples']} windows, {fmt(h['energy_j'], 'J')}, "
                  f"{fmt(h['inferences'])} inferences" for h in c["history"]]
        lines.append("")
    lines += ["## Savings against baselines measured on the same device kind", "",
              "| baseline | J/inference | source | this deployment per inference | energy saved | note |",
              "|---|---|---|---|---|---|"]
    for b in r["baselines"].values():
        if b["measured"]:
            lines.append(f"| {b['label']} | {fmt(b['j_per_inference'], 'J')} | {b['energy_source']} | "
                         f"{saving_text(b['saving_fraction'])} | {fmt(b['saving_j'], 'J')} | {b['note'] or ''} |")
        else:
            lines.append(f"| {b['label']} | – | – | – | – | {b['note']} |")
    lines += ["", "## Envelope", "",
              f"- Limits from: {e['limits_from'] or 'no envelope known'}",
              f"- Windows above the average-power limit: {e['windows_above_avg_limit']}",
              f"- Windows above the peak-power limit: {e['windows_above_peak_limit']}",
              f"- Violations: {len(e['violations'])}"]
    lines += [f"  - {v['at_iso']}: {v['limit_name']} {fmt(v['limit_value'])} exceeded, measured "
              f"{fmt(v['measured_value'])} (config {v['config_id']})" for v in e["violations"]]
    eff = r["efficiency"]
    peak = eff["device_peak"]
    lines += ["", "## Efficiency", "",
              f"- Workload FLOPs per inference: {si(eff['flops_per_inference'], 'FLOP')}",
              f"- Achieved: {si(eff['flops_per_j'], 'FLOP/J')} ({source_label(eff['energy_source'])})",
              "- Device peak: " + (f"{si(peak['peak_flops_per_j'], 'FLOP/J')} ({peak['device']}, "
                                   f"{peak['precision_basis']}, {si(peak['peak_flops_per_s'], 'FLOP/s')} / "
                                   f"{peak['tdp_w']} W; {peak['source']})" if peak else (eff["note"] or "unknown")),
              f"- Fraction of peak: {fmt(eff['fraction_of_peak_flops_per_j'])}"]
    if r["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
    lines += ["", "## Windows", "", "| end (UTC) | s | J | inferences | J/inference | avg W | peak W | shared |",
              "|---|---|---|---|---|---|---|---|"]
    for s in r["samples"]:
        shared = f"{s['other_processes']} other(s)" if s["other_processes"] else "no"
        lines.append(f"| {iso(s['t_end'])} | {fmt(s['duration_s'], '', 3)} | {fmt(s['energy_j'])} | "
                     f"{s['inferences']} | {fmt(s['j_per_inference'])} | {fmt(s['avg_power_w'])} | "
                     f"{fmt(s['peak_power_w'])} | {shared} |")
    return "\n".join(lines) + "\n"


def _summary_md(summary: Mapping[str, Any]) -> str:
    lines = ["# Energy of every deployment", ""]
    if summary.get("since"):
        lines += [f"Since {summary['since']}.", ""]
    lines += ["| deployment | policy | device | config | energy | kWh | inferences | J/inference | avg W "
              "| peak W | limit W | violations | vs eager fp32 | vs compile fp32 | source |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["deployments"]:
        lines.append(
            f"| {r['name']} | {r['policy'] or '–'} | {r['device_kind']} | {r['config'] or '–'} | "
            f"{fmt(r['energy_j'], 'J')} | {fmt(r['energy_kwh'])} | {fmt(r['inferences'])} | "
            f"{fmt(r['j_per_inference'])} | {fmt(r['avg_power_w'])} | {fmt(r['peak_power_w'])} | "
            f"{fmt(r['max_avg_power_w'])} | {r['violations']} | {pct(r['saving_vs_eager_fp32'])} | "
            f"{pct(r['saving_vs_compile_default_fp32'])} | {source_label(r['energy_source'])} |")
    if not summary["deployments"]:
        lines.append("| (no deployments recorded) |" + " |" * 14)
    return "\n".join(lines) + "\n"


# -- HTML -----------------------------------------------------------------------------------------
def _tag(source: str | None) -> str:
    if not source:
        return ""
    if "estimate" in source:
        return '<span class="tag estimate">ESTIMATE · not measured</span>'
    return f'<span class="tag measured">measured · {escape(source)}</span>'


def _card(label: str, value: str, sub: str = "") -> str:
    return (f'<div class="card"><div class="label">{escape(label)}</div><div class="value">{value}</div>'
            f'<div class="sub">{sub}</div></div>')


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _limit_sub(measured: float | None, limit: float | None, what: str) -> str:
    if limit is None:
        return f"no {what} limit in the policy"
    if measured is None:
        return f"limit {fmt(limit, 'W')}"
    state = '<span class="tag over">over</span>' if measured > limit else '<span class="tag ok">within</span>'
    return f"limit {fmt(limit, 'W')} {state}"


def render_html(report: Mapping[str, Any]) -> str:
    """One self-contained HTML page (plots inline as base64 PNG)."""
    from importlib.resources import files
    from string import Template

    from joulepilot.compiler.provenance import package_version

    version = package_version("joulepilot") or "unknown"

    if report.get("kind") == SUMMARY_KIND:
        body, title = _summary_html(report), "joulepilot: energy of every deployment"
    else:
        body, title = _report_html(report), f"joulepilot energy report: {report['deployment']['name']}"
    template = Template(files("joulepilot.controller").joinpath("report_template.html").read_text())
    return template.substitute(title=escape(title), body=body, version=escape(version),
                               generated_at=escape(human_time(report.get("generated_at"))))


def _report_html(r: Mapping[str, Any]) -> str:
    from .report_plots import report_plots

    d, t, e, c, p = r["deployment"], r["totals"], r["envelope"], r["configuration"], r["period"]
    src = t["energy_source"]
    parts = [f"<h1>Energy report: {escape(d['name'])}</h1>",
             '<div class="meta">'
             f"Policy <b>{escape(d['policy'] or '–')}</b> · device <b>{escape(str(d['device']))}</b> "
             f"({escape(d['device_kind'])}) · host <b>{escape(d['hostname'] or '–')}</b><br>"
             f"Workload <b>{escape(d['workload'] or 'unknown')}</b>"
             + (f" (batch {d['batch_size']})" if d["batch_size"] else "")
             + f" · period <b>{escape(human_time(p['start']))}</b> to <b>{escape(human_time(p['end']))}</b> "
             f"({p['samples']} windows, {fmt(t['metered_s'], 's')} metered)"
             + (f" · since {escape(human_time(p['since']))}" if p["since"] else "")
             + f"<br>Energy source: {_tag(src) or '–'}</div>"]
    if t["is_estimate"]:
        parts.append('<div class="banner"><b>Estimate, not a measurement.</b> No energy counter (NVML or RAPL) '
                     "was readable on this host, so energy is the deployment's CPU time × an assumed watts per "
                     "busy core. Use these figures to compare configurations on this host only.</div>")
    if e["violations"]:
        last = e["violations"][-1]
        parts.append(f'<div class="banner bad"><b>Envelope violated {len(e["violations"])} time(s).</b> Latest: '
                     f"{escape(last['at_iso'])}, {escape(last['limit_name'])} = {fmt(last['limit_value'], 'W')}, "
                     f"measured {fmt(last['measured_value'], 'W')} (configuration "
                     f"{escape(str(last['config_id']))}).</div>")
    parts.append("<h2>Headline</h2>")
    cards = [
        _card("Total energy", fmt(t["energy_j"], "J"), f"{fmt(t['energy_kwh'], 'kWh')} {_tag(src)}"),
        _card("Inferences", fmt(t["inferences"]), "forward calls (one batch each)"),
        _card("Energy per inference", fmt(t["j_per_inference"], "J"),
              "whole period incl. idle windows" if t["j_per_inference"] else ""),
        _card("Average power", fmt(t["avg_power_w"], "W"),
              _limit_sub(t["avg_power_w"], e["max_avg_power_w"], "average-power")
              + (f"<br>{e['windows_above_avg_limit']} of {p['samples']} windows above it"
                 if e["max_avg_power_w"] is not None else "")),
        _card("Peak power", fmt(t["peak_power_w"], "W"),
              _limit_sub(t["peak_power_w"], e["max_peak_power_w"], "peak-power")
              + "<br>highest instant read in any window"),
    ]
    for b in r["baselines"].values():
        if not b["measured"]:
            sub = escape(b["note"] or "")
        elif b["served_is_baseline"]:
            sub = (f"baseline {fmt(b['j_per_inference'], 'J')}/inference. This deployment serves {escape(b['label'])} "
                   "itself: live serving vs benchmark, not a policy saving")
        else:
            sub = (f"per inference than the benchmarked {fmt(b['j_per_inference'], 'J')}; "
                   f"{fmt(b['saving_j'], 'J')} saved over the period")
        cards.append(_card(f"vs {b['label']}", saving_text(b["saving_fraction"]) if b["measured"] else "no baseline",
                           sub))
    if r["co2"]:
        cards.append(_card("CO₂", fmt(r["co2"]["co2_g"], "g"),
                           f"at {fmt(r['co2']['grid_gco2_per_kwh'], 'gCO₂/kWh')} (configured grid intensity)"))
    parts.append('<div class="cards">' + "".join(cards) + "</div>")

    parts.append("<h2>Configuration in use and why</h2>")
    parts.append(_table(["configuration", "decision", "decided at", "reason"], [[
        f"<code>{escape(c['label'] or c['config_id'] or 'unknown')}</code>", escape(c["decision_state"] or "–"),
        escape(human_time(c["decided_at"])), escape(c["decision_reason"] or "–")]]))
    if len(c["history"]) > 1:
        parts.append("<p class=meta>Configurations served in this period (a fallback swap changes it):</p>")
        parts.append(_table(["configuration", "windows", "energy", "inferences"],
                            [[f"<code>{escape(h['label'] or h['config_id'])}</code>", h["samples"],
                              fmt(h["energy_j"], "J"), fmt(h["inferences"])] for h in c["history"]], (1, 2, 3)))

    plots = report_plots(r)
    parts.append("<h2>Power against the envelope</h2>")
    parts.append(f'<figure><img alt="power per window" src="{plots["power"]}"><figcaption>Blue: average power of '
                 "each metering window (energy counter delta ÷ window length). Orange dots: highest instant power "
                 "read in the window. Red: the policy's limits"
                 + (f" (from {escape(e['limits_from'])})" if e["limits_from"] else " (none known)")
                 + ".</figcaption></figure>")
    parts.append("<h2>Energy per inference over time</h2>")
    parts.append(f'<figure><img alt="J per inference per window" src="{plots["j_per_inference"]}"><figcaption>'
                 "Each window's energy divided by the calls it served; horizontal lines are the benchmark "
                 "baselines measured for this workload on the same device kind.</figcaption></figure>")
    parts.append("<h2>Cumulative energy</h2>")
    parts.append(f'<figure><img alt="cumulative energy" src="{plots["cumulative"]}"></figure>')

    parts.append("<h2>Savings against baselines</h2>")
    rows = []
    for b in r["baselines"].values():
        if b["measured"]:
            rows.append([escape(b["label"]), fmt(b["j_per_inference"], "J"), _tag(b["energy_source"]),
                         str(b["runs"]), saving_text(b["saving_fraction"]), fmt(b["saving_j"], "J"),
                         escape(b["note"] or "")])
        else:
            rows.append([escape(b["label"]), "–", "–", "0", "–", "–", escape(b["note"] or "")])
    parts.append(_table(["baseline (benchmarked)", "J/inference", "source", "runs",
                         "this deployment per inference", "energy saved", "note"], rows, (1, 3, 4, 5)))
    parts.append(f"<p class=meta>This deployment: {fmt(t['j_per_inference'], 'J')} per inference. Saving = 1 − "
                 "(this deployment's J/inference ÷ the baseline's median J/inference over its benchmark runs); "
                 "energy saved = that difference × the inferences served. Baselines are runs of the same "
                 "workload and batch on the same device kind.</p>")

    eff = r["efficiency"]
    peak = eff["device_peak"]
    parts.append("<h2>Compute efficiency</h2>")
    parts.append(_table(["figure", "value", "basis"], [
        ["workload FLOPs per inference", si(eff["flops_per_inference"], "FLOP"), "torch FLOP counter, one batch"],
        ["achieved FLOPs per joule", si(eff["flops_per_j"], "FLOP/J"), _tag(eff["energy_source"])],
        ["device peak FLOPs per joule", si((peak or {}).get("peak_flops_per_j"), "FLOP/J"),
         escape(f"{peak['device']}: {peak['precision_basis']} {si(peak['peak_flops_per_s'], 'FLOP/s')} ÷ "
                f"{peak['tdp_w']} W board power ({peak['source']})") if peak else escape(eff["note"] or "unknown")],
        ["fraction of peak", pct(eff["fraction_of_peak_flops_per_j"]).lstrip("+")
         if eff["fraction_of_peak_flops_per_j"] is not None else "–", ""],
    ], (1,)))

    parts.append("<h2>Envelope and sharing</h2>")
    sh = r["sharing"]
    parts.append(_table(["figure", "value"], [
        ["limits from", escape(e["limits_from"] or "no envelope known")],
        ["windows above the average-power limit", str(e["windows_above_avg_limit"])],
        ["windows above the peak-power limit", str(e["windows_above_peak_limit"])],
        ["violations recorded by the guard", str(len(e["violations"]))],
        ["windows with other processes on the device", f"{sh['windows_shared']} of {sh['windows']}"],
        ["this deployment's mean share of utilisation", pct(sh["mean_share"]).lstrip("+")
         if sh["mean_share"] is not None else ("not shared" if not sh["windows_shared"] else "unavailable")],
    ]))
    if e["violations"]:
        parts.append(_table(["at (UTC)", "limit", "limit value", "measured", "configuration"], [
            [escape(v["at_iso"]), escape(v["limit_name"]), fmt(v["limit_value"], "W"), fmt(v["measured_value"], "W"),
             f"<code>{escape(str(v['config_id']))}</code>"] for v in e["violations"]], (2, 3)))

    if r["notes"]:
        parts.append("<h2>Notes</h2><ul class=notes>" + "".join(f"<li>{escape(n)}</li>" for n in r["notes"])
                     + "</ul>")

    parts.append("<h2>Metering windows</h2>")
    window_rows = [[escape(iso(s["t_end"]) or ""), fmt(s["duration_s"], "", 3), fmt(s["energy_j"]),
                    str(s["inferences"]), fmt(s["j_per_inference"]), fmt(s["avg_power_w"]), fmt(s["peak_power_w"]),
                    escape(s["energy_source"]),
                    f"{s['other_processes']} other(s)" if s["other_processes"] else "no"] for s in r["samples"]]
    parts.append(f"<details><summary>{len(window_rows)} windows (click to show)</summary>"
                 + _table(["end (UTC)", "length (s)", "energy (J)", "inferences", "J/inference", "avg W",
                           "peak W", "source", "shared"], window_rows, (1, 2, 3, 4, 5, 6)) + "</details>")
    return "\n".join(parts)


def _summary_html(summary: Mapping[str, Any]) -> str:
    rows = [[escape(r["name"]), escape(r["policy"] or "–"), escape(r["device_kind"]),
             f"<code>{escape(r['config'] or '–')}</code>", fmt(r["energy_j"], "J"), fmt(r["energy_kwh"]),
             fmt(r["inferences"]), fmt(r["j_per_inference"]), fmt(r["avg_power_w"]), fmt(r["peak_power_w"]),
             fmt(r["max_avg_power_w"]), str(r["violations"]), pct(r["saving_vs_eager_fp32"]),
             pct(r["saving_vs_compile_default_fp32"]), _tag(r["energy_source"]) or "–"]
            for r in summary["deployments"]]
    estimate = any("estimate" in (r["energy_source"] or "") for r in summary["deployments"])
    return ("<h1>Energy of every deployment</h1>"
            + (f'<div class="meta">Since {escape(summary["since"])} UTC</div>' if summary.get("since") else "")
            + ('<div class="banner"><b>Some figures are estimates</b> (marked ESTIMATE): no energy counter was '
               "readable for those deployments.</div>" if estimate else "")
            + _table(["deployment", "policy", "device", "configuration", "energy", "kWh", "inferences",
                      "J/inference", "avg W", "peak W", "avg-power limit W", "violations", "vs eager fp32",
                      "vs compile fp32", "source"], rows or [["(no deployments recorded)"] + [""] * 14],
                     (4, 5, 6, 7, 8, 9, 10, 11, 12, 13)))
