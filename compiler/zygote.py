"""The parent's side of the worker zygote: one per workload, started when its first job runs.

A sweep measures one workload under many configurations; each configuration's worker used to start
Python, import torch, Dynamo, Inductor and the model's library and build the model before doing any work
of its own. A zygote (`zygote_server.py`) does that once; each job then runs in a process forked from it,
with fresh compile caches, exactly as a fresh worker would run it. `ZygotePool` keeps, on each device, the
zygote of the workload being swept there and closes it when that device moves to another workload or the
sweep ends; a sweep over several GPUs shares one pool between its measuring threads.

Where forking is not possible (preloading initialised CUDA or started threads, the zygote died or did not
get ready within its allowance, or `JOULEPILOT_FORK_WORKERS=0`), the workload's jobs run as fresh
processes, as before; each result says which (`worker_process`).
"""

from __future__ import annotations

import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

FORK_WORKERS_ENV = "JOULEPILOT_FORK_WORKERS"
FORKED = "forked from the workload's zygote"
FRESH = "fresh process"
START_POLL_S = 0.2
EXIT_WAIT_S = 10.0
FORK_WAIT_S = 30.0


class ZygoteGone(RuntimeError):
    """The zygote's pipe closed: it exited or was killed."""


@dataclass(frozen=True)
class ZygoteKey:
    """What a zygote preloads: one workload (spec and shape) for one device."""

    spec: str
    batch_size: int
    seq_len: int | None
    image_size: int | None
    seed: int
    device: str
    # the job's model options and generation (`generation_workloads.job_fields`) as sorted JSON; '' for none
    variant: str = ""

    @classmethod
    def of_job(cls, job: dict[str, Any]) -> ZygoteKey:
        variant = {k: job[k] for k in ("model_options", "generation") if job.get(k)}
        return cls(str(job["spec"]), int(job["config"].get("batch_size") or 1), job.get("seq_len"),
                   job.get("image_size"), int(job.get("seed", 1234)), str(job["device"]),
                   json.dumps(variant, sort_keys=True) if variant else "")


def forking_enabled() -> bool:
    """False when JOULEPILOT_FORK_WORKERS is 0/false/no/off: every job then runs in a fresh process."""
    return os.environ.get(FORK_WORKERS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def kill_process_tree(pid: int) -> None:
    """SIGKILL a worker that leads its own session and every descendant (one that left the group too)."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)  # forked a moment ago, before it made its own session
        except (ProcessLookupError, PermissionError):
            pass
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=5)


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


class Zygote:
    """A started zygote and the pipe to it; one job at a time."""

    def __init__(self, key: ZygoteKey, proc: subprocess.Popen, workdir: Path) -> None:
        self.key = key
        self.proc = proc
        self.workdir = workdir
        self.info: dict[str, Any] = {}
        self._buffer = b""
        self.gone = False
        self.early = False  # started ahead of its workload's first job (`ZygotePool.start_early`)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, key: ZygoteKey, *, module: str, workdir: Path, env: dict[str, str]) -> Zygote:
        setup = workdir / "zygote.json"
        setup.write_text(json.dumps({**asdict(key), "parent_pid": os.getpid()}))
        env = dict(env)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / "inductor-cache")  # stays empty: it never compiles
        env["TRITON_CACHE_DIR"] = str(workdir / "triton-cache")
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        with open(workdir / "stderr.txt", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", module, "--zygote", str(setup)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True)
        return cls(key, proc, workdir)

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        """The zygote's next message, or None when none came within `timeout_s`; ZygoteGone at its end."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                return json.loads(line)
            if self.gone:
                raise ZygoteGone(f"zygote {self.pid} exited")
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self.gone = True
                continue
            self._buffer += chunk

    def wait_ready(self, limit_s: float, cancel: Callable[[], str | None] | None) -> tuple[str, str | None]:
        """('ready', None) once the zygote has preloaded and can fork; ('refused', why) when it cannot, died
        or ran out of time; ('cancelled', reason) when `cancel` asked to stop."""
        deadline = time.monotonic() + limit_s
        while True:
            reason = cancel() if cancel is not None else None
            if reason:
                return "cancelled", reason
            try:
                event = self.next_event(min(START_POLL_S, max(0.0, deadline - time.monotonic())))
            except ZygoteGone:
                code = self.proc.wait()
                why = f"the zygote exited with code {code} while preloading"
                last = _last_line(self.workdir / "stderr.txt")
                return "refused", f"{why}: {last}" if last else why
            if event is not None and event.get("event") == "ready":
                self.info = event
                if event.get("fork_safe"):
                    return "ready", None
                return "refused", str(event.get("why") or "the zygote cannot fork")
            if time.monotonic() >= deadline:
                return "refused", f"the zygote was not ready within {limit_s:g} s"

    def fork(self, command: dict[str, Any]) -> ForkedWorker:
        """Ask for a worker running `command`; ZygoteGone if the zygote is no longer there."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"op": "run", **command}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self.gone = True
            raise ZygoteGone(f"zygote {self.pid} is gone: {exc}") from exc
        while True:
            event = self.next_event(FORK_WAIT_S)
            if event is None:
                # It may still fork later: end it (and anything it forked) so no second worker runs the job.
                kill_process_tree(self.pid)
                self.gone = True
                raise ZygoteGone(f"zygote {self.pid} did not start a worker within {FORK_WAIT_S:g} s")
            if event.get("event") == "started":
                return ForkedWorker(self, int(event["pid"]))

    def close(self) -> None:
        """Ask the zygote to exit, kill it if it does not, and remove its folder."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                try:
                    self.proc.stdin.write(b'{"op": "exit"}\n')
                    self.proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                kill_process_tree(self.proc.pid)
                self.proc.wait(timeout=10)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            shutil.rmtree(self.workdir, ignore_errors=True)


class ForkedWorker:
    """A job's worker forked by a zygote, watched like a subprocess (`pid`, `poll`, `returncode`)."""

    how = FORKED

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self.note = ""

    def poll(self, timeout_s: float = 0.0) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            event = self.zygote.next_event(timeout_s)
        except ZygoteGone:
            # The worker dies with its zygote (PR_SET_PDEATHSIG): make sure, then report it as killed.
            kill_process_tree(self.pid)
            self.returncode = -signal.SIGKILL
            self.note = "its zygote process died"
            return self.returncode
        if event is not None and event.get("event") == "exited" and int(event.get("pid", -1)) == self.pid:
            self.returncode = int(event["code"])
        return self.returncode

    def kill_tree(self) -> None:
        kill_process_tree(self.pid)
        deadline = time.monotonic() + EXIT_WAIT_S
        while self.poll(timeout_s=0.5) is None and time.monotonic() < deadline:
            pass


class _Starter:
    """The thread that starts a pool's zygotes. The kernel sends a zygote its PR_SET_PDEATHSIG when the thread
    that started it ends, not only the process: a measuring thread (one per job on a GPU, `device_pool.py`)
    ends with its job, so a zygote started there would die before the device's next job. This thread lives
    as long as the pool."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[Callable[[], Zygote], Future[Zygote]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="joulepilot-zygote-starter", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            start, done = request
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(start())
            except BaseException as exc:  # noqa: BLE001 - raised again in the thread that asked
                done.set_exception(exc)

    def start(self, start: Callable[[], Zygote]) -> Zygote:
        """`start()` run on this thread; its zygote, or what it raised."""
        done: Future[Zygote] = Future()
        self._requests.put((start, done))
        try:
            return done.result()
        except BaseException:
            if not done.cancel():  # Ctrl-C while it started: nobody would close it otherwise
                done.add_done_callback(lambda f: f.exception() is None and f.result().close())
            raise

    def stop(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=10)


class _Slot:
    """One device's zygotes: the ready one, and one started early that nobody has waited for yet. `lock` is
    held by the job that is getting a zygote on this device (one job per device at a time)."""

    def __init__(self) -> None:
        self.current: Zygote | None = None
        self.pending: Zygote | None = None
        self.lock = threading.Lock()

    def close(self) -> None:
        for zygote in (self.current, self.pending):
            if zygote is not None:
                zygote.close()
        self.current = self.pending = None


class ZygotePool:
    """The zygote of the workload being measured on each device (at most one alive per device); a context
    manager that closes them all.

    `zygote_for(job)` starts the zygote of the job's workload and device at the first such job and waits for
    it; None means "run this job as a fresh process" (`fallback_reason(job)` says why). A zygote that died
    is started again once. One pool serves a sweep over several devices: each device's jobs, one at a time,
    come from a thread of their own, and its zygote is used by that device's jobs only (a zygote forks one
    worker at a time and its pipe has one reader), so the pool's bookkeeping is guarded by a lock, and a
    device's zygote by a lock of its own that one device's slow preload does not hold up the others with.
    Every zygote is started by the pool's own thread (`_Starter`), whatever thread asks."""

    def __init__(self, *, enabled: bool | None = None) -> None:
        self.enabled = forking_enabled() if enabled is None else enabled
        self._slots: dict[str, _Slot] = {}
        self._refused: dict[ZygoteKey, str] = {}
        self._deaths: dict[ZygoteKey, int] = {}
        self._lock = threading.Lock()  # _slots, _refused, _deaths, _starter, _closed
        self._starter: _Starter | None = None
        self._closed = False

    def __enter__(self) -> ZygotePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _slot(self, device: str) -> _Slot:
        with self._lock:
            return self._slots.setdefault(device, _Slot())

    def _only_slot(self) -> _Slot | None:
        with self._lock:
            slots = list(self._slots.values())
        if len(slots) > 1:
            raise RuntimeError("the pool serves several devices: ask zygote_on(device) or pending_on(device)")
        return slots[0] if slots else None

    @property
    def current(self) -> Zygote | None:
        """The ready zygote of the one device this pool has served (see `zygote_on` for several)."""
        slot = self._only_slot()
        return slot.current if slot is not None else None

    @property
    def pending(self) -> Zygote | None:
        """The zygote started early, not yet waited for, of the one device this pool has served."""
        slot = self._only_slot()
        return slot.pending if slot is not None else None

    def zygote_on(self, device: str) -> Zygote | None:
        with self._lock:
            slot = self._slots.get(device)
        return slot.current if slot is not None else None

    def pending_on(self, device: str) -> Zygote | None:
        with self._lock:
            slot = self._slots.get(device)
        return slot.pending if slot is not None else None

    def fallback_reason(self, job: dict[str, Any]) -> str:
        if not self.enabled:
            return f"{FORK_WORKERS_ENV}=0"
        with self._lock:
            return self._refused.get(ZygoteKey.of_job(job), "")

    def _refused_key(self, key: ZygoteKey) -> bool:
        with self._lock:
            return key in self._refused

    def _start(self, key: ZygoteKey, start: Callable[[ZygoteKey], Zygote]) -> Zygote | None:
        """A zygote for `key`, started on the pool's thread; None once the pool is closed."""
        with self._lock:
            if self._closed:
                return None
            if self._starter is None:
                self._starter = _Starter()
            starter = self._starter
        return starter.start(lambda: start(key))

    def start_early(self, job: dict[str, Any], start: Callable[[ZygoteKey], Zygote]) -> bool:
        """Start the zygote for `job`'s workload now without waiting for it; True when one was started. A GPU
        sweep does this before it measures the GPU's idle power, and the daemon for the workload a GPU will
        measure next, while the current one measures there: the zygote's work on the CPU does not disturb the
        GPU's counter. Nothing happens while a job on that device is getting its zygote, when the device's
        zygote is that workload's already, or when another was started early there and not used yet."""
        if not self.enabled:
            return False
        key = ZygoteKey.of_job(job)
        slot = self._slot(key.device)
        if not slot.lock.acquire(blocking=False):
            return False
        try:
            current = slot.current
            if slot.pending is None and (current is None or current.key != key) and not self._refused_key(key):
                slot.pending = self._start(key, start)
                if slot.pending is None:
                    return False
                slot.pending.early = True
                return True
            return False
        finally:
            slot.lock.release()

    def zygote_for(self, job: dict[str, Any], *, start: Callable[[ZygoteKey], Zygote], limit_s: float,
                   cancel: Callable[[], str | None] | None = None) -> tuple[Zygote | None, str | None]:
        """(a ready zygote for `job` or None, the cancel reason when `cancel` stopped the wait)."""
        if not self.enabled:
            return None, None
        key = ZygoteKey.of_job(job)
        slot = self._slot(key.device)
        with slot.lock:
            if self._refused_key(key):
                return None, None
            current = slot.current
            if current is not None and (current.key != key or current.gone or current.proc.poll() is not None):
                current.close()  # the zygote started early for this workload, if any, stays
                slot.current = None
                with self._lock:
                    if current.key == key:
                        self._deaths[key] = self._deaths.get(key, 0) + 1
                    if self._deaths.get(key, 0) >= 2:
                        self._refused[key] = "its zygote died twice"
                        return None, None
            if slot.current is None:
                zygote, slot.pending = slot.pending, None
                if zygote is not None and zygote.key != key:
                    zygote.close()
                    zygote = None
                zygote = zygote or self._start(key, start)
                if zygote is None:  # the pool was closed
                    return None, None
                try:
                    state, why = zygote.wait_ready(limit_s, cancel)
                except BaseException:  # Ctrl-C while it preloads
                    zygote.close()
                    raise
                if state != "ready":
                    zygote.close()
                    if state == "cancelled":
                        return None, why
                    with self._lock:
                        self._refused[key] = why or "the zygote cannot fork"
                    return None, None
                slot.current = zygote
            return slot.current, None

    def close(self) -> None:
        """Close every device's zygotes (the workers they forked die with them) and the pool's thread."""
        with self._lock:
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
            starter, self._starter = self._starter, None
        for slot in slots:
            slot.close()
        if starter is not None:
            starter.stop()
