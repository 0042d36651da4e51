"""`joulepilot telemetry` and `joulepilot measure`, through click's runner and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from fakes.powercap import FakePowercap

from joulepilot.cli import main


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("JOULEPILOT_POWERCAP_ROOT", None)
    env.update(extra)
    return env


def test_telemetry_json_explains_every_meter(tmp_path, monkeypatch):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "absent"))
    result = CliRunner().invoke(main, ["telemetry", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    status = {m["name"]: m for m in data["meters"]}
    assert set(status) == {"nvml", "rapl", "estimate"}
    assert all(m["reason"] for m in data["meters"])
    assert not status["rapl"]["active"] and "no powercap tree" in status["rapl"]["reason"]
    assert status["estimate"]["active"] and data["primary_source"]["cpu"] == "estimate"

    tree = FakePowercap(tmp_path / "pc")
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tree.root))
    data = json.loads(CliRunner().invoke(main, ["telemetry", "--json"]).output)
    status = {m["name"]: m for m in data["meters"]}
    assert status["rapl"]["active"] and status["rapl"]["devices"] == ["cpu:0", "dram:0", "cpu:1", "dram:1"]
    assert not status["estimate"]["active"] and data["primary_source"]["cpu"] == "rapl"
    assert {d["id"] for d in data["devices"]} >= {"cpu:0", "cpu:1"}

    table = CliRunner().invoke(main, ["telemetry"])
    assert table.exit_code == 0 and "rapl" in table.output and "device 'cpu' is metered by: rapl" in table.output


def test_measure_json_reports_child_energy_and_passes_exit_code(tmp_path):
    burn = ("import sys, time\nprint('child output')\nt = time.process_time()\n"
            "while time.process_time() - t < 0.4: pass\nsys.exit(7)\n")
    script = tmp_path / "burn.py"
    script.write_text(burn)
    proc = subprocess.run(
        [sys.executable, "-m", "joulepilot", "measure", "--json", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=60,
        env=_env(JOULEPILOT_POWERCAP_ROOT=str(tmp_path / "absent"), JOULEPILOT_ESTIMATE_W_PER_CORE="10"),
    )
    assert proc.returncode == 7, proc.stderr
    assert "child output" in proc.stderr  # the child's stdout is moved aside so stdout stays JSON
    data = json.loads(proc.stdout)
    for key in ("duration_s", "energy_j", "exit_code", "devices", "sources", "primary_source", "estimated"):
        assert key in data
    assert data["exit_code"] == 7 and data["estimated"] is True and data["sources"] == ["estimate"]
    (device,) = data["devices"]
    assert {"device", "source", "energy_j"} <= set(device)
    assert device["device"] == "cpu:0" and device["source"] == "estimate"
    assert 0.35 * 10 <= device["energy_j"] <= 0.8 * 10  # only the child's CPU time (~0.4 s + start-up)
    assert data["duration_s"] >= 0.4


def test_measure_covers_the_child_tree_and_prints_a_table(tmp_path, monkeypatch):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "absent"))
    script = tmp_path / "burn.py"
    script.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n")
    shell = f'"{sys.executable}" "{script}" & "{sys.executable}" "{script}"; wait'
    result = CliRunner().invoke(main, ["measure", "--", "sh", "-c", shell])
    assert result.exit_code == 0, result.output
    assert "ESTIMATE" in result.output and "cpu:0" in result.output
    total_j = float(result.output.split("total ")[1].split(" J")[0])
    assert total_j >= 0.55 * 10  # both grandchildren, 0.3 s each


def test_measure_rejects_unknown_commands_and_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "absent"))
    missing = CliRunner().invoke(main, ["measure", "--", "no-such-command-xyz"])
    assert missing.exit_code == 127 and "command not found: 'no-such-command-xyz'" in missing.output  # as a shell
    bad = CliRunner().invoke(main, ["measure", "--device", "tpu:0", "--", "true"])
    assert bad.exit_code == 2 and "--device 'tpu:0' is not a device: use cpu or cuda:N" in bad.output
    assert "None" not in bad.output
    monkeypatch.setitem(sys.modules, "pynvml", None)
    nogpu = CliRunner().invoke(main, ["measure", "--device", "cuda:0", "--", "true"])
    assert nogpu.exit_code == 1 and "cannot meter cuda:0" in nogpu.output


def test_measure_exits_like_a_shell_when_the_command_cannot_run(tmp_path):
    script = tmp_path / "not-executable.sh"
    script.write_text("echo hi\n")
    script.chmod(0o644)
    for argv, code in ([["no-such-command-xyz"], 127], [[str(script)], 126], [["sh", "-c", "exit 127"], 127]):
        proc = subprocess.run([sys.executable, "-m", "joulepilot", "measure", "--", *argv], capture_output=True,
                              text=True, timeout=60, env=_env(JOULEPILOT_POWERCAP_ROOT=str(tmp_path / "absent")))
        shell = subprocess.run(["sh", "-c", " ".join(argv) if argv[0] != "sh" else "exit 127"], capture_output=True)
        assert proc.returncode == code == shell.returncode, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_measure_has_no_db_option_and_says_so(tmp_path):
    result = CliRunner().invoke(main, ["measure", "--db", str(tmp_path / "m.db"), "--", "true"])
    assert result.exit_code == 2
    assert "measure has no option '--db'" in result.output and "measurements are not stored" in result.output
    assert not (tmp_path / "m.db").exists()


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "0", "inf"])
def test_a_bad_watts_per_core_setting_is_one_clean_line_in_every_command(tmp_path, monkeypatch, value):
    monkeypatch.setenv("JOULEPILOT_POWERCAP_ROOT", str(tmp_path / "absent"))  # the estimate meters the CPU here
    monkeypatch.setenv("JOULEPILOT_ESTIMATE_W_PER_CORE", value)
    for args in (["telemetry"], ["telemetry", "--json"], ["measure", "--", "true"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1, (args, result.output)
        assert lines[0].startswith(f"Error: JOULEPILOT_ESTIMATE_W_PER_CORE={value!r} is not a finite number"), lines
        assert "unset it to use the default 10 W" in lines[0] and "unexpected" not in lines[0]
