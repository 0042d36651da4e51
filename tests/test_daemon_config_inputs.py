"""Hostile or mistaken daemon configs: every number finite and in its range, devices once each, files that are
not UTF-8, nesting deep enough to break the TOML parser, huge values. Each is refused at load with one short
line naming the file, the field and the fix; none reaches the daemon."""

from __future__ import annotations

import logging
import math

import pytest
from click.testing import CliRunner
from joulepilot.controller.daemon_config import NUMBER_RANGES, DaemonConfigError, load_daemon_config

from joulepilot.cli import main

MESSAGE_LIMIT = 600  # a refused value is quoted in at most 200 characters; the rest is the field and the fix


def refusal(tmp_path, text: str, *, encoding: str = "utf-8") -> str:
    path = tmp_path / "daemon.toml"
    path.write_text(text, encoding=encoding)
    with pytest.raises(DaemonConfigError) as err:
        load_daemon_config(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message and len(message) < MESSAGE_LIMIT, message
    return message


def as_toml(label: str, value: str) -> str:
    section, _, key = label.rpartition(".")
    return f"[{section}]\n{key} = {value}\n" if section else f"{label} = {value}\n"


@pytest.mark.parametrize(
    ("label", "value"),
    [
        ("interval_s", "nan"), ("interval_s", "inf"), ("interval_s", "0"),
        ("max_decision_age_s", "nan"), ("max_decision_age_s", "-inf"),
        ("bench.min_seconds", "nan"), ("bench.min_seconds", "0"), ("bench.budget_s", "inf"),
        ("bench.max_attempts", "0"),
        ("idle.poll_s", "0"), ("idle.max_utilization_pct", "nan"), ("idle.max_utilization_pct", "0"),
        ("idle.min_idle_s", "inf"), ("idle.cpu_max_load_pct", "+nan"),
        ("exporter.port", "70000"),
    ],
)
def test_numbers_must_be_finite_and_in_range(tmp_path, label, value):
    message = refusal(tmp_path, as_toml(label, value))
    low, high, _ = NUMBER_RANGES[label]
    assert f"{label} must be" in message and f"found {value.lstrip('+')}" in message
    assert f"from {low:,g}" in message and "remove it for the default" in message


def test_each_range_accepts_its_own_ends_and_the_defaults_lie_inside(tmp_path):
    path = tmp_path / "daemon.toml"
    for label, (low, high, _) in NUMBER_RANGES.items():
        section, _, key = label.rpartition(".")
        for end in (low, high):
            path.write_text(as_toml(label, repr(int(end) if key in ("max_attempts", "port") else float(end))))
            cfg = load_daemon_config(path)
            assert getattr(getattr(cfg, section) if section else cfg, key) == end
        default = getattr(getattr(load_daemon_config(None), section) if section else load_daemon_config(None), key)
        assert math.isfinite(default) and low <= default <= high


@pytest.mark.parametrize("devices", ["[0, 0]", '[1, "cuda:1"]', '["cpu", "cpu"]', '["auto", "all"]'])
def test_a_device_named_twice_is_refused_at_load(tmp_path, devices):
    message = refusal(tmp_path, f"devices = {devices}\n")
    assert "devices names" in message and "more than once" in message and "list each device once" in message


def test_a_utf16_file_is_refused_with_the_encoding_fix(tmp_path):
    message = refusal(tmp_path, "interval_s = 5\n", encoding="utf-16")
    assert "UTF-16" in message and "save it as UTF-8" in message


def test_a_byte_that_is_not_utf8_is_located(tmp_path):
    path = tmp_path / "daemon.toml"
    path.write_bytes(b'interval_s = 5\nlog_level = "\xff"\n')
    with pytest.raises(DaemonConfigError, match=r"byte 0xff at line 2 is not UTF-8; save it as UTF-8"):
        load_daemon_config(path)


@pytest.mark.parametrize("depth", [4, 5000])
def test_deep_nesting_names_the_key_instead_of_overflowing_the_stack(tmp_path, depth):
    message = refusal(tmp_path, "[idle]\nallow_other_processes = " + "[" * depth + "]" * depth + "\n")
    assert "idle.allow_other_processes" in message and "nests tables or arrays too deeply" in message
    assert "each key takes a plain value or a flat list" in message


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('log_level = "' + "x" * 200_000 + '"\n', "log_level"),
        ('devices = ["' + "g" * 200_000 + '"]\n', "devices"),
        ("[exporter]\nbind = " + repr(["b" * 200_000]).replace("'", '"') + "\n", "exporter.bind"),
        ('"' + "k" * 200_000 + '" = 1\n', "unknown key"),
    ],
)
def test_a_huge_value_is_quoted_in_a_short_line(tmp_path, text, field):
    message = refusal(tmp_path, text)
    assert field in message and "(200,0" in message  # the quote ends with the value's full length


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "daemon.toml"
    os.mkfifo(fifo)
    with pytest.raises(DaemonConfigError, match="not a regular file"):
        load_daemon_config(fifo)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_daemon_command_refuses_a_non_finite_interval_in_one_line(tmp_path, value, restore_logging):
    """The long-running daemon met `interval_s = nan` only when it scheduled its passes, and ended with
    'unexpected ValueError' (inf: OverflowError): refused now before anything starts."""
    config = tmp_path / "daemon.toml"
    config.write_text(f'db = "{tmp_path / "j.db"}"\ninterval_s = {value}\ndevices = "cpu"\n'
                      "[exporter]\nenabled = false\n")
    (tmp_path / "policies").mkdir()
    logging.getLogger("joulepilot").handlers.clear()
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--policies", str(tmp_path / "policies")])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {config}: interval_s must be a number from 1 to 86,400 (seconds), found {value}; set it in range, "
        "or remove it for the default 300"]
    assert not (tmp_path / "j.db").exists()


def test_a_lock_dir_that_is_not_a_folder_is_refused_in_one_line(tmp_path):
    """`lock_dir` naming a regular file used to be accepted, and every lock the daemon wrote there then failed."""
    import os

    (tmp_path / "locks.txt").write_text("a file, not a folder\n")
    message = refusal(tmp_path, 'lock_dir = "locks.txt"\n')
    assert f"lock_dir {tmp_path / 'locks.txt'} is a regular file, not a folder; name a folder" in message
    os.mkfifo(tmp_path / "pipe")
    assert "is a FIFO (named pipe), not a folder" in refusal(tmp_path, 'lock_dir = "pipe"\n')
    (tmp_path / "loop").symlink_to("loop")
    assert "cannot be used (Too many levels of symbolic links)" in refusal(tmp_path, 'lock_dir = "loop"\n')
    # a folder, or a path where nothing is yet, is taken
    (tmp_path / "daemon.toml").write_text('lock_dir = "state/locks"\n')
    assert load_daemon_config(tmp_path / "daemon.toml").lock_dir == tmp_path / "state" / "locks"
    (tmp_path / "daemon.toml").write_text('lock_dir = "locks.txt"\n')
    result = CliRunner().invoke(main, ["daemon", "--once", "--config", str(tmp_path / "daemon.toml")])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {tmp_path / 'daemon.toml'}: lock_dir "), \
        result.output
