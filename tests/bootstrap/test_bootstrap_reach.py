"""A claim is on what the transfer really reaches (issue 32, first finding): for NIXL the UCX
worker address inside the registration's metadata, never the agent name. Renaming the agent in
a copy of a victim's metadata (in the envelope, in NIXL's own serialised agent, or both) is
still the victim's worker: one claim, 409 at the daemon. Hypothesis draws the renamings; real
NIXL engines supply the metadata."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.bootstrap.claims import claim_of
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.reach import claim_key, mooncake_key, nixl_key, nixl_worker_addresses
from kvbridge.errors import EndpointError

AGENT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=40)


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def serdes(agent: str, conns: list[tuple[bytes, bytes]], tail: bytes = b"") -> bytes:
    """NIXL's serialised agent, as ``nixlSerDes`` writes it (the fields reach.py reads, then ``tail``)."""
    out = b"nixlSerDes|" + _field(b"Agent", agent.encode()) + _field(b"Conns", struct.pack("<Q", len(conns)))
    for backend, address in conns:
        out += _field(b"t", backend) + _field(b"c", address)
    return out + tail


def envelope(agent: str, md: bytes, regions: list[tuple[int, int, int, int]] | None = None) -> str:
    info = {"t": "nixl-peer", "agent": agent, "md": md, "regions": regions or [(1 << 40, 4096, 0, 0)]}
    return base64.b64encode(msgspec.msgpack.encode(info)).decode()


def renamed(metadata: str, agent: str) -> tuple[str, str]:
    """A copy of ``metadata`` with its agent renamed everywhere: the issue's forgery."""
    info = msgspec.msgpack.decode(base64.b64decode(metadata))
    old, conns = nixl_worker_addresses(info["md"])
    head = b"nixlSerDes|" + _field(b"Agent", old.encode())
    md = b"nixlSerDes|" + _field(b"Agent", agent.encode()) + info["md"][len(head):]
    return f"nixl:{agent}", envelope(agent, md, [tuple(r) for r in info["regions"]])


@pytest.fixture(scope="module")
def real_metadata() -> list[tuple[str, str]]:
    """Two real NIXL engines' sessions and metadata (base64), as their registrations carry them."""
    pytest.importorskip("nixl_cu12")
    import numpy as np

    from kvbridge.transfer.engine import create_engine

    out, engines, bufs = [], [], []
    for _ in range(2):
        e = create_engine("nixl")
        b = np.zeros(1 << 16, np.uint8)
        e.register(b.ctypes.data, b.nbytes)
        out.append((e.session_id, base64.b64encode(e.metadata).decode()))
        engines.append(e)
        bufs.append(b)
    yield out
    for e in engines:
        e.close()


def test_a_real_agents_metadata_parses_to_one_ucx_worker(real_metadata: list[tuple[str, str]]) -> None:
    (s1, m1), (s2, m2) = real_metadata
    k1, k2 = nixl_key(s1, m1), nixl_key(s2, m2)
    assert k1.startswith("nixl-ucx:") and len(k1) == len("nixl-ucx:") + 32
    assert k1 != k2  # two processes' workers (two engines here: two workers)
    assert claim_key(s1, m1) == k1 and claim_key(s1, m1) != s1


@settings(max_examples=60, deadline=None)
@given(agent=AGENT)
def test_a_renamed_copy_of_real_metadata_is_the_victims_worker(real_metadata: list[tuple[str, str]],
                                                               agent: str) -> None:
    session, metadata = real_metadata[0]
    forged_session, forged = renamed(metadata, agent)
    assert nixl_key(forged_session, forged) == nixl_key(session, metadata)
    c = claim_of("a", "x/a", "attacker", forged_session, [], None, [], None, engine_metadata=forged)
    v = claim_of("v", "y/v", "victim", session, [], None, [], None, engine_metadata=metadata)
    assert c.session == v.session


@settings(max_examples=200, deadline=None)
@given(victim=AGENT, attacker=AGENT, address=st.binary(min_size=1, max_size=300), tail=st.binary(max_size=64),
       other_tail=st.binary(max_size=64), flip=st.integers(min_value=0, max_value=10_000))
def test_any_agent_name_over_one_worker_address_is_one_claim(victim: str, attacker: str, address: bytes, tail: bytes,
                                                              other_tail: bytes, flip: int) -> None:
    v = nixl_key(f"nixl:{victim}", envelope(victim, serdes(victim, [(b"UCX", address)], tail)))
    a = nixl_key(f"nixl:{attacker}", envelope(attacker, serdes(attacker, [(b"UCX", address)], other_tail),
                                              [(0, 1, 0, 0)]))
    assert a == v  # the name, the memory section and the published regions are not the key
    other = bytearray(address)
    other[flip % len(other)] ^= 0x01
    assert nixl_key(f"nixl:{victim}", envelope(victim, serdes(victim, [(b"UCX", bytes(other))]))) != v


def test_metadata_that_does_not_name_one_ucx_worker_of_its_session_is_refused() -> None:
    good = serdes("a", [(b"UCX", b"\x01\x02")])
    cases = {
        "no metadata": ("nixl:a", ""),
        "not base64": ("nixl:a", "!!!"),
        "not a peer record": ("nixl:a", base64.b64encode(msgspec.msgpack.encode([1, 2])).decode()),
        "no magic": ("nixl:a", envelope("a", b"nixlSerDez|" + good[11:])),
        "truncated": ("nixl:a", envelope("a", good[:30])),
        "length past the end": ("nixl:a", envelope("a", good[:-11] + struct.pack("<Q", 999) + b"\x01\x02|")),
        "another agent in md": ("nixl:a", envelope("a", serdes("b", [(b"UCX", b"\x01")]))),
        "another agent in the envelope": ("nixl:a", envelope("b", good)),
        "session names another agent": ("nixl:b", envelope("a", good)),
        "two workers": ("nixl:a", envelope("a", serdes("a", [(b"UCX", b"\x01"), (b"UCX", b"\x02")]))),
        "another backend": ("nixl:a", envelope("a", serdes("a", [(b"GDS", b"\x01")]))),
        "no connection": ("nixl:a", envelope("a", serdes("a", []))),
        "empty worker address": ("nixl:a", envelope("a", serdes("a", [(b"UCX", b"")]))),
    }
    for why, (session, metadata) in cases.items():
        with pytest.raises(EndpointError) as err:
            claim_key(session, metadata)
            pytest.fail(why)
        assert err.value.field == "engine_metadata", why
    assert claim_key("nixl:a", envelope("a", good)).startswith("nixl-ucx:")


def test_mooncake_and_opaque_sessions_keep_their_canonical_form() -> None:
    assert mooncake_key("LOCALHOST.:05000") == "127.0.0.1:5000" == claim_key("127.1:5000", "")
    assert claim_key("ipc:abc") == "ipc:abc" and claim_key("local:x") == "local:x"
    with pytest.raises(EndpointError):
        claim_key("127.0.0.1:5000\n")


# ---- at a real daemon ------------------------------------------------------------------------------

def _body(kvb: Any, contract: RuntimeContract, inst: str, session: str, metadata: str) -> dict[str, Any]:
    body = kvb.body(kvb.register_request(contract, inst, "decode"))
    body.update(session_id=session, engine_metadata=metadata)
    return body


def test_a_renamed_copy_of_a_live_ranks_nixl_metadata_is_refused_at_the_daemon(
        http: httpx.Client, kvb: Any, small_contract: RuntimeContract, instance_name: Callable[[str], str],
        real_metadata: list[tuple[str, str]]) -> None:
    (session, metadata), (other_session, other_metadata) = real_metadata
    v = http.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("victim"), session, metadata))
    assert v.status_code == 201, v.text
    for agent in ("attacker", "kvb-127.0.0.1-1-000000000000", session[5:] + "x"):
        forged_session, forged = renamed(metadata, agent)
        r = http.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("attacker"), forged_session, forged))
        assert r.status_code == 409 and r.json()["error"] == "claim_held", r.text
        assert v.json()["rank_id"] in r.json()["holder"]
    bad = http.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("attacker"), "nixl:someone", metadata))
    assert bad.status_code == 400 and bad.json()["field"] == "engine_metadata", bad.text
    own = http.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("other"), other_session, other_metadata))
    assert own.status_code == 201, own.text  # another worker: its own claim
    for r in (v, own):
        http.delete(f"/v1/ranks/{r.json()['rank_id']}", headers={"X-KVBridge-Lease": r.json()["lease_secret"]})
