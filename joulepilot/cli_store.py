"""`joulepilot runs`: list stored runs, and export or import them between databases."""

from __future__ import annotations

import sys

import click

from joulepilot.store import (
    export_runs,
    export_text,
    import_runs,
    list_runs,
    open_db,
    parse_export,
    read_export,
    transaction,
)
from joulepilot.store.exchange import write_export
from joulepilot.store.timevalues import local_minute

from .clikit import (
    DB_META_KEY,
    FilePath,
    db_option,
    echo_json,
    echo_table,
    reading_store,
    since_option,
    text_value,
)

RUN_COLUMNS = ("id", "date", "workload", "config_label", "status", "latency_ms_p50", "energy_j_per_inference",
               "avg_power_w", "energy_source")
RUN_HEADERS = ("id", "started", "workload", "config_label", "status", "latency_ms_p50", "energy_j_per_inference",
               "avg_power_w", "energy_source")
workload_option = click.option("--workload", callback=text_value, help="Only runs of this workload spec (e.g. torchvision:resnet50).")


@click.group("runs", invoke_without_command=True)
@db_option
@workload_option
@click.option("--status", type=click.Choice(["ok", "failed"]), help="Only runs with this status.")
@since_option("runs started")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True, help="Newest N runs (0 for all).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def runs_command(ctx: click.Context, db: str | None, workload: str | None, status: str | None, since: float | None,
                 limit: int, as_json: bool) -> None:
    """List stored benchmark runs, newest first; `runs export` and `runs import` move them between hosts.

    \b
    joulepilot runs --workload mlp --since 7d
    joulepilot runs export h200-runs.json --since 30d     # on one host
    joulepilot runs import h200-runs.json                 # on another of the same GPU kind
    """
    if ctx.invoked_subcommand is not None:
        return
    with reading_store(db) as database:
        rows = list_runs(database, workload=workload, status=status, since=since, limit=limit or None)
    if as_json:
        echo_json(rows)
    else:
        echo_table([dict(r, date=local_minute(r.get("started_at"))) for r in rows], RUN_COLUMNS, RUN_HEADERS,
                   drop_first=("avg_power_w", "latency_ms_p50", "date"))


def _group_db(ctx: click.Context, db: str | None) -> str | None:
    """--db given to the subcommand, else to `runs` itself (`joulepilot runs --db X export F`)."""
    parent = ctx.parent.params.get("db") if ctx.parent is not None else None
    chosen = db or parent
    if chosen:
        ctx.meta[DB_META_KEY] = chosen
    return chosen


@runs_command.command("export")
@click.argument("file", type=FilePath("export file", "give the path of the JSON file to write (or - for stdout)",
                                      allow_dash=True))
@db_option
@workload_option
@since_option("runs started")
@click.pass_context
def export_command(ctx: click.Context, file: str, db: str | None, workload: str | None, since: float | None) -> None:
    """Write runs with their workload, configuration and host rows to FILE (JSON; '-' for stdout).

    Another database imports the file with `joulepilot runs import FILE`; hosts with the same GPU kind
    then decide from each other's measurements.
    """
    with reading_store(_group_db(ctx, db)) as database:
        records = export_runs(database, workload=workload, since=since)
    if file == "-":
        click.echo(export_text(records), nl=False)
    else:
        write_export(file, records)
    hosts = {r["host"]["id"] for r in records}
    workloads = {r["workload"]["spec"] for r in records}
    click.echo(f"exported {len(records)} run(s) of {len(workloads)} workload(s) from {len(hosts)} host(s)"
               + ("" if file == "-" else f" to {file}"), err=True)


@runs_command.command("import")
@click.argument("files", nargs=-1, required=True,
                type=FilePath("export file", "give a JSON file that `joulepilot runs export` wrote (or - for stdin)",
                              exists=True, allow_dash=True))
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print what was imported as JSON.")
@click.pass_context
def import_command(ctx: click.Context, files: tuple[str, ...], db: str | None, as_json: bool) -> None:
    """Add the runs in export FILES to the database (created if needed); runs already there are skipped.

    Every file is checked before anything is written, and all of them are imported in one transaction.
    """
    # The configuration vocabulary checks each record's config row (the store sits below the compiler).
    from joulepilot.compiler.config import CompileConfig

    parsed = [("<stdin>", parse_export(sys.stdin.read(), "<stdin>")) if file == "-" else (file, read_export(file))
              for file in files]
    database = open_db(_group_db(ctx, db))
    try:
        results = []
        with transaction(database):
            for name, records in parsed:
                new_ids = import_runs(database, records, source=name, check_config=CompileConfig.from_row)
                results.append({"file": name, "runs": len(records), "imported": len(new_ids),
                                "skipped": len(records) - len(new_ids), "run_ids": new_ids})
    finally:
        database.close()
    if as_json:
        echo_json(results)
        return
    for r in results:
        click.echo(f"{r['file']}: {r['imported']} run(s) imported, {r['skipped']} already present")


commands = [runs_command]
