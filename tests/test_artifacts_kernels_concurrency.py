"""Saves and warm starts of the same artifacts at once: the kernel binaries' tar and its recorded SHA-256 are two
files, and must stay one save's pair. Before, two saves could interleave their renames (A's tar, B's tar, B's
digest, A's digest) and leave a pair that every later warm start refused, and a reader could read the digest of
one save and open the tar of the next. Real files and real locks throughout; the interleavings are forced with
events on the rename and lock steps, and once with real processes racing."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from joulepilot.compiler import artifacts, artifacts_lock
from joulepilot.compiler.artifacts import (
    REFUSED,
    VERIFIED,
    kernels_digest_path,
    kernels_path,
    load_kernels,
    save_warm_start,
    write_kernels,
)
from joulepilot.compiler.artifacts_lock import kernels_lock_path
from kernel_tars import cache_files, cache_folders, members_of, tar_of

WAIT_S = 60  # only a guard against a hang: every wait below is released by an event the other side sets


@pytest.fixture
def caches(tmp_path):
    return cache_folders(tmp_path)


def on_disk_pair(artifacts_path) -> tuple[str, str]:
    """(the recorded digest, the SHA-256 of the tar on disk)."""
    recorded = kernels_digest_path(artifacts_path).read_text().split()[0]
    return recorded, hashlib.sha256(kernels_path(artifacts_path).read_bytes()).hexdigest()


def signal_when_lock_is_busy(monkeypatch, thread_name: str, event: threading.Event) -> None:
    """Set `event` when the thread named `thread_name` finds the kernels' lock taken (and goes on waiting)."""
    real_flock = fcntl.flock

    def flock(fd, operation):
        try:
            return real_flock(fd, operation)
        except BlockingIOError:
            if threading.current_thread().name == thread_name:
                event.set()
            raise

    monkeypatch.setattr(fcntl, "flock", flock)


def run_thread(name: str, target, outcome: dict) -> threading.Thread:
    def body():
        try:
            outcome[name] = target()
        except BaseException as exc:  # reported by the test, not lost in the thread
            outcome[name] = exc

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread


def test_two_saves_at_once_leave_the_later_saves_tar_and_digest(tmp_path, caches, monkeypatch):
    """A renames its tar; B then saves all it can before A renames its digest. Before, that left B's tar beside
    A's digest; now B waits for A's pair, then replaces it with its own."""
    saved = tmp_path / "k.bin"
    start_b, b_done_or_waiting = threading.Event(), threading.Event()
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if threading.current_thread().name == "save-a" and Path(dst) == kernels_path(saved):
            start_b.set()  # A's tar is in place, its digest not yet
            assert b_done_or_waiting.wait(WAIT_S)

    def save_b():
        assert start_b.wait(WAIT_S)
        try:
            return write_kernels(saved, tar_of(members_of("b")))
        finally:
            b_done_or_waiting.set()

    monkeypatch.setattr(os, "replace", replace)
    signal_when_lock_is_busy(monkeypatch, "save-b", b_done_or_waiting)
    outcome: dict = {}
    threads = [run_thread("save-b", save_b, outcome), run_thread("save-a", lambda: write_kernels(saved, tar_of(members_of("a"))), outcome)]
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    digest_a, digest_b = outcome["save-a"], outcome["save-b"]
    assert isinstance(digest_a, str) and isinstance(digest_b, str) and digest_a != digest_b
    assert on_disk_pair(saved) == (digest_b, digest_b)
    assert load_kernels(saved, caches) == (3, VERIFIED, None, digest_b)
    assert cache_files(caches) == members_of("b")


def test_a_warm_start_reads_the_digest_and_the_tar_of_one_save(tmp_path, caches, monkeypatch):
    """A save runs to its end between the reader's reading the digest and its opening the tar. Before, the reader
    checked the new tar against the old digest and refused it; now the save waits until the reader has both
    open, and the reader uses the earlier save's kernels whole."""
    saved = tmp_path / "k.bin"
    digest_1 = write_kernels(saved, tar_of(members_of("1")))
    save_done_or_waiting = threading.Event()
    outcome: dict = {}
    threads: list[threading.Thread] = []
    real_recorded = artifacts.recorded_kernels_digest

    def save_2():
        try:
            return write_kernels(saved, tar_of(members_of("2")))
        finally:
            save_done_or_waiting.set()

    def recorded_kernels_digest(path):
        digest = real_recorded(path)
        if threading.current_thread() is threading.main_thread() and not threads:
            threads.append(run_thread("save-2", save_2, outcome))
            assert save_done_or_waiting.wait(WAIT_S)
        return digest

    monkeypatch.setattr(artifacts, "recorded_kernels_digest", recorded_kernels_digest)
    signal_when_lock_is_busy(monkeypatch, "save-2", save_done_or_waiting)
    loaded = load_kernels(saved, caches)
    assert len(threads) == 1
    threads[0].join(WAIT_S)
    assert not threads[0].is_alive()
    assert loaded == (3, VERIFIED, None, digest_1)
    assert cache_files(caches) == members_of("1")
    digest_2 = outcome["save-2"]
    assert isinstance(digest_2, str) and on_disk_pair(saved) == (digest_2, digest_2)  # the save went on after


def hold_lock_in_another_process(saved: Path) -> subprocess.Popen:
    """A process holding the kernels' lock exclusively (as a save that stopped between its renames), until its
    stdin closes; returns once it holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(kernels_lock_path(saved))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture
def short_lock_wait(monkeypatch):
    monkeypatch.setattr(artifacts_lock, "LOCK_WAIT_S", 0.2)  # the wait is the same, only shorter


def test_a_lock_that_stays_held_costs_only_the_kernels(tmp_path, caches, monkeypatch, short_lock_wait, caplog):
    """A save that cannot take the lock leaves the pair that is there and says why in its info; a warm start
    that cannot goes on without kernels (they are built) and says why. Neither waits for the holder."""
    saved = tmp_path / "k.bin"
    digest_1 = write_kernels(saved, tar_of(members_of("1")))
    # torch's cache entries as a compile would leave them: this test is about the kernels beside them.
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts",
                        lambda: (b"entries", SimpleNamespace(artifacts={"inductor": ["k1"]})))
    kernels_from = tmp_path / "compile-cache"
    (kernels_from / "ab").mkdir(parents=True)
    (kernels_from / "ab" / "cabc.so").write_bytes(b"this compile's kernel")
    holder = hold_lock_in_another_process(saved)
    try:
        with caplog.at_level(logging.WARNING, logger="joulepilot.artifacts"):
            info = save_warm_start(saved, kernels_from={"inductor": kernels_from})
            loaded = load_kernels(saved, caches)
    finally:
        holder.stdin.close()
        holder.wait(WAIT_S)
    assert info.path == saved and saved.read_bytes() == b"entries" and info.entries == {"inductor": 1}
    assert info.kernels == 0 and info.kernels_sha256 is None
    assert info.to_dict()["kernels_error"].startswith("kernel binaries not saved: ")
    assert str(kernels_lock_path(saved)) in info.kernels_error
    assert on_disk_pair(saved) == (digest_1, digest_1)  # the earlier save's pair, untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert loaded.written == 0 and loaded.integrity == REFUSED and str(kernels_lock_path(saved)) in loaded.error
    assert cache_files(caches) == {}
    said = [r.getMessage() for r in caplog.records]
    assert any("not saved" in m and str(kernels_lock_path(saved)) in m for m in said)
    assert any("not used" in m and str(kernels_lock_path(saved)) in m for m in said)
    assert load_kernels(saved, caches) == (3, VERIFIED, None, digest_1)  # once the holder is gone


SAVER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from joulepilot.compiler.artifacts import write_kernels
from kernel_tars import cache_files, cache_folders, members_of, tar_of
saved, writer, saves = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(saves):
    write_kernels(saved, tar_of(members_of(f"{writer}-{i}")))
"""


def test_warm_starts_during_concurrent_saves_always_find_one_saves_pair(tmp_path, caches):
    """Two processes save the same artifacts over and over while this one loads them: every load verifies, and
    unpacks all of one save's binaries; when the saves end, the pair on disk is one save's."""
    saved = tmp_path / "k.bin"
    write_kernels(saved, tar_of(members_of("first")))
    savers = [subprocess.Popen([sys.executable, "-c", SAVER, str(saved), writer, "40", str(Path(__file__).parent)],
                               stderr=subprocess.PIPE, text=True) for writer in ("a", "b")]
    loads = []
    while any(saver.poll() is None for saver in savers) or len(loads) < 2:
        loaded = load_kernels(saved, caches)
        assert loaded.integrity == VERIFIED, loaded.error
        tags = {data.decode().split(";")[0].split()[-1] for data in cache_files(caches).values()}
        assert len(tags) == 1, tags  # every binary of one save
        loads.append(tags.pop())
    for saver in savers:
        assert saver.wait(WAIT_S) == 0, saver.stderr.read()[-2000:]
    recorded, actual = on_disk_pair(saved)
    assert recorded == actual
    assert load_kernels(saved, caches).integrity == VERIFIED
