"""Devices the daemon cannot meter: refused at start in one line (which device, why, the fix), never a traceback;
a GPU lost while the daemon runs is logged once and skipped, the others go on, and it is used again once back.

No GPU here: NVML is the fake, in this process, where the daemon runs (no job is measured: the policy folder
is empty, so nothing starts a worker)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from click.testing import CliRunner
from daemon_factories import wait_for, write_daemon_config
from fakes import fake_pynvml
from fakes.fake_pynvml import FakeGpu
from joulepilot.controller.daemon import Daemon, DeviceUnavailable

from joulepilot.cli import main

pytestmark = pytest.mark.usefixtures("restore_logging")


@pytest.fixture
def gpus(monkeypatch):
    two = [FakeGpu(uuid="GPU-0a0a0a0a-1111-2222-3333-444444444444"),
           FakeGpu(uuid="GPU-1b1b1b1b-1111-2222-3333-444444444444")]
    fake_pynvml.install_everywhere(monkeypatch, two)
    return two


def config_with(tmp_path, devices: str, *, interval_s: float = 3600):
    policies = tmp_path / "policies"
    policies.mkdir(exist_ok=True)
    config = write_daemon_config(tmp_path / "daemon.toml", db=tmp_path / "j.db", policies=policies,
                                 interval_s=interval_s)
    config.write_text(f"devices = {devices}\n" + config.read_text())
    return config, policies


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def saying(self, text: str) -> list[str]:
        return [r.getMessage() for r in self.records if text in r.getMessage()]


@pytest.fixture
def records():
    handler = Records()
    logger = logging.getLogger("joulepilot")
    logger.handlers[:] = [handler]  # the daemon adds no handler of its own where one is set up
    return handler


def test_a_gpu_that_does_not_exist_is_refused_at_start_in_one_line(tmp_path, gpus):
    config, policies = config_with(tmp_path, "[3]")
    logging.getLogger("joulepilot").handlers.clear()
    result = CliRunner().invoke(main, ["daemon", "--config", str(config), "--once", "--policies", str(policies)])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: {config}: devices: cuda:3 cannot be used: cannot meter cuda:3: NVML: cuda:3 does not exist; "
        '2 GPU(s) visible; list only devices this host can meter in `devices` (GPUs here: 0, 1), or use "auto"']
    assert not (tmp_path / "j.db").exists()  # refused before anything was opened


def test_the_long_running_daemon_refuses_a_lost_gpu_at_start(tmp_path, gpus, records):
    gpus[1].lost = True
    config, _ = config_with(tmp_path, "[0, 1]")
    daemon = Daemon.from_cli(config_path=str(config), db=None, policies=())
    stopper = threading.Timer(30, daemon.request_stop)  # a daemon that started anyway ends here
    stopper.start()
    try:
        with pytest.raises(DeviceUnavailable) as err:
            daemon.run(once=False)
    finally:
        stopper.cancel()
    message = str(err.value)
    assert message.startswith(f"{config}: devices: cuda:1 cannot be used: cannot meter cuda:1:")
    assert "GPU is lost" in message and "\n" not in message
    assert not (tmp_path / "j.db").exists()


def passes_after(daemon: Daemon, since: float, what: str, check=lambda p: True, timeout_s: float = 30) -> dict:
    def finished():
        last = daemon.last_pass
        done = not last.get("in_progress") and (last.get("finished_at") or 0) > since
        return last if done and check(last) else None

    return wait_for(finished, timeout_s, what, interval_s=0.05)


@contextmanager
def running(config) -> Iterator[Daemon]:
    """The long-running daemon of `config` in a thread of this process; stopped, and its exit checked, after."""
    daemon = Daemon.from_cli(config_path=str(config), db=None, policies=())
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=daemon.run(once=False)), daemon=True)
    thread.start()
    try:
        yield daemon
        assert thread.is_alive()  # no pass ended the daemon
    finally:
        daemon.request_stop("test over")
        thread.join(30)
    assert not thread.is_alive() and outcome["result"].exit_code == 0


def test_a_gpu_lost_while_running_is_logged_once_and_skipped_until_it_is_back(tmp_path, gpus, records):
    config, _ = config_with(tmp_path, "[0, 1]", interval_s=1)
    with running(config) as daemon:
        first = passes_after(daemon, 0, "the first pass")
        assert first["devices"] == ["cuda:0", "cuda:1"] and first["device_errors"] == []

        gpus[0].lost = True
        since = time.time()
        lost = passes_after(daemon, since, "a pass without cuda:0", lambda p: p["device_errors"])
        passes_after(daemon, lost["finished_at"], "a second pass without cuda:0")
        assert lost["devices"] == ["cuda:1"] and lost["device"] == "cuda:1"  # the other GPU goes on
        assert [e["device"] for e in lost["device_errors"]] == ["cuda:0"]
        assert "GPU is lost" in lost["device_errors"][0]["error"]

        gpus[1].lost = True
        both = passes_after(daemon, time.time(), "a pass with no GPU", lambda p: len(p["device_errors"]) == 2)
        passes_after(daemon, both["finished_at"], "a second pass with no GPU")
        assert both["devices"] == [] and both["decided"] == []

        gpus[0].lost = gpus[1].lost = False
        back = passes_after(daemon, time.time(), "a pass with both GPUs", lambda p: not p["device_errors"])
        assert back["devices"] == ["cuda:0", "cuda:1"]
    assert not [r for r in records.records if r.exc_info]  # no traceback in the log
    for device in ("cuda:0", "cuda:1"):
        (skipped,) = records.saying(f"{device} skipped: cannot meter {device}")  # once, however many passes
        assert "GPU is lost" in skipped and "\n" not in skipped
        assert records.saying(f"{device} can be metered again")
    assert len(records.saying("passes skipped: no device of `devices` can be metered")) == 1


def test_auto_starts_without_a_gpu_it_found_lost_and_uses_it_once_back(tmp_path, gpus, records):
    gpus[1].lost = True  # still listed by NVML, as after an Xid error
    config, _ = config_with(tmp_path, '"auto"', interval_s=1)
    with running(config) as daemon:
        first = passes_after(daemon, 0, "the first pass")
        assert first["devices"] == ["cuda:0"] and [e["device"] for e in first["device_errors"]] == ["cuda:1"]
        gpus[1].lost = False
        back = passes_after(daemon, time.time(), "a pass with both GPUs", lambda p: not p["device_errors"])
        assert back["devices"] == ["cuda:0", "cuda:1"]
    (started,) = records.saying('cuda:1 (found by "auto") cannot be metered now')
    assert "GPU is lost" in started


def test_auto_with_no_gpu_it_can_meter_is_refused_at_start(tmp_path, gpus):
    gpus[0].lost = gpus[1].lost = True
    config, _ = config_with(tmp_path, '"auto"')
    daemon = Daemon.from_cli(config_path=str(config), db=None, policies=())
    with pytest.raises(DeviceUnavailable) as err:
        daemon.run(once=True)
    message = str(err.value)
    assert message.startswith(f"{config}: devices: cuda:0 cannot be used:") and 'or use "auto"' not in message
