"""The shell both endpoints share around their rooms' state machine.

A side's machine (``prefill/machine.py``, ``decode/machine.py``) is sans-I/O: events in,
actions out, through one door, ``machine.feed(event)``, where an event is a frozen record
(``prefill/events.py``, ``decode/machine.py``, the shared ones in ``actions.py``). Its
endpoint is the shell: it owns the loop thread, the lock and the queue of events that other
threads produced (an engine's completion, a daemon's answer, a copy that finished), and it is
the only caller of the machine:

    any thread:  pool thread / copy done / write refused  --queue(event)-->  wake the loop
    loop turn:   receive messages -> feed each  ->  feed the queued events  ->  Tick(now)
                 every feed: machine.feed(event) -> actions -> carried out, in order

Nothing calls into the machine from inside an action the shell is carrying out: an
action's result (a write refused at submission, a scatter done) is queued as an event
record and fed after the actions of the current event are carried out, so the machine never
sees a second event while the first one's actions are still running (``feeding``: a
guard that raises instead of nesting).

Locking, the same on both sides: every feed runs with the lock held. A thread that is not
the loop never *waits* for the lock to hand the machine a result: a pool thread (a daemon's
answer, a nonce written) only queues and wakes. The engine's completion callback
(``_engine_final``, installed by the side whose engine writes: prefill) may fire on any
thread, inside ``submit_write`` too: it *tries* the lock, and when it is free collects the
completions on its own thread (no loop turn: the fewest hops); when it is held (by the poster
inside ``submit_write``, or the loop) it only wakes the loop, which collects once the holder
is done. Never a wait for the lock, never a nested feed.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from kvbridge.errors import ConfigError
from kvbridge.transfer.actions import AbortRoom, CloseRoom
from kvbridge.transfer.staging import STAGING_MODES

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["EndpointShell"]

STALL_DUMP_ENV = "KVBRIDGE_STALL_DUMP"


def stall_dump_s() -> float | None:
    """``KVBRIDGE_STALL_DUMP`` (seconds), the loop turn past which the shell dumps every thread's
    stack (``EndpointShell._run_watched``); None when unset, empty, not a number or not positive.
    faulthandler keeps one timer per process: with several endpoints in one process, a turn of one
    re-arms the others' (the CI servers run one rank per process)."""
    raw = os.environ.get(STALL_DUMP_ENV, "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        log.warning("%s=%r is not a number of seconds: no stall dumps", STALL_DUMP_ENV, raw)
        return None
    return value if value > 0 else None


class EndpointShell:
    """The loop, the lock and the event queue of one endpoint. Subclasses set ``machine``,
    ``config`` and the staging buffer, and define ``_carry`` (one action), ``_wake``, ``_step``
    (one loop turn) and, where the engine reports completions, ``_collect``."""

    machine: Any
    config: Any
    _loop_name = "endpoint"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._room_freed = threading.Condition(self._lock)  # notified when a room id is forgotten
        self._events: deque[Any] = deque()  # event records fed on the loop's next turn (appended from any thread)
        self._released: deque[Any] = deque()  # rooms whose handle was dropped (appended without the lock)
        self._feeding = False  # the machine's actions are being carried out (lock held)
        self._feeder = 0  # the thread carrying them out (``threading.get_ident``) while ``_feeding``
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- feeding the machine (lock held) ----------------------------------------

    def _feed_event(self, event: Any) -> None:
        """Feed one event record through the machine's door and carry out what it returns."""
        self._feed(self.machine.feed(event))

    def _feed(self, actions: Any) -> None:
        """Carry out the actions one machine event returned, then feed the events queued
        meanwhile (by those actions or by other threads), oldest first, one at a time: the
        machine sees its next event only once the last one's actions are all carried out."""
        if self._feeding:  # an action called back into the machine: the recursion this shell exists to rule out
            raise RuntimeError(f"{self.config.rank_label}: a machine event was fed while another one's actions "
                               "were being carried out")
        self._feeding, self._feeder = True, threading.get_ident()
        try:
            while True:
                for a in actions:
                    self._carry(a)
                if not self._events:
                    return
                actions = self.machine.feed(self._events.popleft())
        finally:
            self._feeding = False

    def _feed_queued(self) -> None:
        """Feed every queued event, oldest first (lock held)."""
        if self._events:
            self._feed(())

    def _queue(self, event: Any) -> None:
        """Feed the event record ``event`` on the loop's next turn (any thread, lock held or not:
        it never takes the lock). Queued by an action of the feed in progress on this thread (a
        write posted, a scatter done): that feed takes it before it returns, so the loop is not
        woken for it (a pipe write and an empty loop turn per write saved, and on one interpreter
        the write's hand-off of the GIL)."""
        self._events.append(event)
        if not (self._feeding and self._feeder == threading.get_ident()):
            self._wake()

    def _carry(self, action: Any) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _collect(self) -> None:
        """(lock held) Feed the engine's completions (the side whose engine writes defines it)."""
        raise NotImplementedError

    # -- engine-facing (any thread) -------------------------------------------

    def _engine_final(self) -> None:
        """Engine callback, a write became final (any thread, inside ``submit_write`` too): when
        the lock is free, collect and report from this thread; when it is held, wake the loop,
        which collects once the holder is done. Never a wait for the lock, never a nested feed."""
        if self._lock.acquire(blocking=False):
            try:
                self._collect()
            finally:
                self._lock.release()
        else:
            self._wake()

    def locked(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the endpoint's lock held (what a handle reads)."""
        with self._lock:
            return fn()

    def release(self, r: Any) -> None:
        """The engine dropped its handle: the room closes at the next housekeeping.
        Runs from a GC finalizer, possibly on a thread that holds the lock: no locking here."""
        self._released.append(r)

    def _close_released(self) -> None:
        """(lock held) Close the rooms of dropped handles."""
        while self._released:
            self._feed_event(CloseRoom(self._released.popleft(), time.monotonic()))

    def close_room(self, r: Any) -> None:
        """The engine closes room ``r``'s handle: fed here, its actions carried out on this thread.
        The loop is woken only for a room that had not finished (closing fails it, and the loop
        settles what follows); closing a finished room leaves it nothing to do, and a wake would
        cost it an empty turn per closed room."""
        with self._lock:
            finished = r.state.final
            self._feed_event(CloseRoom(r, time.monotonic()))
        if not finished:
            self._wake()

    def abort_room(self, r: Any, reason: str) -> None:
        with self._lock:
            self._feed_event(AbortRoom(r, reason, time.monotonic()))
        self._wake()

    def _check_staging_mode(self, mode: str, buffer: Any, what: str) -> None:
        """``set_staging``'s checks: a known mode, and a rank that has its staging buffer."""
        if mode not in STAGING_MODES:
            raise ConfigError(f"staging must be one of {STAGING_MODES}, got {mode!r}", rank=self.config.rank_label,
                              field="staging")
        if mode != "never" and buffer is None:
            raise ConfigError(f"this rank has no {what} (staging 'never' at start, GPU pages on a direct-only "
                              "engine, or pages on several devices)", rank=self.config.rank_label, field="staging")

    def __enter__(self) -> Any:
        self.start()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]

    # -- the loop -------------------------------------------------------------

    def _start_loop(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _stop_loop(self, timeout: float) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        dump_s = stall_dump_s()
        if dump_s is not None:
            self._run_watched(dump_s)
            return
        while not self._stop.is_set():
            self._turn()

    def _turn(self) -> None:
        """One loop step; a bug in it is logged, the loop goes on."""
        try:
            self._step()
        except Exception:  # a bug must not kill the rank's only control loop
            log.exception("%s loop step failed", self._loop_name)
            time.sleep(0.05)

    def _run_watched(self, dump_s: float) -> None:
        """``_run`` with ``KVBRIDGE_STALL_DUMP`` set: a loop turn that runs past ``dump_s`` seconds
        has every thread's Python stack written to stderr while it still runs (faulthandler's
        watchdog, which needs no lock and no GIL), and once it returns a warning with the turn's
        wall time and the process's CPU time meanwhile (none: the process stood still or waited;
        as much: something in it was busy). A diagnostic for CI: it arms a timer every turn."""
        while not self._stop.is_set():
            start, cpu = time.monotonic(), time.process_time()
            faulthandler.dump_traceback_later(dump_s, exit=False, file=2)  # (fd 2: whatever wraps sys.stderr)
            try:
                self._turn()
            finally:
                faulthandler.cancel_dump_traceback_later()
            took = time.monotonic() - start
            if took > dump_s:
                log.warning("%s: a loop turn took %.1fs, in which the process used %.1fs of CPU (%s set: every "
                            "thread's stack is above)", self._loop_name, took, time.process_time() - cpu,
                            STALL_DUMP_ENV)
