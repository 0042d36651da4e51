"""`joulepilot exporter`: the Prometheus endpoint as its own process (a thin layer over controller.exporter)."""

from __future__ import annotations

import errno
import logging
import socket
import sys

import click

from .clikit import db_option, text_value


def _log_to_stderr() -> logging.Handler | None:
    """Send joulepilot's log to stderr (journald under systemd) unless something already handles it."""
    root = logging.getLogger("joulepilot")
    root.setLevel(logging.INFO)
    if root.handlers:
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s joulepilot-exporter[%(process)d] %(levelname)s %(message)s"))
    root.addHandler(handler)
    return handler


# Errors that say the address is wrong (not resolvable, not on this host, not of a family this host serves).
_ADDRESS_ERRNOS = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL)


def listen_error(bind: str, port: int, exc: OSError) -> str:
    """One line for a failed listen, whose fix names the option at fault: --bind for the address, --port for
    a port that is taken or privileged."""
    where = f"cannot listen on {bind}:{port}: {exc.strerror or exc}"
    if isinstance(exc, socket.gaierror) or exc.errno in _ADDRESS_ERRNOS:
        return (f"{where}; pass --bind with an address of this host (127.0.0.1 for this host only, 0.0.0.0 for "
                f"every interface, or one that `ip addr` lists)")
    if exc.errno == errno.EADDRINUSE:
        return (f"{where}; pass --port with a free port (the daemon serves the same endpoint unless its config "
                f"sets [exporter] enabled = false)")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"{where}; ports below 1024 need root or CAP_NET_BIND_SERVICE: pass --port 1024 or above"
    return f"{where}; check --bind and --port"


@click.command("exporter")
@db_option
@click.option("--bind", default="127.0.0.1", show_default=True, callback=text_value,
              help="Address to listen on (0.0.0.0: every interface; restrict it with a firewall).")
@click.option("--port", type=click.IntRange(0, 65535), default=9464, show_default=True,
              help="Port to listen on (0: any free port, printed on stderr).")
def exporter_command(db: str | None, bind: str, port: int) -> None:
    """Serve Prometheus /metrics for a database until SIGTERM or SIGINT.

    Opens the database read-only at every scrape (never migrating or writing it), so it runs with read
    access alone and keeps answering while the daemon is down: joulepilot_daemon_up then reads 0. A
    missing or unreadable database gives joulepilot_exporter_scrape_error 1 (logged once), not an exit.
    Turn the daemon's own endpoint off (`[exporter] enabled = false`) when this serves the same port.
    """
    from joulepilot.controller.exporter import serve_exporter
    from joulepilot.store import default_db_path

    path = db or str(default_db_path())

    def ready(exporter) -> None:
        click.echo(f"joulepilot exporter: serving http://{exporter.address}:{exporter.port}/metrics for {path}",
                   err=True)

    handler = _log_to_stderr()
    try:
        serve_exporter(path, port=port, bind=bind, on_ready=ready)
    except OSError as exc:
        raise click.ClickException(listen_error(bind, port, exc)) from exc
    finally:
        if handler is not None:
            logging.getLogger("joulepilot").removeHandler(handler)


commands = [exporter_command]
