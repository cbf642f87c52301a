"""Test drivers for the two room machines: the old call style (``m.message(ident, msg, now)``)
spoken through each machine's one door, ``feed(event)``. A driver plays the shell's part only
where the machine asks for memory to be read (decode: ``ReadForCommit``, ``EchoScratch``),
with the fakes a test gives it. Anything else is read from the machine itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbridge.errors import KVBridgeError
from kvbridge.transfer.actions import AbortRoom, CloseRoom, Send, Shutdown, Tick
from kvbridge.transfer.channel import wire
from kvbridge.transfer.decode import events as de
from kvbridge.transfer.decode.machine import DecodeRooms
from kvbridge.transfer.prefill import events as pe
from kvbridge.transfer.prefill.admission import NonceWritten
from kvbridge.transfer.prefill.machine import PrefillRooms
from kvbridge.transfer.prefill.staged import ChunkPostFailed, ChunkPosted


class _Driver:
    machine: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.machine, name)

    def feed(self, event: Any) -> Any:
        return self.machine.feed(event)

    def open(self, *args: Any) -> Any:
        return self.machine.open(*args)

    def abort(self, r: Any, reason: str, now: float) -> Any:
        return self.feed(AbortRoom(r, reason, now))

    def close(self, r: Any, now: float) -> Any:
        return self.feed(CloseRoom(r, now))

    def shutdown(self, reason: str, now: float) -> Any:
        return self.feed(Shutdown(reason, now))

    def tick(self, now: float) -> Any:
        return self.feed(Tick(now))


class PrefillDriver(_Driver):
    def __init__(self, machine: PrefillRooms, hello_of: Callable[[bytes], str | None]) -> None:
        self.machine, self.hello_of = machine, hello_of

    def engine_init(self, r, num_tokens, num_pages, now, first_page=0):
        return self.feed(pe.EngineInit(r, num_tokens, num_pages, now, first_page))

    def chunk(self, r, logical, local, num_tokens_ready, is_last, aux_row, aux_slot, ready_event=None, layers=None):
        self.feed(pe.Chunk(r, logical, local, num_tokens_ready, is_last, aux_row, aux_slot, ready_event, layers))

    def post(self, r, now, aux=None):
        return self.feed(pe.Post(r, now, aux))

    def message(self, ident, msg, now):
        return self.feed(pe.Message(ident, msg, self.hello_of(ident), now))

    def nonce_written(self, ident, problem, now):
        return self.feed(NonceWritten(ident, problem, now))

    def resolved(self, rank_id, detail, problem, now, engine_kind="local"):
        return self.feed(pe.Resolved(rank_id, detail, problem, now, engine_kind))

    def posted(self, a, handle, now):
        return self.feed(pe.Posted(a, handle, now))

    def post_failed(self, a, reason, now):
        return self.feed(pe.PostFailed(a, reason, now))

    def chunk_posted(self, a, handle, num_slices, num_bytes, now):
        return self.feed(ChunkPosted(a, handle, num_slices, num_bytes, now))

    def chunk_post_failed(self, a, reason, now):
        return self.feed(ChunkPostFailed(a, reason, now))

    def write_final(self, handle, status, now):
        return self.feed(pe.WriteFinal(handle, status, now))

    def gc(self, now):
        return self.feed(pe.Gc(now))


def prefill_machine(*args: Any, hello_of: Callable[[bytes], str | None] = lambda ident: None,
                    endpoint: Callable[[], str] = lambda: "", **kw: Any) -> PrefillDriver:
    """A PrefillRooms (same arguments) serving at ``endpoint()``, driven in the old call style."""
    m = PrefillRooms(*args, **kw)
    m.feed(pe.Serving(endpoint()))
    return PrefillDriver(m, hello_of)


class DecodeDriver(_Driver):
    def __init__(self, machine: DecodeRooms, read_aux_row: Callable, page_digests: Callable,
                 read_scratch: Callable[[int], bytes] | None) -> None:
        self.machine, self.read_aux_row, self.page_digests, self.read_scratch = (
            machine, read_aux_row, page_digests, read_scratch)
        self.written: list[tuple[int, Any]] = []  # (slot, row): aux rows the shell wrote (a report carried them)
        self.write_error: str | None = None  # a WriteAuxRow's answer: written, or this error
        self.defer_writes = False  # WriteAuxRow answered only by ``complete_writes`` (a GPU copy the loop polls)
        self.deferred: list[Any] = []  # the WriteAuxRow actions not answered yet

    def feed(self, event: Any) -> Any:
        return self._carry(self.machine.feed(event))

    def _carry(self, actions: Any) -> Any:
        """The memory reads the machine asks for, answered at once with the test's fakes."""
        out: list[Any] = []
        for a in actions:
            if isinstance(a, de.ReadForCommit):
                try:
                    if a.row is not None:  # a report carried it: the shell writes it into the slot
                        if not a.row_written:  # (unless it is there already: WriteAuxRow)
                            self.written.append((a.aux_slot, a.row))
                        row, read_s = a.row, 0.0
                    else:
                        row, read_s = self.read_aux_row(a.aux_slot)
                    digests = tuple(self.page_digests(d.pools, d.pages, d.physical, d.num_tokens, d.layers)
                                    for d in a.digests)
                    found = de.CommitRead(a.room, row, read_s, digests, None, 0.0)
                except KVBridgeError as exc:
                    found = de.CommitRead(a.room, None, 0.0, (), str(exc), 0.0)
                out += self._carry(self.machine.feed(found))
            elif isinstance(a, de.WriteAuxRow) and self.defer_writes:
                self.deferred.append(a)
            elif isinstance(a, de.WriteAuxRow):  # a row ahead of the room's last pages: written now
                if self.write_error is None:
                    self.written.append((a.aux_slot, a.row))
                out += self._carry(self.machine.feed(de.AuxRowWritten(a.room, 1e-4, self.write_error, 0.0)))
            elif isinstance(a, de.EchoScratch):
                try:
                    out.append(Send((a.endpoint,), wire.ChallengeEcho(nonce=self.read_scratch(a.offset))))
                except KVBridgeError:
                    pass
            else:
                out.append(a)
        return out or ()  # (as the machine: an event that asks for nothing returns ())

    def complete_writes(self, now: float) -> Any:
        """The deferred aux row writes complete (their copies ran): answered in order."""
        out: list[Any] = []
        while self.deferred:
            a = self.deferred.pop(0)
            self.written.append((a.aux_slot, a.row))
            out += list(self.feed(de.AuxRowWritten(a.room, 1e-4, None, now)))
        return out

    def init(self, r, pages, aux_slot, num_tokens, first_page, now):
        return self.feed(de.Init(r, pages, aux_slot, num_tokens, first_page, now))

    def message(self, endpoint, msg, now):
        return self.feed(de.Message(endpoint, msg, now))

    def looked_up(self, room, key, topo, error, now):
        return self.feed(de.LookedUp(room, key, topo, error, now))

    def refreshed(self, key, topo, now):
        return self.feed(de.Refreshed(key, topo, now))

    def lease_checked(self, endpoint, rank_id, gone, now):
        return self.feed(de.LeaseChecked(endpoint, rank_id, gone, now))

    def scattered(self, room, slot, now):
        return self.feed(de.Scattered(room, slot, now))

    def running(self, start: float, end: float, heard: bool = True) -> None:
        """The loop turns every second from ``start`` to ``end``, every known prefill rank heard at
        each turn (``heard``): a loop that runs. A jump in time is a loop that did not run, which
        spares the rooms' deadlines and blames no peer."""
        now = start
        while now < end:
            now = min(now + 1.0, end)
            if heard:
                for p in list(self.machine.peers.values()):
                    self.message(p.endpoint, wire.Heartbeat(cp_rank=0, seq=int(now)), now)
            self.tick(now)


def decode_machine(*args: Any, read_aux_row: Callable, page_digests: Callable, rank_id: Callable[[], str | None],
                   read_scratch: Callable[[int], bytes] | None = None, **kw: Any) -> DecodeDriver:
    """A DecodeRooms (same arguments) registered as ``rank_id()``, driven in the old call style;
    its memory reads answered by ``read_aux_row``, ``page_digests`` and ``read_scratch``."""
    m = DecodeRooms(*args, scratch=read_scratch is not None, **kw)
    m.feed(de.Registered(rank_id()))
    return DecodeDriver(m, read_aux_row, page_digests, read_scratch)
