"""What an energy report says: typed sections, built from the store's read functions only.

`build_report(db, name)` gathers one deployment's figures into a `DeploymentReport`;
`build_summary(db)` one row per deployment. Renderers (`report_render`) turn either into HTML,
Markdown, JSON or CSV; `to_dict()` is the JSON. Sections also read like the JSON they become
(`report["totals"]["energy_j"]` is `report.totals.energy_j`), so code written against the JSON
output works on the model unchanged.

Where figures come from:
- energy, inferences, power, the envelope's window counts, sharing and per-configuration shares: sums over
  every window of the period, computed by the store (`store.deployment_figures`), never by loading the windows;
  the report lists only the newest `windows` of them (DEFAULT_WINDOWS) and, when it leaves some out, the period
  in spans for the plots (`timeline`);
- the envelope: the policy file found by name (`policies.find_policy`), else the limits recorded by
  `attach`, else the newest decision's details, else the limit cited by recorded violations;
- the configuration and why: the newest decision of the policy for the configuration served;
- baselines: `runs` of the policy's workload at its own batch size (the deployment's workload when it is
  served at that batch size: same id, hence same batch and shapes) on the same device kind, for eager fp32
  and stock `torch.compile` (mode default, fp32), each a median over its runs of one energy source (the
  deployment's when it has runs of it); a deployment served at another batch size (the batch-size
  lever) is compared with them per sample (`Baseline`);
- peak efficiency: the datasheet rows of `gpu_datasheets.toml`;
- the tuning's payback: the tuning bill (`policies.bill`) of the newest decision for the configuration
  served, and every call this deployment served with that configuration, from its first window
  (whatever `since` says: payback counts from the start), summed by the store as well.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from joulepilot.policies.bill import NEVER, PAYS_BACK, payback_progress
from joulepilot.policies.sources import UNKNOWN_SOURCE, ranked_sources, source_key
from joulepilot.store import Store, get_deployment, list_deployments, list_violations
from joulepilot.store import reports as store_reports
from joulepilot.store.catalog import config_row, workload_row
from joulepilot.store.decisions import APPLICABLE_STATES, DecisionRow, latest_decision
from joulepilot.store.deployment_figures import (
    ConfigTotals,
    SampleTotals,
    TimelineSpan,
    calls_progress,
    config_totals,
    recent_samples,
    sample_timeline,
    sample_totals,
    sources_at,
)
from joulepilot.store.devicekind import device_kind
from joulepilot.store.runs import latest_runs, ok_runs_per_config
from joulepilot.store.timevalues import iso_utc, parse_since

from .gpu_datasheets import find_datasheet
from .report_format import J_PER_KWH, energy, fmt, power_reading

GRID_ENV = "JOULEPILOT_GRID_GCO2_PER_KWH"
GRID_OPTION = "--grid-gco2-per-kwh"
REPORT_KIND = "joulepilot.deployment_report"
SUMMARY_KIND = "joulepilot.deployments_summary"
BASELINE_LABELS = {"eager_fp32": "eager fp32", "compile_default_fp32": "torch.compile default fp32"}
# Windows a report lists (the newest; `joulepilot report --windows N`): its figures cover every window of the
# period whatever this says, and a deployment metered every 5 s writes 17,280 a day.
DEFAULT_WINDOWS = 500
# Spans of the period the plots draw when windows are left out of the list (`DeploymentReport.timeline`).
TIMELINE_SPANS = 500
LIMIT_NAMES = ("max_avg_power_w", "max_peak_power_w")


class Section:
    """A report section: a dataclass that also reads like the dict it serialises to."""

    def __getitem__(self, key: str) -> Any:
        if key in {f.name for f in fields(self)}:  # type: ignore[arg-type]
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


@dataclass
class DevicePeak(Section):
    device: str
    precision_basis: str
    peak_flops_per_s: float
    tdp_w: float
    peak_flops_per_j: float
    source: str
    source_url: str


@dataclass
class DeploymentInfo(Section):
    name: str
    policy: str | None
    device: str | None
    device_kind: str
    host_id: str | None
    hostname: str | None
    workload_id: str | None
    workload: str | None
    batch_size: int | None
    created_at: str | None


@dataclass
class Period(Section):
    since: str | None
    start: str | None
    end: str | None
    start_t: float | None
    end_t: float | None
    samples: int  # windows in the period, all counted in every figure
    samples_listed: int = 0  # of them listed in `samples` (the newest)
    samples_left_out: int = 0  # the older ones, not listed

    @property
    def listing_text(self) -> str | None:
        """'Showing the last 500 of 120,960 windows' when some windows are not listed, else None."""
        if not self.samples_left_out:
            return None
        if not self.samples_listed:
            return f"No windows listed of {self.samples:,} (--windows N lists the last N)"
        return f"Showing the last {self.samples_listed:,} of {self.samples:,} windows"


@dataclass
class Window(Section):
    """One metering window as the report shows it."""

    t_start: float
    t_end: float
    duration_s: float
    energy_j: float
    cumulative_energy_j: float
    inferences: int
    j_per_inference: float | None
    avg_power_w: float | None
    peak_power_w: float | None
    energy_source: str
    config_id: str | None
    other_processes: int
    share: float | None
    tokens: int | None = None  # a generation's generated tokens (None: forward calls)
    j_per_token: float | None = None


@dataclass
class Totals(Section):
    energy_j: float
    energy_kwh: float
    inferences: int
    j_per_inference: float | None
    busy_j_per_inference: float | None
    avg_power_w: float | None
    peak_power_w: float | None
    metered_s: float
    energy_source: str | None
    is_estimate: bool
    attributed_energy_j: float | None
    # The part that is an estimate, when some windows were metered and others estimated (a meter that failed
    # for a while): `is_estimate` is then set too, but the rest was measured.
    estimated_energy_j: float = 0.0
    estimated_windows: int = 0
    # A generation's: the tokens its generate calls generated, and the energy of its windows per token.
    tokens: int | None = None
    j_per_token: float | None = None

    @property
    def partly_estimate(self) -> bool:
        return self.is_estimate and self.energy_source != "estimate"

    @property
    def generates(self) -> bool:
        return self.tokens is not None


@dataclass
class Violation(Section):
    id: int | None
    at: float
    at_iso: str | None
    policy: str | None
    deployment: str | None
    limit_name: str
    limit_value: float
    measured_value: float
    config_id: str | None
    config_label: str | None
    decision_id: int | None
    # The source of the window the trip ended (`measured_value` is a reading of that meter, or an estimate).
    energy_source: str | None = None


@dataclass
class Envelope(Section):
    max_avg_power_w: float | None
    max_peak_power_w: float | None
    limits_from: str | None
    windows_above_avg_limit: int
    windows_above_peak_limit: int
    violations: list[Violation]
    # Set when the decision in force is `infeasible`: no measured configuration meets the power envelope
    # ("the envelope cannot be met: lowest measured ... exceeds 250 W by 13%").
    cannot_be_met: str | None = None

    @property
    def has_limits(self) -> bool:
        return self.max_avg_power_w is not None or self.max_peak_power_w is not None


@dataclass
class ConfigShare(Section):
    config_id: str
    label: str | None
    samples: int
    energy_j: float
    inferences: int
    tokens: int | None = None


@dataclass
class Configuration(Section):
    config_id: str | None
    label: str | None
    precision: str | None
    decision_state: str | None
    decision_reason: str | None
    decided_at: str | None
    served_config_ids: list[str]
    history: list[ConfigShare]
    # Graph breaks bench found in the served configuration (its latest ok run on this device kind), and
    # their one-line summary naming where they are and the `joulepilot doctor` command to run.
    graph_breaks: int | None = None
    graph_break_summary: str | None = None


@dataclass
class Baseline(Section):
    """A benchmarked baseline and what the deployment saved against it.

    When the deployment serves the baseline's own configuration there is no saving to speak of:
    `served_is_baseline` is set and the saving figures are None. Nor is there when the baseline's runs were
    metered by other sources than the deployment's windows (`like_for_like` is False: RAPL benchmarks, an
    `estimate` deployment): their J are not like for like. Whenever a baseline has no saving figure,
    `no_saving_reason` says why. The median is over the baseline's runs of one source, never a mix: those
    metered like the deployment's windows when there are any, else the most trustworthy source's
    (`policies.sources`); `left_out_runs` counts the others per source.

    `j_per_inference` is the baseline's median J per call, at its own `batch_size`. When the deployment is
    served at another batch size (`served_batch_size`: a decision made with the batch-size lever) the two
    are compared per sample: `unit` is 'J/sample', `j_per_sample` and `deployment_j_per_sample` are each
    side's J per call / its batch size, `saving_fraction` is per sample, and `saving_j` counts the samples
    served (calls x `served_batch_size`). A generation deployment compares J per generated token (`unit`
    'J/token': the baseline's median `energy_j_per_token` as `j_per_token`, the deployment's as
    `deployment_j_per_token`, `saving_j` over the tokens served), whatever the lengths of its requests.
    Otherwise `unit` is 'J/call' and the per-sample figures are None."""

    label: str
    measured: bool = False
    j_per_inference: float | None = None
    runs: int = 0
    run_ids: list[int] = field(default_factory=list)
    energy_source: str | None = None
    saving_fraction: float | None = None
    saving_j: float | None = None
    note: str | None = None
    served_is_baseline: bool = False
    batch_size: int | None = None
    served_batch_size: int | None = None
    unit: str = "J/call"
    j_per_sample: float | None = None
    deployment_j_per_sample: float | None = None
    like_for_like: bool | None = None  # same energy source(s) on both sides; None when either is unknown
    no_saving_reason: str | None = None
    # Runs of the baseline metered by other sources than `energy_source`, by source: not in its median.
    left_out_runs: dict[str, int] = field(default_factory=dict)
    j_per_token: float | None = None
    deployment_j_per_token: float | None = None

    @property
    def per_sample(self) -> bool:
        return self.unit == "J/sample"

    @property
    def per_token(self) -> bool:
        return self.unit == "J/token"


@dataclass
class ServedVsBenchmarked(Section):
    """The J per call this deployment served with the configuration in use, beside the median J per call of that
    configuration's benchmark runs on the same device kind, metered by the same source (never an estimate against
    a counter): the runs that count (`policies.resolve.counted_runs`) and their median's interval
    (`policies.judge.intervals`, the workload's other configurations of that source giving the typical
    spread). `verdict`: `within_noise` (the served figure lies inside that interval), `above` or `below` (outside
    it: `hint` says what commonly makes the difference), or `not_compared` (`why`)."""

    verdict: str
    text: str
    why: str | None = None
    hint: str | None = None
    config_id: str | None = None
    config_label: str | None = None
    energy_source: str | None = None
    served_j_per_call: float | None = None
    unit: str = "J/call"  # 'J/token' for a generation: the J figures are then per generated token
    served_calls: int = 0
    served_windows: int = 0
    benchmarked_j_per_call: float | None = None  # the median of `benchmark_runs` runs
    benchmark_low_j: float | None = None
    benchmark_high_j: float | None = None
    benchmark_interval: str | None = None  # how the interval was made (`policies.noise`)
    benchmark_runs: int = 0
    benchmark_run_ids: list[int] = field(default_factory=list)
    benchmark_batch_size: int | None = None
    ratio: float | None = None  # served / benchmarked


@dataclass
class Co2(Section):
    grid_gco2_per_kwh: float
    co2_g: float
    energy_source: str | None


@dataclass
class Efficiency(Section):
    flops_per_inference: float | None
    flops_per_j: float | None
    energy_source: str | None
    device_peak: DevicePeak | None
    fraction_of_peak_flops_per_j: float | None
    note: str | None


@dataclass
class Sharing(Section):
    windows: int
    windows_shared: int
    max_other_processes: int
    mean_share: float | None
    attributed_energy_j: float | None


@dataclass
class Payback(Section):
    """When this deployment's calls paid back the tuning: the energy the search behind the decision it
    serves cost, over the saving per call that decision brings against its baseline.

    `verdict`: `paid_back` (`paid_back_after_s` from the first window counted), `not_yet` (`fraction` of
    the calls needed so far, `remaining_s` at the call rate so far), `never` (nothing is saved per call)
    or `unknown` (`why`: no decision, no bill, no baseline ...)."""

    verdict: str
    text: str
    why: str | None = None
    decision_id: int | None = None
    config_label: str | None = None
    search_energy_j: float | None = None
    search_source: str | None = None
    search_seconds: float | None = None
    search_runs: int | None = None
    baseline: str | None = None
    saving_j_per_inference: float | None = None
    saving_source: str | None = None
    payback_inferences: float | None = None
    payback_source: str | None = None
    calls: int = 0
    fraction: float | None = None
    calls_per_s: float | None = None
    paid_back_at: float | None = None  # epoch seconds (ISO text and `paid_back_at_epoch` in JSON)
    paid_back_after_s: float | None = None
    remaining_s: float | None = None


@dataclass
class DeploymentReport(Section):
    kind: str
    version: int
    generated_at: str | None
    deployment: DeploymentInfo
    period: Period
    totals: Totals
    envelope: Envelope
    configuration: Configuration
    baselines: dict[str, Baseline]
    co2: Co2 | None
    efficiency: Efficiency
    sharing: Sharing
    notes: list[str]
    samples: list[Window]
    payback: Payback | None = None
    served_vs_benchmarked: ServedVsBenchmarked | None = None
    # When windows are left out of `samples`: the whole period in at most TIMELINE_SPANS spans, each summing the
    # windows that started in it (the plots draw these then). None when every window is listed.
    timeline: list[TimelineSpan] | None = None


@dataclass
class SummaryRow(Section):
    name: str
    policy: str | None
    device_kind: str
    config: str | None
    decision_state: str | None
    start: str | None
    end: str | None
    samples: int
    energy_j: float
    energy_kwh: float
    inferences: int
    j_per_inference: float | None
    avg_power_w: float | None
    peak_power_w: float | None
    max_avg_power_w: float | None
    violations: int
    saving_vs_eager_fp32: float | None
    saving_vs_compile_default_fp32: float | None
    serves_baseline: list[str]
    co2_g: float | None
    energy_source: str | None
    shared_windows: int
    payback: str | None = None
    paid_back_after_s: float | None = None
    per_sample: list[str] = field(default_factory=list)  # baselines compared per sample (another batch size)
    not_like_for_like: list[str] = field(default_factory=list)  # baselines metered by another source: no saving
    # The part that is an estimate (as in `Totals`): a `estimate+rapl` row was partly measured.
    estimated_energy_j: float = 0.0
    estimated_windows: int = 0
    tokens: int | None = None  # a generation's (as in `Totals`)
    j_per_token: float | None = None
    per_token: list[str] = field(default_factory=list)  # baselines compared per generated token


@dataclass
class Summary(Section):
    kind: str
    version: int
    generated_at: str | None
    since: str | None
    deployments: list[SummaryRow]


# -- arguments ------------------------------------------------------------------------------------
def _intensity(raw: Any, origin: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{origin}: {raw!r} is not a grid carbon intensity; give grams CO2 per kWh as a "
                         "finite number >= 0 (for example 300)")
    return value


def grid_intensity(value: float | str | None) -> float | None:
    """The grid's gCO2/kWh: the argument (the --grid-gco2-per-kwh option), else
    $JOULEPILOT_GRID_GCO2_PER_KWH, else None. Negative, non-finite or non-numeric figures raise
    ValueError naming where they came from."""
    if value is not None:
        return _intensity(value, GRID_OPTION)
    raw = os.environ.get(GRID_ENV, "").strip()
    return _intensity(raw, GRID_ENV) if raw else None


iso = iso_utc


# -- gathering ------------------------------------------------------------------------------------
def device_peak(device_name: str | None, precision: str | None) -> DevicePeak | None:
    """Datasheet peak FLOP/s, board power and peak FLOPs per joule for a GPU name, or None when unknown."""
    sheet = find_datasheet(device_name)
    if sheet is None:
        return None
    tensor = precision in ("bf16", "fp16")
    flops = (sheet.dense_bf16_tflops if tensor else sheet.fp32_tflops) * 1e12
    return DevicePeak(device=sheet.name, precision_basis="dense BF16/FP16 tensor" if tensor else "FP32 (non-tensor)",
                      peak_flops_per_s=flops, tdp_w=sheet.tdp_w, peak_flops_per_j=flops / sheet.tdp_w,
                      source=sheet.source, source_url=sheet.source_url)


def _details(dep: Mapping[str, Any]) -> Mapping[str, Any]:
    details = dep.get("details")
    return details if isinstance(details, Mapping) else {}


def _device_kind(db: Store, dep: Mapping[str, Any]) -> str:
    if _details(dep).get("device_kind"):
        return str(_details(dep)["device_kind"])
    device = str(dep.get("device") or "")
    meter_device = "gpu:" + device.split(":", 1)[1] if device.startswith("cuda:") else "cpu:0"
    name = store_reports.device_name(db, dep.get("host_id"), meter_device)
    return device_kind({"device": dep.get("device"), "device_name": name})


def _decision(db: Store, dep: Mapping[str, Any], kind: str) -> DecisionRow | None:
    """The newest decision of the deployment's policy on its device kind: one for the configuration it
    serves when there is one, else any."""
    if not dep.get("policy"):
        return None
    served = dep.get("config_id")
    found = latest_decision(db, dep["policy"], kind, config_id=served) if served else None
    return found or latest_decision(db, dep["policy"], kind)


def _baseline_workload_id(dep: Mapping[str, Any], decision: DecisionRow | None) -> str | None:
    """Where the baselines of the deployment's policy are measured: its workload at the policy's own batch size.

    Recorded by `attach` as `baseline_workload_id` (the deployment's own workload is the one it serves, at the
    decided configuration's batch size); for a deployment recorded before that, the decision's workload
    (`resolve` decides for the policy's own batch size); else the deployment's workload."""
    recorded = _details(dep).get("baseline_workload_id")
    if recorded:
        return str(recorded)
    decided = decision.details.get("workload_id") if decision is not None else None
    return str(decided) if decided else dep.get("workload_id")


def _served_batch_size(db: Store, dep: Mapping[str, Any],
                       workload: Mapping[str, Any] | None) -> int | None:
    """Samples per call the deployment serves: as `attach` recorded it (the decided configuration's batch
    size), else the batch size of the configuration it serves, else its workload's."""
    for value in (_details(dep).get("batch_size"), (config_row(db, dep.get("config_id")) or {}).get("batch_size"),
                  (workload or {}).get("batch_size")):
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1:
            return int(value)
    return None


def _limits(dep: Mapping[str, Any], decision: DecisionRow | None,
            violations: Sequence[Mapping[str, Any]]) -> tuple[dict[str, float], str | None]:
    if dep.get("policy"):
        try:
            from joulepilot.policies.load import find_policy, load_policy

            policy = load_policy(find_policy(dep["policy"]))
            found = {k: getattr(policy.limits, k) for k in LIMIT_NAMES if getattr(policy.limits, k) is not None}
            return found, f"policy file {policy.path}"
        except Exception:  # noqa: BLE001 - a missing or broken policy file only costs the envelope lines
            pass
    recorded = _details(dep).get("limits")
    if isinstance(recorded, Mapping) and recorded:
        return {k: recorded[k] for k in LIMIT_NAMES if recorded.get(k) is not None}, "limits recorded at attach"
    decided = decision.details if decision is not None else {}
    if isinstance(decided.get("limits"), Mapping):
        return {k: decided["limits"][k] for k in LIMIT_NAMES if decided["limits"].get(k) is not None}, \
            "decision details"
    cited = {v["limit_name"]: v["limit_value"] for v in violations if v["limit_name"] in LIMIT_NAMES}
    if cited:
        return cited, "recorded violations"
    return {}, None


def _baseline(db: Store, key: str, workload_id: str | None, kind: str,
              deployment_j: float | None, inferences: int, source: str, served: set[str],
              served_batch: int | None = None, totals: Totals | None = None) -> Baseline:
    out = Baseline(label=BASELINE_LABELS[key], served_batch_size=served_batch)
    if totals is not None and totals.generates:  # a generation: compared per generated token
        out.unit = "J/token"
        deployment_j, inferences = totals.j_per_token, totals.tokens or 0
    if not workload_id:
        out.note = out.no_saving_reason = "no baseline measured: the deployment's workload is unknown"
        return out
    all_runs = [r for r in store_reports.baseline_runs(db, workload_id, key) if device_kind(r) == kind]
    if not all_runs:
        out.note = out.no_saving_reason = f"no baseline measured for this workload on {kind}"
        return out
    chosen, runs, out.left_out_runs = _baseline_source(all_runs, source)
    out.measured = True
    out.j_per_inference = statistics.median(r["energy_j_per_inference"] for r in runs)
    per_token = [r["energy_j_per_token"] for r in runs if r.get("energy_j_per_token") is not None]
    out.j_per_token = statistics.median(per_token) if per_token else None
    out.runs = len(runs)
    out.run_ids = [r["id"] for r in runs]
    out.energy_source = None if chosen == UNKNOWN_SOURCE else chosen
    out.served_is_baseline = bool(served) and served <= {r["config_id"] for r in runs}
    batches = {int(r["batch_size"]) for r in runs if r.get("batch_size")}
    out.batch_size = batches.pop() if len(batches) == 1 else None
    if out.energy_source and source:
        out.like_for_like = out.energy_source == source_key(source)
    unlike = (f"the baseline was metered by {out.energy_source} and this deployment by {source}: not like for "
              f"like, so no saving is shown")
    notes = []
    if out.left_out_runs:
        others = ", ".join(f"{n} run{'s' if n != 1 else ''} metered by {s}" for s, n in sorted(out.left_out_runs.items()))
        notes.append(f"the median of its {len(runs)} {chosen} run{'s' if len(runs) != 1 else ''}; {others} not counted "
                     "(a median never mixes meters)")
    if out.served_is_baseline:
        notes.append("this deployment serves the baseline's own configuration, so there is no saving to "
                     "report; any difference from the benchmark is live serving (load, idle time, "
                     "contention), not the policy")
        out.no_saving_reason = notes[0] if out.like_for_like is not False else f"{notes[0]}; {unlike}"
    elif out.like_for_like is False:
        out.no_saving_reason = unlike
    elif deployment_j is None:
        out.no_saving_reason = "this deployment served no calls in this period"
    elif not out.j_per_inference:
        out.no_saving_reason = "the baseline's benchmark recorded no energy per call"
    elif out.per_token:
        if not out.j_per_token:
            out.no_saving_reason = "the baseline's benchmark recorded no energy per token"
        else:
            out.deployment_j_per_token = deployment_j
            out.saving_fraction = 1.0 - deployment_j / out.j_per_token
            out.saving_j = (out.j_per_token - deployment_j) * inferences
            notes.append("compared per generated token")
    else:
        if served_batch and out.batch_size and served_batch != out.batch_size:
            # A call of each side holds a different number of samples (the batch-size lever): per sample.
            out.unit = "J/sample"
            out.j_per_sample = out.j_per_inference / out.batch_size
            out.deployment_j_per_sample = deployment_j / served_batch
            out.saving_fraction = 1.0 - out.deployment_j_per_sample / out.j_per_sample
            out.saving_j = (out.j_per_sample - out.deployment_j_per_sample) * inferences * served_batch
            notes.append(f"compared per sample: served at batch {served_batch}, baseline at batch {out.batch_size}")
        else:
            out.saving_fraction = 1.0 - deployment_j / out.j_per_inference
            out.saving_j = (out.j_per_inference - deployment_j) * inferences
    if out.like_for_like is False:
        notes.append(unlike)
    out.note = "; ".join(notes) or None
    return out


def _baseline_source(runs: Sequence[Mapping[str, Any]], deployment_source: str
                     ) -> tuple[str, list[Mapping[str, Any]], dict[str, int]]:
    """Which of a baseline's runs its median is over: those metered like the deployment's windows when there are
    any, else those of the most trustworthy source (`policies.sources`: a median never mixes meters). Returns that
    source, its runs, and how many runs of each other source are left out."""
    by_source: dict[str, list[Mapping[str, Any]]] = {}
    for run in runs:
        by_source.setdefault(source_key(run["energy_source"]), []).append(run)
    wanted = source_key(deployment_source) if deployment_source else None
    chosen = wanted if wanted in by_source else ranked_sources({s: len(r) for s, r in by_source.items()})[0]
    return chosen, by_source[chosen], {s: len(r) for s, r in by_source.items() if s != chosen}


def _windows(samples: Sequence[Mapping[str, Any]], energy_before_j: float = 0.0) -> list[Window]:
    """Listed windows; their cumulative energy counts from `energy_before_j`, the period's windows before them."""
    rows, cumulative = [], energy_before_j
    for s in samples:
        cumulative += s["energy_j"]
        rows.append(Window(
            t_start=s["t_start"], t_end=s["t_end"], duration_s=s["t_end"] - s["t_start"], energy_j=s["energy_j"],
            cumulative_energy_j=cumulative, inferences=s["inferences"],
            j_per_inference=s["energy_j"] / s["inferences"] if s["inferences"] else None,
            avg_power_w=s["avg_power_w"], peak_power_w=s["peak_power_w"], energy_source=s["energy_source"],
            config_id=s.get("config_id"), other_processes=s.get("other_processes") or 0, share=s.get("share"),
            tokens=s.get("tokens"), j_per_token=s["energy_j"] / s["tokens"] if s.get("tokens") else None,
        ))
    return rows


def _totals(sums: SampleTotals) -> Totals:
    energy_j, inferences, metered_s = sums.energy_j, sums.inferences, sums.metered_s
    return Totals(
        energy_j=energy_j, energy_kwh=energy_j / J_PER_KWH, inferences=inferences,
        j_per_inference=energy_j / inferences if inferences else None,
        busy_j_per_inference=sums.busy_energy_j / inferences if inferences else None,
        avg_power_w=energy_j / metered_s if metered_s > 0 else None,
        peak_power_w=sums.peak_power_w, metered_s=metered_s,
        energy_source="+".join(sums.sources) if sums.sources else None, is_estimate="estimate" in sums.sources,
        attributed_energy_j=sums.attributed_energy_j if sums.shared_windows else None,
        estimated_energy_j=sums.estimated_energy_j, estimated_windows=sums.estimated_windows,
        tokens=sums.tokens, j_per_token=sums.j_per_token,
    )


def _configuration(db: Store, dep: Mapping[str, Any], decision: DecisionRow | None,
                   shares: Sequence[ConfigTotals], kind: str) -> Configuration:
    served = sorted({c.config_id for c in shares} | ({dep["config_id"]} if dep.get("config_id") else set()))
    labels = store_reports.config_labels(db, served)
    config = config_row(db, dep.get("config_id")) or {}
    history = [ConfigShare(config_id=c.config_id, label=labels.get(c.config_id), samples=c.windows,
                           energy_j=c.energy_j, inferences=c.inferences, tokens=c.tokens) for c in shares]
    if decision is None:
        reason = f"no decision recorded for this policy on {kind}" if dep.get("policy") else "deployed without a policy"
    else:
        reason = decision.reason
    return Configuration(
        config_id=dep.get("config_id"), label=config.get("label"), precision=config.get("precision"),
        decision_state=decision.state if decision else None, decision_reason=reason,
        decided_at=iso(decision.decided_at if decision else None), served_config_ids=served, history=history)


def _graph_breaks(db: Store, dep: Mapping[str, Any], workload: Mapping[str, Any] | None,
                  configuration: Configuration, kind: str) -> None:
    """Fill the configuration's graph breaks from the latest ok run of the served configuration."""
    from joulepilot.compiler.graph_breaks import break_summary, doctor_command, run_breaks

    if not dep.get("workload_id") or not configuration.config_id:
        return
    run = latest_runs(db, dep["workload_id"], kind).get(configuration.config_id)
    if run is None:
        return
    breaks, count = run_breaks(run)
    configuration.graph_breaks = count
    spec = (workload or {}).get("spec")
    command = doctor_command(spec, (workload or {}).get("batch_size")) if spec else None
    configuration.graph_break_summary = break_summary(breaks, count, command)


def _cannot_be_met(decision: DecisionRow | None, totals: Totals | None = None,
                   limits: Mapping[str, float] | None = None) -> str | None:
    """The statement that the envelope cannot be met, when the decision in force says so. The decision's figure
    is the upper bound of its benchmark runs' median (the envelope is judged on it); when this deployment's own
    average power is within the limit, the statement says so beside it, naming which figure is which."""
    if decision is None or decision.state != "infeasible":
        return None
    shortfall = decision.details.get("confidence") or decision.reason or ""
    text = f"the envelope cannot be met: {shortfall}".rstrip(": ")
    limit = (limits or {}).get("max_avg_power_w")
    served = totals.avg_power_w if totals is not None else None
    if limit is not None and served is not None and served <= limit:
        text += (f"; this deployment's own average power, {power_reading(served, totals.energy_source)} over its "
                 f"windows, is within the {fmt(limit, 'W')} limit: the decision judges the benchmark's runs by the "
                 f"upper bound of their median, which is over it")
    return text


def _envelope(db: Store, dep_id: int, limits: Mapping[str, float], limits_from: str | None,
              sums: SampleTotals, violations: Sequence[Mapping[str, Any]],
              decision: DecisionRow | None = None, totals: Totals | None = None) -> Envelope:
    labels = store_reports.config_labels(db, (v.get("config_id") for v in violations))
    # Each violation's reading carries the source of the window that tripped it; one outside every window
    # stored (written before its windows were) that of the deployment's windows when they all have one.
    sources = sources_at(db, dep_id, (v["at"] for v in violations))
    uniform = sums.sources[0] if len(sums.sources) == 1 else None
    return Envelope(
        max_avg_power_w=limits.get("max_avg_power_w"), max_peak_power_w=limits.get("max_peak_power_w"),
        limits_from=limits_from, windows_above_avg_limit=sums.windows_above_avg_limit,
        windows_above_peak_limit=sums.windows_above_peak_limit,
        violations=[Violation(id=v.get("id"), at=v["at"], at_iso=iso(v["at"]), policy=v.get("policy"),
                              deployment=v.get("deployment"), limit_name=v["limit_name"],
                              limit_value=v["limit_value"], measured_value=v["measured_value"],
                              config_id=v.get("config_id"), config_label=labels.get(v.get("config_id") or ""),
                              decision_id=v.get("decision_id"), energy_source=sources.get(v["at"], uniform))
                    for v in violations],
        cannot_be_met=_cannot_be_met(decision, totals, limits),
    )


def _efficiency(workload: Mapping[str, Any] | None, dep: Mapping[str, Any], kind: str, precision: str | None,
                totals: Totals, served_batch: int | None = None) -> Efficiency:
    flops = (workload or {}).get("flops_per_inference")
    recorded_batch = (workload or {}).get("batch_size")
    if flops and served_batch and recorded_batch and served_batch != recorded_batch:
        # The workload row is at another batch size than the calls served (a deployment recorded under its
        # policy's workload): FLOPs per call scale with the samples in a call.
        flops = float(flops) * served_batch / float(recorded_batch)
    peak = device_peak(kind if kind != "cpu" else None, precision)
    achieved = flops / totals.j_per_inference if flops and totals.j_per_inference else None
    note = None if peak else ("no datasheet peak for CPUs (the table covers data-centre GPUs)"
                              if kind == "cpu" else f"device peak unknown for {kind}")
    if not flops:
        note = "workload FLOPs unknown" if dep.get("workload_id") else "workload unknown"
    return Efficiency(flops_per_inference=flops, flops_per_j=achieved, energy_source=totals.energy_source,
                      device_peak=peak,
                      fraction_of_peak_flops_per_j=achieved / peak.peak_flops_per_j if achieved and peak else None,
                      note=note)


def _sharing(sums: SampleTotals, totals: Totals) -> Sharing:
    return Sharing(windows=sums.windows, windows_shared=sums.shared_windows,
                   max_other_processes=sums.max_other_processes, mean_share=sums.mean_share,
                   attributed_energy_j=totals.attributed_energy_j)


def partly_estimate_text(totals: Totals, windows: int) -> str:
    """What is an estimate in a deployment metered partly by a counter and partly estimated."""
    measured = "+".join(x for x in (totals.energy_source or "").split("+") if x != "estimate")
    return (f"{totals.estimated_windows:,} of {windows:,} windows ({energy(totals.estimated_energy_j)} of "
            f"{energy(totals.energy_j)}) are an estimate, CPU time x watts per core, read while no energy counter "
            f"could be; the other windows were measured by {measured}, and figures over the whole period mix the two")


def _notes(totals: Totals, sharing: Sharing, baselines: Mapping[str, Baseline], windows: int) -> list[str]:
    notes = []
    if not windows:
        notes.append("no samples in this period: the deployment served nothing metered yet")
    if totals.partly_estimate:
        notes.append(f"PARTLY ESTIMATE: {partly_estimate_text(totals, windows)}")
    elif totals.is_estimate:
        notes.append("ESTIMATE: no energy counter could be read on this host; energy is CPU time x watts per "
                     "core, not a measurement")
    if sharing.windows_shared:
        share = sharing.mean_share
        notes.append(
            f"shared device: other processes used it in {sharing.windows_shared} of {sharing.windows} "
            f"windows (up to {sharing.max_other_processes}); energy figures are the whole device's"
            + (f"; this deployment's mean share of utilisation was {share:.0%}, about "
               f"{energy(sharing.attributed_energy_j)} attributed to it" if share is not None else
               "; per-process utilisation was unavailable, so no share could be attributed"))
    if any(b.measured for b in baselines.values()) and totals.busy_j_per_inference is not None \
            and totals.j_per_inference and totals.busy_j_per_inference < 0.9 * totals.j_per_inference:
        notes.append("idle windows raise this deployment's J/inference above the benchmark's, which measures "
                     "back-to-back calls; J/inference over windows that served calls is "
                     f"{energy(totals.busy_j_per_inference)}")
    return notes


def _payback(db: Store, dep: Mapping[str, Any], kind: str) -> Payback:
    """The payback section (see `Payback`): the newest decision that applies the configuration served."""
    served = dep.get("config_id")
    decision = latest_decision(db, dep["policy"], kind, states=APPLICABLE_STATES, config_id=served) \
        if dep.get("policy") and served else None
    if decision is None:
        why = ("deployed without a policy" if not dep.get("policy") else
               f"no decision of policy {dep['policy']} on {kind} applies the configuration served")
        return Payback("unknown", f"payback not known: {why}", why)
    bill = decision.details.get("bill")
    label = store_reports.config_labels(db, [served]).get(served)
    if not isinstance(bill, Mapping):
        why = ("the decision was stored before joulepilot recorded tuning bills; decide again (the daemon's next "
               "pass, or `joulepilot policy lock`) to record one")
        return Payback("unknown", f"payback not known: {why}", why, decision.id, label)
    search = bill.get("search") or {}
    out = Payback("unknown", "", bill.get("why") or None, decision.id, label,
                  search_energy_j=search.get("energy_j"), search_source=search.get("source"),
                  search_seconds=search.get("seconds"), search_runs=search.get("runs"),
                  baseline=(bill.get("baseline") or {}).get("kind"),
                  saving_j_per_inference=bill.get("saving_j_per_inference"), saving_source=bill.get("saving_source"),
                  payback_inferences=bill.get("payback_inferences"), payback_source=bill.get("payback_source"))
    needed = out.payback_inferences if bill.get("verdict") == PAYS_BACK else None
    progress = calls_progress(db, dep["id"], served, calls_needed=needed)
    if bill.get("verdict") not in (PAYS_BACK, NEVER):
        out.text = f"payback not known: {out.why}"
        out.calls = progress.calls
        return out
    reached = payback_progress(needed, calls=progress.calls, metered_s=progress.metered_s,
                               first_t_start=progress.first_t_start, crossing=progress.crossing)
    out.verdict, out.calls, out.fraction = reached.verdict, reached.calls, reached.fraction
    out.calls_per_s, out.remaining_s = reached.calls_per_s, reached.remaining_s
    out.paid_back_at = reached.paid_back_at
    out.paid_back_after_s = reached.paid_back_after_s
    out.text = f"the tuning never pays back: {out.why}" if reached.verdict == NEVER else f"the tuning {reached.text}"
    return out


def _served_vs_benchmarked(db: Store, dep: Mapping[str, Any], kind: str, totals: Totals,
                           shares: Sequence[ConfigTotals], sharing: Sharing) -> ServedVsBenchmarked:
    """The served configuration's J per call against its benchmark runs (see `ServedVsBenchmarked`)."""
    from joulepilot.policies.judge import counted_rows, intervals
    from joulepilot.policies.sources import group_by_source

    config_id = dep.get("config_id")
    label = store_reports.config_labels(db, [config_id]).get(config_id) if config_id else None
    out = ServedVsBenchmarked("not_compared", "", config_id=config_id, config_label=label)
    share = next((c for c in shares if c.config_id == config_id), None)
    source = totals.energy_source
    # a generation: J per generated token, whatever the lengths of the requests served
    figure, per = ("energy_j_per_token", "token") if totals.generates else ("energy_j_per_inference", "call")
    out.unit = f"J/{per}"
    if share is not None:
        out.served_calls, out.served_windows = share.inferences, share.windows
        count = share.tokens if totals.generates else share.inferences
        out.served_j_per_call = share.energy_j / count if count else None
    if config_id is None or not dep.get("workload_id"):
        out.why = "the configuration served or its workload is not recorded"
    elif out.served_j_per_call is None:
        out.why = "this deployment served no calls with it in this period"
    elif not source or "+" in source:
        out.why = (f"its windows were metered by several sources ({source}): no one benchmark source is like for "
                   "like" if source else "its windows record no energy source")
    if out.why:
        out.text = f"served against benchmarked: not compared, {out.why}"
        return out
    out.energy_source = source_key(source)
    per_config = {cid: counted_rows(runs) for cid, runs in ok_runs_per_config(db, dep["workload_id"], kind).items()}
    by_source = group_by_source({cid: [r for r in runs if getattr(r, figure) is not None]
                                 for cid, runs in per_config.items()}, lambda run: run.energy_source)
    mine = by_source.get(out.energy_source, {}).get(config_id, [])
    if not mine:
        others = sorted(s for s, configs in by_source.items() if configs.get(config_id))
        out.why = (f"{label or config_id} has no benchmark run on {kind} metered by {out.energy_source}"
                   + (f" (only by {', '.join(others)}: not like for like)" if others else ""))
        out.text = f"served against benchmarked: not compared, {out.why}"
        return out
    values = {cid: [getattr(r, figure) for r in runs] for cid, runs in by_source[out.energy_source].items()}
    interval = intervals(values)[config_id]
    out.benchmarked_j_per_call, out.benchmark_low_j, out.benchmark_high_j = interval.median, interval.low, interval.high
    out.benchmark_interval, out.benchmark_runs = interval.method, len(mine)
    out.benchmark_run_ids = [r.id for r in mine]
    out.benchmark_batch_size = mine[0].batch_size
    served = out.served_j_per_call
    assert served is not None
    out.ratio = served / interval.median if interval.median else None
    said = (f"served {energy(served)}/{per} with {label or config_id} against {energy(interval.median)} benchmarked "
            f"(median of {len(mine)} run{'s' if len(mine) != 1 else ''}, {energy(interval.low)} to "
            f"{energy(interval.high)}; {out.energy_source})")
    if interval.low <= served <= interval.high:
        out.verdict, out.text = "within_noise", f"{said}: within the benchmark's noise"
        return out
    out.verdict = "above" if served > interval.high else "below"
    times = f"{out.ratio:.2f}x" if out.ratio else "not"
    out.text = f"{said}: {times} the benchmark, more than its noise"
    batch = f" (batch {out.benchmark_batch_size})" if out.benchmark_batch_size else ""
    if out.verdict == "above":
        shared = (f"; other processes used the device in {sharing.windows_shared} of {sharing.windows} windows"
                  if sharing.windows_shared else "")
        out.hint = (f"check that the calls carry the batch size and input sizes benchmarked{batch}: smaller "
                    "batches or longer inputs cost more per call; idle time between calls counts in the served "
                    f"energy but not in the benchmark's back-to-back calls; other load on the device adds to its "
                    f"energy{shared}")
    else:
        out.hint = (f"check that the calls carry the batch size and input sizes benchmarked{batch}: smaller "
                    "batches or shorter inputs cost less per call")
    return out


def _break_notes(configuration: Configuration) -> list[str]:
    if not configuration.graph_break_summary:
        return []
    return [f"the served configuration ({configuration.label or configuration.config_id}) has "
            f"{configuration.graph_break_summary}"]


def build_report(db: Store, deployment: str, since: float | str | None = None, *,
                 grid_gco2_per_kwh: float | str | None = None, windows: int = DEFAULT_WINDOWS,
                 timeline_spans: int = TIMELINE_SPANS) -> DeploymentReport:
    """Every figure of one deployment's report (see the module docstring).

    The figures cover every window of the period, summed by the store; `samples` lists the newest `windows` of
    them (0: none), and when some are left out `timeline` holds the period in at most `timeline_spans` spans."""
    dep = get_deployment(db, deployment)
    if dep is None:
        known = [d["name"] for d in list_deployments(db)]
        raise LookupError(f"no deployment named {deployment!r} in the store"
                          + (f"; known: {', '.join(known)}" if known else "; none recorded yet"))
    intensity = grid_intensity(grid_gco2_per_kwh)
    since_t = parse_since(since)
    violations = list_violations(db, deployment=deployment, since=since_t)
    kind = _device_kind(db, dep)
    decision = _decision(db, dep, kind)
    limits, limits_from = _limits(dep, decision, violations)
    sums = sample_totals(db, dep["id"], since=since_t, max_avg_power_w=limits.get("max_avg_power_w"),
                         max_peak_power_w=limits.get("max_peak_power_w"))
    listed, energy_before_j = recent_samples(db, dep["id"], max(0, windows), since=since_t)
    samples = _windows(listed, energy_before_j)
    left_out = sums.windows - len(samples)
    workload = workload_row(db, dep.get("workload_id"))
    served_batch = _served_batch_size(db, dep, workload)

    totals = _totals(sums)
    shares = config_totals(db, dep["id"], since=since_t)
    configuration = _configuration(db, dep, decision, shares, kind)
    _graph_breaks(db, dep, workload, configuration, kind)
    served = {c.config_id for c in shares} or ({dep["config_id"]} if dep.get("config_id") else set())
    baseline_workload = _baseline_workload_id(dep, decision)
    baselines = {key: _baseline(db, key, baseline_workload, kind, totals.j_per_inference, totals.inferences,
                                totals.energy_source or "", served, served_batch, totals) for key in BASELINE_LABELS}
    sharing = _sharing(sums, totals)
    return DeploymentReport(
        kind=REPORT_KIND, version=1, generated_at=iso(time.time()),
        deployment=DeploymentInfo(
            name=dep["name"], policy=dep.get("policy"), device=dep.get("device"), device_kind=kind,
            host_id=dep.get("host_id"), hostname=store_reports.hostname(db, dep.get("host_id")),
            workload_id=dep.get("workload_id"), workload=(workload or {}).get("spec"),
            batch_size=served_batch, created_at=iso(dep.get("created_at"))),
        period=Period(since=iso(since_t), start=iso(sums.first_t_start), end=iso(sums.last_t_end),
                      start_t=sums.first_t_start, end_t=sums.last_t_end, samples=sums.windows,
                      samples_listed=len(samples), samples_left_out=left_out),
        totals=totals,
        envelope=_envelope(db, dep["id"], limits, limits_from, sums, violations, decision, totals),
        configuration=configuration,
        baselines=baselines,
        co2=None if intensity is None else Co2(grid_gco2_per_kwh=intensity,
                                               co2_g=totals.energy_j / J_PER_KWH * intensity,
                                               energy_source=totals.energy_source),
        efficiency=_efficiency(workload, dep, kind, configuration.precision, totals, served_batch),
        sharing=sharing,
        notes=_notes(totals, sharing, baselines, sums.windows) + _break_notes(configuration),
        samples=samples,
        payback=_payback(db, dep, kind),
        served_vs_benchmarked=_served_vs_benchmarked(db, dep, kind, totals, shares, sharing),
        timeline=sample_timeline(db, dep["id"], timeline_spans, since=since_t) if left_out else None,
    )


def build_summary(db: Store, since: float | str | None = None, *,
                  grid_gco2_per_kwh: float | str | None = None) -> Summary:
    """One row per deployment with its headline figures (the same figures as its full report)."""
    grid_intensity(grid_gco2_per_kwh)  # a bad figure is refused even when there is no deployment yet
    rows = []
    for dep in list_deployments(db):
        r = build_report(db, dep["name"], since, grid_gco2_per_kwh=grid_gco2_per_kwh, windows=0, timeline_spans=0)
        t, c = r.totals, r.configuration
        eager, stock = r.baselines["eager_fp32"], r.baselines["compile_default_fp32"]
        rows.append(SummaryRow(
            name=dep["name"], policy=dep.get("policy"), device_kind=r.deployment.device_kind,
            config=c.label or c.config_id, decision_state=c.decision_state, start=r.period.start,
            end=r.period.end, samples=r.period.samples, energy_j=t.energy_j, energy_kwh=t.energy_kwh,
            inferences=t.inferences, j_per_inference=t.j_per_inference, avg_power_w=t.avg_power_w,
            peak_power_w=t.peak_power_w, max_avg_power_w=r.envelope.max_avg_power_w,
            violations=len(r.envelope.violations), saving_vs_eager_fp32=eager.saving_fraction,
            saving_vs_compile_default_fp32=stock.saving_fraction,
            serves_baseline=[k for k, b in r.baselines.items() if b.served_is_baseline],
            co2_g=r.co2.co2_g if r.co2 else None, energy_source=t.energy_source,
            shared_windows=r.sharing.windows_shared, payback=r.payback.text if r.payback else None,
            paid_back_after_s=r.payback.paid_back_after_s if r.payback else None,
            per_sample=[k for k, b in r.baselines.items() if b.per_sample],
            not_like_for_like=[k for k, b in r.baselines.items() if b.like_for_like is False],
            estimated_energy_j=t.estimated_energy_j, estimated_windows=t.estimated_windows, tokens=t.tokens,
            j_per_token=t.j_per_token, per_token=[k for k, b in r.baselines.items() if b.per_token]))
    return Summary(kind=SUMMARY_KIND, version=1, generated_at=iso(time.time()), since=iso(parse_since(since)),
                   deployments=rows)
