"""`joulepilot fit`, `joulepilot frontier` and `joulepilot policy check|explain|lock`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from joulepilot.controller import TradeoffError, cross_validate, fit, frontier, plot_frontier
from joulepilot.policies import PolicyError, break_even_text, checked_policy, find_policy
from joulepilot.policies.load import policy_file_names
from joulepilot.store import compile_energy_text, open_db, open_for_reading
from joulepilot.store.safeio import shorten

from .clikit import SIZE, db_option, echo_json, echo_table, reading_store, table_width, text_value

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
device_name_option = click.option(
    "--device-name", callback=text_value, help="Device kind: a GPU name as NVML reports it (e.g. 'NVIDIA H200') or 'cpu' "
                          "(default: this host's cuda:0 if present, else cpu).")


def _torch_version(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """torch major.minor of --torch-version, checked before anything is decided or stored."""
    if value is None:
        return None
    from joulepilot.policies.resolve import given_torch_minor

    try:
        return given_torch_minor(value)
    except ValueError as exc:
        raise click.ClickException(f"--torch-version {shorten(repr(value), 80)}: {exc}") from None


torch_option = click.option("--torch-version", metavar="VERSION", callback=_torch_version,
                            help="torch version to decide for, as major.minor (2.11) or in full (2.11.0+cu130); "
                                 "default: the installed one.")


def _device_kind(device_name: str | None) -> str:
    if device_name:
        return device_name
    from joulepilot.runtime import current_device_kind

    return current_device_kind()


def _fitted_workloads(model: Any) -> list[str]:
    """The workloads either task's model learnt from."""
    return sorted({*model.workloads, *(model.generation.workloads if model.generation else ())})


@click.command("fit")
@db_option
@json_option
def fit_command(db: str | None, as_json: bool) -> None:
    """Fit the trade-off model and print its cross-validated error per target (whole workloads held out)."""
    with reading_store(db) as database:
        try:
            model = fit(database)
        except TradeoffError as exc:
            raise click.ClickException(str(exc)) from exc
        try:
            scores = cross_validate(database)
        except TradeoffError as exc:
            click.echo(f"fitted on {model.runs} ok runs of {', '.join(_fitted_workloads(model))}", err=True)
            raise click.ClickException(str(exc)) from exc
    if as_json:
        echo_json({"model": model.summary(), "cross_validation": scores})
        return
    rows = [{"target": t, "mape_pct": 100 * m["mape"], "median_ape_pct": 100 * m["median_ape"],
             "r2_log": m["r2_log"], "rows": m["n"], "workloads": m["workloads"], "folds": m["folds"]}
            for t, m in scores.items()]
    click.echo(f"fitted on {model.runs} ok runs, {len(_fitted_workloads(model))} workloads, "
               f"devices: {', '.join(model.devices)}")
    click.echo("cross-validation, whole workloads held out (GroupKFold by workload spec):")
    echo_table(rows, ["target", "mape_pct", "median_ape_pct", "r2_log", "rows", "workloads", "folds"],
               ["target", "MAPE %", "median APE %", "R² (log)", "rows", "workloads", "folds"],
               drop_first=("folds", "workloads", "median_ape_pct"))


# The plot formats `frontier --plot` writes, by file extension (each is tested): matplotlib lists more, some of
# which need programs a host may lack (pgf needs LaTeX).
PLOT_FORMATS = ("png", "svg", "pdf")


def _plot_path(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """--plot's file, refused before any work when its extension is no format the plot is written in, or its
    folder does not exist."""
    if value is None:
        return None
    path = Path(value).expanduser()
    extension = path.suffix.lower().lstrip(".")
    if extension not in PLOT_FORMATS:
        found = f"'.{shorten(extension, 40)}'" if extension else "no extension"
        raise click.ClickException(f"--plot {shorten(value, 200)}: expected a file name ending in "
                                   f"{', '.join('.' + f for f in PLOT_FORMATS)} (the extension picks the format), "
                                   f"found {found}")
    if not path.parent.is_dir():
        raise click.ClickException(f"--plot {shorten(value, 200)}: the folder {shorten(str(path.parent), 200)} "
                                   f"does not exist; create it or write the plot elsewhere")
    return value


@click.command("frontier")
@click.argument("workload", callback=text_value)
@db_option
@click.option("--device-name", callback=text_value, help="Device kind (a GPU name or 'cpu'); default: the one with most runs.")
@click.option("--batch-size", type=SIZE, help="Batch size; default: the one with most runs.")
@click.option("--policy", "policy_file", metavar="POLICY", callback=text_value,
              help="Predict the search space of POLICY, a file or a name (see `joulepilot policy --help`); "
                   "default: combinations of the knobs measured.")
@click.option("--no-predict", is_flag=True, help="Measured points only.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), callback=_plot_path,
              help=f"Write a plot here; its extension picks the format: {', '.join(PLOT_FORMATS)}.")
@json_option
def frontier_command(workload: str, db: str | None, device_name: str | None, batch_size: int | None,
                     policy_file: str | None, no_predict: bool, plot_path: str | None, as_json: bool) -> None:
    """The latency/energy Pareto frontier of WORKLOAD: measured points, and predicted unmeasured ones."""
    search = _load(policy_file).search if policy_file else None
    try:
        with reading_store(db) as database:
            result = frontier(database, workload, device_name=device_name, batch_size=batch_size, search=search,
                              predict=not no_predict)
    except TradeoffError as exc:
        raise click.ClickException(str(exc)) from exc
    if plot_path:
        result["plot"] = str(plot_frontier(result, plot_path))
    if as_json:
        echo_json(result)
        return
    generates = result.get("task") == "generate"
    click.echo(f"{result['workload']} batch {result['batch_size']} on {result['device_kind']}"
               + (" (a generation: time per output token against J per generated token)" if generates else "")
               + "  (* = on the Pareto frontier)")
    rows = [p | {"front": "*" if p["pareto"] else "", "pm": _plus_minus(p, result.get("axes", {}).get("y")),
                 "source_text": _source_text(p["source"], p.get("energy_source"))} for p in result["points"]]
    if generates:
        echo_table(rows, ["front", "label", "source_text", "tpot_ms_p50", "energy_j_per_token", "pm", "ttft_ms_p50",
                          "tpot_ms_p95", "repeats", "avg_power_w"],
                   ["", "config", "source", "TPOT ms", "J/token", "± J", "TTFT ms", "TPOT p95 ms", "runs", "avg W"],
                   drop_first=("avg_power_w", "repeats", "tpot_ms_p95", "ttft_ms_p50"))
    else:
        echo_table(rows, ["front", "label", "source_text", "latency_ms_p95", "energy_j_per_inference", "pm", "repeats",
                          "avg_power_w"],
                   ["", "config", "source", "p95 ms", "J/call", "± J", "runs", "avg W"],
                   drop_first=("avg_power_w", "repeats"))
    _echo_estimate_line(p.get("energy_source") for p in result["points"])
    for note in result["notes"]:
        click.echo(note, err=True)
    if plot_path:
        click.echo(f"plot written to {plot_path}")


POLICY_ARGUMENT_HELP = (
    "POLICY is a policy file or a policy's name. An argument that ends in .toml or holds a / is a file path; any "
    "other is the file of that name when one exists here, else a name, looked up as <name>.toml in "
    "$JOULEPILOT_POLICIES, then $JOULEPILOT_HOME/policies, then the current directory (the first found wins).")


@click.group("policy", help=f"Validate policy files, explain and lock their decisions.\n\n{POLICY_ARGUMENT_HELP}")
def policy_group() -> None:
    pass


def _found(name_or_path: str) -> str:
    """The policy file POLICY names (find_policy's rule, as the hook finds it); PolicyError when none. Something
    there by that name that is no folder is taken as given: reading it says what is wrong with it (a FIFO)."""
    given = Path(name_or_path).expanduser()
    if os.path.exists(given) and not os.path.isdir(given):  # os.path: a name too long for a file is not there
        return str(given)
    return str(find_policy(name_or_path))


def _load(name_or_path: str) -> Any:
    """The policy POLICY names, validated as `policy check` validates it (its workload too, without running any of
    its code); ClickException with every problem. A workload library missing here is no problem: these commands
    decide from stored runs, often for another host (--device-name)."""
    try:
        policy, _library_missing = checked_policy(_found(name_or_path))
    except PolicyError as exc:
        raise click.ClickException(str(exc)) from exc
    return policy


def _policy_files(given: tuple[str, ...]) -> list[str]:
    """`policy check`'s arguments, a folder given as a path (it holds a /) standing for its *.toml files, as the
    daemon reads a policy folder: each is then checked as a file (a FIFO or a link that loops is its own error)."""
    files: list[str] = []
    for item in given:
        folder = Path(item).expanduser()
        if ("/" in item or item in (".", "..")) and folder.is_dir():
            names = policy_file_names(folder)
            files.extend([str(folder / name) for name in names] or [item])  # none: the folder's own error
        else:
            files.append(item)
    return files


@policy_group.command("check", help=f"""Validate each POLICY and check that its workload resolves (without
building it or running its code); exits 1 if any is invalid. A workload library not installed here is a
warning. A folder given as a path (policies/, ./) checks every *.toml file in it, as the daemon reads it.

{POLICY_ARGUMENT_HELP}""")
@click.argument("policies", metavar="POLICY...", nargs=-1, required=True, callback=text_value)
@json_option
def check_command(policies: tuple[str, ...], as_json: bool) -> None:
    from joulepilot.policies.schema import setting_warnings

    results = []
    for given in _policy_files(policies):
        file = shorten(given, 200)  # until found: an argument may be a name of any length
        try:
            file = _found(given)
            policy, warning = checked_policy(file)
        except PolicyError as exc:
            results.append({"file": file, "ok": False, "problems": [p.to_dict() for p in exc.problems],
                            "warnings": []})
            continue
        warnings = [warning] if warning is not None else []
        warnings += setting_warnings(policy, file)
        results.append({"file": file, "ok": True, "policy": policy.name, "hash": policy.hash, "problems": [],
                        "warnings": [w.to_dict() for w in warnings]})
    if as_json:
        echo_json(results)
    else:
        for r in results:
            if r["ok"]:
                click.echo(f"{r['file']}: ok (policy {r['policy']}, hash {r['hash']})")
            else:
                click.echo(f"{r['file']}: {len(r['problems'])} problem(s)")
            for p in r["problems"]:
                hint = f" ({p['hint']})" if p["hint"] else ""
                click.echo(f"  {p['key']}: expected {p['expected']}, found {p['found']}{hint}")
            for p in r["warnings"]:
                hint = f" ({p['hint']})" if p["hint"] else ""
                after = "; the daemon will skip this policy on a host without it" if p["key"] == "workload" else ""
                click.echo(f"  warning: {p['key']}: {p['found']}{hint}{after}")
    if not all(r["ok"] for r in results):
        raise SystemExit(1)


def _provenance_key(device_kind: str, torch_version: str) -> str | None:
    """This host's provenance key when deciding for its own device kind and installed torch, else None
    (a decision for another host's device or torch cannot say what software it will run under)."""
    from joulepilot.controller.device_probe import probe_device
    from joulepilot.policies import torch_minor
    from joulepilot.runtime import current_device_kind

    if torch_version != torch_minor():
        return None
    here = current_device_kind()
    if device_kind != here:
        return None
    try:
        return probe_device("cpu" if here == "cpu" else "cuda:0").provenance_key
    except Exception:  # no NVML, an odd driver: the decision is simply recorded without one
        return None


def _decide(policy: Any, db: str | None, device_name: str | None, torch_version: str | None, *, record: bool,
            lock: bool, decided_by: str) -> tuple[Any, dict[str, Any] | None]:
    from joulepilot.controller.redecide import decide_now, fit_or_none
    from joulepilot.policies import default_lock_dir, torch_minor

    # The database must exist (a typo must not decide on nothing); only a command that stores the
    # decision opens it for writing.
    database = open_db(db, must_exist=True) if record else open_for_reading(db)
    try:
        kind = _device_kind(device_name)
        version = torch_minor(torch_version) if torch_version else torch_minor()
        decided, plan = decide_now(database, policy, kind, fit_or_none(database), decided_by=decided_by,
                                   reason=f"`joulepilot {decided_by}`", torch_version=version,
                                   provenance_key=_provenance_key(kind, version) if record else None,
                                   lock_dir=default_lock_dir(), record=record, lock=lock)
        return decided, plan.summary() if plan is not None else None
    finally:
        database.close()


def _source_text(source: str, energy_source: str | None) -> str:
    """'measured (nvml)', 'measured (estimate)' or 'predicted': measured or predicted, and what metered it."""
    return f"{source} ({energy_source})" if source == "measured" and energy_source else source


def _echo_estimate_line(energy_sources: Any) -> None:
    """Under a table with rows marked estimate: what an estimate is (it is no measurement)."""
    from joulepilot.controller.report_format import ESTIMATE_ROWS

    if any("estimate" in (source or "") for source in energy_sources):
        import textwrap

        click.echo(textwrap.fill(ESTIMATE_ROWS, table_width()))


def _plus_minus(point: dict[str, Any], energy: str | None = None) -> float | None:
    """± of a frontier point's J/call (J/token): the median's interval (measured), one std (predicted)."""
    if point.get("median") is not None:
        return max(point["ci_high"] - point["median"], point["median"] - point["ci_low"])
    return point.get(f"{energy or 'energy_j_per_inference'}_std")


def _spread_text(cand: Any) -> str | None:
    """'±4% (3)': the median objective's interval in percent and how many runs it rests on."""
    if cand.source != "measured" or cand.spread_pct is None:
        return None
    return f"±{cand.spread_pct:.0f}% ({cand.repeats})"


def _elsewhere_hint(decision: Any) -> str | None:
    """What to pass to decide for a device kind / torch pair that has runs, when this one has none."""
    if not decision.measured_elsewhere:
        return None
    pairs = "; ".join(f"{p['device_kind']} / torch {p['torch_version']} ({p['runs']} ok runs): "
                      f"--device-name \"{p['device_kind']}\" --torch-version {p['torch_version']}"
                      for p in decision.measured_elsewhere)
    return (f"nothing is measured on {decision.device_kind} with torch {decision.torch_version}; runs of "
            f"{decision.workload} exist for {pairs}")


CANDIDATE_COLUMNS = ["status", "label", "source", "score", "spread", "amortised_energy_j", "latency_ms_p95", "avg_power_w",
                     "compile_s", "max_rel_error", "break_even", "why"]


# A generation policy's table shows J per generated token, time per output token (p50, p95) and to the first
# token, and whether the greedy tokens matched eager's in the configuration's own precision.
GENERATION_COLUMNS = ["status", "label", "source", "score", "spread", "amortised_energy_j", "tpot_ms_p50",
                      "tpot_ms_p95", "ttft_ms_p50", "avg_power_w", "compile_s", "max_rel_error", "tokens_match",
                      "break_even", "why"]


def _candidate_rows(decision: Any) -> list[dict[str, Any]]:
    rows = []
    for c in decision.candidates:
        fig = c.figures if c.source == "measured" else {k: v[0] for k, v in c.predicted.items()}
        match = fig.get("tokens_match") if c.source == "measured" else None
        rows.append({"status": c.status, "label": c.label, "score": c.score,
                     "source": _source_text(c.source, c.figures.get("energy_source")),
                     "spread": _spread_text(c),
                     "amortised_energy_j": c.amortised_energy_j, "latency_ms_p95": fig.get("latency_ms_p95"),
                     "tpot_ms_p50": fig.get("tpot_ms_p50"), "tpot_ms_p95": fig.get("tpot_ms_p95"),
                     "ttft_ms_p50": fig.get("ttft_ms_p50"),
                     "tokens_match": None if match is None else "yes" if match else "no",
                     "avg_power_w": fig.get("avg_power_w"), "compile_s": fig.get("compile_s"),
                     "max_rel_error": fig.get("max_rel_error"),
                     "break_even": "never" if c.break_even_never else c.break_even_inferences,
                     "why": "; ".join([*c.reasons, *c.notes]) if c.reasons else
                     "; ".join(["within every limit", *c.notes])})
    return rows


def _echo_decision(decision: Any) -> None:
    generates = decision.generates
    count, unit = (decision.expected_tokens, "tokens") if generates else (decision.expected_inferences, "inferences")
    meaning = {"energy": "J per generated token", "latency": "TPOT p50, ms per output token",
               "edp": "J per generated token x TPOT p50"}[decision.objective] if generates else ""
    click.echo(f"policy     {decision.policy} ({decision.workload}, "
               + (f"generation, objective {decision.objective} ({meaning}), " if generates else
                  f"objective {decision.objective}, ") + f"{count:,} expected {unit})")
    click.echo(f"device     {decision.device_kind}, torch {decision.torch_version}")
    click.echo(f"decision   {decision.label}  [{decision.state}]")
    if len(decision.batch_sizes) > 1:  # the batch-size lever: which batch size was chosen, and how they compared
        searched = ", ".join(map(str, sorted(decision.batch_sizes)))
        click.echo(f"batch      {decision.config.get('batch_size')} (the policy's batch_size is "
                   f"{decision.batch_sizes[0]}; searched {searched}, compared in {decision.objective_unit})")
    click.echo(f"reason     {decision.reason}")
    if decision.confidence:
        click.echo(f"confidence {decision.confidence}")
    if decision.proposed:
        click.echo(f"proposed   {decision.proposed['label']} (prediction only: benchmark it to verify)")
    flagged = [c.label for c in decision.candidates if c.flagged]
    if flagged:
        click.echo(f"flagged    {', '.join(flagged)}: bench flagged their runs \"repeat this run\"; they cannot "
                   f"make a decision verified" + (" (the daemon repeats them)" if decision.repeat else ""))
    if decision.excluded_violated:
        labels = [c.label for c in decision.candidates if c.config_id in set(decision.excluded_violated)]
        click.echo(f"excluded   {', '.join(labels) or ', '.join(decision.excluded_violated)}: broke the power "
                   f"envelope in a deployment")
    break_even = break_even_text(decision.break_even_inferences, decision.break_even_never,
                                 decision.config.get("mode") != "eager", unit)
    if break_even is not None:
        click.echo(f"break-even vs eager fp32: {break_even}")
    applied = next((c for c in decision.candidates if c.config_id == decision.config_id and c.source == "measured"),
                   None)
    compile_text = compile_energy_text(applied.figures) if applied is not None and decision.config.get(
        "mode") != "eager" else None
    if compile_text:
        click.echo(f"compile    {compile_text}, amortised over {count:,} {unit}")
    if decision.bill:
        import textwrap

        click.echo(textwrap.fill(decision.bill["text"], table_width(), initial_indent=f"{'tuning':<11}",
                                 subsequent_indent=" " * 11))
    click.echo("")
    if generates:
        echo_table(_candidate_rows(decision), GENERATION_COLUMNS,
                   ["status", "config", "source", "median", "± (runs)", "J/token amortised", "TPOT ms", "TPOT p95 ms",
                    "TTFT ms", "avg W", "compile s", "rel err", "tokens match", "break-even", "why"],
                   drop_first=("max_rel_error", "compile_s", "avg_power_w", "ttft_ms_p50", "tpot_ms_p95",
                               "amortised_energy_j", "break_even", "tokens_match", "spread"), below=("label", "why"))
    else:
        echo_table(_candidate_rows(decision), CANDIDATE_COLUMNS,
                   ["status", "config", "source", "median", "± (runs)", "J/call amortised", "p95 ms", "avg W",
                    "compile s", "rel err", "break-even", "why"],
                   drop_first=("max_rel_error", "compile_s", "avg_power_w", "amortised_energy_j", "latency_ms_p95",
                               "break_even", "spread"), below=("label", "why"))
    _echo_estimate_line(c.figures.get("energy_source") for c in decision.candidates if c.source == "measured")


def _graph_break_notes(policy: Any, db: str | None, decision: Any) -> list[dict[str, Any]]:
    """The graph breaks stored with the runs of the measured candidates, one note per distinct set."""
    from joulepilot.compiler.graph_breaks import doctor_command, graph_break_notes
    from joulepilot.store import workload_runs

    wanted = {c.run_id for c in decision.candidates if c.source == "measured" and c.run_id is not None}
    if not wanted:
        return []
    with reading_store(db) as database:
        runs = [r for wid in decision.workload_ids or [decision.workload_id]
                for r in workload_runs(database, wid) if r.id in wanted]
    # the doctor analyses a forward pass: a generation's breaks are named without a command to run
    command = None if policy.generates else doctor_command(
        decision.workload, decision.config.get("batch_size") or policy.batch_size, policy.seq_len, policy.image_size)
    return graph_break_notes(runs, command)


def _echo_graph_breaks(notes: list[dict[str, Any]]) -> None:
    import textwrap

    from joulepilot.compiler.graph_breaks import note_line

    if notes:
        click.echo("")
    for note in notes:
        click.echo(textwrap.fill(note_line(note), table_width(), initial_indent=f"{'breaks':<11}",
                                 subsequent_indent=" " * 11))


def _echo_search(search: dict[str, Any] | None) -> None:
    """Where the guided search stands: what it measures next or why it stopped, and each skipped candidate."""
    import textwrap

    if search is None:
        return
    width = table_width()

    def line(head: str, text: str) -> None:
        click.echo(textwrap.fill(text, width, initial_indent=f"{head:<11}", subsequent_indent=" " * 11))

    click.echo("")
    runs = sum(m["runs"] for m in search["measured"])
    line("search", f"guided: {len(search['measured'])} configurations measured ({runs} runs; "
                   f"{search['measurements']} by the daemon, {search['spent_s']:g} s)")
    for step in search["next"]:
        line("next", f"{step['label']} ({step['kind']}): {step['why']}")
    if search["stop_reason"]:
        line("stopped", search["stop_reason"])
    for skipped in search["skipped"]:
        line("skipped", f"{skipped['label']}: {skipped['reason']}")


@policy_group.command("explain", help=f"""Resolve POLICY now and show the decision and every candidate with why
it was kept or rejected.

Decides as the daemon does: configurations that broke the envelope in a deployment are left out.

{POLICY_ARGUMENT_HELP}""")
@click.argument("name_or_path", metavar="POLICY", callback=text_value)
@db_option
@device_name_option
@torch_option
@click.option("--record", is_flag=True, help="Also store the decision (the hook then uses it).")
@json_option
def explain_command(name_or_path: str, db: str | None, device_name: str | None, torch_version: str | None,
                    record: bool, as_json: bool) -> None:
    policy = _load(name_or_path)
    decided, search = _decide(policy, db, device_name, torch_version, record=record, lock=False,
                              decided_by="policy explain --record")
    decision = decided.decision
    hint = _elsewhere_hint(decision)
    breaks = _graph_break_notes(policy, db, decision)
    if as_json:
        echo_json(decision.to_dict() | {"search": search, "graph_breaks": breaks})
    else:
        _echo_decision(decision)
        _echo_graph_breaks(breaks)
        _echo_search(search)
    if hint:
        click.echo(f"note: {hint}", err=True)


@policy_group.command("lock", help=f"""Decide POLICY as the daemon does, store the decision and write
<stem>.lock.json beside the policy file (or, when that folder is read-only, <name>.lock.json in the lock
directory).

{POLICY_ARGUMENT_HELP}""")
@click.argument("name_or_path", metavar="POLICY", callback=text_value)
@db_option
@device_name_option
@torch_option
@json_option
def lock_command(name_or_path: str, db: str | None, device_name: str | None, torch_version: str | None,
                 as_json: bool) -> None:
    decided, _search = _decide(_load(name_or_path), db, device_name, torch_version, record=True, lock=True,
                               decided_by="policy lock")
    decision = decided.decision
    if decided.lock_error:
        raise click.ClickException(f"decision {decision.id} is stored, but {decided.lock_error}")
    hint = _elsewhere_hint(decision)
    if as_json:
        echo_json({"lock_file": str(decided.lock_file), "device_kind": decision.device_kind,
                   "torch_version": decision.torch_version, "config": decision.config, "state": decision.state,
                   "reason": decision.reason, "decision_id": decision.id,
                   "excluded_violated": decision.excluded_violated})
    else:
        click.echo(f"{decided.lock_file}: {decision.device_kind} / torch {decision.torch_version} -> "
                   f"{decision.label} [{decision.state}]")
        click.echo(f"reason: {decision.reason}")
    if hint:
        click.echo(f"note: {hint}", err=True)


commands = [fit_command, frontier_command, policy_group]
