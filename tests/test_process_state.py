"""The guard that fails a test leaving process-wide state changed (tests/process_state.py) sees each kind of change
and puts it back."""

from __future__ import annotations

import os
import signal
import threading

import process_state
import torch._dynamo.config as dynamo_config


def test_a_deleted_dynamo_key_is_seen_though_a_copy_of_the_config_still_lists_it_and_is_put_back():
    before = process_state.snapshot()
    try:
        # what pytest >= 9.1's monkeypatch.setattr(torch._dynamo.config, "recompile_limit", ...) leaves on undo
        del dynamo_config.recompile_limit
        after = process_state.snapshot()
        assert after["torch._dynamo.config"] == before["torch._dynamo.config"]
        assert process_state.changes(before, after) == ["torch._dynamo.config, deleted: recompile_limit"]
        process_state.put_back(before, after)
        assert dynamo_config.recompile_limit == before["torch._dynamo.config"]["recompile_limit"]
        assert process_state.changes(before, process_state.snapshot()) == []
    finally:
        if "recompile_limit" in process_state._deleted_keys(dynamo_config):
            dynamo_config.recompile_limit = before["torch._dynamo.config"]["recompile_limit"]


def test_a_changed_value_an_environment_variable_the_working_folder_and_a_signal_handler_are_named(tmp_path):
    before = process_state.snapshot()
    cwd, handler, limit = os.getcwd(), signal.getsignal(signal.SIGUSR2), dynamo_config.recompile_limit
    try:
        os.environ["JOULEPILOT_GUARD_TEST"] = "1"
        os.chdir(tmp_path)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        dynamo_config.recompile_limit = limit + 1
        after = process_state.snapshot()
        assert process_state.changes(before, after) == [
            "os.environ[JOULEPILOT_GUARD_TEST]", "signal handlers[SIGUSR2]", "torch._dynamo.config[recompile_limit]",
            "working folder"]
        process_state.put_back(before, after)
        assert process_state.changes(before, process_state.snapshot()) == []
        assert "JOULEPILOT_GUARD_TEST" not in os.environ and os.getcwd() == cwd
    finally:
        os.environ.pop("JOULEPILOT_GUARD_TEST", None)
        os.chdir(cwd)
        signal.signal(signal.SIGUSR2, handler)
        dynamo_config.recompile_limit = limit


def test_a_joulepilot_thread_left_running_is_named_and_one_that_ends_in_its_moment_is_not():
    before = process_state.snapshot()
    stop, quick = threading.Event(), threading.Event()
    running = threading.Thread(target=stop.wait, name="joulepilot-meter:left", daemon=True)
    ending = threading.Thread(target=quick.wait, name="joulepilot-meter:ending", daemon=True)
    running.start()
    ending.start()
    try:
        threading.Timer(0.05, quick.set).start()  # ends within the moment it is given
        assert process_state.left_threads(before, grace_s=1.0) == [running]
        assert process_state.changes(before, process_state.snapshot()) == [
            "a thread left running: joulepilot-meter:left"]
    finally:
        stop.set()
        quick.set()
        running.join()
        ending.join()
    assert process_state.changes(before, process_state.snapshot()) == []
