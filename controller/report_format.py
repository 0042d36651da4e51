"""Numbers and phrases for people, shared by every report format so they all say the same thing.

Energy reads in the unit that suits its size (µJ to GJ); kWh is added only from 0.01 kWh (36 kJ)
up, where it reads well. Numbers never come out in scientific notation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

J_PER_KWH = 3.6e6
KWH_READABLE_FROM = 0.01
DASH = "–"

_ENERGY_UNITS = ((1e9, "GJ"), (1e6, "MJ"), (1e3, "kJ"), (1.0, "J"), (1e-3, "mJ"), (1e-6, "µJ"), (1e-9, "nJ"))
_SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def number(value: Any, digits: int = 4) -> str:
    """`digits` significant digits in plain decimal notation, thousands grouped: 12965.3 -> '12,965',
    0.00006892 -> '0.00006892', 42 -> '42'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if not isinstance(value, float):
        return str(value)
    if value == 0:
        return "0"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    if decimals <= 0:
        return f"{round(value):,}"
    text = f"{value:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt(value: Any, unit: str = "", digits: int = 4) -> str:
    """A number and its unit: fmt(387.0, 'W') -> '387 W'."""
    text = number(value, digits)
    return text if text == DASH else f"{text} {unit}".strip()


def energy(joules: Any) -> str:
    """Joules in the unit that suits the amount: 0.0353 -> '35.3 mJ', 12965 -> '12.97 kJ'."""
    if not _finite(joules):
        return DASH
    if joules == 0:
        return "0 J"
    size = abs(joules)
    for scale, unit in _ENERGY_UNITS:
        if size >= scale * 0.99995:  # so 999.99 J reads '1 kJ', not '1,000 J'
            return f"{number(joules / scale)} {unit}"
    return f"{number(joules / 1e-9)} nJ"


def kwh(joules: Any) -> str:
    """Joules as kWh in plain decimals, whatever the size (for tooltips and machine-minded columns)."""
    return fmt(joules / J_PER_KWH, "kWh") if _finite(joules) else DASH


def kwh_if_readable(joules: Any) -> str | None:
    """'13.89 kWh' from 0.01 kWh up; None below, where kWh would read as a string of zeros."""
    if not _finite(joules) or abs(joules) / J_PER_KWH < KWH_READABLE_FROM:
        return None
    return kwh(joules)


def energy_with_kwh(joules: Any) -> str:
    """'12.97 kJ', or '50 MJ (13.89 kWh)' once kWh reads well."""
    readable = kwh_if_readable(joules)
    return f"{energy(joules)} ({readable})" if readable else energy(joules)


def si(value: Any, unit: str) -> str:
    """131457512 FLOP/J -> '131.5 MFLOP/J'."""
    if not _finite(value):
        return DASH
    for scale, prefix in _SI_PREFIXES:
        if abs(value) >= scale:
            return f"{number(value / scale)} {prefix}{unit}"
    return f"{number(float(value))} {unit}"


def percent(fraction: Any) -> str:
    """0.214 -> '21.4%' (no sign)."""
    return DASH if not _finite(fraction) else f"{fraction:.1%}"


def human_time(iso_text: str | None) -> str:
    """'2024-05-01T12:00:00+00:00' -> '2024-05-01 12:00:00 UTC'."""
    if not iso_text:
        return DASH
    return iso_text.replace("T", " ").replace("+00:00", " UTC")


ESTIMATE_ROWS = ("estimate: no energy counter was readable when the rows marked estimate were benchmarked; their "
                 "energy is CPU time x watts per core, not a measurement")


def estimate_part(source: str | None) -> str | None:
    """How much of a figure of `source` is an estimate: 'whole' (`estimate` alone), 'part' (`estimate` and a
    meter: `estimate+rapl`, `nvml+estimate`), or None (measured, or no source known)."""
    parts = set((source or "").split("+")) - {""}
    if "estimate" not in parts:
        return None
    return "whole" if parts == {"estimate"} else "part"


def measured_part(source: str | None) -> str:
    """The meters among a source's parts: 'rapl' of 'estimate+rapl'."""
    return "+".join(x for x in (source or "").split("+") if x and x != "estimate")


def source_label(source: str | None) -> str:
    """'rapl (measured)', 'estimate (ESTIMATE, not measured)', or for figures mixing both
    'estimate+rapl (PARTLY ESTIMATE, the rest measured by rapl)'."""
    if not source:
        return DASH
    part = estimate_part(source)
    if part == "whole":
        return f"{source} (ESTIMATE, not measured)"
    if part == "part":
        return f"{source} (PARTLY ESTIMATE, the rest measured by {measured_part(source)})"
    return f"{source} (measured)"


def summary_source(row: Mapping[str, Any]) -> str:
    """A summary row's energy source as `source_label` words it; for a deployment partly estimated, how much:
    'estimate+rapl (PARTLY ESTIMATE: 30 of 300 windows estimated, the rest measured by rapl)'."""
    source = row.get("energy_source")
    if estimate_part(source) != "part":
        return source_label(source)
    return (f"{source} (PARTLY ESTIMATE: {row.get('estimated_windows', 0):,} of {row.get('samples', 0):,} windows "
            f"estimated, the rest measured by {measured_part(source)})")


def power_reading(watts: Any, source: str | None) -> str:
    """A power figure with how it was read: 'measured 475 W (nvml)', 'estimated 10 W (ESTIMATE, not measured)',
    '12 W (PARTLY ESTIMATE: nvml+estimate)', or '12 W (source unknown)'."""
    part = estimate_part(source)
    if not source:
        return f"{fmt(watts, 'W')} (source unknown)"
    if part == "whole":
        return f"estimated {fmt(watts, 'W')} (ESTIMATE, not measured)"
    if part == "part":
        return f"{fmt(watts, 'W')} (PARTLY ESTIMATE: {source})"
    return f"measured {fmt(watts, 'W')} ({source})"


# -- the tuning's payback -------------------------------------------------------------------------
def payback_headline(payback: Mapping[str, Any] | None) -> str:
    """'after 3.1 hours', 'not yet (34%)', 'never' or 'not known': when this deployment paid back the tuning."""
    from joulepilot.policies.bill import duration_text, fraction_text

    if not payback:
        return DASH
    verdict = payback["verdict"]
    if verdict == "paid_back":
        return f"after {duration_text(payback['paid_back_after_s'])}"
    if verdict == "not_yet":  # a shortfall never reads 100%
        fraction = payback["fraction"]
        return f"not yet ({fraction_text(fraction, 1) if _finite(fraction) else DASH})"
    return "never" if verdict == "never" else "not known"


def search_cost(payback: Mapping[str, Any]) -> str:
    """'41.2 kJ (nvml+estimate) over 7 runs, 6.2 min of measuring', or a dash when no bill is known."""
    from joulepilot.policies.bill import duration_text

    if payback.get("search_energy_j") is None:
        return DASH
    runs = payback.get("search_runs") or 0
    return (f"{energy(payback['search_energy_j'])} ({payback.get('search_source') or 'no source'}) over {runs} "
            f"run{'s' if runs != 1 else ''}, {duration_text(payback.get('search_seconds'))} of measuring")


# -- baselines ------------------------------------------------------------------------------------
BASELINE_ITSELF = "this deployment is the baseline"
NOT_LIKE_FOR_LIKE = "no saving shown: not like for like"


def versus(saving_fraction: Any, *, is_baseline: bool = False, itself: str = BASELINE_ITSELF) -> str:
    """Energy per inference against a baseline: '21.4% less', '3.0% more', or `itself` when the
    deployment serves the baseline's own configuration (a percentage would compare it with itself)."""
    if is_baseline:
        return itself
    if not _finite(saving_fraction):
        return DASH
    return f"{saving_fraction:.1%} less" if saving_fraction >= 0 else f"{-saving_fraction:.1%} more"


def per_sample(baseline: Mapping[str, Any]) -> bool:
    """Whether a report's baseline is compared per sample (the deployment serves another batch size)."""
    return baseline.get("unit") == "J/sample"


def per_token(baseline: Mapping[str, Any]) -> bool:
    """Whether a report's baseline is compared per generated token (a generation deployment)."""
    return baseline.get("unit") == "J/token"


def versus_baseline(baseline: Mapping[str, Any]) -> str:
    """The headline against one baseline of a report ('21.4% less', '60.0% more per sample'), saying so when the
    baseline rests on one run ('21.4% less (against a baseline of one run)')."""
    if not baseline["measured"]:
        return "no baseline"
    if baseline.get("like_for_like") is False and not baseline["served_is_baseline"]:
        return NOT_LIKE_FOR_LIKE
    text = versus(baseline["saving_fraction"], is_baseline=baseline["served_is_baseline"])
    if not _finite(baseline["saving_fraction"]) or baseline["served_is_baseline"]:
        return text
    text = f"{text} per sample" if per_sample(baseline) else f"{text} per token" if per_token(baseline) else text
    return f"{text} (against a baseline of one run)" if baseline.get("runs") == 1 else text


def summary_versus(row: Mapping[str, Any], key: str) -> str:
    """A summary row's saving against the baseline `key`, as `versus_baseline` words it."""
    saving = row[f"saving_vs_{key}"]
    if key in (row.get("not_like_for_like") or ()) and key not in row["serves_baseline"]:
        return "not like for like"
    text = versus(saving, is_baseline=key in row["serves_baseline"], itself="is the baseline")
    if key in (row.get("per_token") or ()) and _finite(saving):
        return f"{text} per token"
    return f"{text} per sample" if key in (row.get("per_sample") or ()) and _finite(saving) else text


def baseline_energy(baseline: Mapping[str, Any]) -> str:
    """A baseline's benchmarked energy in the unit it is compared in: '35.3 mJ' per call, or
    '1.1 mJ/sample (35.3 mJ/call at batch 32)' when compared per sample."""
    if per_token(baseline):
        return f"{energy(baseline['j_per_token'])}/token"
    if not per_sample(baseline):
        return energy(baseline["j_per_inference"])
    return (f"{energy(baseline['j_per_sample'])}/sample ({energy(baseline['j_per_inference'])}/call at batch "
            f"{baseline['batch_size']})")


def deployment_energy(baseline: Mapping[str, Any]) -> str:
    """The deployment's side of a per-sample comparison: '1.6 mJ/sample at batch 8' (per token: '0.6 J/token
    served'); '' when per call."""
    if per_token(baseline):
        return f"{energy(baseline['deployment_j_per_token'])}/token served"
    if not per_sample(baseline):
        return ""
    return f"{energy(baseline['deployment_j_per_sample'])}/sample at batch {baseline['served_batch_size']}"


def energy_saved(baseline: Mapping[str, Any]) -> str:
    """'12.3 kJ saved' or '208.7 J more than the baseline' over the period; a dash when no saving applies."""
    saving_j = baseline["saving_j"]
    if not baseline["measured"] or baseline["served_is_baseline"] or not _finite(saving_j):
        return DASH
    if saving_j >= 0:
        return f"{energy(saving_j)} saved"
    return f"{energy(-saving_j)} more than the baseline"


def served_versus(comparison: Mapping[str, Any] | None) -> str:
    """The headline of served against benchmarked: '3.77x the benchmark (161.7 mJ against 42.9 mJ)', 'within the
    noise (43.3 mJ against 42.9 mJ)', or 'not compared'."""
    if comparison is None or comparison["verdict"] == "not_compared":
        return "not compared"
    per = "/token" if comparison.get("unit") == "J/token" else ""
    figures = (f"({energy(comparison['served_j_per_call'])}{per} against "
               f"{energy(comparison['benchmarked_j_per_call'])}{per})")
    if comparison["verdict"] == "within_noise":
        return f"within the noise {figures}"
    ratio = comparison["ratio"]
    return f"{ratio:.2f}x the benchmark {figures}" if _finite(ratio) else f"{comparison['verdict']} the benchmark"
