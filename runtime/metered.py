"""Live metering of a deployed model: count calls on the hot path, meter energy off it.

`runtime.attach.attach(model, "name")` returns a `MeteredModel`. Calling it runs the wrapped model and
bumps an `itertools.count` (atomic under the GIL, no lock, no device call). A daemon thread wakes every
`interval_s`, reads the cumulative energy counter of the deployment's device (plus a few instant
power reads in between, for the peak), and appends one sample per window. Samples are written to
the store in batches, one transaction per batch, and flushed on `close()` and at interpreter exit
(`atexit`). A SIGTERM handler that flushes (chained to the previous one) is opt-in
(`flush_on_sigterm()`): a serving process's signals belong to its framework. Without it, a SIGTERM
that ends the process without a normal exit, like a SIGKILL, loses at most the unflushed batch
(`flush_interval_s`, 30 s by default). Python runs that handler in the main thread, between two bytecodes of
whatever it was running; a SIGTERM that lands while the main thread is inside a deployment's `flush()` or `close()`
(holding locks the handler's own flush needs) is held until that call ends, then handled
(`runtime.signal_deferral`), still within EXIT_WAIT_S of its arrival.

The store never stops the metering nor holds up the served process for long. The thread waits at most
STORE_WAIT_S for the store's write lock; a batch it refuses stays in memory for the next flush and is kept
meanwhile in a side file beside the database (`store.deployment_side_files`), so a kill while the store is
locked loses nothing either. Exit waits at most EXIT_WAIT_S for the last windows; what the store has not
taken by then is in the side file, which the next deployment attached to that database (or `bench`, or the
daemon) imports. Windows and violations are stored idempotently, so a retry or a second import counts
nothing twice. A window the meter cannot read folds its calls and energy into the next one it can.

The envelope guard (`runtime.guard`) sees every window. When it trips it warns at once and its violation is
written with the windows that show it (after them, in the same transaction); with `action = "fallback"`,
the metering thread only *requests* a swap; the next call on the caller's thread builds (compiles)
the fallback configuration and serves with it from then on, so that compile happens where a
`torch.compile` call would normally happen and never races the model from another thread.

A process forked after `attach` (a prefork server's workers) meters its own calls: at its first call it
starts a metering thread of its own, with its own counter from zero, a new database connection and, where
joulepilot built the meter, a new meter for that process. The parent's unwritten windows stay the parent's.
A child that never calls the model (a helper process) meters nothing, and once a child meters, a window in
which the parent served no call is not written: it would hold the children's use of the device again.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import mmap
import os
import signal
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from joulepilot.policies.resolve import torch_minor
from joulepilot.store import Store, as_store_error, is_busy, open_db, transaction
from joulepilot.store.deployment_side_files import (
    deployment_side_file,
    describe_deployment_imports,
    drop_deployment_side_file,
    import_deployment_side_files,
    set_aside_deployment,
)
from joulepilot.store.deployment_writes import store_samples
from joulepilot.store.deployments import set_deployment_config
from joulepilot.store.lock_wait import set_lock_wait_s

from .guard import EnvelopeGuard
from .signal_deferral import SignalDeferral
from .trips import trip_rows, warn_trip, write_trip

log = logging.getLogger("joulepilot.deployment")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_FLUSH_INTERVAL_S = 30.0
POWER_READS_PER_WINDOW = 4
# A last window (at close) shorter than this many seconds, or than this fraction of the interval, is folded
# into the window before it: the energy counter steps every ~100 ms, so a sliver of a window reads 0 J
# (0 W in the exporter, a drop in plots) or one whole step (a spike).
MIN_TAIL_S = 1.0
MIN_TAIL_FRACTION = 0.2
# The metering thread waits at most this long for the store's write lock (another process's long write); a
# batch refused meanwhile stays buffered, goes to the side file, and is retried at the next flush.
STORE_WAIT_S = 2.0
# Interpreter exit (and a SIGTERM with `flush_on_sigterm`) waits at most this long, for every deployment of the
# process together, for the last windows to be written: two store waits (a write under way, then the last one).
# Whatever the store has not taken by then is in the side file.
EXIT_WAIT_S = 5.0
# While it waits for a metering thread to end, close() looks this often for a SIGTERM that arrived meanwhile (and
# shortens the wait to what is left of EXIT_WAIT_S since it arrived).
JOIN_SLICE_S = 0.05


@dataclass
class Fallback:
    """A configuration to swap to: its id and label, and how to build the callable (lazily)."""

    config_id: str | None
    label: str
    build: Callable[[], Callable[..., Any]]


def _torch_version() -> str:
    """major.minor, as decisions record it."""
    try:
        return torch_minor()
    except Exception:  # noqa: BLE001 - torch metadata missing: the decision's own version is used
        return ""


def _own_pids() -> set[int]:
    pids = {os.getpid()}
    try:
        import psutil

        pids |= {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:  # noqa: BLE001 - psutil is best effort here
        pass
    return pids


def _shared_gpu(index: int) -> tuple[int, float | None]:
    """(other compute processes on the GPU, this process tree's share of their utilisation)."""
    from joulepilot.telemetry import gpu_activity  # looked up per call: tests stand in a shared GPU

    activity = gpu_activity(index)
    pids = set(getattr(activity, "compute_pids", None) or [])
    mine = _own_pids()
    others = pids - mine
    if not others:
        return 0, 1.0
    util = getattr(activity, "process_utilization", None)
    if not util:
        return len(others), None
    ours = sum(pct for pid, pct in util.items() if pid in mine)
    total = sum(util.values())
    return len(others), (ours / total if total > 0 else None)


def _side_token() -> str:
    """Names this process's side file: its pid and a random part (a pid is reused, the file may outlive it)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


class MeteredModel:
    """A callable deployment: forwards calls to the model, counts them, meters energy in the background."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        *,
        deployment_id: int | None,
        db_path: str | None,
        shared_db: Store | None,
        meter: Any,
        own_meter: bool,
        device: str,
        interval_s: float,
        flush_interval_s: float,
        config_id: str | None,
        config_label: str | None,
        policy_name: str | None,
        decision: dict[str, Any] | None,
        device_kind: str | None,
        guard: EnvelopeGuard | None,
        fallback: Fallback | Callable[[], Fallback | None] | None,
        register: Callable[[Store], Any] | None = None,
        generates: bool = False,
    ) -> None:
        self._fn = fn
        self._calls = itertools.count()
        # A generation (`generate`): the tokens its calls generated, and the calls under way (a generate call can
        # outlast a window: a window it ran in served something, though no call ended in it).
        self.generates = generates
        self._tokens = 0
        self._tokens_lock = threading.Lock()
        self._in_flight = 0
        self._ran_in_window = False
        self._last_tokens = 0
        self._pending_swap: Fallback | None = None
        self._attend = False  # the next call has something to do first (a swap, or starting metering in a fork)
        self._dormant = False  # a forked child that has not served yet: it meters from its first call
        self.name = name
        self.deployment_id = deployment_id
        # With deployment_id None: registers the deployment on the thread's connection (attach's `_register`),
        # before the first windows are written; retried at each flush while the store refuses.
        self._register = register
        self.device = device
        self.interval_s = float(interval_s)
        self.flush_interval_s = float(flush_interval_s)
        self.config_id = config_id
        self.config_label = config_label
        self.policy_name = policy_name
        self.decision_row = decision
        self._decided = True  # what serves is what `decision_row` chose (until a fallback swap)
        self.device_kind = device_kind
        self.guard = guard
        self.trips: list[dict[str, Any]] = []
        self._fallback = fallback
        self._meter = meter
        self._own_meter = own_meter
        self._db_path = db_path
        self._shared_db = shared_db
        self._db: Store | None = None
        self._buffer: list[dict[str, Any]] = []  # windows taken, not yet in the store
        self._pending_trips: list[dict[str, Any]] = []  # trips whose rows are not yet in the store
        # The main thread takes the buffer and write locks only inside `_SIGTERM_DEFERRAL.busy()` (flush, close): the
        # SIGTERM handler, which runs in the main thread, needs them too. It never needs the swap lock.
        self._buffer_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._final_flush_tried = False
        self._store_refusing = False  # the last flush failed (logged once until the store takes a batch)
        self._meter_failing = False  # the last window could not be read (logged once until one is)
        self._side_imported = False  # side files left beside the database have been imported
        self._side_token = _side_token()
        self._side_file: Path | None = None  # this deployment's side file, while it holds something
        # Set (to 1) by a child forked from this process when it starts metering; shared memory, seen here at once.
        self._children_metering = mmap.mmap(-1, 1)
        self._written_config_id = config_id
        self._newest: dict[str, Any] | None = None  # the newest window taken (buffered or written)
        self.samples_written = 0
        self._use_meter(meter)
        self._last_mono = time.monotonic()  # windows are timed by this clock; the wall clock only stamps them
        self._last_t_end = time.time()  # the stamped end of the newest window (here: where the first starts)
        self._last_e: float | None = self._energy_now()  # None: no starting reading yet (the next window takes one)
        self._last_n = 0
        self._last_flush = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"joulepilot-meter:{name}", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        _flush_at_exit()
        _restart_in_forked_children()

    def _use_meter(self, meter: Any) -> None:
        self._meter = meter
        gpus = [d for d in meter.devices if getattr(d, "kind", "") == "gpu"]
        self._gpu_index = gpus[0].index if gpus else None
        self.energy_source = meter.primary_source

    # -- hot path ---------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._attend:
            self._attend_to()
        out = self._fn(*args, **kwargs)
        next(self._calls)
        return out

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's `generate`, metered: one call, and the tokens it generated over the whole batch
        (`compiler.generation.generated_tokens`: each sequence's new tokens up to its end-of-sequence token)."""
        from joulepilot.compiler.generation import generated_tokens

        if self._attend:
            self._attend_to()
        model = self._fn
        with self._tokens_lock:
            self._in_flight += 1
            self._ran_in_window = True
        try:
            out = model.generate(*args, **kwargs)
        finally:
            with self._tokens_lock:
                self._in_flight -= 1
        tokens = generated_tokens(model, out, args, kwargs)
        with self._tokens_lock:
            self._tokens += tokens
        next(self._calls)
        return out

    @property
    def inferences(self) -> int:
        """Completed calls so far (read without advancing the counter: `count(N)` reprs as N)."""
        return int(repr(self._calls)[6:-1])

    @property
    def tokens(self) -> int:
        """Tokens generated by the completed `generate` calls so far."""
        return self._tokens

    def _window_activity(self) -> tuple[int, bool]:
        """(tokens so far, whether a generate call ran during the window now ending), starting the next window."""
        with self._tokens_lock:
            ran = self._ran_in_window or self._in_flight > 0
            self._ran_in_window = self._in_flight > 0
            return self._tokens, ran

    def __getattr__(self, item: str) -> Any:
        # Only reached for names MeteredModel lacks: behave like the wrapped model (eval(), .training, ...).
        if item.startswith("__") or "_fn" not in self.__dict__:
            raise AttributeError(item)
        return getattr(self.__dict__["_fn"], item)

    # -- the caller's thread: fallback swap, metering in a forked child ---------------------------
    def _attend_to(self) -> None:
        with self._swap_lock:
            self._attend = False  # cleared before reading what to do: a request made meanwhile sets it again
            if self._dormant:
                self._start_in_child()
            target = self._pending_swap
            if target is None:
                return
            log.warning("deployment %r: switching to fallback configuration %s (building it now)",
                        self.name, target.label)
            self._fn = target.build()
            self.config_id = target.config_id
            self.config_label = target.label
            self._decided = False  # no decision chose the fallback (see `_on_trip`)
            if self.guard is not None:
                self.guard.reset()
            self._pending_swap = None

    def request_swap(self, target: Fallback) -> None:
        """Serve `target` from the next call on (it is built on the caller's thread at that call)."""
        self._pending_swap = target
        self._attend = True

    # -- metering thread --------------------------------------------------------------------------
    def _energy_now(self) -> float:
        return float(sum(self._meter.read_energy_j().values()))

    def _power_now(self) -> float | None:
        try:
            readings = self._meter.read_power_w()
        except Exception:  # noqa: BLE001 - a failed instant read only loses the peak
            return None
        return float(sum(readings.values())) if readings else None

    def _database(self) -> Store:
        if self._db is None:
            if not self._db_path:
                self._db = self._shared_db
            else:
                # The thread writes through its own connection so a caller's open transaction never mixes in,
                # and waits for the store's lock only briefly: what it cannot write now, it writes later.
                db = open_db(self._db_path)
                try:
                    set_lock_wait_s(db, STORE_WAIT_S)
                except Exception:
                    db.close()
                    raise
                self._db = db
        return self._db

    def _registered(self, db: Store) -> int:
        """The deployment's id, registering it first when `attach` left that to this thread (raises as the store)."""
        if self.deployment_id is None and self._register is not None:
            registered = self._register(db)
            self.deployment_id = registered.deployment_id
            self.decision_row = registered.decision_row or self.decision_row
            self.config_label = self.config_label or registered.config_label
            log.info("deployment %r registered (id %d) by its metering thread", self.name, self.deployment_id)
        assert self.deployment_id is not None
        return self.deployment_id

    def _register_or_wait(self) -> None:
        """Register now (waiting at most STORE_WAIT_S); when the store refuses, the first flush it takes does."""
        try:
            with self._write_lock:
                self._registered(self._database())
        except Exception as exc:  # noqa: BLE001 - retried at each flush; the windows wait, buffered
            log.warning("deployment %r: not registered in the store yet (%s); its windows are kept until it is",
                        self.name, exc)

    def _run(self, in_child: bool = False) -> None:
        try:
            if in_child:
                self._begin_in_child()
            elif self.deployment_id is None:
                self._register_or_wait()
            step_s = self.interval_s / POWER_READS_PER_WINDOW
            next_sample = time.monotonic() + self.interval_s
            powers: list[float] = []
            while not self._stop.wait(max(0.0, min(step_s, next_sample - time.monotonic()))):
                if time.monotonic() < next_sample:
                    power = self._power_now()
                    if power is not None:
                        powers.append(power)
                    continue
                self._take_sample_or_carry_on(powers)
                powers = []
                next_sample += self.interval_s
                if next_sample < time.monotonic():  # a stall: don't queue up a burst of short windows
                    next_sample = time.monotonic() + self.interval_s
                self._maybe_flush()
            self._take_sample_or_carry_on(powers, final=True)
            self._final_flush()
        except Exception:  # noqa: BLE001 - metering must never take the served model down
            log.exception("deployment %r: metering stopped", self.name)
        finally:
            if self._db is not None and self._db is not self._shared_db:
                self._db.close()
                self._db = None

    def _take_sample_or_carry_on(self, powers: list[float], final: bool = False) -> None:
        """Take a window; when the meter fails, its calls and energy go to the next window that can be read."""
        try:
            self._take_sample(powers, final=final)
        except Exception:  # noqa: BLE001 - a failed reading must not stop the metering
            if not self._meter_failing:
                log.warning("deployment %r: a window could not be metered; its calls and energy are counted "
                            "in the next window that can be", self.name, exc_info=True)
            self._meter_failing = True
            return
        if self._meter_failing:
            log.warning("deployment %r: the meter reads again", self.name)
            self._meter_failing = False

    def _take_sample(self, powers: list[float], final: bool = False) -> None:
        mono_end = time.monotonic()
        t_end = time.time()
        energy = self._energy_now()
        count = self.inferences
        tokens, generating = self._window_activity()
        if self._last_e is None:  # no starting reading (a forked child whose meter failed): this is it
            self._last_mono, self._last_e, self._last_t_end = mono_end, energy, t_end
            self._last_n, self._last_tokens = count, tokens
            return
        # The window's length comes from the monotonic clock, so a wall-clock step (NTP, a VM resuming)
        # neither stretches nor squeezes it; see `_stamps` for where it is placed in wall-clock time.
        duration_s = mono_end - self._last_mono
        if final and duration_s <= 0:
            return
        inferences = count - self._last_n
        served = inferences > 0 or generating  # a generate call under way serves, though none ended yet
        if not served and self._children_metering[0]:
            # A child forked from here meters this deployment: a window in which this process served nothing
            # holds only the children's use of the device (or of this process tree), which they write themselves.
            self._last_mono, self._last_e, self._last_n = mono_end, energy, count
            self._last_tokens = tokens
            self._last_t_end = max(self._last_t_end, t_end)
            if self.guard is not None and not final:
                self.guard.feed(None)  # an idle window breaks the guard's streak, as it would if written
            return
        if final and duration_s < max(MIN_TAIL_S, MIN_TAIL_FRACTION * self.interval_s) \
                and self._fold_tail(duration_s, mono_end, energy, count, powers, tokens):
            return
        energy_j = max(0.0, energy - self._last_e)
        avg_power_w = energy_j / duration_s if duration_s > 0 else None
        # The window's mean power bounds its peak from below; sparse instant reads can miss the top.
        candidates = [p for p in powers if p is not None] + ([avg_power_w] if avg_power_w is not None else [])
        other_processes, share = 0, (1.0 if self.energy_source == "estimate" else None)
        if self._gpu_index is not None:
            try:
                other_processes, share = _shared_gpu(self._gpu_index)
            except Exception:  # noqa: BLE001 - attribution is best effort
                other_processes, share = 0, None
        t_start, t_end = self._stamps(t_end, duration_s)
        sample = {
            "t_start": t_start,
            "t_end": t_end,
            "energy_j": energy_j,
            "inferences": inferences,
            "avg_power_w": avg_power_w,
            "peak_power_w": max(candidates) if candidates else None,
            "energy_source": self.energy_source,
            "config_id": self.config_id,
            "other_processes": other_processes,
            "share": share,
            "tokens": tokens - self._last_tokens if self.generates else None,
        }
        self._last_mono, self._last_e, self._last_n, self._last_t_end = mono_end, energy, count, t_end
        self._last_tokens = tokens
        with self._buffer_lock:
            self._buffer.append(sample)
        self._newest = sample
        if self.guard is not None and not final:
            # a window of a generate call under way is not idle, though no call ended in it
            trip = self.guard.feed(avg_power_w, inferences=max(inferences, int(served)), at=t_end, energy_j=energy_j,
                                   tokens=sample["tokens"])
            if trip is not None:
                self._on_trip(trip)

    def _stamps(self, wall_end: float, duration_s: float) -> tuple[float, float]:
        """(t_start, t_end) of a window that lasted `duration_s` (monotonic) and ended at `wall_end` (wall clock).

        The length wins: t_end - t_start is always the metered duration. The window ends at the wall clock
        unless it would then start before the previous window ended (the wall clock stepped back): it then
        starts where that one ended. So windows never overlap and stay in order; after a step forward (a VM
        resuming) they follow the wall clock at once, leaving a gap; after a step back the stamps run ahead
        of the wall clock by at most the step, for as long as this deployment runs.
        """
        t_start = wall_end - duration_s
        if t_start < self._last_t_end:
            t_start = self._last_t_end
        return t_start, t_start + duration_s

    def _fold_tail(self, tail_s: float, mono_end: float, energy: float, count: int, powers: list[float],
                   tokens: int = 0) -> bool:
        """Extend the newest window by the tail's `tail_s` seconds (monotonic) instead of writing a short last
        one; False when there is no window to extend (the tail is then written on its own)."""
        previous = self._newest
        if previous is None or previous["config_id"] != self.config_id or self._last_e is None:
            return False
        merged = dict(previous)
        # The window keeps its start stamp (the store knows it by that) and grows by the tail's monotonic
        # length, so its stamps still span exactly the time it metered.
        merged["t_end"] = previous["t_end"] + tail_s
        merged["energy_j"] = previous["energy_j"] + max(0.0, energy - self._last_e)
        merged["inferences"] = previous["inferences"] + count - self._last_n
        if previous.get("tokens") is not None:
            merged["tokens"] = previous["tokens"] + tokens - self._last_tokens
        duration_s = merged["t_end"] - previous["t_start"]
        merged["avg_power_w"] = merged["energy_j"] / duration_s if duration_s > 0 else previous["avg_power_w"]
        # The tail's own mean power is what a counter step distorts, so only its instant reads count.
        peaks = [p for p in (previous["peak_power_w"], merged["avg_power_w"], *powers) if p is not None]
        merged["peak_power_w"] = max(peaks) if peaks else None
        # Under the write lock: a flush on another thread must not write `previous` and then drop `merged`.
        with self._write_lock, self._buffer_lock:
            if self._buffer and self._buffer[-1] is previous:
                self._buffer[-1] = merged
            else:  # already stored: the next flush extends the stored window (same start, later end) to it
                self._buffer.append(merged)
        self._newest = merged
        self._last_mono, self._last_e, self._last_n = mono_end, energy, count
        self._last_tokens = tokens
        self._last_t_end = merged["t_end"]
        return True

    def _on_trip(self, trip: Any) -> None:
        rows = trip_rows(trip, deployment=self.name, policy=self.policy_name, config_id=self.config_id,
                         decision=self.decision_row, device_kind=self.device_kind, torch_version=_torch_version(),
                         source=self.energy_source, config_label=self.config_label, broke_decision=self._decided)
        entry = {"message": rows["message"], "violation_id": None, "decision_id": None}
        with self._buffer_lock:
            self._pending_trips.append({"rows": rows, "entry": entry})
        try:
            warn_trip(rows["message"])
        except Exception:  # noqa: BLE001 - warnings turned into errors: the trip is recorded all the same
            log.warning("%s", rows["message"])
        # Stored now rather than at the next flush, after the windows that show it (in the same transaction); a
        # store that refuses it delays the fallback by at most STORE_WAIT_S.
        self._flush_or_keep()
        if self.guard is not None and self.guard.action == "fallback":
            try:
                self._request_fallback()
            except Exception:  # noqa: BLE001 - a fallback that cannot be prepared keeps the current one serving
                log.warning("deployment %r: the fallback configuration could not be prepared; serving on with "
                            "%s", self.name, self.config_label, exc_info=True)
        self.trips.append(entry)

    def _request_fallback(self) -> None:
        target = self._fallback() if callable(self._fallback) and not isinstance(self._fallback, Fallback) \
            else self._fallback
        if target is None:
            warnings.warn(f"deployment {self.name!r}: guard action is 'fallback' but no fallback "
                          "configuration is available (pass base_model= or fallback= to attach); keeping "
                          "the current configuration", RuntimeWarning, stacklevel=2)
            return
        if target.config_id is not None and target.config_id == self.config_id:
            warnings.warn(f"deployment {self.name!r} already serves its fallback configuration "
                          f"{target.label}; nothing lower to switch to", RuntimeWarning, stacklevel=2)
            return
        self.request_swap(target)

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self._flush_or_keep()

    def _flush_or_keep(self) -> bool:
        """Flush; when the store refuses, say so once (the windows stay buffered and in the side file)."""
        try:
            written = self.flush()
        except Exception as exc:  # noqa: BLE001 - the batch stays buffered; the next flush retries it
            if not self._store_refusing:
                log.warning("deployment %r: the store refused %d window(s) (%s); %s, and written when it takes them",
                            self.name, len(self._buffer), self._problem(exc), self._where_kept())
            self._store_refusing = True
            return False
        if self._store_refusing:
            log.warning("deployment %r: the store takes windows again (%d written)", self.name, written)
            self._store_refusing = False
        if not self._side_imported:
            self._import_side_files()
        return True

    def _problem(self, exc: BaseException) -> str:
        """What the store's error means, naming the database file and the fix (`store.database_error`); a lock
        held by another process as SQLite says it (this deployment retries by itself)."""
        if is_busy(exc):
            return str(exc)
        return str(as_store_error(exc, self._db_path or "(the store given to attach)") or exc)

    def _where_kept(self) -> str:
        if self._side_file is not None:
            return f"they are kept in memory and in {self._side_file}"
        return "they are kept in memory only (no side file could be written)"

    def _final_flush(self) -> None:
        self._final_flush_tried = True
        try:
            self.flush()
            self._import_side_files()
        except Exception as exc:  # noqa: BLE001 - on the way out: keep what we can, say where
            if self._side_file is not None:
                log.warning("deployment %r: the store refused the last %d window(s) (%s); they are kept in %s and "
                            "imported the next time a deployment, bench or the daemon opens %s", self.name,
                            len(self._buffer), self._problem(exc), self._side_file, self._db_path)
            else:
                log.error("deployment %r: the store refused the last %d window(s) (%s) and no side file could be "
                          "written: they are lost", self.name, len(self._buffer), self._problem(exc))

    def _keep_aside(self, error: str) -> None:
        """Write what the store has not taken yet to this deployment's side file (rewritten whole each time)."""
        if not self._db_path:
            return
        with self._buffer_lock:
            samples = list(self._buffer)
            violations = [{"decision": t["rows"]["decision"], "violation": t["rows"]["violation"]}
                          for t in self._pending_trips if t["rows"].get("violation") is not None]
        if not samples and not violations:
            return
        path = deployment_side_file(self._db_path, self._side_token)
        try:
            set_aside_deployment(path, deployment=self.name, samples=samples, violations=violations, error=error)
        except OSError as exc:
            log.warning("deployment %r: could not keep the unwritten windows in %s (%s)", self.name, path, exc)
            return
        self._side_file = path

    def _import_side_files(self) -> None:
        """Store what earlier processes left in side files beside this database: after this deployment's first
        flush the store takes (not before its first window, whose timing that work would disturb), retried until the
        import works."""
        if self._side_imported or not self._db_path:
            return
        try:
            with self._write_lock:
                items = import_deployment_side_files(self._database())
        except Exception as exc:  # noqa: BLE001 - retried after the next flush the store takes
            log.debug("deployment %r: side files not imported yet (%s)", self.name, exc)
            return
        # files left because the store refused them are tried again after a later flush the store takes
        self._side_imported = not any(item.refused is not None for item in items)
        for line in describe_deployment_imports(items):
            log.warning("deployment %r: %s", self.name, line)

    def flush(self) -> int:
        """Write the buffered samples, and any trip not yet recorded, now (one transaction); returns how many
        samples were new to the store. When the store refuses, they stay buffered for the next flush, are kept
        in the side file, and the store's error is raised."""
        with _SIGTERM_DEFERRAL.busy(), self._write_lock:
            with self._buffer_lock:
                batch = list(self._buffer)
                trips = list(self._pending_trips)
            self._last_flush = time.monotonic()
            if not batch and not trips:
                return 0
            current = batch[-1]["config_id"] if batch else self._written_config_id
            try:
                db = self._database()
                deployment_id = self._registered(db)
                with transaction(db):
                    stored = store_samples(db, deployment_id, batch)
                    if current != self._written_config_id:
                        set_deployment_config(db, deployment_id, current)
                    written = [write_trip(db, t["rows"]) for t in trips]
            except Exception as exc:
                self._keep_aside(self._problem(exc))
                raise
            with self._buffer_lock:
                del self._buffer[:len(batch)]
                del self._pending_trips[:len(trips)]
            for trip, ids in zip(trips, written, strict=True):
                trip["entry"].update(violation_id=ids["violation_id"], decision_id=ids["decision_id"])
            self._written_config_id = current
            self.samples_written += stored.inserted
            if self._side_file is not None:  # everything it held is stored now
                drop_deployment_side_file(self._side_file)
                self._side_file = None
            return stored.inserted

    # -- a process forked from this one -----------------------------------------------------------
    def _forked(self) -> None:
        """In a child just forked: forget the parent's metering state; meter this process from its first call."""
        if self._closed:
            return
        # The parent's connection and meter are parked, not closed: closing them here could disturb the parent's.
        _INHERITED.extend(x for x in (self._db,) if x is not None and x is not self._shared_db)
        self._db = None
        # Locks another thread of the parent held at the fork would stay held here for good.
        self._buffer_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._calls = itertools.count()
        self._tokens_lock = threading.Lock()
        self._tokens = self._in_flight = self._last_tokens = 0
        self._ran_in_window = False
        self._buffer, self._pending_trips, self.trips = [], [], []
        self._newest = None
        self.samples_written = 0
        self._side_token, self._side_file = _side_token(), None
        self._side_imported = True  # the parent imported them when it started
        self._store_refusing = self._meter_failing = self._final_flush_tried = False
        self._dormant = True
        self._attend = True

    def _start_in_child(self) -> None:
        """The first call in a forked child: start this process's metering thread (caller's thread, swap lock).
        Runs on a served call, so it never raises: a child that cannot start a thread (a pids limit) or map
        its flag serves unmetered, said once."""
        self._dormant = False
        try:
            flag = mmap.mmap(-1, 1)  # ours, for children forked from this process
            thread = threading.Thread(target=self._run, kwargs={"in_child": True},
                                      name=f"joulepilot-meter:{self.name}", daemon=True)
            thread.start()
        except Exception as exc:  # noqa: BLE001 - the served call must go on
            log.warning("deployment %r: cannot meter forked process %d (%s: %s); it serves unmetered", self.name,
                        os.getpid(), type(exc).__name__, exc)
            return
        self._children_metering[0] = 1  # the parent's flag: from now on its idle windows are ours
        self._children_metering, self._thread = flag, thread

    def _begin_in_child(self) -> None:
        """On the child's metering thread, before its first window: its own meter and starting point."""
        if self._own_meter:
            try:
                from joulepilot.telemetry import EnergyMeter

                fresh = EnergyMeter(device=self.device, sampler=False)
            except Exception:  # noqa: BLE001 - the parent's meter still reads the device
                log.warning("deployment %r: no meter of its own in forked process %d; reading the parent's",
                            self.name, os.getpid(), exc_info=True)
            else:
                _INHERITED.append(self._meter)
                self._use_meter(fresh)
        self._last_mono, self._last_t_end, self._last_n, self._last_tokens = time.monotonic(), time.time(), 0, 0
        self._last_flush = time.monotonic()
        try:
            self._last_e = self._energy_now()
        except Exception:  # noqa: BLE001 - the first window that reads takes the starting point
            self._last_e = None

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self, timeout_s: float = 30.0) -> None:
        """Take the last (partial) window, flush every sample, stop the thread. Idempotent.

        Returns within about two store waits (`STORE_WAIT_S`) and at most `timeout_s`; what the store
        refuses by then is in the side file. A SIGTERM arriving meanwhile is handled once it returns, and
        shortens the wait to what is left of EXIT_WAIT_S since it arrived."""
        with _SIGTERM_DEFERRAL.busy():
            self._close(timeout_s)

    def _close(self, timeout_s: float) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        _LIVE.discard(self)
        if self._dormant:  # a forked child that never served: nothing of its own to write
            return
        thread = self._thread
        if thread is not threading.current_thread():
            waited_s = _join(thread, timeout_s)
            if thread.is_alive():
                self._keep_aside(f"the last write did not finish within {waited_s:.1f} s")
                log.warning("deployment %r: the last windows were not written within %.1f s; %s", self.name,
                            waited_s, self._where_kept())
            elif not self._final_flush_tried and (self._buffer or self._pending_trips):
                self._final_flush()  # the thread ended without its last flush: write the rest from here
                if self._db is not None and self._db is not self._shared_db:
                    self._db.close()
                    self._db = None
        if self._own_meter:
            try:
                self._meter.close()
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> MeteredModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"MeteredModel({self.name!r}, device={self.device!r}, config={self.config_label!r}, "
                f"inferences={self.inferences}, source={self.energy_source!r})")

# -- exit paths -----------------------------------------------------------------------------------
_LIVE: weakref.WeakSet[MeteredModel] = weakref.WeakSet()
_ATEXIT_REGISTERED = False
_FORK_HANDLER_REGISTERED = False
_SIGTERM_INSTALLED = False
_PREVIOUS_SIGTERM: Any = None
_INHERITED: list[Any] = []  # a parent's connections and meters, kept alive (unused) in a forked child
_SIGTERM_DEFERRAL = SignalDeferral()


def _join(thread: threading.Thread, timeout_s: float) -> float:
    """Wait for `thread` to end, at most `timeout_s` and at most until EXIT_WAIT_S after a SIGTERM held meanwhile;
    returns the seconds waited."""
    started = time.monotonic()
    end = started + timeout_s
    while thread.is_alive():
        held_since = _SIGTERM_DEFERRAL.held_since()
        limit = end if held_since is None else min(end, held_since + EXIT_WAIT_S)
        left_s = limit - time.monotonic()
        if left_s <= 0:
            break
        thread.join(min(left_s, JOIN_SLICE_S))
    return time.monotonic() - started


def close_all(timeout_s: float | None = None) -> None:
    """Flush and stop every live deployment in this process, waiting at most `timeout_s` (default
    `EXIT_WAIT_S`) for all of them together; what is not written by then is in their side files."""
    wait_s = EXIT_WAIT_S if timeout_s is None else timeout_s
    with _SIGTERM_DEFERRAL.busy():
        models = list(_LIVE)
        for model in models:
            model._stop.set()  # all take their last window and write it at once
        deadline = time.monotonic() + wait_s
        for model in models:
            try:
                model.close(timeout_s=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - on the way out, one failure must not stop the others
                log.exception("deployment %r: final flush failed", model.name)


def _flush_at_exit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        _ATEXIT_REGISTERED = True
        atexit.register(close_all)


def _after_fork_in_child() -> None:
    _SIGTERM_DEFERRAL.forked()
    for model in list(_LIVE):
        try:
            model._forked()
        except Exception:  # noqa: BLE001 - one deployment's trouble must not keep the others from metering
            log.exception("deployment %r: metering could not be prepared in forked process %d", model.name,
                          os.getpid())


def _restart_in_forked_children() -> None:
    global _FORK_HANDLER_REGISTERED
    if not _FORK_HANDLER_REGISTERED and hasattr(os, "register_at_fork"):
        _FORK_HANDLER_REGISTERED = True
        os.register_at_fork(after_in_child=_after_fork_in_child)


def _on_sigterm(signum: int, frame: Any) -> None:
    # Handled at once, or, when the main thread was inside a flush or close (its locks held), as soon as that ends.
    _SIGTERM_DEFERRAL.deliver(signum, frame, _stop_on_sigterm)


def _stop_on_sigterm(signum: int, frame: Any, arrived: float) -> None:
    close_all(timeout_s=max(0.0, arrived + EXIT_WAIT_S - time.monotonic()))
    previous = _PREVIOUS_SIGTERM
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL or previous is None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def flush_on_sigterm() -> bool:
    """Opt in to flushing every live deployment on SIGTERM, then running the handler that was there
    before (the default one still ends the process by the signal). Python runs no `atexit` on a
    SIGTERM it has no handler for, so a process stopped that way (systemd, Kubernetes) otherwise loses
    the unflushed batch. A SIGTERM that arrives while the main thread is inside a deployment's `flush()` or
    `close()` is handled as soon as that call ends. Not installed by default: a serving framework's own
    handler decides how its process stops. Idempotent; returns False where no handler can be installed (not the main thread)."""
    global _SIGTERM_INSTALLED, _PREVIOUS_SIGTERM
    if _SIGTERM_INSTALLED:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return False
    _PREVIOUS_SIGTERM, _SIGTERM_INSTALLED = previous, True
    return True
