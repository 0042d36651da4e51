"""The TF32 switches are process-wide: threads that call a served tf32 model (or take a strict fp32 reference)
at the same time must each run with the setting they asked for, and leave the switches as they found them once
the last of them returns. Autocast (bf16/fp16) is thread-local in torch and must stay so."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from joulepilot.compiler import CompileConfig, apply_config
from joulepilot.compiler.precision import _precision_knobs, strict_fp32, tf32_enabled

THREADS = 4
CALLS = 150


def switches() -> tuple:
    """Every process-wide precision switch, as a comparable value."""
    return (torch.get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32(),
            tuple(getattr(obj, name) for obj, name in _precision_knobs()))


@pytest.fixture(autouse=True)
def _switches_put_back():
    """A test that fails here must not leave TF32 on for the next one."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32()
    knobs = [(obj, name, getattr(obj, name)) for obj, name in _precision_knobs()]
    yield
    torch.set_float32_matmul_precision(matmul)
    torch._C._set_cudnn_allow_tf32(cudnn)
    for obj, name, value in knobs:
        setattr(obj, name, value)


def tf32_state() -> tuple[str, bool]:
    return torch.get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32()


class Recorder(torch.nn.Module):
    """Records the switches each call runs under, and lingers a little so that calls of several threads overlap."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    def forward(self, x):
        self.seen.append(tf32_state())
        time.sleep(0.0005)
        self.seen.append(tf32_state())
        return x * 2


def run_threads(*targets) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hung in a precision scope"


def test_concurrent_calls_of_a_tf32_model_leave_tf32_off_afterwards():
    before = switches()
    model = Recorder()
    run = apply_config(CompileConfig("eager", precision="tf32"), model, "cpu")

    def serve():
        for _ in range(CALLS):
            run(torch.ones(2))

    run_threads(*[serve] * THREADS)
    assert len(model.seen) == 2 * THREADS * CALLS
    assert set(model.seen) == {("high", True)}  # every call ran with TF32 on, from start to end
    assert switches() == before  # and the last one out switched it off again


def test_concurrent_strict_fp32_references_leave_cudnn_tf32_as_it_was():
    before = switches()
    seen = []

    def reference():
        for _ in range(CALLS):
            with strict_fp32():
                seen.append(tf32_state())
                time.sleep(0.0005)
                seen.append(tf32_state())

    run_threads(*[reference] * THREADS)
    assert set(seen) == {("highest", False)}
    assert switches() == before


def test_tf32_calls_and_strict_references_in_threads_each_run_with_their_own_setting():
    before = switches()
    model = Recorder()
    run = apply_config(CompileConfig("eager", precision="tf32"), model, "cpu")
    strict_seen = []

    def serve():
        for _ in range(CALLS):
            run(torch.ones(2))

    def reference():
        for _ in range(CALLS // 3):
            with strict_fp32():
                strict_seen.append(tf32_state())
                time.sleep(0.0005)
                strict_seen.append(tf32_state())

    run_threads(serve, serve, reference, reference)
    assert set(model.seen) == {("high", True)}
    assert set(strict_seen) == {("highest", False)}
    assert switches() == before


def test_a_thread_nesting_scopes_does_not_wait_on_itself_while_another_waits():
    """Thread A holds TF32 on; B asks for strict fp32 and must wait for A; A then nests a tf32 and a strict scope
    of its own, which must not wait behind B (B waits on A), and runs each with the setting it asked for."""
    before = switches()
    a_in, b_started, a_done = threading.Event(), threading.Event(), threading.Event()
    a_seen, b_seen = [], []

    def a():
        with tf32_enabled(True):
            a_in.set()
            b_started.wait(10)
            time.sleep(0.1)  # B is now waiting for A to leave
            with tf32_enabled(True):
                a_seen.append(tf32_state())
                with strict_fp32():
                    a_seen.append(tf32_state())
                a_seen.append(tf32_state())
            a_done.set()

    def b():
        a_in.wait(10)
        b_started.set()
        with strict_fp32():
            b_seen.append((a_done.is_set(), *tf32_state()))

    run_threads(a, b)
    assert a_seen == [("high", True), ("highest", False), ("high", True)]
    assert b_seen == [(True, "highest", False)]  # B ran only once A had left, with TF32 off
    assert switches() == before


def test_autocast_of_a_bf16_model_stays_in_its_thread():
    """bf16/fp16 go through torch.autocast, whose state is the calling thread's: an fp32 call in another thread
    at the same time runs without it, and nothing is left on afterwards."""
    inside, release = threading.Event(), threading.Event()
    bf16_seen = []

    class Holds(torch.nn.Module):
        def forward(self, x):
            bf16_seen.append(torch.is_autocast_enabled("cpu"))
            inside.set()
            release.wait(10)
            return x

    run = apply_config(CompileConfig("eager", precision="bf16"), Holds(), "cpu")
    plain = apply_config(CompileConfig("eager", precision="fp32"), torch.nn.Linear(2, 2), "cpu")
    other_seen = []

    def other():
        inside.wait(10)
        other_seen.append((torch.is_autocast_enabled("cpu"), plain(torch.ones(1, 2)).dtype))
        release.set()

    run_threads(lambda: run(torch.ones(2)), other)
    assert bf16_seen == [True]
    assert other_seen == [(False, torch.float32)]
    assert not torch.is_autocast_enabled("cpu")


def test_a_child_forked_while_another_thread_holds_tf32_starts_with_the_switches_restored():
    before = switches()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with tf32_enabled(True):
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: the holding thread does not exist here
            code = 1
            try:
                restored = switches() == before
                with strict_fp32():  # must not wait for the thread that is gone
                    strict = tf32_state() == ("highest", False)
                code = 0 if restored and strict and switches() == before else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child hung in a precision scope")
            time.sleep(0.05)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        release.set()
        holder.join(10)
    assert switches() == before
