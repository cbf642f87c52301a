"""The server end of the transport (``transport.py`` says what a connection may cost and why):
it listens, admits pending connections, authenticates each by the Hello that answers its
challenge, and serves peers within ``Limits``."""

from __future__ import annotations

import collections
import itertools
import logging
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

from kvbridge.errors import ConfigError, KVBridgeError, PeerLost, ProtocolError, TransferError
from kvbridge.transfer.channel.envelope import HELLO_MAX_BYTES, Codec, Hello
from kvbridge.transfer.channel.frames import HEADER, READ_PER_CALL, Meter, Stream, frame
from kvbridge.transfer.channel.transport import (ACCEPT_PAUSE_S, DEFAULT_HWM, IDLE_SCAN_S, MAX_BATCH, READ,
                                                 REFUSALS_QUEUED, SCAN_S, Channel, Limits, Received, listen_socket,
                                                 parse_address, power_of_two, set_nodelay)

log = logging.getLogger("kvbridge.transfer.channel")


class Server(Channel[bytes]):
    """Listens on ``address`` (``tcp://host:port``, port 0: a free one; ``unix:@name`` abstract,
    ``unix:/path``); a peer is its connection's id (bytes). ``admit(sock)`` may refuse a new
    connection by raising (its result is kept as the stream's ``info``)."""

    def __init__(self, codec: Codec[Any], address: str, *, hwm: int = DEFAULT_HWM, limits: Limits | None = None,
                 admit: Callable[[socket.socket], Any] | None = None,
                 on_lost: Callable[[bytes], None] | None = None,
                 vouch: Callable[[Hello], bool] | None = None,
                 protected: Callable[[bytes], bool] | None = None) -> None:
        super().__init__(codec, hwm=hwm)
        self.limits = limits or Limits()
        if self.limits.frame_allowance < 64:
            raise ConfigError(f"the {codec.name} channel's frame_allowance ({self.limits.frame_allowance} bytes) must "
                              "hold at least a frame header and a small message (64 bytes)", field="frame_allowance")
        if self.limits.frame_budget < self._max_frame + HEADER.size:
            raise ConfigError(f"the {codec.name} channel's frame_budget ({self.limits.frame_budget} bytes) must hold "
                              f"its largest frame ({self._max_frame + HEADER.size} bytes)", field="frame_budget")
        self._admit = admit
        self._on_lost = on_lost
        # slots for known peers: a connection ``protected(peer)`` vouches for (a rank that proved
        # itself) is never displaced, and a newcomer whose Hello ``vouch`` accepts (names such a
        # rank) displaces an unprotected connection when every slot is taken, instead of being
        # refused: a flood from many addresses can neither push a proven rank out nor keep it out
        self._vouch = vouch
        self._is_protected = protected
        family, sockaddr, label = parse_address(address, listen=True)
        try:
            self._listener = listen_socket(family, sockaddr)
        except OSError as exc:
            self._sel.close()
            self.wakeup.close()
            raise ConfigError(f"cannot bind the {codec.name} channel to {label}: {exc.strerror or exc}",
                              field="port") from exc
        if family == socket.AF_UNIX:
            self.port = 0
            self.endpoint = address
        else:
            self.port = int(self._listener.getsockname()[1])
            host = sockaddr[0]
            self.endpoint = f"tcp://{f'[{host}]' if ':' in host else host}:{self.port}"
        self._peers: dict[bytes, Stream] = {}
        self._pending: dict[Stream, None] = {}  # accepted, no Hello yet (oldest first)
        self._pending_by_address: collections.Counter[str] = collections.Counter()
        self._by_address: dict[str, dict[Stream, None]] = {}  # authenticated peers per address (oldest first)
        self._budget_used = 0  # bytes of frame_budget the readers hold
        self._budget_by_address: collections.Counter[str] = collections.Counter()  # of it, per source address
        # at most this much of the budget for one address (at least one largest frame): a flood from
        # one address leaves the rest to the others
        self._address_share = max(self.limits.frame_budget // 2, self._max_frame + HEADER.size)
        self._throttled: dict[Stream, None] = {}  # readers waiting for frame_budget (oldest first)
        # the same readers by source address, the addresses in turn order: the next grant goes to the
        # first address here whose share has room (its oldest waiting reader); served, it moves to the end
        self._turns: dict[str, dict[Stream, None]] = {}
        self._meter = Meter()  # unsent output of every connection
        self._ids = itertools.count(1)
        self._accept_failures = 0
        self._listen_paused = 0.0
        self._next_scan = 0.0
        self._sel.register(self._listener, READ, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_peers(self) -> int:
        return len(self._peers)

    @property
    def peers(self) -> list[bytes]:
        """The connected peers (authenticated connections), in no promised order."""
        return list(self._peers)

    def peers_from(self, address: str) -> int:
        """Authenticated connections from one source address."""
        return len(self._by_address.get(address, ()))

    @property
    def buffered_bytes(self) -> int:
        """Bytes every connection's reader holds (what the frame budgets bound)."""
        with self._io:
            return sum(s.reader.buffered for s in self._by_fd.values())

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting unsent for every peer (what max_queued_bytes bounds)."""
        return self._meter.queued

    def hello_of(self, peer: bytes) -> Hello | None:
        """What a connected peer said it is (its Hello), or None once it is gone."""
        stream = self._peers.get(peer)
        return None if stream is None else stream.hello

    def info_of(self, peer: bytes) -> Any:
        stream = self._peers.get(peer)
        return None if stream is None else stream.info

    def send(self, peer: bytes, msg: Any) -> None:
        """Send to a connected peer (any thread); PeerLost when it is gone or its queue is full."""
        self.send_frame(peer, self.codec.encode(msg))

    def send_frame(self, peer: bytes, data: bytes) -> None:
        """Send one encoded message (or, in tests, any bytes) to ``peer`` (any thread)."""
        who = f"peer {peer.hex()}"
        with self._io:
            stream = self._peers.get(peer)
            if stream is None or stream.sock is None or stream.broken:
                raise PeerLost(f"{self.codec.name} channel to {who}: peer not connected")
            self._send(stream, data, who)
            if stream.sock is None or stream.broken:
                raise PeerLost(f"{self.codec.name} channel to {who}: connection closed")
            if self._meter.queued > self.limits.max_queued_bytes:
                self._shed_output()
                if stream.sock is None:
                    raise PeerLost(f"{self.codec.name} channel to {who}: closed holding the most unsent output "
                                   f"(over {self.limits.max_queued_bytes} bytes for all peers)")

    def _shed_output(self) -> None:
        """Over max_queued_bytes: close the peers holding the most unsent output (ones that do
        not read) until under it again."""
        while self._meter.queued > self.limits.max_queued_bytes:
            hoarder = max(self._peers.values(), key=lambda s: s.queued_bytes, default=None)
            if hoarder is None or not hoarder.queued_bytes:
                return
            self.stats.output_closed += 1
            if power_of_two(self.stats.output_closed):
                log.warning("%s channel %s: closed %d connection(s) holding the most unsent output; latest from %s "
                            "(%d bytes)", self.codec.name, self.endpoint, self.stats.output_closed, hoarder.address,
                            hoarder.queued_bytes)
            self._lost(hoarder, f"{hoarder.queued_bytes} bytes unsent: the peer does not read")

    def _refusal(self, err: ProtocolError, body: bytes) -> Any:
        """The answer to a malformed message (None: no answer)."""
        return None

    def _receive(self, stream: Stream, body: bytes) -> Received[bytes] | None:
        if stream.hello is None:
            self._authenticate(stream, body)
            return None
        stream.last_rx = time.monotonic()
        result = self._decode(body, f"peer {stream.ident.hex()}")
        if result is None:  # it failed its MAC
            stream.bad_macs += 1
            if stream.bad_macs >= self.limits.max_bad_macs:
                self.stats.bad_mac_closed += 1
                if power_of_two(self.stats.bad_mac_closed):
                    log.warning("%s channel %s: closed %d connection(s) whose frames failed their MAC; latest from %s",
                                self.codec.name, self.endpoint, self.stats.bad_mac_closed, stream.address)
                self._lost(stream, f"{stream.bad_macs} frames failed their MAC")
            return None
        if isinstance(result, ProtocolError):
            reply = None
            if stream.queued_frames < REFUSALS_QUEUED:  # (a peer that does not read gets no pile of them)
                reply = self._refusal(result, getattr(result, "body", b""))
            if reply is not None:
                try:
                    self.send(stream.ident, reply)
                    self.stats.error_replies += 1
                except TransferError as exc:
                    log.debug("could not answer a malformed message: %s", exc)
        return None if result is None else (stream.ident, result)

    def _authenticate(self, stream: Stream, body: bytes) -> None:
        """A pending connection's first frame: its Hello, or the connection is closed."""
        try:
            hello = self.codec.open_hello(body, stream.challenge)
        except ProtocolError as err:
            self.stats.unauthenticated += 1
            if power_of_two(self.stats.unauthenticated):
                log.warning("%s channel %s: closed %d connection(s) without a valid hello; latest from %s: %s",
                            self.codec.name, self.endpoint, self.stats.unauthenticated, stream.address, err)
            self._lost(stream, f"no valid hello: {err}")
            return
        self._unpend(stream)
        limits, address = self.limits, stream.address
        cap = limits.max_connections_per_address
        why = None
        if cap is not None and self.peers_from(address) >= cap:
            why = f"{cap} connections from {address} already"
        elif len(self._peers) >= limits.max_connections:
            busiest = self._displaceable(address, known=self._vouch is not None and self._vouch(hello))
            if busiest is None:
                why = f"{len(self._peers)} peers connected"
            else:
                self.stats.displaced += 1
                if power_of_two(self.stats.displaced):
                    log.warning("%s channel %s: every slot taken; %d connection(s) of the busiest address displaced "
                                "for newcomers (latest: one of %s's for %s)", self.codec.name, self.endpoint,
                                self.stats.displaced, busiest.address, address)
                self._lost(busiest, f"displaced: every slot taken, and {busiest.address} holds the most")
        if why is not None:
            self.stats.refused += 1
            if power_of_two(self.stats.refused):
                log.warning("%s channel %s: refused %d authenticated connection(s); latest from %s: %s",
                            self.codec.name, self.endpoint, self.stats.refused, address, why)
            self._lost(stream, f"too many peers: {why}")
            return
        stream.hello = hello
        stream.last_rx = time.monotonic()
        stream.reader.max_frame = self._max_frame
        self._peers[stream.ident] = stream
        self._by_address.setdefault(address, {})[stream] = None

    def _protected(self, stream: Stream) -> bool:
        return self._is_protected is not None and self._is_protected(stream.ident)

    def _displaceable(self, address: str, *, known: bool = False) -> Stream | None:
        """The oldest unprotected connection of the address holding the most, when it holds more
        than one more than ``address`` does (so that displacing it makes the table fairer), or,
        for a ``known`` newcomer, whatever it holds; else None. Protected connections stay."""
        mine = self.peers_from(address)
        for busiest in sorted(self._by_address, key=lambda a: len(self._by_address[a]), reverse=True):
            held = self._by_address[busiest]
            if not known and len(held) <= mine + 1:
                return None
            victim = next((s for s in held if not self._protected(s)), None)
            if victim is not None:
                return victim
        return None

    def _greeting(self, stream: Stream) -> bool:
        return stream.hello is None

    def _frames(self, stream: Stream, out: list[Received[bytes]], limit: int | None = MAX_BATCH) -> None:
        greeted = stream.hello is None
        super()._frames(stream, out, limit)
        if not greeted or stream.sock is None or stream.hello is None or stream.reader.ready:
            return
        # the Hello was opened in this turn: what its peer sent after it is read now, as a peer's
        try:
            alive, why = self._readable(stream), "closed by the peer"
        except (OSError, KVBridgeError) as exc:
            alive, why = False, str(exc)
        if stream.sock is not None:
            super()._frames(stream, out, limit if alive else None)
        if stream.sock is not None and not alive:
            self._lost(stream, why)

    def _readable(self, stream: Stream) -> bool:
        if stream.hello is None:  # pending: its header, then the Hello it announces, and no byte past it
            # (what follows the Hello is read once it is opened, within the allowance and the
            # budget: taken in the same read, it would stay in the reader beyond both; ``_frames``)
            if stream.reader.buffered < HEADER.size:
                if not stream.read(HEADER.size - stream.reader.buffered):
                    return False
                if stream.reader.buffered < HEADER.size:
                    return True
            if stream.reader.announced > HELLO_MAX_BYTES:
                return True  # (refused at its header)
            return stream.read(HEADER.size + stream.reader.announced - stream.reader.buffered)
        room = self._room(stream)
        if room <= 0:
            self._throttle(stream)
            return True
        alive = stream.read(min(READ_PER_CALL, room))
        self._taken(stream)
        return alive

    # -- the frame budget ------------------------------------------------------------------------
    #   a reader's bytes:  [0, frame_allowance)                its own: small frames, headers
    #                      [frame_allowance, end of frame)     reserved whole from frame_budget
    # A frame larger than the allowance is read only once its whole excess is reserved (all or
    # nothing): whoever holds a reservation can finish its frame, so the readers never wait on one
    # another in a circle, and the budget comes back when the frame is taken out or its connection
    # closes. Waiting readers are served fairly by source address, not in arrival order: the
    # addresses take turns (round robin; within one, oldest first), and no address holds more than
    # ``_address_share`` at once, so a flood of large frames from one address (any number of its
    # connections) delays another address's frame by at most one turn, never starves it.
    def _room(self, stream: Stream) -> int:
        """Bytes ``stream`` may read now (<= 0: it waits for the budget)."""
        return self.limits.frame_allowance + stream.budget - stream.reader.buffered

    def _next_in_turn(self) -> Stream | None:
        """The waiting reader whose turn it is: the oldest of the first address in turn order
        whose share has room for it; None when no waiting reader's address has room."""
        for address, waiting in self._turns.items():
            stream = next(iter(waiting))  # (oldest first)
            if self._budget_by_address[address] - stream.budget + self._need(stream) <= self._address_share:
                return stream
        return None

    def _need(self, stream: Stream) -> int:
        size = stream.reader.announced if stream.sock is not None else 0
        return max(0, HEADER.size + size - self.limits.frame_allowance) if size else 0

    def _taken(self, stream: Stream) -> None:
        if stream.hello is None:
            return
        need = self._need(stream)
        if need == stream.budget:
            return
        if need > stream.budget:
            waiting = bool(self._throttled) and not (stream.throttled and self._next_in_turn() is stream)
            over_share = self._budget_by_address[stream.address] - stream.budget + need > self._address_share
            if waiting or over_share or self._budget_used - stream.budget + need > self.limits.frame_budget:
                need = 0  # not now: what it held goes back, and it waits its turn
        freed = need < stream.budget
        self._budget_used += need - stream.budget
        self._budget_by_address[stream.address] += need - stream.budget
        if self._budget_by_address[stream.address] <= 0:
            del self._budget_by_address[stream.address]
        stream.budget = need
        if freed and self._throttled:
            self._unthrottle()

    def _throttle(self, stream: Stream) -> None:
        if not stream.throttled:
            stream.throttled = time.monotonic()
            self._throttled[stream] = None
            self._turns.setdefault(stream.address, {})[stream] = None
            self.stats.throttled += 1
            self._interest(stream)
            self._unthrottle()  # the budget may have room for it, or for a waiter its turn puts first

    def _unwait(self, stream: Stream) -> None:
        """``stream`` waits no more; its address leaves the turns when none of its readers waits."""
        if self._throttled.pop(stream, 0) is None:
            same = self._turns[stream.address]
            del same[stream]
            if not same:
                del self._turns[stream.address]
        stream.throttled = 0.0

    def _unthrottle(self) -> None:
        """Readers waiting for the budget are read again, in turn, while it has room; their
        frame's clock did not run while they waited."""
        now = time.monotonic()
        while self._throttled:
            stream = self._next_in_turn()
            if stream is None:
                return
            self._taken(stream)
            if self._room(stream) <= 0:
                return
            since = stream.throttled
            self._unwait(stream)
            rest = self._turns.pop(stream.address, None)  # served: its address goes to the end of the turns
            if rest:
                self._turns[stream.address] = rest
            if stream.partial_since:
                stream.partial_since += now - since
            if stream.sock is not None:
                self._interest(stream)

    def _broken(self, stream: Stream, why: str) -> None:
        """The peer stopped reading: nothing more is sent, but what it sent is still read."""
        stream.broken = True
        stream.drop_output()
        self._interest(stream)

    def _writable(self, stream: Stream) -> None:
        try:
            stream.flush()
        except OSError as exc:
            self._broken(stream, str(exc))

    def _other_event(self, key: selectors.SelectorKey, out: list[Received[bytes]]) -> None:
        if key.fileobj is not self._listener or self._listen_paused:
            return
        for _ in range(64):  # connections accepted per wake-up: the rest wait for the next
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: stop listening for a moment (the
                # listener stays readable, so watching it now would spin), then again
                self._accept_failures += 1
                if power_of_two(self._accept_failures):
                    log.warning("%s channel %s: accept failed (%d times): %s; pausing accepts %.1fs",
                                self.codec.name, self.endpoint, self._accept_failures, exc, ACCEPT_PAUSE_S)
                self._sel.unregister(self._listener)
                self._listen_paused = time.monotonic() + ACCEPT_PAUSE_S
                return
            self._accepted(sock, addr[0] if isinstance(addr, tuple) else "unix", out)

    def _accepted(self, sock: socket.socket, address: str, out: list[Received[bytes]]) -> None:
        info = None
        if self._admit is not None:
            try:
                info = self._admit(sock)
            except (OSError, KVBridgeError) as exc:
                log.warning("%s channel %s: refused a connection: %s", self.codec.name, self.endpoint, exc)
                sock.close()
                return
        set_nodelay(sock)
        limits = self.limits
        if self._pending_by_address[address] >= limits.max_pending_per_address:
            self._evict(next(s for s in self._pending if s.address == address))
        elif len(self._pending) >= limits.max_pending:
            self._evict(next(iter(self._pending)))
        stream = Stream(sock, HELLO_MAX_BYTES, self.hwm)
        stream.ident = b"\x00" + next(self._ids).to_bytes(4, "big")
        stream.address = address
        stream.info = info
        stream.meter = self._meter
        stream.hello_by = time.monotonic() + limits.hello_timeout
        stream.challenge, challenge = self.codec.challenge()
        self._pending[stream] = None
        self._pending_by_address[address] += 1
        try:
            stream.queue(frame(challenge))  # (a few dozen bytes: the kernel takes them at once)
        except OSError as exc:
            self._lost(stream, f"could not send the hello challenge: {exc}")
            return
        self._watch(stream)

    def _evict(self, stream: Stream) -> None:
        self.stats.evicted += 1
        if power_of_two(self.stats.evicted):
            log.warning("%s channel %s: evicted %d connection(s) that sent no hello (latest from %s)",
                        self.codec.name, self.endpoint, self.stats.evicted, stream.address)
        self._lost(stream, "evicted: no hello while newer connections waited")

    def _unpend(self, stream: Stream) -> None:
        if self._pending.pop(stream, 0) is None:
            self._pending_by_address[stream.address] -= 1
            if self._pending_by_address[stream.address] <= 0:
                del self._pending_by_address[stream.address]

    def _due(self) -> float | None:
        due = self._listen_paused or None
        if self._pending or (self._peers and self.limits.idle_timeout is not None) or any(
                s.partial_since for s in self._peers.values()):
            due = min(due or self._next_scan, self._next_scan)
        return due

    def _housekeeping(self, out: list[Received[bytes]]) -> None:
        now = time.monotonic()
        if self._listen_paused and now >= self._listen_paused:
            self._listen_paused = 0.0
            self._sel.register(self._listener, READ, None)
        if now < self._next_scan:
            return
        urgent = self._pending or any(s.partial_since for s in self._peers.values())
        self._next_scan = now + (SCAN_S if urgent else IDLE_SCAN_S)
        for stream in [s for s in self._pending if s.hello_by <= now]:
            self._expire(stream, f"no hello within {self.limits.hello_timeout:g}s")
        for stream in [s for s in self._peers.values() if self._overdue(s, now)]:
            if stream.sock is not None and not stream.throttled:  # what it sent meanwhile counts first
                self._service(stream, READ, out)
            if stream.sock is not None and (why := self._overdue(stream, time.monotonic())):
                self._expire(stream, why)

    def _overdue(self, stream: Stream, now: float) -> str | None:
        """Why ``stream`` missed a deadline, or None (a throttled reader's frame clock is stopped)."""
        limits = self.limits
        if stream.partial_since and not stream.throttled:
            size = stream.reader.announced
            allowed = limits.frame_deadline(size)
            if now - stream.partial_since > allowed:
                return f"a frame of {size} bytes not completed within {allowed:.3g}s"
        if limits.idle_timeout is not None and now - stream.last_rx > limits.idle_timeout:
            return f"idle for {limits.idle_timeout:g}s"
        return None

    def _expire(self, stream: Stream, why: str) -> None:
        self.stats.timed_out += 1
        if power_of_two(self.stats.timed_out):
            log.warning("%s channel %s: closed %d connection(s) on a deadline; latest from %s: %s",
                        self.codec.name, self.endpoint, self.stats.timed_out, stream.address, why)
        self._lost(stream, why)

    def _lost(self, stream: Stream, why: str) -> None:
        self._unwatch(stream)
        self._unpend(stream)
        self._unwait(stream)
        stream.drop_output()
        stream.close()
        self._taken(stream)  # (its budget back)
        same = self._by_address.get(stream.address)
        if same is not None and same.pop(stream, 0) is None and not same:
            del self._by_address[stream.address]
        known = self._peers.pop(stream.ident, None) is not None
        log.debug("%s channel %s: connection %s closed (%s)", self.codec.name, self.endpoint, stream.ident.hex(), why)
        if known and self._on_lost is not None:
            self._on_lost(stream.ident)

    def close(self) -> None:
        with self._io:
            if self._closed:
                return
            streams = list(self._peers.values()) + list(self._pending)
            self._peers.clear()
            self._pending.clear()
            self._by_address.clear()
            self._throttled.clear()
            self._turns.clear()
            if not self._listen_paused:
                self._sel.unregister(self._listener)
            self._close(streams, [self._listener])


# ---- the client end ---------------------------------------------------------------------------------
