"""The tuning bill: what measuring cost, and after how many calls a decision's saving pays it back.

What "spent measuring" is, per stored run (the README's "The tuning bill" says the same for users):
- seconds: the whole daemon job that made the run (`extra.job_wall_s`: worker start-up, the idle
  baseline, building the model, the eager reference, compile, warm-up, latency pass, energy window,
  saving artifacts, describing the workload); where no job was recorded (a run made by `bench`), the
  worker's own run, `finished_at - started_at`;
- metered joules: the first (compiling) call, `compile_energy_j` (a warm-started repeat's first call, which
  compiled nothing, as its meter recorded it in `extra.compile_window`), and the energy window, `energy_j`,
  as the run's meters read them, each part with its own source: the window the run's `energy_source`
  (`nvml`, `rapl`, or `estimate` where no counter could be read), the compile call its GPU and CPU parts
  with theirs (`store.compile_energy`; a GPU run's CPU part is the labelled `estimate` where RAPL cannot be
  read). They are kept apart per source (`metered_j_by_source`), so an estimated part is never counted as
  a measurement; a run stored with one compile figure and no parts gives it the run's `energy_source`;
- estimated joules, always labelled `estimate`, for the seconds no meter read: warm-up and the latency
  pass at the window's average power (they make the same calls), everything else at the run's idle
  power. A failed run had nothing metered: all its seconds are at idle power, the median idle power
  of the other runs billed with it where it has none. Seconds with no power to price them are
  counted as `unpriced_s`, never guessed.
The bill's energy is metered + estimated, and its `source` names every source in it ("nvml+estimate"),
the metered parts' included.
A measurement stopped before it ended (the daemon was stopped, production load came back) stored no
run and is not billed.

Payback: the saving per call is the baseline's median J per call less the applied configuration's,
both as the resolver counts runs (medians over counted repeats on the decision's device kind and
torch; the baseline's over its runs metered like the applied configuration's when it has any, and a
baseline metered otherwise gives no saving: two sources are not like for like). The baseline is what would run without tuning: stock `torch.compile` (mode default, fp32)
when it is measured, else eager fp32, else (a policy that allows no fp32, such as a bf16 generation) eager in the
applied configuration's precision. The search pays back after `search energy / saving` calls;
where nothing is saved (the decision keeps the baseline, or costs more per call) it never pays back.
With the batch-size lever (`policies.batches`) the search is every run of the policy's workload at each
batch size of its grid, the baseline stays at the policy's batch size, and a decision at another batch
size saves the baseline's J for as many samples as one of its calls, less its own J per call.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from joulepilot.store import Store
from joulepilot.store.runs import RunRow, workload_runs

from .judge import counted_rows, intervals
from .sources import ESTIMATE, UNKNOWN_SOURCE, joined_sources, source_key

BASELINES = (("default", "stock compile default fp32"), ("eager", "eager fp32"))
PAYS_BACK, NEVER, UNKNOWN = "pays_back", "never", "unknown"


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass
class RunCost:
    """What one run cost: its seconds and the parts of them that were metered, loaded or idle."""

    run_id: int | None
    ok: bool
    seconds: float
    seconds_basis: str  # 'job' (the daemon's whole job) | 'run' (the worker's run) | 'phases' (their sum)
    metered_j: float | None  # compile call + energy window, as the meters read them
    metered_s: float
    metered_source: str | None  # every source of the metered joules ('nvml+estimate')
    loaded_s: float  # warm-up and latency pass: the same calls as the window, not metered
    loaded_w: float | None  # the window's average power
    idle_s: float  # everything else
    idle_w: float | None  # the run's idle power, None when it has none
    metered_j_by_source: dict[str, float] = field(default_factory=dict)  # the metered joules per source

    def estimated_j(self, fallback_idle_w: float | None) -> tuple[float, float]:
        """(estimated joules, unpriced seconds): loaded seconds at the window's power, the rest at the
        run's idle power (else `fallback_idle_w`)."""
        joules, unpriced = 0.0, 0.0
        if self.loaded_s > 0:
            if self.loaded_w is None:
                unpriced += self.loaded_s
            else:
                joules += self.loaded_s * self.loaded_w
        idle_w = self.idle_w if self.idle_w is not None else fallback_idle_w
        if self.idle_s > 0:
            if idle_w is None:
                unpriced += self.idle_s
            else:
                joules += self.idle_s * idle_w
        return joules, unpriced


def _latency_pass_s(extra: Mapping[str, Any]) -> float:
    if extra.get("latency_source") == "window":
        return 0.0  # the window's own calls were timed: no separate pass
    calls, mean_ms = _number(extra.get("latency_calls")), _number(extra.get("latency_ms_mean"))
    return calls * mean_ms / 1000.0 if calls and mean_ms else 0.0


def _run_source(run: RunRow, extra: Mapping[str, Any]) -> str | None:
    """The source of the run's own meter: `energy_source`, else the sources its compile window recorded."""
    if run.energy_source:
        return run.energy_source
    window = extra.get("compile_window")
    sources = window.get("sources") if isinstance(window, Mapping) else None
    return "+".join(str(s) for s in sources) if isinstance(sources, list) and sources else None


def _compile_parts(run: RunRow, run_source: str | None) -> list[tuple[float, str | None]]:
    """The compile call's joules as (joules, source) parts: its GPU and CPU parts with their sources; a run
    stored with one figure and no parts, that figure with the run's source. Joules in `compile_energy_j`
    that no part accounts for keep the run's source."""
    total = _number(run.compile_energy_j)
    if total is None:
        return []
    parts: list[tuple[float, str | None]] = []
    for side in ("gpu", "cpu"):
        joules = _number(getattr(run, f"compile_energy_{side}_j", None))
        if joules is not None:
            parts.append((joules, getattr(run, f"compile_energy_{side}_source", None) or run_source))
    rest = total - sum(j for j, _ in parts)
    if not parts or rest > 1e-9 * max(1.0, abs(total)):
        parts.append((rest, run_source))
    return parts


def _by_source(parts: Iterable[tuple[float, str | None]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for joules, source in parts:
        key = source or UNKNOWN_SOURCE
        out[key] = out.get(key, 0.0) + joules
    return out


def _warm_first_call(run: RunRow, extra: Mapping[str, Any]) -> tuple[list[tuple[float, str | None]], float]:
    """A warm-started run's first call as its meter read it ((joules, source) parts, seconds): it compiled
    nothing, so it has no compile columns, but the worker metered it as any first call (`extra.compile_window`)."""
    window = extra.get("compile_window")
    if "warm_start_from" not in extra or run.compile_energy_j is not None or not isinstance(window, Mapping):
        return [], 0.0
    devices = window.get("devices")
    parts = [(float(d["energy_j"]), d.get("source")) for d in devices if isinstance(d, Mapping)
             and _number(d.get("energy_j")) is not None] if isinstance(devices, list) else []
    return parts, (_number(window.get("duration_s")) or 0.0) if parts else 0.0


def run_cost(run: RunRow) -> RunCost:
    """The cost of one stored run (see the module docstring)."""
    extra = run.extra or {}
    phases = [_number(v) for v in (run.compile_s, run.warmup_s, run.window_s)]
    job_s = _number(extra.get("job_wall_s"))
    started, finished = _number(run.started_at), _number(run.finished_at)
    if job_s is not None:
        seconds, basis = job_s, "job"
    elif started is not None and finished is not None and finished >= started:
        seconds, basis = finished - started, "run"
    else:
        seconds, basis = sum(p for p in phases if p is not None), "phases"
    compile_j, window_j = _number(run.compile_energy_j), _number(run.energy_j)
    metered_s = ((phases[0] or 0.0) if compile_j is not None else 0.0) + \
        ((phases[2] or 0.0) if window_j is not None else 0.0)
    run_source = _run_source(run, extra)
    first_call, first_call_s = _warm_first_call(run, extra)
    metered_s += first_call_s
    parts = _compile_parts(run, run_source) + first_call + ([(window_j, run_source)] if window_j is not None else [])
    metered = sum(j for j, _ in parts) if parts else None
    by_source = _by_source(parts)
    loaded_s = (phases[1] or 0.0) + _latency_pass_s(extra)
    loaded_s = min(loaded_s, max(0.0, seconds - metered_s))
    return RunCost(run_id=run.id, ok=run.ok, seconds=seconds, seconds_basis=basis, metered_j=metered,
                   metered_s=metered_s, metered_source=joined_sources(k for k, j in by_source.items() if j),
                   loaded_s=loaded_s, loaded_w=_number(run.avg_power_w),
                   idle_s=max(0.0, seconds - metered_s - loaded_s), idle_w=_number(run.idle_power_w),
                   metered_j_by_source=by_source)


@dataclass
class MeasuringBill:
    """The seconds and joules a set of runs cost (see the module docstring)."""

    runs: int = 0
    failed_runs: int = 0
    seconds: float = 0.0
    metered_j: float = 0.0
    metered_source: str | None = None
    estimated_j: float = 0.0
    unpriced_s: float = 0.0
    run_ids: list[int] = field(default_factory=list)
    metered_j_by_source: dict[str, float] = field(default_factory=dict)

    @property
    def energy_j(self) -> float:
        return self.metered_j + self.estimated_j

    @property
    def source(self) -> str | None:
        return joined_sources([self.metered_source], [ESTIMATE] if self.estimated_j > 0 else [])

    def to_dict(self, *, run_ids: bool = False) -> dict[str, Any]:
        out = {"runs": self.runs, "failed_runs": self.failed_runs, "seconds": round(self.seconds, 3),
               "energy_j": self.energy_j, "source": self.source, "metered_j": self.metered_j,
               "metered_source": self.metered_source, "metered_j_by_source": dict(self.metered_j_by_source),
               "estimated_j": self.estimated_j,
               "estimated_source": ESTIMATE, "unpriced_s": round(self.unpriced_s, 3)}
        return (out | {"run_ids": list(self.run_ids)}) if run_ids else out


def bill_of(runs: Iterable[RunRow]) -> MeasuringBill:
    """What `runs` cost together. A run with no idle power of its own is priced at the median idle
    power of the others."""
    costs = [run_cost(r) for r in runs]
    idle = [c.idle_w for c in costs if c.idle_w is not None]
    fallback_idle_w = statistics.median(idle) if idle else None
    bill = MeasuringBill()
    for cost in costs:
        bill.runs += 1
        bill.failed_runs += 0 if cost.ok else 1
        bill.seconds += cost.seconds
        bill.metered_j += cost.metered_j or 0.0
        for source, joules in cost.metered_j_by_source.items():
            bill.metered_j_by_source[source] = bill.metered_j_by_source.get(source, 0.0) + joules
        estimated, unpriced = cost.estimated_j(fallback_idle_w)
        bill.estimated_j += estimated
        bill.unpriced_s += unpriced
        if cost.run_id is not None:
            bill.run_ids.append(cost.run_id)
    bill.metered_source = joined_sources(source for source, joules in bill.metered_j_by_source.items() if joules)
    return bill


# -- words ------------------------------------------------------------------------------------------
_ENERGY_UNITS = ((1e9, "GJ"), (1e6, "MJ"), (1e3, "kJ"), (1.0, "J"), (1e-3, "mJ"), (1e-6, "µJ"))


def energy_text(joules: float | None) -> str:
    """0.47 -> '0.47 J', 41234 -> '41.2 kJ' (three significant digits)."""
    if joules is None or not math.isfinite(joules):
        return "-"
    if joules == 0:
        return "0 J"
    for scale, unit in _ENERGY_UNITS:
        if abs(joules) >= scale * 0.9995:
            return f"{joules / scale:.3g} {unit}"
    return f"{joules / 1e-9:.3g} nJ"


def duration_text(seconds: float | None) -> str:
    """42 -> '42 s', 186 -> '3.1 min', 11160 -> '3.1 hours', 216000 -> '2.5 days'."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    for size, unit in ((86400.0, "days"), (3600.0, "hours"), (60.0, "min")):
        if seconds >= size:
            return f"{seconds / size:.2g} {unit}" if seconds / size < 10 else f"{seconds / size:,.0f} {unit}"
    return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"


def calls_text(calls: float | None) -> str:
    """Calls to three significant digits, grouped: 87234.5 -> '87,200'; counts under 1,000 rounded up."""
    if calls is None or not math.isfinite(calls):
        return "-"
    if calls < 1000:
        return f"{math.ceil(calls):,}"
    digits = 2 - math.floor(math.log10(calls))
    return f"{round(calls, digits):,.0f}"


def _metered_sources_text(bill: Mapping[str, Any]) -> str:
    """'nvml' when one source metered everything, else each source's joules: '600 J nvml + 900 J estimate'
    (measured sources first, `estimate` last). A bill stored before the split names its sources alone."""
    by_source = bill.get("metered_j_by_source")
    if not isinstance(by_source, Mapping):
        return str(bill.get("metered_source") or UNKNOWN_SOURCE)
    shown = {source: joules for source, joules in by_source.items() if joules}
    if len(shown) <= 1:
        return next(iter(shown), None) or str(bill.get("metered_source") or UNKNOWN_SOURCE)
    order = sorted(shown, key=lambda source: (source == ESTIMATE, source == UNKNOWN_SOURCE, source))
    return " + ".join(f"{energy_text(shown[source])} {source}" for source in order)


def fraction_text(fraction: float, decimals: int = 0) -> str:
    """A fraction as a percentage with `decimals` places, 0.34 -> '34%', that never reads 100% short of it:
    one that would round up to 100% shows one more place, floored (0.996 -> '99.6%', 0.99996 -> '99.9%')."""
    percent = 100.0 * fraction
    text = f"{percent:.{decimals}f}"
    if fraction >= 1 or float(text) < 100:
        return f"{text}%"
    places = decimals + 1
    floored = min(math.floor(percent * 10**places) / 10**places, 100 - 10**-places)
    return f"{floored:.{places}f}%"


def bill_text(bill: Mapping[str, Any]) -> str:
    """'41.2 kJ over 7 runs, 6.2 min: 38.1 kJ in compile calls and energy windows (nvml), 3.1 kJ estimated
    for the rest of the jobs (estimate)'; where the metered joules have several sources, each with its
    joules: '... 1.5 kJ in compile calls and energy windows (600 J nvml + 900 J estimate) ...'."""
    parts = []
    if bill["metered_j"]:
        parts.append(f"{energy_text(bill['metered_j'])} in compile calls and energy windows "
                     f"({_metered_sources_text(bill)})")
    if bill["estimated_j"]:
        parts.append(f"{energy_text(bill['estimated_j'])} estimated for the rest of the jobs ({ESTIMATE})")
    if bill.get("unpriced_s"):
        parts.append(f"{duration_text(bill['unpriced_s'])} with no power to price them")
    runs = bill["runs"]
    failed = f", {bill['failed_runs']} failed" if bill.get("failed_runs") else ""
    return (f"{energy_text(bill['energy_j'])} over {runs} run{'s' if runs != 1 else ''}{failed}, "
            f"{duration_text(bill['seconds'])}" + (f": {', '.join(parts)}" if parts else ""))


# -- payback ----------------------------------------------------------------------------------------
def _counted_median_j(runs: Sequence[RunRow], source: str | None = None) -> tuple[float | None, int, str | None]:
    """(median J per call over the counted repeats, how many, their energy source). With `source`, over the
    runs metered by it when there are any (as the resolver counts a configuration: runs of one source)."""
    if source:
        same = [r for r in runs if joined_sources([r.energy_source]) == source]
        runs = same or runs
    counted = counted_rows(list(runs))
    values = [r.energy_j_per_inference for r in counted if r.energy_j_per_inference is not None]
    if not values:
        return None, 0, None
    return statistics.median(values), len(values), joined_sources(r.energy_source for r in counted)


def _saving_noise(ok_by_config: Mapping[str, Sequence[RunRow]], baseline_id: str, applied_id: str,
                  source: str | None, scale: float) -> str | None:
    """'0.41 J +- 4% against 0.40 J +- 3%' when the applied configuration's and the baseline's medians of J per
    call (their counted runs of `source`, the baseline's for as many samples as one applied call: `scale`)
    overlap, so that no saving is measurable; None when the saving is beyond the noise (or either is not
    measured). The intervals are the judge's (`policies.judge.intervals`), over every configuration's runs."""
    values = {cid: [r.energy_j_per_inference for r in counted_rows([r for r in runs if source_key(r.energy_source)
                                                                    == source_key(source)])
                    if r.energy_j_per_inference is not None] for cid, runs in ok_by_config.items()}
    found = intervals(values)
    if baseline_id not in found or applied_id not in found:
        return None
    base, applied = found[baseline_id], found[applied_id]
    low, high = base.low * scale, base.high * scale
    if applied.high < low or high < applied.low:
        return None
    return (f"{energy_text(applied.median)} +- {applied.half_width_rel:.0%} against "
            f"{energy_text(base.median * scale)} +- {base.half_width_rel:.0%}")


def tuning_bill(db: Store, decision: Any) -> dict[str, Any]:
    """The tuning bill of a `policies.resolve.Decision`: the search (every run of its workload on its
    device kind and torch, ok or failed, by the daemon or by `bench`) and its payback against the
    baseline (see the module docstring). A dict, as the decision keeps it in its details."""
    from joulepilot.compiler import CompileConfig

    workload_ids = list(getattr(decision, "workload_ids", None) or [decision.workload_id])
    runs = sorted((run for wid in workload_ids
                   for run in workload_runs(db, wid, decision.device_kind, decision.torch_version)),
                  key=lambda r: -int(r.id or 0))
    search = bill_of(runs)
    by_policy = [r for r in runs if r.extra.get("policy") == decision.policy]
    ok_by_config: dict[str, list[RunRow]] = {}
    for run in runs:
        if run.ok:
            ok_by_config.setdefault(run.config_id, []).append(run)

    applied_batch = int(decision.config.get("batch_size") or 1)
    batch_sizes = getattr(decision, "batch_sizes", None) or [applied_batch]
    batch = int(batch_sizes[0])  # the policy's own batch size
    applied_j = _number((decision.measured or {}).get("energy_j_per_inference"))
    applied_source = (decision.measured or {}).get("energy_source")
    baseline: dict[str, Any] | None = None
    precision = str(decision.config.get("precision") or "fp32")
    # A policy that allows no fp32 measures no fp32 baseline: then eager in the applied configuration's precision.
    baselines = [(mode, "fp32", label) for mode, label in BASELINES]
    if precision != "fp32":
        baselines.append(("eager", precision, f"eager {precision}"))
    for mode, baseline_precision, label in baselines:
        cfg = CompileConfig(mode=mode, precision=baseline_precision, batch_size=batch)
        j, count, source = _counted_median_j(ok_by_config.get(cfg.id, []), applied_source)
        if j is not None:
            baseline = {"kind": label, "config_id": cfg.id, "label": cfg.label, "energy_j_per_inference": j,
                        "runs": count, "source": source, "batch_size": batch}
            if applied_batch != batch:  # as many samples as one call of the applied configuration
                baseline["kind"] = f"{label} at batch {batch}, for {applied_batch} samples"
            break
    out: dict[str, Any] = {
        "search": search.to_dict(run_ids=True),
        "daemon_runs": len(by_policy),
        "baseline": baseline,
        "applied": {"config_id": decision.config_id, "label": decision.label, "energy_j_per_inference": applied_j,
                    "source": applied_source},
        "saving_j_per_inference": None, "saving_source": None, "payback_inferences": None,
        "payback_source": None,
    }
    if baseline is None:
        also = f" nor eager {precision}" if precision != "fp32" else ""
        out["verdict"], out["why"] = UNKNOWN, ("no baseline is measured: neither stock compile default fp32 nor "
                                               f"eager fp32{also} has an ok run on {decision.device_kind}")
    elif applied_j is None:
        out["verdict"], out["why"] = UNKNOWN, f"the applied configuration {decision.label} is not measured"
    elif baseline["source"] != applied_source:
        out["verdict"], out["why"] = UNKNOWN, (f"the baseline was metered by {baseline['source']} and "
                                               f"{decision.label} by {applied_source}: not like for like")
    else:
        scale = applied_batch / batch
        saving = baseline["energy_j_per_inference"] * scale - applied_j
        out["saving_j_per_inference"], out["saving_source"] = saving, applied_source
        noise = _saving_noise(ok_by_config, baseline["config_id"], decision.config_id, applied_source, scale)
        if decision.config_id == baseline["config_id"]:
            out["verdict"], out["why"] = NEVER, f"the decision keeps the baseline, {baseline['kind']}: nothing is saved"
        elif noise is not None:
            out["verdict"], out["why"] = UNKNOWN, (f"no measurable saving: {decision.label} and {baseline['kind']} use "
                                                   f"the same energy per call within the noise of their runs "
                                                   f"({noise})")
            out["no_measurable_saving"] = True
        elif saving <= 0:
            out["verdict"], out["why"] = NEVER, (f"{decision.label} uses {energy_text(-saving)} more per call than "
                                                 f"{baseline['kind']}: nothing is saved")
        else:
            out["verdict"], out["why"] = PAYS_BACK, ""
            out["payback_inferences"] = search.energy_j / saving
            out["payback_source"] = joined_sources([search.source], [applied_source])
    out["text"] = payback_text(out)
    return out


def payback_text(bill: Mapping[str, Any]) -> str:
    """'the search cost 41.2 kJ (...); at 0.47 J saved per call against stock compile default fp32 (nvml) it
    pays back after 87,000 calls', or why it never does, or why that is not known; a baseline measured once
    is said to be ('nvml, a baseline of one run')."""
    head = f"the search cost {bill_text(bill['search'])}"
    baseline = bill.get("baseline") or {}
    once = ", a baseline of one run" if baseline.get("runs") == 1 else ""
    if bill["verdict"] == PAYS_BACK:
        return (f"{head}; at {energy_text(bill['saving_j_per_inference'])} saved per call against "
                f"{baseline['kind']} ({bill['saving_source']}{once}) it pays back after "
                f"{calls_text(bill['payback_inferences'])} calls")
    if bill["verdict"] == NEVER:
        return f"{head}; it never pays back: {bill['why']}"
    if bill.get("no_measurable_saving"):
        return f"{head}; {bill['why']}" + (f" ({baseline['kind']} is a baseline of one run)" if once else "")
    return f"{head}; payback not known: {bill['why']}"


@dataclass
class DeploymentPayback:
    """When a deployment's calls paid back a decision's search (see `deployment_payback`)."""

    verdict: str  # paid_back | not_yet | never | unknown
    payback_inferences: float | None
    calls: int  # calls of the tuned configuration counted
    fraction: float | None  # of the payback reached (capped at 1)
    calls_per_s: float | None  # over the metered windows that count
    paid_back_at: float | None  # epoch seconds
    paid_back_after_s: float | None  # since the first window counted
    remaining_s: float | None  # at the call rate so far, when not yet
    text: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def deployment_payback(payback_inferences: float | None, windows: Sequence[tuple[float, float, int]]
                       ) -> DeploymentPayback:
    """When the calls in `windows` ((t_start, t_end, calls), in time order, of the tuned configuration)
    reached `payback_inferences`: the moment is placed within the window that crossed it, in proportion
    to its calls. None: the search never pays back."""
    crossing, done = None, 0
    if payback_inferences is not None:
        for start, end, n in windows:
            if n and done + n >= payback_inferences:
                crossing = (start, end, n, done)
                break
            done += n
    return payback_progress(payback_inferences, calls=sum(n for _, _, n in windows),
                            metered_s=sum(max(0.0, end - start) for start, end, _ in windows),
                            first_t_start=windows[0][0] if windows else None, crossing=crossing)


def payback_progress(payback_inferences: float | None, *, calls: int, metered_s: float,
                     first_t_start: float | None, crossing: tuple[float, float, int, int] | None
                     ) -> DeploymentPayback:
    """`deployment_payback` from the windows' sums, as a store aggregate gives them: the calls, the metered
    seconds (each window at least 0), the first window's start, and the window whose calls reached
    `payback_inferences` as (t_start, t_end, its calls, the calls before it), None when none did."""
    rate = calls / metered_s if metered_s > 0 and calls else None
    if payback_inferences is None:
        return DeploymentPayback(NEVER, None, calls, None, rate, None, None, None, "never pays back")
    if crossing is not None and first_t_start is not None:
        start, end, n, done = crossing
        at = start + (end - start) * (payback_inferences - done) / n
        after = at - first_t_start
        return DeploymentPayback("paid_back", payback_inferences, calls, 1.0, rate, at, after, None,
                                 f"was paid back after {duration_text(after)} "
                                 f"({calls_text(payback_inferences)} calls)")
    fraction = calls / payback_inferences if payback_inferences > 0 else 1.0
    remaining = (payback_inferences - calls) / rate if rate else None
    text = f"is not paid back yet: {fraction_text(fraction)} after {calls:,} calls"
    if remaining is not None:
        text += f"; at {rate:,.3g} calls/s, about {duration_text(remaining)} more"
    return DeploymentPayback("not_yet", payback_inferences, calls, fraction, rate, None, None, remaining, text)
