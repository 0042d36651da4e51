"""`joulepilot report`: the energy report of one deployment, or a summary of all of them."""

from __future__ import annotations

from pathlib import Path

import click

from joulepilot.controller.report import (
    DEFAULT_WINDOWS,
    FORMATS,
    GRID_ENV,
    build_report,
    build_summary,
    render,
)
from joulepilot.store import default_db_path
from joulepilot.store.files import write_file_atomic

from .clikit import db_option, os_error_message, reading_store, since_option, text_value

SUFFIX_FORMATS = {".html": "html", ".htm": "html", ".md": "md", ".json": "json", ".csv": "csv"}


@click.command("report")
@db_option
@click.option("--deployment", "-d", "name", metavar="NAME", callback=text_value, help="The deployment to report on.")
@click.option("--all", "all_deployments", is_flag=True, help="Summarise every deployment instead.")
@since_option("windows ending")
@click.option("--format", "-f", "fmt", type=click.Choice(FORMATS),
              help="Output format (default: from -o's suffix, else md).")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), callback=text_value,
              help="Write to this file instead of stdout.")
@click.option("--windows", "windows", type=click.IntRange(min=0), metavar="N",
              help=f"List the newest N metering windows (default {DEFAULT_WINDOWS}; 0 lists none). Every figure "
                   "counts all windows of the period whatever N is.")
@click.option("--grid-gco2-per-kwh", metavar="G",
              help=f"Grid carbon intensity in grams CO2 per kWh (a finite number >= 0) for a CO2 figure; "
                   f"default ${GRID_ENV}, else no CO2 figure.")
def report_command(db: str | None, name: str | None, all_deployments: bool, since: float | None, fmt: str | None,
                   as_json: bool, output: str | None, windows: int | None, grid_gco2_per_kwh: str | None) -> None:
    """Energy report of a deployment metered by joulepilot.compile(..., deployment=NAME).

    \b
    joulepilot report --deployment resnet50-prod -o report.html
    joulepilot report --deployment resnet50-prod --since 24h --json
    joulepilot report --all --format csv
    """
    if bool(name) == all_deployments:
        raise click.UsageError("give either --deployment NAME or --all")
    if all_deployments and windows is not None:
        raise click.UsageError("--windows lists one deployment's windows; --all lists none")
    if as_json:
        if fmt not in (None, "json"):
            raise click.UsageError(f"--json conflicts with --format {fmt}")
        fmt = "json"
    if fmt is None:
        fmt = SUFFIX_FORMATS.get(Path(output).suffix.lower(), "md") if output else "md"
    try:
        with reading_store(db) as store:
            if all_deployments:
                data = build_summary(store, since, grid_gco2_per_kwh=grid_gco2_per_kwh)
            else:
                data = build_report(store, name, since, grid_gco2_per_kwh=grid_gco2_per_kwh,
                                    windows=DEFAULT_WINDOWS if windows is None else windows)
    except LookupError as exc:
        database = Path(db).expanduser() if db else default_db_path()
        raise click.ClickException(f"{exc} (database {database}; list them with "
                                   "`joulepilot report --all`)") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    text = render(data, fmt)
    if output:
        _write_whole(Path(output), text)
        click.echo(f"wrote {fmt} report to {output}", err=True)
    else:
        click.echo(text, nl=False)


def _write_whole(path: Path, text: str) -> None:
    """The report at `path` whole or not at all: written to a temporary file beside it, synced, then renamed over
    it, so a full disk, a file size limit or a kill never leaves half a report (nor spoils the one there)."""
    existed = path.exists()
    try:
        write_file_atomic(path, text.encode("utf-8"))
    except OSError as exc:
        why = os_error_message(OSError(exc.errno, exc.strerror)) if exc.errno else str(exc)  # not the temp file's name
        kept = f"; {path} is as it was" if existed else ""
        raise click.ClickException(f"cannot write the report to {path}: {why}; nothing was written{kept}") from None


commands = [report_command]
