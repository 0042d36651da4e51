"""`joulepilot runs`: list stored runs."""

from __future__ import annotations

import click

from joulepilot.store import list_runs, open_db

from .clikit import db_option, echo_json, echo_table

RUN_COLUMNS = ("id", "workload", "config_label", "status", "latency_ms_p50", "energy_j_per_inference",
               "avg_power_w", "energy_source")


@click.command("runs")
@db_option
@click.option("--workload", help="Only runs of this workload spec.")
@click.option("--status", type=click.Choice(["ok", "failed"]), help="Only runs with this status.")
@click.option("--limit", type=int, default=50, show_default=True, help="Newest N runs (0 for all).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def runs_command(db: str | None, workload: str | None, status: str | None, limit: int, as_json: bool) -> None:
    """List stored benchmark runs, newest first."""
    rows = list_runs(open_db(db), workload=workload, status=status, limit=limit or None)
    if as_json:
        echo_json(rows)
    else:
        echo_table(rows, RUN_COLUMNS)


commands = [runs_command]
