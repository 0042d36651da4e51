"""`joulepilot daemon` and `joulepilot status`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import click

from .clikit import (
    DB_META_KEY,
    FilePath,
    ProgressReport,
    db_option,
    echo_json,
    echo_table,
    progress,
    reading_store,
    text_value,
)


@click.command("daemon")
@click.option("--config", "config_path", type=FilePath("--config", "give the daemon's TOML file (see deploy/daemon.toml)"),
              help="Daemon TOML config (see deploy/daemon.toml); without it, the defaults.")
@db_option
@click.option("--policies", "policy_dirs", multiple=True, type=click.Path(file_okay=False), callback=text_value,
              help="Policy folder (repeatable; it must exist); overrides the config's `policies`. Default: "
                   "<JOULEPILOT_HOME>/policies, no policies while it does not exist.")
@click.option("--once", is_flag=True, help="Run one pass (measure, decide, lock) and exit.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the pass summary as JSON on stdout; needs --once (a running daemon's state: "
                   "`joulepilot status --json`).")
def daemon_command(config_path: str | None, db: str | None, policy_dirs: tuple[str, ...], once: bool,
                   as_json: bool) -> None:
    """Keep every policy's decision current: benchmark while the device is idle, refit, re-decide.

    One daemon per database. SIGTERM/SIGINT stop it within seconds (the running measurements are
    re-queued); SIGHUP re-reads the config.
    """
    if as_json and not once:
        raise click.ClickException("--json needs --once: it prints the summary of that one pass; a daemon that "
                                   "keeps running logs to stderr, and `joulepilot status --json` gives its state")
    from joulepilot.controller.daemon import (
        Daemon,
        DaemonAlreadyRunning,
        DaemonConfigError,
        DeviceUnavailable,
    )

    try:
        daemon = Daemon.from_cli(config_path=config_path, db=db, policies=policy_dirs)
    except DaemonConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    # The database the daemon opens (its config's `db` where --db is not given), for the error boundary's
    # one line about a SQLite error in the middle of a pass.
    from joulepilot.store import StoreError, shown, side_path

    click.get_current_context().meta[DB_META_KEY] = shown(daemon.cfg.db)

    try:
        if once:
            with progress(None, "daemon pass", noun="job", tag="job") as report:
                daemon.listener = _pass_progress(report)
                result = daemon.run(once=True)
        else:
            result = daemon.run(once=False)
    except (DaemonAlreadyRunning, DeviceUnavailable, StoreError) as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:  # the lock file or scratch folder beside the database cannot be written
        raise click.ClickException(f"{exc}; the daemon needs write access to the folder of its database's side "
                                   f"files ({side_path(daemon.cfg.db).parent}); fix its permissions or pass --db") \
            from exc
    if once and as_json:
        echo_json(result.summary)
    sys.exit(result.exit_code)


def _pass_progress(report: ProgressReport) -> Callable[[str, dict[str, Any]], None]:
    """The daemon's pass events as progress lines on stderr: job i of n in the pass ('of n so far' while a
    guided search or an exhaustive policy's repeats may still plan more), its policy, configuration and purpose,
    elapsed, ETA (jobs on several GPUs overlap: each one's end line carries its own number)."""
    started = 0
    numbers: dict[Any, int] = {}  # job id -> its number in this pass

    def listen(event: str, fields: dict[str, Any]) -> None:
        nonlocal started
        if event == "jobs_planned":
            report.parallel = max(1, int(fields.get("devices") or 1))
            report.set_total(started + int(fields["total"]), open_ended=bool(fields.get("open_ended")))
        elif event == "job_started":
            started += 1
            numbers[fields.get("job_id")] = started
            report.start(started, fields["label"], "measuring")
        elif event == "job_finished":
            number = numbers.pop(fields.get("job_id"), None)
            kind, reason = fields.get("kind"), fields.get("reason") or ""
            if kind == "measured":
                report.finish(f"{fields.get('status') or 'stored'}, run {fields.get('run_id')}", number)
            elif kind in ("crashed", "timeout", "error"):
                report.finish(f"FAILED ({kind}): {reason.splitlines()[0] if reason else 'no reason given'}", number)
            else:
                report.finish(f"re-queued: {reason}", number)
            if fields.get("note"):
                report.note(fields["note"], number)

    return listen


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _short(text: str | None, limit: int = 80) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


@click.command("status")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status_command(db: str | None, as_json: bool) -> None:
    """Is the daemon alive, what is it doing, the queue, and each policy's decision."""
    from joulepilot.controller.status import daemon_status
    from joulepilot.store import StoreUnreachable, default_db_path

    path = db or str(default_db_path())
    try:
        with reading_store(path) as database:
            status = daemon_status(database, path)
    except StoreUnreachable as exc:
        _status_unreachable(path, exc, as_json)
        return
    if as_json:
        echo_json(status)
        return
    d = status["daemon"]
    if d["alive"]:
        head = f"daemon: running (pid {d['pid']}), {d['state'] or 'starting'}"
    elif d["state"] is None:
        head = "daemon: never ran on this database"
    else:
        head = f"daemon: not running (last pid {d['pid']}, last state {d['state']})"
    click.echo(f"database: {status['db']}")
    click.echo(head)
    if d["last_heartbeat_age_s"] is not None:
        click.echo(f"last heartbeat: {_age(d['last_heartbeat_age_s'])} ago")
    if d["doing"]:
        click.echo(f"doing: {d['doing']}")
    cache = d.get("compile_cache")
    if d["alive"] and cache:
        click.echo(f"compile cache: {cache.get('url')} answers" if cache.get("answers") else
                   f"compile cache: {cache.get('problem')}; compiling without it")
    if d["alive"] and len(d["current_jobs"]) > 1:
        click.echo("running: " + "; ".join(f"job {j.get('id')} {j.get('policy')} {j.get('config')} on {j.get('device')}"
                                           for j in d["current_jobs"]))
    last = status["last_pass"]
    if last:
        finished = last.get("finished_at")
        when = f"{_age(time.time() - finished)} ago" if finished else "in progress"
        click.echo(f"last pass: {when}, {last.get('runs_ok', 0)} ok / {last.get('runs_failed', 0)} failed runs, "
                   f"{len(last.get('decided', []))} decided" + _pass_spent(last.get("measuring")))
    if status["no_policy_folder"]:
        click.echo(f"policies: none; {status['no_policy_folder']['message']}", err=True)
    for err in status["policy_errors"]:
        click.echo(f"policy error: {err['file']}: {err['error']}", err=True)
    counts = status["queue"]["counts"]
    click.echo("queue: " + ", ".join(f"{k} {v}" for k, v in counts.items())
               + (f"; {status['requests_pending']} request(s) pending" if status["requests_pending"] else ""))
    if status["queue"]["next"]:
        echo_table(status["queue"]["next"], ["id", "state", "host", "policy", "workload", "config", "attempts"],
                   drop_first=("attempts", "workload", "host"))
    if len(status["fleet"]) > 1:  # hosts sharing this store: who measures what
        click.echo("")
        click.echo(f"fleet: {len(status['fleet'])} hosts share this store")
        echo_table([_host_row(h) for h in status["fleet"]], ["host", "state", "heartbeat", "measuring"],
                   drop_first=("heartbeat",))
    if status["measuring"]:
        click.echo("")
        click.echo("measuring, per policy (every run the daemon made for it; energy metered where a meter read "
                   "it, the rest an estimate):")
        echo_table([_spent_row(m) for m in status["measuring"]],
                   ["policy", "runs", "time", "energy", "source", "last_pass"],
                   ["policy", "runs", "time", "energy", "source", "last pass"], drop_first=("time",))
    click.echo("")
    rows = [dict(r, age=_age(r["age_s"]), reason=_short(r.get("reason")), payback=_payback(r.get("bill")))
            for r in status["decisions"]]
    echo_table(rows, ["policy", "device_kind", "config", "state", "age", "payback", "reason"],
               ["policy", "device", "config", "state", "age", "payback", "reason"],
               drop_first=("payback", "age", "device_kind"))


def _status_unreachable(path: str, exc: Exception, as_json: bool) -> None:
    """`status` when the database server does not answer: what this host's daemon recorded of the outage (the
    runs it keeps aside meanwhile); exit 1."""
    from joulepilot.store import shown
    from joulepilot.store.unreachable import read_unreachable

    outage = read_unreachable(path)
    if as_json:
        echo_json({"db": shown(path), "reachable": False, "error": str(exc), "outage": outage})
        raise SystemExit(1)
    click.echo(f"database: {shown(path)}: unreachable ({exc})", err=True)
    if outage is None:
        click.echo("daemon: this host's daemon has not met the outage yet (or none runs here)", err=True)
    else:
        click.echo(f"daemon: pid {outage.get('pid')} could not reach it since {_age(time.time() - outage['since'])} "
                   f"ago (last try {_age(time.time() - outage['at'])} ago); {outage['waiting_runs']} measured run(s) "
                   "wait in side files on this host and are stored when it answers; the hooks keep applying the "
                   "decisions in their lock files", err=True)
    raise SystemExit(1)


def _host_row(host: dict[str, Any]) -> dict[str, Any]:
    """A fleet host as `status` lists it: what it measures (job, configuration, seconds left on its claim)."""
    jobs = "; ".join(f"job {m['job']} {m['policy']} {m['config']}"
                     + (f" (claim {m['lease_left_s']:.0f}s)" if m["lease_left_s"] is not None else "")
                     for m in host["measuring"])
    age = host["last_heartbeat_age_s"]
    return {"host": host["host"], "state": host["state"] or "-", "heartbeat": f"{_age(age)} ago" if age is not None
            else "-", "measuring": jobs or "-"}


def _spent(entry: dict[str, Any]) -> str:
    """'2 runs, 39 s, 412 J (estimate)'."""
    from joulepilot.policies.bill import duration_text, energy_text

    runs = entry.get("runs", 0)
    return (f"{runs} run{'s' if runs != 1 else ''}, {duration_text(entry.get('seconds'))}, "
            f"{energy_text(entry.get('energy_j'))} ({entry.get('source') or 'no energy'})")


def _pass_spent(measuring: Any) -> str:
    """The last pass's measuring, all policies together: '; measuring 2 runs, 39 s, 412 J (estimate)'."""
    from joulepilot.policies.sources import joined_sources

    entries = [m for m in measuring or [] if isinstance(m, dict)]
    if not entries:
        return ""
    total = {"runs": sum(m.get("runs", 0) for m in entries), "seconds": sum(m.get("seconds", 0.0) for m in entries),
             "energy_j": sum(m.get("energy_j", 0.0) for m in entries),
             "source": joined_sources(m.get("source") for m in entries)}
    return f"; measuring {_spent(total)}"


def _spent_row(entry: dict[str, Any]) -> dict[str, Any]:
    from joulepilot.policies.bill import duration_text, energy_text

    last = entry.get("last_pass")
    return {"policy": entry["policy"], "runs": entry["runs"], "time": duration_text(entry["seconds"]),
            "energy": energy_text(entry["energy_j"]), "source": entry["source"] or "-",
            "last_pass": _spent(last) if last else "-"}


def _payback(bill: dict[str, Any] | None) -> str:
    """A decision's payback in a few words: 'after 87,000 calls', 'never', 'unknown'."""
    from joulepilot.policies.bill import NEVER, PAYS_BACK, calls_text

    if not bill:
        return "-"
    if bill.get("verdict") == PAYS_BACK:
        return f"after {calls_text(bill.get('payback_inferences'))} calls"
    if bill.get("no_measurable_saving"):
        return "no measurable saving"
    return "never" if bill.get("verdict") == NEVER else "unknown"


commands = [daemon_command, status_command]
