"""`joulepilot doctor`: why torch.compile does not pay for a model (graph breaks, graphs, recompiles)."""

from __future__ import annotations

import os
from typing import Any

import click

from .clikit import SIZE, FiniteFloat, echo_json, echo_table, progress, sigterm_as_exit, text_value


def _place(file: str | None, line: int | None) -> str:
    """A path as a person reads it: relative to the current folder when under it."""
    if not file:
        return "unknown place"
    try:
        shown = os.path.relpath(file)
        if shown.startswith(".."):
            shown = file
    except ValueError:
        shown = file
    return f"{shown}:{line}" if line is not None else shown


def _lines(graph: dict[str, Any]) -> str | None:
    """'model.py:11-14', the code a graph was traced from."""
    if not graph.get("file"):
        return None
    first, last = graph.get("first_line"), graph.get("last_line")
    span = str(first) if first == last else f"{first}-{last}"
    return f"{os.path.basename(graph['file'])}:{span}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _echo_report(found: dict[str, Any]) -> None:
    breaks, graphs, recompiles = found["graph_breaks"], found["graphs"], found["recompiles"]
    click.echo(f"doctor     {found['spec']}, batch {found['batch_size']} on {found['device']} "
               f"(torch {found.get('torch_version')}, backend {found.get('backend')})")
    sizes = ", ".join(str(g["ops"]) for g in graphs)
    click.echo(f"graphs     {found['graph_count']}" + (f" ({sizes} ops)" if graphs else " (nothing was compiled)"))
    click.echo(f"breaks     {len(breaks)}")
    click.echo(f"recompiles {found['recompile_count']}")
    forward = found.get("forward_ms")
    click.echo(f"eager time {_percent(found.get('eager_time_fraction'))} of forward time outside compiled graphs"
               + (f" ({forward:.3g} ms a call over {found['profiled_calls']} profiled calls)" if forward else ""))
    if breaks:
        click.echo("")
        click.echo("graph breaks:")
        for number, item in enumerate(breaks, 1):
            where = _place(item["file"], item["line"])
            function = f" in {item['function']}" if item.get("function") else ""
            click.echo(f"  {number}. {where}{function}")
            if item.get("source"):
                click.echo(f"       {item['source']}")
            click.echo(f"     why: {item['reason']}")
            if item.get("hint"):
                click.echo(f"     fix: {item['hint']}")
    if graphs:
        click.echo("")
        rows = [{"graph": g["index"], "function": g.get("function"), "lines": _lines(g),
                 "ops": g["ops"], "calls": g["calls"],
                 "ms_per_call": g["time_ms"] / g["calls"] if g["calls"] else None} for g in graphs]
        echo_table(rows, ["graph", "function", "lines", "ops", "calls", "ms_per_call"],
                   ["graph", "function", "lines", "ops", "profiled calls", "ms a call"], drop_first=("lines", "ops"))
    if recompiles:
        click.echo("")
        click.echo(f"recompiles ({found['recompile_count']}):")
        for item in recompiles:
            function = f" {item['function']}" if item.get("function") else ""
            click.echo(f"  {_place(item['file'], item['line'])}{function}: guard failed: {item['guard']}")
        hints = list(dict.fromkeys(item["hint"] for item in recompiles if item.get("hint")))
        for hint in hints:
            click.echo(f"     fix: {hint}")
    for item in found.get("recompile_limit_hit") or []:
        click.echo(f"  {_place(item['file'], item['line'])}: {item['reason']}: Dynamo runs "
                   f"{item.get('function') or 'this function'} eagerly from then on")
    if not breaks and not recompiles:
        click.echo("")
        click.echo("no graph breaks and no recompiles: Dynamo captures this model whole")




@click.command("doctor")
@click.argument("spec")
@click.option("--batch-size", type=SIZE, default=1, show_default=True,
              help="Samples per forward call.")
@click.option("--seq-len", type=SIZE, help="Sequence length for token workloads.")
@click.option("--image-size", type=SIZE, help="Image side for vision workloads.")
@click.option("--device", callback=text_value, help="cuda:N or cpu (default: cuda:0 when available, else cpu).")
@click.option("--backend", type=click.Choice(["inductor", "eager"]), default="inductor", show_default=True,
              help="What compiles Dynamo's graphs. 'eager' finds the same graph breaks without Inductor's compile "
                   "time, but then graph time is uncompiled.")
@click.option("--budget-s", type=FiniteFloat(min=1), default=600, show_default=True,
              help="Budget of the calls that compile (the first, and any that recompile); an overrun stops the "
                   "analysis.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (progress stays on stderr).")
def doctor_command(spec: str, batch_size: int, seq_len: int | None, image_size: int | None, device: str | None,
                   backend: str, budget_s: float, as_json: bool) -> None:
    """Show why torch.compile does not pay for SPEC: each graph break with its place in the code, its reason
    and a fix; the graphs and their sizes; recompiles with the guard that failed; and the share of forward
    time spent outside compiled graphs.

    SPEC is a workload as `bench` takes it (mlp, torchvision:<name>, path/to/model.py:factory, ...). The
    model runs in a worker process of its own.
    """
    from joulepilot.compiler import ConfigError, WorkloadError
    from joulepilot.compiler.doctor import DoctorError, check_doctor_args, doctor
    from joulepilot.compiler.runner import phase_text

    try:
        device = check_doctor_args(spec, device, backend)
        with sigterm_as_exit(), progress(1, "doctor", noun="model") as report:
            report.start(1, spec, "starting the worker")
            found = doctor(spec, batch_size=batch_size, seq_len=seq_len, image_size=image_size, device=device,
                           backend=backend, budget_s=budget_s,
                           on_phase=lambda kind, phase: report.phase(phase_text(kind, phase)))
            report.finish(f"{len(found['graph_breaks'])} graph break(s), {found['graph_count']} graph(s), "
                          f"{found['recompile_count']} recompile(s)")
    except (ConfigError, WorkloadError, DoctorError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        echo_json(found)
    else:
        _echo_report(found)


commands = [doctor_command]
