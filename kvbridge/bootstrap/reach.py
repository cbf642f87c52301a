"""What a transfer really reaches, per engine: the key a registration's claim is compared by.

A claim must name the process a writer's transfer engine will connect to, not a label the
registrant chose. One function per engine:

    engine     session_id               what the engine connects to          claim key
    Mooncake   host:port                that address and port                canonical_session(host:port)
    NIXL       nixl:<agent>             the UCX worker address inside the    "nixl-ucx:" + SHA-256 of that
                                        agent metadata (engine_metadata);    worker address (the agent name
                                        the agent name is a label            is excluded)
    IPC        ipc:<name>               a same-host peer the engine names    the session, exactly
    local      local:<name>             an in-process test fabric            the session, exactly

**NIXL.** ``engine_metadata`` (base64) is kvbridge's ``PeerInfo`` envelope (MessagePack: the
agent name, NIXL's own metadata ``md``, the published regions). ``md`` is NIXL's serialised
agent (``nixlSerDes``: a magic ``nixlSerDes|``, then fields ``tag | u64 length | value | '|'``):

    nixlSerDes| Agent <len> <agent name> | Conns <8> <n> | t <len> "UCX" | c <len> <worker address> | ...

The worker address (UCX's packed address: the process's transport endpoints, shared-memory
segments and pid) is what a writer's ``add_remote_agent`` + ``make_connection`` reaches; the
agent name travels in two places (the envelope and ``md``) and an attacker may rename it in
both, so it is no part of the key. kvbridge's NIXL engine uses the UCX backend only: metadata
with another backend, more than one connection entry, or an agent name that differs from the
session's is refused (``EndpointError`` on ``engine_metadata``).

Memory keys are not part of the key: on this build a UCX memory key carries no process
identity (two processes registering same-sized regions publish identical key bytes), the
worker address selects the process, and claiming the keys would make unrelated processes
conflict. What the metadata opens inside that process is bounded by the claim's ranges (the
registration's pools, aux, scratch and staging), compared within the worker's key.

What this cannot see: a worker address altered byte by byte so that UCX still reaches the
same process (UCX's packed address has fields, such as the worker's UUID, that routing does
not use). The ownership proof (docs/security.md) is what stops such a registrant: it cannot
show control of memory in the process it names.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct

import msgspec

from kvbridge.bootstrap.endpoints import canonical_session
from kvbridge.errors import EndpointError

__all__ = ["NIXL_MAGIC", "claim_key", "mooncake_key", "nixl_key", "nixl_worker_addresses"]

NIXL_MAGIC = b"nixlSerDes|"
NIXL_PREFIX = "nixl:"
_U64 = struct.Struct("<Q")
MAX_NIXL_CONNS = 16


def mooncake_key(session_id: str) -> str:
    """Mooncake (and any ``host:port`` engine): the canonical session (either mode, no resolution;
    the daemon stored it canonical already)."""
    return canonical_session(session_id, local=None, resolve=None)


def _field(md: bytes, pos: int, tag: bytes, what: str) -> tuple[bytes, int]:
    """The value of field ``tag`` at ``pos`` of a ``nixlSerDes`` string, and the position after it."""
    end = pos + len(tag)
    if md[pos:end] != tag or end + 8 > len(md):
        raise EndpointError(f"engine_metadata: NIXL metadata has no {what} field ({tag.decode()!r}) at byte {pos}",
                            field="engine_metadata")
    (n,) = _U64.unpack_from(md, end)
    start = end + 8
    if n > len(md) - start - 1 or md[start + n : start + n + 1] != b"|":
        raise EndpointError(f"engine_metadata: NIXL metadata field {tag.decode()!r} at byte {pos} runs past its end",
                            field="engine_metadata")
    return md[start : start + n], start + n + 1


def nixl_worker_addresses(md: bytes) -> tuple[str, list[tuple[str, bytes]]]:
    """The agent name and the ``(backend, worker address)`` entries of NIXL's serialised agent
    metadata (``md``); EndpointError naming ``engine_metadata`` when it does not parse."""
    if not md.startswith(NIXL_MAGIC):
        raise EndpointError("engine_metadata: NIXL metadata does not start with 'nixlSerDes|'", field="engine_metadata")
    agent, pos = _field(md, len(NIXL_MAGIC), b"Agent", "agent name")
    count, pos = _field(md, pos, b"Conns", "connection count")
    if len(count) != 8:
        raise EndpointError("engine_metadata: NIXL metadata's connection count is not 8 bytes", field="engine_metadata")
    (n,) = _U64.unpack(count)
    if not 1 <= n <= MAX_NIXL_CONNS:
        raise EndpointError(f"engine_metadata: NIXL metadata lists {n} connections (1-{MAX_NIXL_CONNS} expected)",
                            field="engine_metadata")
    conns = []
    for _ in range(n):
        backend, pos = _field(md, pos, b"t", "backend")
        address, pos = _field(md, pos, b"c", "worker address")
        conns.append((backend.decode("ascii", "replace"), address))
    return agent.decode("utf-8", "replace"), conns


def nixl_key(session_id: str, engine_metadata: str) -> str:
    """NIXL: ``"nixl-ucx:"`` + SHA-256 (32 hex) of the UCX worker address the metadata names.
    Refused (EndpointError, ``engine_metadata``): no or malformed metadata, an agent name in it
    other than the session's, a backend other than UCX or more than one connection entry."""
    if not session_id.startswith(NIXL_PREFIX):
        raise EndpointError(f"session_id {session_id!r} is not a NIXL session", field="session_id")
    try:
        raw = base64.b64decode(engine_metadata, validate=True)
        info = msgspec.msgpack.decode(raw)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise EndpointError(f"engine_metadata of NIXL session {session_id!r} is not a base64 NIXL peer record",
                            field="engine_metadata") from None
    if not isinstance(info, dict) or info.get("t") != "nixl-peer" or not isinstance(info.get("md"), bytes):
        raise EndpointError(f"engine_metadata of NIXL session {session_id!r} is not a NIXL peer record "
                            "(kvbridge's PeerInfo)", field="engine_metadata")
    agent, conns = nixl_worker_addresses(info["md"])
    named = session_id[len(NIXL_PREFIX):]
    if agent != named or info.get("agent") != named:
        raise EndpointError(f"engine_metadata of NIXL session {session_id!r} names agent {agent!r} "
                            f"(envelope: {info.get('agent')!r})", field="engine_metadata")
    if len(conns) != 1 or conns[0][0] != "UCX" or not conns[0][1]:
        raise EndpointError(f"engine_metadata of NIXL session {session_id!r} lists backends "
                            f"{[b for b, _ in conns]}; kvbridge's NIXL engine publishes one UCX worker",
                            field="engine_metadata")
    return "nixl-ucx:" + hashlib.sha256(conns[0][1]).hexdigest()[:32]


def claim_key(session_id: str, engine_metadata: str = "") -> str:
    """What ``session_id`` (with its registration's ``engine_metadata``) really reaches, as a
    claim compares it: ``nixl_key`` for a NIXL session, ``mooncake_key`` for ``host:port``,
    opaque sessions (``ipc:``, ``local:``) exactly. EndpointError when refused."""
    if session_id.startswith(NIXL_PREFIX):
        return nixl_key(session_id, engine_metadata)
    return mooncake_key(session_id)
