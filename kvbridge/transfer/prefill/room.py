"""One room on a prefill CP rank: its state, read and written by the machine (``machine.py``).

A room on a prefill CP rank holds the chunks of owned pages the engine handed
in, and one :class:`~kvbridge.transfer.prefill.targets.Target` per decode rank that asked
for the room. Every chunk is posted to every target (one plan per chunk and target); each
write is reported when it becomes final.

    decode init() --request--> message(): check, plan --PostWrite--> shell: engine.submit_write
                                                      <--posted(write, handle)--
    engine callback --write_final(handle, status)--> Send(PagesDone) --> decode

A write is in flight from the moment its PostWrite is emitted (so no failure report or
abort ack leaves before the shell posted it, hard rule 6) until ``write_final`` or
``post_failed``.

Chunk boundaries. ``send(..., num_tokens_ready=t)`` says tokens ``[0, t)`` of the
request exist. A page is complete once all its valid rows exist; a page that a
chunk ends inside is *held* and travels with the chunk that completes it:

    page_size 4, 10 tokens          page 0     page 1     page 2
                                    0 1 2 3 |  4 5 6 7 |  8 9 . .
    send([0, 1], ready=6)           sent       held (rows 6, 7 not computed yet)
    send([2], ready=10, is_last)               sent       sent (2 valid rows)

    send(chunk 0) ... send(chunk n, is_last)      engine thread
          |                     |
       chunks[0]  ...       chunks[n] (+ held pages completed now) (+ aux row)
          |                     |
     target A: posted 0..n, in flight {write: pages}, pages done, aux done
     target B: ...

Layer ranges. ``send(..., layers=(start, end))`` hands in complete pages of target layers
``[start, end)`` only (the forward pass has written those layers), as the engine computes
them; the room's layer span is its pipeline stage's target layers (all of them without
pipeline parallelism), and a range carries every pool's layers by the stage rule
(``kvbridge.layout.layer_range_specs``: index K follows the target ids, the draft goes with
the range that ends at the last target layer). A page is given once every layer of the
span was handed in; a range handed in twice for a page, outside the span, or left unsent
when the last chunk comes is refused (LayerRangeError, nothing queued):

    4 layers, pages 0-2          layers 0-1   layers 2-3
    send([0,1,2], layers=(0,2))  given        -            (one write per target: 2 layers)
    send([0,1,2], layers=(2,4))  given        given        pages given; reported to a target
                                                           once both writes to it are final
    send([], is_last, aux=row)   the aux row, and any page held from an earlier chunk

A page that a chunk ends inside is held and travels with a later send of every layer (a
layer-range send neither carries nor completes it).

Decode prefix. A target holds logical pages ``[0, first_page)`` already (its prefix
cache) and receives the owned pages from there on. An engine may send every page (each
target takes what it lacks), or, once every target asked, read the prefix they share
(``decode_first_page``) and hand in only the pages after it (``init(first_page=)``):

    4 pages, decode prefix 2     page 0   page 1 | page 2   page 3
    engine_first_page 0          given    given  | given    given     (pages 0, 1 filtered per target)
    engine_first_page 2          -        -      | given    given     (the last chunk needs only these)

Heterogeneous TP. A target is one decode TP rank; what this prefill TP rank sends
it follows their TP route (``kvbridge.layout.tp_routes``): whole rows of some
pools, one head slice of others (``Target.parts``), and the aux row only when this
is the decode rank's first source (``Target.aux_source``) and this CP rank owns
the last valid token. Every TP rank of that CP rank passes the aux row to
``send()``; each writes it only to the decode ranks it is the first source of.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbridge.errors import LayerRangeError, LayoutError, RoomBindingError
from kvbridge.layout import OwnerLanes, has_repeats
from kvbridge.transfer.binding import engine_binding_refusal
from kvbridge.transfer.poll import KVPoll, RoomState
from kvbridge.transfer.prefill.targets import Target
from kvbridge.transfer.rooms import Life, Stage

_EMPTY = np.zeros(0, dtype=np.int64)


class PrefillRoom:
    """Everything the prefill rank knows about one room."""

    def __init__(self, room: int, cp_rank: int, lanes: OwnerLanes, page_size: int, stage: Stage = Stage.OPEN,
                 now: float = 0.0, pp: tuple[int, int] = (0, 1),
                 layer_span: tuple[int, int] = (0, 1 << 30)) -> None:
        self.room = room
        self.cp_rank = cp_rank
        self.pp_rank, self.pp_size = pp  # pipeline stage: only the last one writes the aux row
        self.lanes = lanes
        self.page_size = page_size
        self.layer_span = layer_span  # the target layers [start, end) this rank holds: a layer range lies inside
        self.state = RoomState(now)
        self.life = Life(stage)
        self.num_tokens: int | None = None  # None until known (init(num_tokens), or the last chunk)
        self._num_pages: int | None = None
        self._aux_owner = -1  # the cp rank of the last page (which holds the last valid token), once known
        self.num_tokens_ready = 0
        self.owned: np.ndarray = _EMPTY  # logical pages this rank owns (after init)
        self.engine_first_page = 0  # the engine hands in owned pages from here (init(first_page=)): decode has the rest
        self.given: np.ndarray = np.zeros(0, dtype=bool)  # per logical page: handed in by the engine
        self.chunks: list[tuple[np.ndarray, np.ndarray]] = []  # complete pages, in the order they were ready
        self.chunk_events: list[Any] = []  # per chunk: the CUDA event(s) its source pages wait on, or None
        self.chunk_layers: list[tuple[int, int] | None] = []  # per chunk: its target layer range (None: all)
        self.chunk_tokens: list[int] = []  # per chunk: the tokens ready when it was queued (the kind pools' bound)
        self.local_of: np.ndarray = _EMPTY  # per logical page: the local page it was handed in at (-1: not yet)
        # per logical page and target layer of the span: handed in (allocated by the first layer-range send)
        self.layers_given: np.ndarray | None = None
        self.last_event: Any = None  # the latest send()'s event (the aux row written with it waits on it)
        self.held: tuple[np.ndarray, np.ndarray] = (_EMPTY, _EMPTY)  # given, not yet complete
        self.is_last = False
        self.auto_last = False  # nothing to send: complete on init() alone
        self.aux_row: np.ndarray | None = None  # packed row, staged by kvbridge
        self.aux_slot: int | None = None  # or: a slot of the engine's own registered aux rows
        self.aux_from: Any = None  # where the shell says the row is written from (machine.AuxFrom)
        self.targets: dict[str, Target] = {}
        self.holder: tuple[str, str] | None = None  # (decode instance, rank label) of the first claim: the only one served
        self.binding: bytes | None = None  # the engine's digest of the request (init(binding=)); None: not said yet
        self.claimed_binding: bytes | None = None  # the digest the accepted claims presented (transfer/binding.py)
        self.released: str | None = None  # why decode said it needs nothing of the room (wire.Release)
        self.pending_replies: list[tuple[bytes, Any]] = []  # failure reports and acks waiting for the room to be quiet
        self.num_expected_targets: int | None = None
        self.created = now
        self.asked_since = now  # target_timeout counts from here (a loop that did not run restarts it)
        self.first_post: float | None = None  # monotonic time of the first write posted (transfer timing)
        self.num_slices = 0  # posted for this room, all targets
        self.num_bytes = 0
        self.paths: dict[str, str] = {}  # decode rank -> "direct" / "staged"
        self.staged = {"chunks": 0, "bytes_staged": 0, "plan_slices": 0}  # staged writes, all targets

    # -- derived --------------------------------------------------------------

    @property
    def ctx(self) -> dict[str, Any]:
        return {"room": self.room, "rank": f"cp{self.cp_rank}" + (f"/pp{self.pp_rank}" if self.pp_size > 1 else "")}

    @property
    def num_pages(self) -> int:
        if self._num_pages is None:
            raise LayoutError("the room's length is not known before init()", field="num_tokens", **self.ctx)
        return self._num_pages

    @property
    def length_known(self) -> bool:
        return self._num_pages is not None

    @property
    def plan_tokens(self) -> int:
        """The token count to plan writes with: the request's, or, while only its page count is
        known, every page full (true of every page queued then: a page is queued once complete,
        and the last page is complete only once the last chunk says the length)."""
        return self.num_tokens if self.num_tokens is not None else self.num_pages * self.page_size

    @property
    def owns_last_token(self) -> bool:
        """The last valid token lies in the last page, whatever the token count: its owner, in the
        last pipeline stage (which holds the last hidden state)."""
        return self._num_pages is not None and self._aux_owner == self.cp_rank and self.pp_rank == self.pp_size - 1

    @property
    def owns_last_lane(self) -> bool:
        """This CP rank owns the last valid token, in whichever pipeline stage: it writes its
        stage's layers of the state slots (``prefill/kinds.py``)."""
        return self._num_pages is not None and self._aux_owner == self.cp_rank

    @property
    def has_aux(self) -> bool:
        return self.aux_row is not None or self.aux_slot is not None

    def age_ms(self, now: float) -> float:
        return (now - self.created) * 1000

    def claim(self, instance: str, decode_rank: str) -> bool:
        """A room id belongs to the decode instance whose request reached it first (its TP ranks
        share it): True when ``instance`` holds it now (claimed here, or before)."""
        if self.holder is None:
            self.holder = (instance, decode_rank)
        return self.holder[0] == instance

    def add_target(self, t: Target, binding: bytes, now: float) -> None:
        """Decode rank ``t.decode_rank`` is a target now (its claim presented ``binding``); the room
        waits for input once every decode rank whose TP route runs through us asked."""
        self.targets[t.decode_rank] = t
        if self.claimed_binding is None:
            self.claimed_binding = binding
        self.num_expected_targets = t.num_decode_targets
        if self.state.state == KVPoll.Bootstrapping and len(self.targets) >= self.num_expected_targets:
            self.state.to(KVPoll.WaitingForInput, now=now)

    def held_by(self, instance: str | None) -> bool:
        """Nobody claimed the room yet, or ``instance`` did."""
        return self.holder is None or self.holder[0] == instance

    def reply_when_quiet(self, ident: bytes, msg: Any) -> bool:
        """Keep a failure report or abort ack until no write of the room is in flight (True: kept)."""
        if self.num_inflight:
            self.pending_replies.append((ident, msg))
            return True
        return False

    def quiet_replies(self) -> list[tuple[bytes, Any]]:
        """The replies kept, once nothing of the room is in flight (else none)."""
        if self.num_inflight or not self.pending_replies:
            return []
        out, self.pending_replies = self.pending_replies, []
        return out

    @property
    def drain_reason(self) -> str:
        return f"{self.num_inflight} write(s) of the previous room still in flight"

    @property
    def num_inflight(self) -> int:
        return sum(len(t.inflight) for t in self.targets.values())

    def stats(self, now: float) -> dict[str, Any]:
        end = self.state.entered[self.state.state] if self.state.final else now
        return {
            **({"pp_rank": self.pp_rank} if self.pp_size > 1 else {}),
            "slices": self.num_slices,
            "bytes": self.num_bytes,
            "paths": dict(self.paths),
            "layer_sends": sum(1 for span in self.chunk_layers if span is not None),
            **self.staged,
            "seconds": self.state.durations(),
            "transfer_s": None if self.first_post is None else round(max(0.0, end - self.first_post), 6),
            "total_s": round(now - self.created, 6),
            **({"released": self.released} if self.released else {}),
        }

    @property
    def decode_first_page(self) -> int:
        """The decode prefix every target of this room holds, in pages (logical pages
        ``[0, p)``), once every decode rank that draws from this rank asked (the poll state
        WaitingForInput). One prefix per room: targets that hold different prefixes (decode TP
        ranks whose caches differ) are an error naming each rank and its first page, since an
        engine that skips the prefix (SGLang's ``pop_decode_prefix_len``) has one number to
        give; an engine that cannot honour that sends every page (``engine_first_page`` 0) and
        each target still receives only the pages after its own prefix."""
        expected = self.num_expected_targets
        if expected is None or len(self.targets) < expected:
            failed = f"; the room failed: {self.state.reason}" if self.state.state == KVPoll.Failed else ""
            asked = f"{len(self.targets)} of {expected}" if expected is not None else "none"
            raise LayoutError(f"the decode prefix of room {self.room} is not known before every decode rank asked "
                              f"for it ({asked} of its decode ranks have; poll() reads WaitingForInput once all "
                              f"have){failed}", field="decode_first_page", **self.ctx)
        first = {t.first_page for t in self.targets.values()}
        if len(first) > 1:
            ranks = ", ".join(f"{name} first page {t.first_page}" for name, t in sorted(self.targets.items()))
            raise LayoutError(f"the decode ranks of room {self.room} hold different prefixes ({ranks}): one "
                              "prefix per room can be skipped by the engine; send every page instead "
                              "(init without first_page)", field="first_page", **self.ctx)
        return first.pop()

    @property
    def num_to_send(self) -> int:
        """Owned pages the engine hands in: those at or after its first page."""
        return self.num_owned_from(self.engine_first_page)

    def num_owned_from(self, first_page: int) -> int:
        """Owned pages at or after ``first_page``: what a target with that decode prefix receives."""
        if first_page <= 0:  # (no prefix: every owned page)
            return int(self.owned.size)
        return int(np.count_nonzero(self.owned >= first_page))

    @property
    def layer_width(self) -> int:
        """Target layers a page has on this rank: what a target must receive of it to count it."""
        return self.layer_span[1] - self.layer_span[0]

    def target_complete(self, t: Target) -> bool:
        """Every page (and the aux row, if this rank owns it) written to ``t``."""
        return (
            self.is_last
            and t.active
            and not t.inflight
            and t.posted == len(self.chunks)
            and t.num_pages_done == t.num_expected
            and (t.aux_done or not (self.owns_last_token and t.aux_source))
            and not t.kind_wait
        )

    # -- engine input ---------------------------------------------------------

    def set_length(self, source: str, *, num_tokens: int | None = None, num_pages: int | None = None) -> None:
        """The request's length, from the engine or a decode rank: its valid tokens, or only its
        page count (an engine that knows pages; the tokens then come with the last chunk). Every
        source must agree with what is already known."""
        for name, value in (("num_tokens", num_tokens), ("num_pages", num_pages)):
            if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                                      or value <= 0):
                raise LayoutError(f"{name} must be a positive integer, got {value!r} ({source})", field=name,
                                  **self.ctx)
        if num_tokens is None and num_pages is None:
            raise LayoutError(f"{source} gives neither num_tokens nor num_pages", field="num_tokens", **self.ctx)
        pages = -(-int(num_tokens) // self.page_size) if num_tokens is not None else int(num_pages)
        if num_pages is not None and pages != num_pages:
            raise LayoutError(f"{source}: {num_tokens} tokens are {pages} pages of {self.page_size}, not {num_pages}",
                              field="num_pages", **self.ctx)
        if self._num_pages is not None and pages != self._num_pages:
            known = f"{self.num_tokens} tokens" if self.num_tokens is not None else f"{self._num_pages} pages"
            raise LayoutError(f"{source} says {num_tokens if num_tokens is not None else pages} "
                              f"{'tokens' if num_tokens is not None else 'pages'}, but the room was started with "
                              f"{known}", field="num_tokens", **self.ctx)
        if num_tokens is not None:
            self._learn_tokens(int(num_tokens), source)
        if self._num_pages is None:
            self._num_pages = pages
            self._aux_owner = self.lanes.owner_of_page(pages - 1, pages)  # asked on every settle
            self.owned = self.lanes.owned_pages(self.cp_rank, pages)
            self.given = np.zeros(pages, dtype=bool)
            self.local_of = np.full(pages, -1, dtype=np.int64)

    def set_num_tokens(self, num_tokens: int, source: str) -> None:
        self.set_length(source, num_tokens=num_tokens)

    def _learn_tokens(self, num_tokens: int, source: str) -> None:
        if self.num_tokens is not None and self.num_tokens != num_tokens:
            raise LayoutError(f"{source} says {num_tokens} tokens, but the room was started with {self.num_tokens}",
                              field="num_tokens", **self.ctx)
        if num_tokens < self.num_tokens_ready:
            raise LayoutError(f"{source} says {num_tokens} tokens, but {self.num_tokens_ready} are already ready",
                              field="num_tokens", **self.ctx)
        self.num_tokens = num_tokens

    def engine_init(self, num_tokens: int | None, num_pages: int | None = None, first_page: int = 0,
                    binding: bytes = b"") -> None:
        """The engine's init(): a rank with nothing to send is done once decode asked (only the
        engine says so: a room decode asked for first waits for its sender). ``first_page``:
        the engine sends no page below it, since every decode rank holds them: a target with
        a shorter prefix (asked already, or later) is refused, as its pages would never come."""
        if not isinstance(first_page, (int, np.integer)) or isinstance(first_page, bool) or first_page < 0:
            raise LayoutError(f"first_page must be a non-negative integer, got {first_page!r} (init())",
                              field="first_page", **self.ctx)
        binding = self.check_binding(binding or self.binding or b"", "init()")
        for t in self.targets.values():
            self.check_prefix(t, int(first_page))
        self.set_length("init()", num_tokens=num_tokens, num_pages=num_pages)
        self.binding = binding
        if first_page > self.num_pages:
            raise LayoutError(f"first_page {first_page} outside a request of {self.num_pages} pages (init())",
                              field="first_page", **self.ctx)
        self.engine_first_page = int(first_page)
        if not self.num_to_send and not self.owns_last_token and not self.is_last:
            self.is_last = self.auto_last = True
            self.num_tokens_ready = self.num_tokens or 0

    def bind(self, binding: bytes) -> None:
        """The engine's digest of the request, said when the room opens (``KVSender.bind``), so that
        a claim arriving before ``init()`` is judged by it at once (SGLang: decode asks before init)."""
        self.binding = self.check_binding(binding, "bind()")

    def check_binding(self, binding: bytes, source: str) -> bytes:
        """``binding`` if the engine may bind the room to it: at most 64 bytes, the digest it said
        before (if any), and the one the claims accepted so far presented; else RoomBindingError."""
        if not isinstance(binding, bytes) or len(binding) > 64:
            raise RoomBindingError(f"binding must be at most 64 bytes, got {binding!r:.80} ({source})",
                                   field="binding", **self.ctx)
        if self.binding and binding != self.binding:
            raise RoomBindingError(f"{source} binds room {self.room} to {binding.hex() or '(none)'}, but it was bound "
                                   f"to {self.binding.hex()}", field="binding", **self.ctx)
        refusal = engine_binding_refusal(binding, self.claimed_binding, room=self.room)
        if refusal is not None:
            raise RoomBindingError(refusal, field="binding", **self.ctx)
        return binding

    def check_prefix(self, t: Target, first_page: int | None = None) -> None:
        """Target ``t`` holds at least the pages the engine skips (``first_page``: the engine's,
        by default), or it would wait for pages that never come."""
        first = self.engine_first_page if first_page is None else first_page
        if t.first_page < first:
            raise LayoutError(f"decode rank {t.decode_rank} holds pages [0, {t.first_page}) of room {self.room}, but "
                              f"the prefill engine sends pages from {first} on: pages [{t.first_page}, {first}) would "
                              "never come", field="first_page", **self.ctx)

    def select(self, page_table: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(logical pages, local pages)`` this rank sends, from its page table: entry ``i`` is
        the physical page of the ``i``-th page this rank stores for the request (its lane order:
        ``OwnerLanes.owners(...)[1]``). A shorter table (chunked prefill) selects what it covers."""
        table = np.asarray(page_table).reshape(-1)
        num_pages = self.num_pages
        stored = self.lanes.num_local_pages(self.cp_rank, num_pages)
        if table.size > stored or (table.size and not np.issubdtype(table.dtype, np.integer)):
            raise LayoutError(f"page table of {table.size} {table.dtype} entries; this rank stores {stored} pages of "
                              f"the request (integers)", field="page_table", **self.ctx)
        _, local_index = self.lanes.owners(self.owned, num_pages)
        keep = local_index < table.size
        return self.owned[keep], table[local_index[keep]].astype(np.int64)

    def add_chunk(self, logical: Any, local: Any, num_tokens_ready: int | None, is_last: bool,
                  aux_row: np.ndarray | None, aux_slot: int | None, ready_event: Any = None,
                  layers: Any = None) -> None:
        """Check a chunk from the engine and queue its complete pages; raises before queueing anything.
        ``ready_event``: the chunk's pages (and held pages it completes) are written once it completes.
        ``layers``: only target layers ``[start, end)`` of the pages (module docstring)."""
        if not self.length_known:
            raise LayoutError("send() before init()", field="num_tokens", **self.ctx)
        logical, local = page_ids(logical, "logical_pages", self.ctx), page_ids(local, "local_pages", self.ctx)
        if self.auto_last and not logical.size and aux_row is None and aux_slot is None:
            return  # a rank with nothing to send may still call send(): nothing to do
        if self.is_last:
            raise LayoutError("send() after the last chunk", field="is_last", **self.ctx)
        if logical.shape != local.shape:
            raise LayoutError(f"{logical.size} logical pages but {local.size} local pages", field="local_pages",
                              **self.ctx)
        span = None if layers is None else self._check_layers(layers)
        ready = self._ready(num_tokens_ready, is_last)
        num_pages = self.num_pages
        sent = None  # which of the chunk's pages were handed in before
        if logical.size:
            # ascending pages (what engines send) are each given once, and their ends are their bounds
            ascending = logical.size == 1 or bool((logical[1:] > logical[:-1]).all())
            lo, hi = (int(logical[0]), int(logical[-1])) if ascending else (int(logical.min()), int(logical.max()))
            if lo < 0 or hi >= num_pages:
                raise LayoutError(f"logical pages must lie in [0, {num_pages})", field="logical_pages", **self.ctx)
            owner = self.lanes.owner_ranks(logical, num_pages)
            if owner is not None and (owner != self.cp_rank).any():
                bad = int(np.flatnonzero(owner != self.cp_rank)[0])
                raise LayoutError(f"logical page {int(logical[bad])} is owned by cp rank {int(owner[bad])}, not this "
                                  "rank", field="logical_pages", **self.ctx)
            if lo < self.engine_first_page:
                raise LayoutError(f"logical page {lo} lies below first page {self.engine_first_page}, where this "
                                  "engine said it starts (init(first_page=): the decode ranks hold the pages below)",
                                  field="logical_pages", **self.ctx)
            if not ascending and has_repeats(logical):
                raise LayoutError("a logical page was sent twice", field="logical_pages", **self.ctx)
            sent = self.given[logical]
            if span is None and sent.any():
                bad = int(logical[sent][0])
                what = "" if self.layers_given is None or self.layers_given[bad].all() else " (some of its layers)"
                raise LayoutError(f"logical page {bad} was sent twice{what}", field="logical_pages", **self.ctx)
        if span is not None:
            self._check_layer_pages(logical, local, span, ready, self.num_tokens if self.num_tokens is not None
                                    else ready if is_last else -1)
            if is_last and self.held[0].size:
                raise LayerRangeError(f"logical page {int(self.held[0][0])} is held from an earlier chunk (it ended "
                                      "inside it) and travels with a send of every layer: end with a send without "
                                      "layers", field="layers", **self.ctx)
        num_new = 0 if sent is None else logical.size - int(np.count_nonzero(sent))
        self._check_aux(is_last, aux_row, aux_slot, int(np.count_nonzero(self.given)) + num_new)
        if is_last:
            self._check_layers_complete(logical, span)
        if is_last and self.num_tokens is None:  # started from its page count: the last chunk gives the length
            self._learn_tokens(ready, "the last chunk's num_tokens_ready")
        self.given[logical] = True
        self.local_of[logical] = local
        if span is not None:  # complete pages of some layers: queued as they are; held pages wait
            self._give_layers(logical, span)
            if logical.size:
                self.chunks.append((logical, local))
                self.chunk_events.append(ready_event)
                self.chunk_layers.append(span)
                self.chunk_tokens.append(ready)
            self.last_event = ready_event
            self.num_tokens_ready = ready
            self.is_last = is_last
            if is_last:
                self.aux_row, self.aux_slot = aux_row, aux_slot
            return
        if self.layers_given is not None and logical.size:
            self.layers_given[logical] = True
        # pages complete within `ready` go now; the rest wait for the chunk that completes them
        pend_logical = np.concatenate([self.held[0], logical])
        pend_local = np.concatenate([self.held[1], local])
        complete = ((pend_logical + 1) * self.page_size <= ready) | (
            (pend_logical == num_pages - 1) & (ready == self.num_tokens))
        self.held = (pend_logical[~complete], pend_local[~complete])
        if complete.any():
            self.chunks.append((pend_logical[complete], pend_local[complete]))
            self.chunk_events.append(ready_event)  # on one stream, it also covers the held pages' rows
            self.chunk_layers.append(None)
            self.chunk_tokens.append(ready)
        self.last_event = ready_event
        self.num_tokens_ready = ready
        self.is_last = is_last
        if is_last:
            self.aux_row, self.aux_slot = aux_row, aux_slot

    def _ready(self, num_tokens_ready: int | None, is_last: bool) -> int:
        """How many tokens exist after this chunk. A room started from its page count learns
        its length here: the last chunk's ``num_tokens_ready``, inside the last page."""
        ctx, n = self.ctx, self.num_tokens
        if num_tokens_ready is None:
            if not is_last:
                raise LayoutError("a chunk that is not the last must say how many tokens of the request are ready "
                                  "(num_tokens_ready): a page it ends inside is held until its rows exist",
                                  field="num_tokens_ready", **ctx)
            if n is None:
                raise LayoutError("this room was started from its page count: the last chunk must say the request's "
                                  "length (num_tokens_ready), so that only the valid rows of its last page travel",
                                  field="num_tokens_ready", **ctx)
            return int(n)
        low, high = self.num_tokens_ready, n if n is not None else self.num_pages * self.page_size
        if is_last and n is None:
            low = max(low, (self.num_pages - 1) * self.page_size + 1)
        if not isinstance(num_tokens_ready, (int, np.integer)) or isinstance(num_tokens_ready, bool) \
                or not low <= num_tokens_ready <= high:
            what = "the last chunk's" if is_last and n is None else ""
            raise LayoutError(f"{what or 'num_tokens_ready'} {num_tokens_ready!r} must lie in [{low}, {high}] "
                              f"({'inside the last of ' + str(self.num_pages) + ' pages; ' if what else ''}"
                              "it never goes back)", field="num_tokens_ready", **ctx)
        if is_last and n is not None and num_tokens_ready != n:
            raise LayoutError(f"the last chunk leaves tokens [{num_tokens_ready}, {n}) not ready",
                              field="num_tokens_ready", **ctx)
        return int(num_tokens_ready)

    def _check_aux(self, is_last: bool, aux_row: np.ndarray | None, aux_slot: int | None, num_given: int) -> None:
        ctx = self.ctx
        has_aux = aux_row is not None or aux_slot is not None
        if aux_row is not None and aux_slot is not None:
            raise LayoutError("pass the aux row (aux=) or the slot of your registered aux rows (aux_slot=), not both",
                              field="aux", **ctx)
        if not is_last:
            if has_aux:
                raise LayoutError("the aux row goes with the last chunk", field="aux", **ctx)
            return
        if num_given != self.num_to_send:
            raise LayoutError(f"last chunk leaves {self.num_to_send - num_given} owned pages unsent",
                              field="logical_pages", **ctx)
        if self.owns_last_token and not has_aux:
            raise LayoutError("this rank owns the last valid token: the last send() must carry the aux row (aux= or "
                              "aux_slot=)", field="aux", **ctx)
        if not self.owns_last_token and has_aux:
            if self.pp_rank != self.pp_size - 1:
                raise LayoutError(f"aux row given to pipeline stage pp{self.pp_rank} of {self.pp_size}; the last stage "
                                  "writes it (it holds the last hidden state)", field="aux", **ctx)
            raise LayoutError("aux row given, but another cp rank owns the last valid token (hard rule 4)",
                              field="aux", **ctx)

    # -- layer ranges ----------------------------------------------------------

    def _check_layers(self, layers: Any) -> tuple[int, int]:
        """``layers`` as ``(start, end)`` inside this rank's layer span."""
        lo, hi = self.layer_span
        ok = isinstance(layers, (tuple, list)) and len(layers) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in layers)
        if not ok or not lo <= layers[0] < layers[1] <= hi:
            raise LayerRangeError(f"layers {layers!r} must be a range [start, end) of target layers with {lo} <= "
                                  f"start < end <= {hi} (the layers this rank holds)", field="layers", **self.ctx)
        return int(layers[0]), int(layers[1])

    def _check_layer_pages(self, logical: np.ndarray, local: np.ndarray, span: tuple[int, int], ready: int,
                           num_tokens: int) -> None:
        """A layer-range send carries complete pages, each at the local page it was first handed
        in at, none of whose layers in ``span`` was handed in before."""
        ctx = self.ctx
        if not logical.size:
            return
        complete = ((logical + 1) * self.page_size <= ready) | (
            (logical == self.num_pages - 1) & (ready == num_tokens))
        if not complete.all():
            bad = int(logical[~complete][0])
            raise LayerRangeError(f"logical page {bad} ends past the {ready} tokens ready: a layer-range send carries "
                                  "complete pages only (a page a chunk ends inside goes with a send of every layer)",
                                  field="layers", **ctx)
        seen = self.given[logical]
        if seen.any():
            moved = seen & (self.local_of[logical] != local)
            if moved.any():
                i = int(np.flatnonzero(moved)[0])
                raise LayerRangeError(f"logical page {int(logical[i])} was handed in at local page "
                                      f"{int(self.local_of[logical[i]])}, now at {int(local[i])}: every layer range "
                                      "of a page names the same local page", field="local_pages", **ctx)
            given = self.layers_given
            a, b = span[0] - self.layer_span[0], span[1] - self.layer_span[0]
            twice = seen if given is None else given[logical, a:b].any(axis=1)  # (no layers_given: all full pages)
            if twice.any():
                i = int(np.flatnonzero(twice)[0])
                rows = np.ones(self.layer_width, dtype=bool) if given is None else given[logical[i]]
                sent = np.flatnonzero(rows[a:b]) + span[0]
                raise LayerRangeError(f"layer {int(sent[0])} of logical page {int(logical[i])} was sent twice (layers "
                                      f"[{span[0]}, {span[1]}) asked again)", field="layers", **ctx)

    def _check_layers_complete(self, logical: np.ndarray, span: tuple[int, int] | None) -> None:
        """The last chunk: every page handed in has every layer of the span, this chunk's included."""
        given = self.layers_given
        if given is None and span is None:
            return
        after = np.zeros((self.num_pages, self.layer_width), dtype=bool) if given is None else given.copy()
        if given is None:
            after[self.given] = True  # (every page before the first layer range came whole)
        if span is not None:
            after[logical, span[0] - self.layer_span[0]:span[1] - self.layer_span[0]] = True
        else:
            after[logical] = True
        short = self.given.copy()
        short[logical] = True
        short &= ~after.all(axis=1)
        if short.any():
            page = int(np.flatnonzero(short)[0])
            missing = np.flatnonzero(~after[page]) + self.layer_span[0]
            raise LayerRangeError(f"the last chunk leaves {int(np.count_nonzero(short))} pages with layers unsent: "
                                  f"logical page {page} misses layers {_ranges(missing)}", field="layers", **self.ctx)

    def _give_layers(self, logical: np.ndarray, span: tuple[int, int]) -> None:
        if self.layers_given is None:
            self.layers_given = np.zeros((self.num_pages, self.layer_width), dtype=bool)
            self.layers_given[self.given & (self.local_of >= 0)] = True
            self.layers_given[logical] = False  # (given just now: only the range below)
        self.layers_given[logical, span[0] - self.layer_span[0]:span[1] - self.layer_span[0]] = True


def _ranges(ids: np.ndarray) -> str:
    """``[0, 2), [5, 6)`` for ids 0 1 5."""
    if not ids.size:
        return "none"
    brk = np.flatnonzero(np.diff(ids) != 1) + 1
    starts, ends = np.r_[ids[0], ids[brk]], np.r_[ids[brk - 1], ids[-1]] + 1
    return ", ".join(f"[{int(a)}, {int(b)})" for a, b in zip(starts, ends))


def page_ids(value: Any, field: str, ctx: dict[str, Any]) -> np.ndarray:
    """An engine's page ids as a 1-D int64 array; LayoutError naming ``field`` for anything but
    integers (a float or boolean id cast to int64 would name another page)."""
    arr = value if type(value) is np.ndarray else np.asarray(value)
    if arr.size and arr.dtype.kind not in "iu":
        raise LayoutError(f"{field} must be integers, got dtype {arr.dtype}", field=field, **ctx)
    return arr.astype(np.int64, copy=False).reshape(-1)
