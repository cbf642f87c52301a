"""Prefill's writes in flight: post -> book -> report, one write id per write, direct or staged.

The room machine (``machine.py``) asks this book for the writes a room's queued chunks (and its
aux row) make to each active target, and tells it what became of each; the book answers in plain
data. ``post(room)`` plans every chunk not yet posted (``targets.py``: ``plan_target`` /
``plan_chunk``) and answers ``PostWrite`` for a direct write; a staged one (the path
``staged.py`` chose) is fed to the staged-writes machine as ``StageWrite`` and its answers
(``Started``, ``Gather``, ``Send``) are handed on, in order. A staged chunk larger than one slot
is planned in slot-sized groups, one per call (``post`` says so: the room's next group waits for
the next tick). ``posted`` / ``chunk_posted``: the engine's handle for a write, its bytes and
slices counted. ``end``: a write is final -> its report (one ``PagesDone`` per write, with the aux
row when it carried it; ``SendDigested`` when the decode rank wants digests), the target's counts
updated. A write is in flight from ``post`` to ``end`` (or ``failed``): no failure report or abort
ack leaves before (``PrefillRoom.num_inflight``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.errors import KVBridgeError
from kvbridge.layout import AuxSchema, BufferDesc, PoolSpec, layer_range_specs
from kvbridge.layout.plan import TransferPlan
from kvbridge.transfer.actions import Send
from kvbridge.transfer.channel import wire
from kvbridge.transfer.engine import WriteState, WriteStatus
from kvbridge.transfer.prefill.events import Posted, PostWrite, SendDigested
from kvbridge.transfer.prefill.kinds import KindWrite, KindWrites
from kvbridge.transfer.prefill.room import PrefillRoom
from kvbridge.transfer.prefill.staged import (ChunkCounted, ChunkPosted, StagedWrites, StageWrite, Started,
                                              WriteEnded)
from kvbridge.transfer.prefill.targets import Target, plan_chunk, plan_target

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)


def trace_room(r: PrefillRoom, rank: str, now: float, what: str, *args: Any) -> None:
    """One trace line of room ``r`` on ``rank`` (``trace=True``)."""
    log.info("trace room=%d rank=%s +%.2fms @%.6f " + what, r.room, rank, r.age_ms(now), now, *args)


def pages_text(pages: np.ndarray) -> str:
    """A trace line's page list: in full when short, else its count and ends."""
    if pages.size <= 8:
        return str(pages.tolist())
    return f"{pages.size}[{int(pages[0])}..{int(pages[-1])}]"


class Writes:
    """The writes in flight of a prefill rank's rooms: write id -> its room and target, engine
    handle -> write id, the bytes and slices posted."""

    def __init__(self, specs: Mapping[str, PoolSpec], src_bufs: Sequence[BufferDesc], aux_schema: AuxSchema,
                 num_target_layers: int, stage: StagedWrites, *, cp_rank: int, rank: str, trace: bool,
                 kinds: KindWrites | None = None) -> None:
        """``stage``: the staged-writes machine, which chooses each target's path and group size
        and takes the staged writes (``StageWrite``); ``kinds``: the window, compressed and state
        pools' share of each write (``kinds.py``; None or empty: paged pools only)."""
        self.specs = specs
        self.src_bufs = src_bufs
        self.aux_schema = aux_schema
        self.num_target_layers = num_target_layers
        self.stage = stage
        self.cp_rank = cp_rank
        self.rank = rank
        self.trace = trace
        self.by_write: dict[int, tuple[PrefillRoom, Target]] = {}  # write id -> its room and target (in flight)
        self.handles: dict[int, int] = {}  # engine handle -> write id
        self.next_write = 0
        self.num_bytes = 0
        self.num_slices = 0
        self.cut_specs: dict[tuple[int, int], dict[str, PoolSpec]] = {}  # layer range -> its pools' cut
        self.kinds = kinds
        self.paged = {name for name, spec in specs.items() if spec.kind == "paged"}
        self.kind_reports: dict[int, KindWrite] = {}  # write id -> the kind units it carries
        self._out: list[Any] = []

    def __len__(self) -> int:
        """How many writes are in flight."""
        return len(self.by_write)

    def pending(self, final: Iterable[int] | None = None) -> list[int]:
        """The engine handles of writes in flight (among ``final``, when the engine said which)."""
        handles = self.handles
        return list(handles) if final is None else [h for h in final if h in handles]

    def counted(self, a: Started | ChunkCounted) -> None:
        """A staged write's chunks were planned (``Started``), or one landed (``ChunkCounted``):
        its room's staged counts."""
        r = self.by_write[a.write][0]
        if type(a) is ChunkCounted:
            r.staged["chunks"] += 1
            r.staged["bytes_staged"] += a.num_bytes
            return
        r.staged["plan_slices"] += a.plan_slices
        if self.trace:
            log.info("trace room=%d rank=%s staged write %d: chunks=%d plan_slices=%d bytes=%d", r.room, self.rank,
                     a.write, a.num_chunks, a.plan_slices, a.num_bytes)

    # -- post ----------------------------------------------------------------------------

    def post(self, r: PrefillRoom) -> tuple[list[Any], bool]:
        """Every queued chunk (and the aux row) of room ``r`` to every active target: the actions
        and the staged machine's answers, in order, and whether a staged chunk's next group waits
        for the next tick."""
        more = False
        for t in r.targets.values():
            while t.active and t.posted < len(r.chunks):
                last_chunk = t.posted == len(r.chunks) - 1
                # the aux row rides in the last chunk's batch: one write, one completion
                with_aux = last_chunk and r.is_last and r.has_aux and t.aux_source and not t.aux_posted
                if with_aux and r.aux_from is None:
                    # the last send's Chunk is in, its Post (where the row is written from) not yet: a
                    # request fed between them (the shell feeds queued events after each) posts now, so
                    # the last chunk waits for the Post, which follows in the same send()
                    break
                if not self._post_chunk(r, t, *r.chunks[t.posted], with_aux=with_aux,
                                        after=r.chunk_events[t.posted], layers=r.chunk_layers[t.posted],
                                        kind_to=(r.chunk_tokens[t.posted], last_chunk and r.is_last)):
                    more = True  # one staged group started: the next is planned on the next tick
                    break
                t.posted += 1
            aux_left = r.has_aux and t.aux_source and not t.aux_posted
            kinds_left = bool(self.kinds) and t.kind_wait and self.kinds.wants(r.room, t.decode_rank)
            if t.active and t.posted == len(r.chunks) and r.is_last and (aux_left or kinds_left) \
                    and not (aux_left and r.aux_from is None):  # (as above: the row's source comes with the Post)
                self._post_chunk(r, t, _EMPTY, _EMPTY, with_aux=aux_left, after=r.last_event,
                                 kind_to=(r.num_tokens, True))
        out, self._out = self._out, []
        return out, more

    def _post_chunk(self, r: PrefillRoom, t: Target, logical: np.ndarray, local: np.ndarray, with_aux: bool,
                    after: Any = None, layers: tuple[int, int] | None = None,
                    kind_to: tuple[int | None, bool] | None = None) -> bool:
        """Post an engine chunk's pages (and the aux row) to ``t``: True once all of it is posted;
        False when one slot-sized group of a staged chunk was started and the rest waits for the
        next tick. ``layers``: the chunk carries those target layers of its pages only.
        ``kind_to``: (tokens the chunk ends at, the room's last chunk): the kind pools' units it
        completes ride in the same write (``kinds.py``), direct or staged (a staged chunk planned
        in groups carries them in its last group, the one planned whole)."""
        specs = self.specs if layers is None else self._layer_specs(layers)
        num_layers = None if layers is None else layers[1] - layers[0]
        if t.first_page:  # the decode rank already holds pages below its prefix
            keep = logical >= t.first_page
            logical, local = logical[keep], local[keep]
        logical, local = logical[t.group_at:], local[t.group_at:]
        group = self.stage.group_size(r.room, t, logical.size)
        rank = self.rank
        head = None  # the first group's plan, when the path chosen on it is direct: the write's first part
        ahead = False  # the aux row, taken inline and ahead, is reported on its own after this write is posted
        try:
            if group:  # a staged chunk larger than a slot: one group now, the next at the next tick
                part = plan_target(specs, self.src_bufs, t, logical[:group], local[:group], r.plan_tokens, room=r.room,
                                   rank=rank, layers=layers)
                if self._path(r, t, part) == "staged":
                    self._stage_write(r, t, logical[:group], False, part, after, num_layers)
                    t.group_at += group
                    return False
                head = part
            t.group_at = 0  # direct: the whole chunk is one write
            kplan, kunits = None, None
            if self.kinds and kind_to is not None and t.kind_wait:
                kplan, kunits = self.kinds.plan(r.room, t.decode_rank, r.num_tokens, kind_to[0], kind_to[1],
                                                r.local_of, t.dst_pages, r.owns_last_lane, layers,
                                                decode_tp=t.decode_tp)
                if not kunits and self.kinds.settled(r.room, t.decode_rank):
                    t.kind_wait = False  # nothing of the kinds left for this target
            if not logical.size and not with_aux:
                if not kunits:
                    return True
                if self._path(r, t, kplan) == "staged":  # (state with the last chunk, through a slot)
                    self._stage_write(r, t, logical, False, kplan, after, None, kunits)
                    return True
                w = self._start(r, t, logical, False, None)
                self.kind_reports[w] = kunits
                self._out.append(PostWrite(w, r.room, t, t.session, kplan.src, kplan.dst, kplan.length, after))
                return True
            src = None
            if with_aux:
                t.aux_posted = True
                src = r.aux_from
                if src is None:
                    raise KVBridgeError("the aux row's source was not given with the chunk that carried it",
                                        room=r.room, rank=rank, field="aux")
                if self.inline_row(r, t) is not None:  # the row rides in a report, not in a write
                    src = None
                    if not logical.size and not (kplan is not None and kplan.num_slices):
                        return self._report_aux(r, t, num_layers, kunits)  # nothing to write: reported now
                    if t.aux_ahead:
                        # reported on its own, right after the write of the pages it comes with is
                        # posted (long before they land): decode writes it into its device slot while
                        # they land, not at its commit
                        ahead, with_aux = True, False
                else:
                    after = after if src.after is None else src.after  # (the row's copy waited on the chunk's events)
            if head is not None:  # the rest of the chunk after its first group (planned above), then the aux row
                plan = TransferPlan.concat([head, plan_chunk(specs, self.src_bufs, self.aux_schema, t, logical[group:],
                                                             local[group:], r.plan_tokens, src, room=r.room, rank=rank,
                                                             layers=layers)])
            elif logical.size or src is not None:
                plan = plan_chunk(specs, self.src_bufs, self.aux_schema, t, logical, local, r.plan_tokens, src,
                                  room=r.room, rank=rank, layers=layers)
            else:
                plan = TransferPlan.empty()
            if kplan is not None and kplan.num_slices:
                plan = TransferPlan.concat([plan, kplan])
            if self.kinds and not plan.num_slices and not with_aux and not kunits and not (
                    logical.size and any(p in self.paged for p in t.pools)):
                # pages of window pools before their window, no paged pool: nothing to write or report
                # (a staged write of nothing would land in no slot); the pages are done (a layer
                # range: those whose every layer is now done, as ``end`` counts them)
                if num_layers is not None and logical.size:
                    logical = t.count_layers(logical, num_layers, r.layer_width, r.num_pages)
                t.num_pages_done += logical.size
                return self._report_aux(r, t, None, None) if ahead else True
            if self._path(r, t, plan) == "staged":  # the same write through staging slots (aux row, kinds too)
                self._stage_write(r, t, logical, with_aux, plan, after, num_layers, kunits or None)
                return self._report_aux(r, t, None, None) if ahead else True
        except Exception as exc:  # a bug must fail this target, not the engine thread or the loop that called us
            t.group_at = 0
            if isinstance(exc, KVBridgeError):
                t.failure = f"{'aux row: ' if with_aux and not logical.size else ''}{exc}"
            else:
                log.exception("room %d on %s: planning for %s failed", r.room, rank, t.decode_rank)
                t.failure = f"internal error posting room {r.room} to {t.decode_rank}: {type(exc).__name__}: {exc}"
            return True
        w = self._start(r, t, logical, with_aux, num_layers)  # in flight from here: no report before it is final
        if kunits:
            self.kind_reports[w] = kunits
        self._out.append(PostWrite(w, r.room, t, t.session, plan.src, plan.dst, plan.length, after))
        return self._report_aux(r, t, None, None) if ahead else True

    def _report_aux(self, r: PrefillRoom, t: Target, num_layers: int | None, kunits: KindWrite | None) -> bool:
        """The aux row for a target that takes it inline: no write; its report leaves now, carrying
        the row, through the same end as a write's (``WriteEnded``: the machine reports and settles).
        Alone (a room's last send after its layers went: ``kunits`` ride in it), or, to a target that
        asked for it ahead (``aux_ahead``), beside the write of the pages it comes with, right after
        that write is posted."""
        w = self._start(r, t, _EMPTY, True, num_layers)
        if kunits:
            self.kind_reports[w] = kunits
        self._out.append(WriteEnded(w, True, ""))
        return True

    @staticmethod
    def inline_row(r: PrefillRoom, t: Target) -> bytes | None:
        """The aux row's bytes when ``t`` takes it in the report (it asked, and the shell has them:
        ``AuxFrom.row``), else None (the row is written with the pages)."""
        src = r.aux_from
        return src.row if t.aux_inline and src is not None else None

    def _start(self, r: PrefillRoom, t: Target, logical: np.ndarray, with_aux: bool, num_layers: int | None) -> int:
        w = self.next_write
        self.next_write += 1
        t.inflight[w] = (logical, with_aux, num_layers)
        self.by_write[w] = (r, t)
        return w

    def _path(self, r: PrefillRoom, t: Target, plan: TransferPlan) -> str:
        path = r.paths[t.decode_rank] = self.stage.path(r.room, t, plan)
        return path

    def _layer_specs(self, layers: tuple[int, int]) -> dict[str, PoolSpec]:
        """The pools cut to the layer ids that target layers ``layers`` carry (kept per range)."""
        cut = self.cut_specs.get(layers)
        if cut is None:
            cut = self.cut_specs[layers] = layer_range_specs(self.specs, layers, self.num_target_layers)
        return cut

    def _stage_write(self, r: PrefillRoom, t: Target, logical: np.ndarray, with_aux: bool, plan: TransferPlan,
                     after: Any, num_layers: int | None = None,
                     kind_report: KindWrite | None = None) -> None:
        """A write of ``logical`` pages (and the aux row, and the kind units of ``kind_report``)
        through staging: in flight from here, reported (one PagesDone, as a direct write) once
        every chunk landed."""
        w = self._start(r, t, logical, with_aux, num_layers)
        if kind_report is not None:
            self.kind_reports[w] = kind_report
        self._out.extend(self.stage.feed(StageWrite(w, r.room, t, plan, after)))
        if self.trace:
            log.info("trace room=%d rank=%s -> %s staged pages=%s", r.room, self.rank, t.decode_rank,
                     pages_text(logical))

    # -- book ----------------------------------------------------------------------------

    def posted(self, e: Posted) -> None:
        """The shell submitted write ``a``: the engine's ``handle`` reports it."""
        a = e.action
        r, t = self._book(a.write, e.handle, int(a.length.sum()), len(a.length), e.now)
        if self.trace:
            logical, with_aux, _ = t.inflight[a.write]
            trace_room(r, self.rank, e.now, "-> %s pages=%s%s slices=%d bytes=%d submit=%.3fms", t.decode_rank,
                       pages_text(logical), " +aux" if with_aux else "", len(a.length), int(a.length.sum()),
                       e.submit_s * 1e3)

    def chunk_posted(self, e: ChunkPosted) -> None:
        """The shell gathered chunk ``a`` and submitted its wire pieces: the engine's ``handle``
        (the staged machine is fed ``e`` next)."""
        a = e.action
        r, t = self._book(a.write, e.handle, e.num_bytes, e.num_slices, e.now)
        if self.trace:
            trace_room(r, self.rank, e.now, "-> %s chunk %d at %#x slices=%d bytes=%d write=%d", t.decode_rank,
                       a.chunk, a.remote_addr, e.num_slices, e.num_bytes, e.handle)

    def _book(self, w: int, handle: int, num_bytes: int, num_slices: int, now: float) -> tuple[PrefillRoom, Target]:
        """Write ``w`` is in the engine as ``handle``: its bytes and slices counted."""
        self.handles[handle] = w
        r, t = self.by_write[w]
        if r.first_post is None:
            r.first_post = now
        self.num_bytes += num_bytes
        self.num_slices += num_slices
        r.num_bytes += num_bytes
        r.num_slices += num_slices
        return r, t

    def take(self, handle: int) -> int | None:
        """The write engine handle ``handle`` reported (None: not one of ours, or reported already)."""
        return self.handles.pop(handle, None)

    # -- end -----------------------------------------------------------------------------

    def failed(self, w: int, reason: str | None) -> PrefillRoom:
        """Write ``w`` was refused at submission, or not submitted: nothing of it is in flight."""
        r, t = self.by_write.pop(w)
        t.inflight.pop(w, None)
        self.kind_reports.pop(w, None)
        if reason is not None:
            t.failure = reason
        return r

    def end(self, w: int, status: WriteStatus, now: float) -> tuple[PrefillRoom, list[Any]]:
        """Write ``w`` (direct, or every chunk of a staged one) is final: its room, and its report
        (one per write) unless its target failed or stopped."""
        r, t = self.by_write.pop(w)
        pages, with_aux, num_layers = t.inflight.pop(w)
        kwrite = self.kind_reports.pop(w, None)
        if self.trace:
            trace_room(r, self.rank, now, "write of %d pages%s to %s %s", pages.size, " +aux" if with_aux else "",
                       t.decode_rank, status.state.value)
        if status.state is WriteState.FAILED:
            t.failure = t.failure or f"write to decode rank {t.decode_rank} ({t.session}) failed: {status.reason}"
            return r, []
        if not t.active:
            return r, []
        if num_layers is not None and pages.size:  # a layer range: the pages whose every layer reached t
            pages = t.count_layers(pages, num_layers, r.layer_width, r.num_pages)
        if pages.size:
            t.num_pages_done += pages.size
        if with_aux:
            t.aux_done = True
        kunits, klast = self.kinds.landed(r.room, t.decode_rank, kwrite) if kwrite else ({}, False)
        if kwrite and self.kinds.settled(r.room, t.decode_rank):
            t.kind_wait = False
        # one report per write: its pages and, when it carried it, the aux row (and the kind units);
        # pages of paged pools only (a room of kind pools alone reports none)
        pools = [p for p in t.pools if p in self.paged] if pages.size else []
        msg = wire.PagesDone(
            room=r.room, cp_rank=self.cp_rank, status="ok", reason="",
            pools=pools, logical_pages=pages.astype("<i4").tobytes() if pools else b"",
            digests=None, aux=with_aux, num_tokens=(r.num_tokens or 0) if with_aux else 0,
            kind_units=kunits, kind_last=klast, aux_row=self.inline_row(r, t) if with_aux else None)
        if (pools or kunits) and t.want_digest:  # the shell reads the pages and units and fills the digests in
            kinds = tuple((pool, logical, self.kinds.src_units(r.room, pool, logical, r.local_of,
                                                                    r.num_tokens or 0))
                          for pool, packed in kunits.items()
                          for logical in (np.frombuffer(packed, dtype="<i4").astype(np.int64),))
            return r, [SendDigested(t.ident, msg, tuple(pools), pages if pools else _EMPTY,
                                    r.local_of[pages] if pools else _EMPTY, r.plan_tokens, kinds,
                                    r.num_tokens or 0)]
        return r, [Send((t.ident,), msg)]
