"""`joulepilot telemetry` and `joulepilot measure`: thin layers over joulepilot.telemetry."""

from __future__ import annotations

import signal
import sys

import click

from joulepilot.telemetry import (
    TelemetryError,
    detect_meters,
    measure_command,
    meter_status,
    parse_device,
)

from .clikit import FiniteFloat, echo_json, echo_table, text_value

# What a shell exits with when it cannot run a command: not found, found but not executable.
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126


def _device_rows() -> list[dict]:
    rows: list[dict] = []
    for meter in detect_meters(None):
        try:
            for d in meter.devices():
                rows.append(d.to_dict())
        finally:
            meter.close()
    return rows


@click.command("telemetry")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def telemetry_command(as_json: bool) -> None:
    """Show which energy meters work on this host, and why the others do not."""
    statuses = [s.to_dict() for s in meter_status()]
    devices = _device_rows()
    cpu_source = next((s["name"] for s in statuses if s["name"] in ("rapl", "estimate") and s["active"]), None)
    gpu_source = "nvml" if any(s["name"] == "nvml" and s["active"] for s in statuses) else None
    if as_json:
        echo_json({"meters": statuses, "devices": devices, "primary_source": {"cpu": cpu_source, "cuda": gpu_source}})
        return
    echo_table([dict(s, devices=", ".join(s["devices"]) or "-") for s in statuses], ["name", "active", "devices", "reason"])
    click.echo("")
    echo_table(devices, ["id", "source", "name", "driver", "power_limit_w", "memory_bytes"],
               ["device", "source", "name", "driver", "power limit W", "memory bytes"],
               drop_first=("memory_bytes", "driver", "power_limit_w"))
    click.echo("")
    click.echo(f"device 'cpu' is metered by: {cpu_source or '-'}; device 'cuda:N' by: {gpu_source or '- (no NVML)'}")


def _exit_status(code: int) -> int:
    # A child killed by signal N reports -N; shells report 128 + N.
    return 128 - code if code < 0 else code


@click.command("measure", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON on stdout; the command's own stdout then goes to stderr.")
@click.option("--device", default=None, callback=text_value,
              help="'cpu', 'cuda:N', or all measured devices (default). CPU-only hosts without RAPL get an estimate.")
@click.option("--idle-s", type=FiniteFloat(min=0), default=0.0, show_default=True,
              help="Seconds of idle baseline to measure first, for energy above idle (0: none).")
@click.option("--sample-hz", type=FiniteFloat(min=0, min_open=True, max=10), default=10.0, show_default=True,
              help="Power sampler rate in Hz.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def measure_cli(as_json: bool, device: str | None, idle_s: float, sample_hz: float, cmd: tuple[str, ...]) -> None:
    """Run CMD and report the energy it used per device; exits with CMD's exit code (127 when CMD is
    not found, 126 when it cannot be executed, as a shell does). Nothing is stored: use --json to keep
    the report.

    Example: joulepilot measure --json -- python train.py --epochs 1
    """
    if cmd[0].startswith("-"):
        # An option measure does not have lands here (unknown options are passed through to CMD).
        raise click.UsageError(f"measure has no option {cmd[0]!r} (its options are --json, --device, --idle-s, "
                               "--sample-hz; measurements are not stored); put the command after `--`")
    if device is not None:
        try:
            parse_device(device)
        except ValueError:
            raise click.UsageError(f"--device {device!r} is not a device: use cpu or cuda:N (e.g. cuda:0), or leave "
                                   "--device out to measure every device") from None
    try:
        result = measure_command(list(cmd), device=device, idle_s=idle_s, sample_hz=sample_hz,
                                 stdout=2 if as_json else None)  # fd 2: stderr
    except FileNotFoundError as exc:
        click.echo(f"Error: command not found: {cmd[0]!r} ({exc.strerror}); check the name and PATH", err=True)
        sys.exit(EXIT_NOT_FOUND)
    except PermissionError:
        click.echo(f"Error: command not executable: {cmd[0]!r}; chmod +x it or run it through its interpreter",
                   err=True)
        sys.exit(EXIT_NOT_EXECUTABLE)
    except (TelemetryError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        echo_json(result)
    else:
        _print_report(result)
    code = result["exit_code"]
    if code < 0 and -code in (signal.SIGINT, signal.SIGTERM):
        click.echo(f"command was stopped by signal {-code}", err=True)
    sys.exit(_exit_status(code))


def _print_report(result: dict) -> None:
    rows = result["devices"]
    echo_table(rows, ["device", "source", "energy_j", "avg_power_w", "peak_power_w", "energy_above_idle_j"],
               ["device", "source", "energy J", "avg W", "peak W", "above idle J"],
               drop_first=("peak_power_w", "energy_above_idle_j"))
    label = " (ESTIMATE: CPU time x W/core, not measured)" if result["estimated"] else ""
    click.echo(f"total {result['energy_j']:.2f} J in {result['duration_s']:.2f} s, "
               f"exit code {result['exit_code']}{label}")


commands = [telemetry_command, measure_cli]
