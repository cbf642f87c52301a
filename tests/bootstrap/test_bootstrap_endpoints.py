"""One canonical identity per endpoint (issue 26): every spelling the transfer engine reads as
one process is one claim, or refused. The rule (``bootstrap/endpoints.py``) against the
issue's spellings, against generated ones (hypothesis), against the C resolver itself; then at
a real daemon, in local mode (a live victim's session spelt otherwise) and in network mode."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.bootstrap.claims import session_key
from kvbridge.bootstrap.contract import RuntimeContract
from kvbridge.bootstrap.endpoints import (
    LOOPBACK,
    canonical_endpoint,
    canonical_host,
    canonical_session,
    is_canonical_session,
)
from kvbridge.chaos.spellings import ipv4_forms, spellings
from kvbridge.errors import EndpointError

P = 41234
ISSUE = [f"localhost:{P}", f"127.1:{P}", f"127.0.0.1:0{P}", f"127.0.0.2:{P}", f"0.0.0.0:{P}",
         f"[::ffff:127.0.0.1]:{P}", f"localhost.:{P}", f"LOCALHOST:{P}", f"LocalHost.:{P}"]
MALFORMED = [f" 127.0.0.1:{P}", f"127.0.0.1:{P} ", f"127.0.0.1 :{P}", f"127.0.0.1:\t{P}", f"127.0.0.1:+{P}",
             f"127.0.0.1:{P}.0", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:", f":{P}", "127.0.0.1",
             f"[::1:{P}", f"[::1]{P}", f"[fe80::1%eth0]:{P}", f"127.0.0.1:{P}/x", f"127.0.0.1..1:{P}", f"-bad-:{P}",
             f"under_score:{P}", f"1.2.3.4.5:{P}", f"caf\u00e9:{P}", "", "x" * 300, f"256.0.0.1.2:{P}",
             f"[224.0.0.1]:{P}", f"224.0.0.1:{P}", f"255.255.255.255:{P}",
             # a trailing newline: ``$`` matches before one, so every check matches the whole string
             f"127.0.0.1:{P}\n", f"localhost\n:{P}", f"127.0.0.1\n:{P}", "nixl:agent\n", "ipc:x\n"]


def no_dns(name: str) -> list[str]:
    raise AssertionError(f"resolved {name!r}: a literal or localhost needs no resolver")


@pytest.mark.parametrize("spelling", ISSUE)
def test_the_issues_spellings_are_the_victims_session_in_local_mode_and_refused_in_network_mode(spelling: str) -> None:
    assert canonical_session(spelling, local=True, resolve=no_dns) == f"{LOOPBACK}:{P}"
    assert session_key(spelling) == f"{LOOPBACK}:{P}"  # the claim check compares this
    with pytest.raises(EndpointError, match="loopback|unspecified") as err:
        canonical_session(spelling, local=False, resolve=no_dns)
    assert err.value.field == "session_id" and spelling in str(err.value)


@pytest.mark.parametrize("spelling", MALFORMED)
def test_malformed_sessions_are_refused_in_every_mode_naming_the_field(spelling: str) -> None:
    for local in (True, False, None):
        with pytest.raises(EndpointError) as err:
            canonical_session(spelling, local=local, resolve=lambda name: [])
        assert err.value.field == "session_id"
    assert not is_canonical_session(spelling)


def test_every_generated_spelling_of_a_loopback_session_is_one_claim() -> None:
    victim = f"{LOOPBACK}:{P}"
    seen = []
    for s in spellings(LOOPBACK, P):
        try:
            got = canonical_session(s, local=True, resolve=no_dns)
        except EndpointError:
            assert any(c.isspace() for c in s), s  # only the blank-holding near misses are refused
            continue
        assert got == victim, s
        seen.append(s)
    assert len(seen) > 80  # (the generator really generated)


def test_every_generated_spelling_of_a_network_session_is_one_claim() -> None:
    for address in ("10.0.0.5", "192.168.7.1", "203.0.113.200", "8.8.4.4"):
        for s in spellings(address, 8000):
            try:
                got = canonical_session(s, local=False, resolve=no_dns)
            except EndpointError:
                assert any(c.isspace() for c in s), s
                continue
            assert got == f"{address}:8000", s
            with pytest.raises(EndpointError, match="local mode"):
                canonical_session(s, local=True, resolve=no_dns)  # local mode: this host only


@st.composite
def ipv4_spelling(draw: Any, address: int) -> str:
    """One inet_aton spelling of ``address``: 1 to 4 parts, each decimal, octal or hex, in any case."""
    parts = draw(st.integers(1, 4))
    b = address.to_bytes(4, "big")
    values = list(b[: parts - 1]) + [int.from_bytes(b[parts - 1 :], "big")]
    out = []
    for v in values:
        form = draw(st.sampled_from(["dec", "oct", "hex", "HEX"]))
        if form == "dec":
            out.append(str(v))
        elif form == "oct":
            out.append("0" + f"{v:o}" if v else "0" * draw(st.integers(1, 3)))
        else:
            text = f"0x{'0' * draw(st.integers(0, 2))}{v:x}"
            out.append(text.upper() if form == "HEX" else text)
    return ".".join(out)


@st.composite
def session_spelling(draw: Any, address: int, port: int) -> str:
    """A session the resolver reads as ``address:port``: an IPv4 form or an IPv4-mapped IPv6 form
    (bracketed or not), the port with leading zeros."""
    a = ipaddress.IPv4Address(address)
    kind = draw(st.sampled_from(["v4", "mapped", "mapped-hex", "mapped-long"]))
    if kind == "v4":
        host = draw(ipv4_spelling(address))
    else:
        tail = str(a) if kind != "mapped-hex" else f"{address >> 16:x}:{address & 0xFFFF:x}"
        prefix = "::ffff:" if kind != "mapped-long" else "0:0:0:0:0:ffff:"
        text = prefix + tail
        text = text.upper() if draw(st.booleans()) else text
        host = f"[{text}]" if draw(st.booleans()) or kind == "mapped-hex" else text
    return f"{host}:{'0' * draw(st.integers(0, 3))}{port}"


PUBLIC = st.integers(0, 2**32 - 1).filter(lambda n: ipaddress.IPv4Address(n).is_global
                                          and not ipaddress.IPv4Address(n).is_multicast)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), address=PUBLIC, port=st.integers(1, 65535))
def test_generated_spellings_of_one_address_are_one_canonical_session(data: Any, address: int, port: int) -> None:
    a, b = data.draw(session_spelling(address, port)), data.draw(session_spelling(address, port))
    want = f"{ipaddress.IPv4Address(address)}:{port}"
    assert canonical_session(a, local=False, resolve=no_dns) == canonical_session(b, local=False, resolve=no_dns) == want
    assert is_canonical_session(want) and session_key(a) == session_key(b) == want


@settings(max_examples=200, deadline=None)
@given(data=st.data(), address=st.integers(0x7F000000, 0x7FFFFFFF), port=st.integers(1, 65535))
def test_generated_spellings_of_any_loopback_address_are_the_one_local_session(data: Any, address: int,
                                                                               port: int) -> None:
    s = data.draw(session_spelling(address, port))
    assert canonical_session(s, local=True, resolve=no_dns) == f"{LOOPBACK}:{port}"
    with pytest.raises(EndpointError):
        canonical_session(s, local=False, resolve=no_dns)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), address=st.integers(0, 2**32 - 1))
def test_our_reading_of_an_ipv4_spelling_is_the_c_resolvers(data: Any, address: int) -> None:
    """What the transfer engine connects to is what the C library makes of the text: ask it."""
    host = data.draw(ipv4_spelling(address))
    (info, *_) = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    assert info[4][0] == str(ipaddress.IPv4Address(address))
    a = ipaddress.IPv4Address(address)
    if a.is_loopback or a.is_unspecified:
        assert canonical_host(host, local=True, resolve=no_dns) == LOOPBACK
    elif not (a.is_multicast or a.is_reserved or str(a) == "255.255.255.255"):
        assert canonical_host(host, local=False, resolve=no_dns) == str(a)


def test_the_fixed_forms_are_the_c_resolvers_too() -> None:
    for address in ("127.0.0.1", "10.0.0.5", "1.2.3.4"):
        for host in ipv4_forms(address):
            assert socket.getaddrinfo(host, None, socket.AF_INET, 0, 0, socket.AI_NUMERICHOST)[0][4][0] == address, host


def test_names_are_resolved_to_exactly_one_address() -> None:
    one = {"node-3.cluster": ["10.0.0.3", "10.0.0.3"], "dual": ["10.0.0.4", "2001:db8::4"], "none": [],
           "sneaky": ["127.0.0.1"], "mapped": ["::ffff:10.0.0.9"], "two": ["10.0.0.1", "10.0.0.2"]}
    resolve = lambda name: one[name]  # noqa: E731
    assert canonical_session("NODE-3.Cluster.:07000", local=False, resolve=resolve) == "10.0.0.3:7000"
    assert canonical_session("mapped:1", local=False, resolve=resolve) == "10.0.0.9:1"
    with pytest.raises(EndpointError, match="2 addresses"):
        canonical_session("dual:1", local=False, resolve=resolve)
    with pytest.raises(EndpointError, match="2 addresses"):
        canonical_session("two:1", local=False, resolve=resolve)
    with pytest.raises(EndpointError, match="does not resolve"):
        canonical_session("none:1", local=False, resolve=resolve)
    with pytest.raises(EndpointError, match="loopback"):
        canonical_session("sneaky:1", local=False, resolve=resolve)  # a name for loopback is loopback
    assert canonical_session("sneaky:1", local=True, resolve=resolve) == "127.0.0.1:1"
    with pytest.raises(EndpointError, match="a name, not an address"):
        canonical_session("node-3.cluster:1", local=None, resolve=None)  # prefill's check resolves nothing
    assert not is_canonical_session("node-3.cluster:1")


def test_ipv6_is_compressed_in_brackets_and_opaque_sessions_are_exact() -> None:
    assert canonical_session("[2001:DB8:0:0::1]:0080", local=False, resolve=no_dns) == "[2001:db8::1]:80"
    assert canonical_session("2001:db8::1:80", local=False, resolve=no_dns) == "[2001:db8::1]:80"
    assert is_canonical_session("[2001:db8::1]:80") and not is_canonical_session("2001:db8::1:80")
    assert canonical_session("ipc:node:42:1:abc", local=False, resolve=no_dns) == "ipc:node:42:1:abc"
    assert canonical_session("local:f00:3", local=True, resolve=no_dns) == "local:f00:3"
    with pytest.raises(EndpointError, match="network mode"):
        canonical_session("local:f00:3", local=False, resolve=no_dns)


def test_control_endpoints_are_canonical_too() -> None:
    assert canonical_endpoint("TCP://localhost.:09000", local=True, resolve=no_dns) == "tcp://127.0.0.1:9000"
    assert canonical_endpoint("tcp://127.0.0.1:0", local=True, resolve=no_dns) == "tcp://127.0.0.1:0"  # listens on nothing
    assert canonical_endpoint("tcp://[::ffff:10.1.2.3]:5", local=False, resolve=no_dns) == "tcp://10.1.2.3:5"
    for bad in ("udp://127.0.0.1:1", "tcp://127.0.0.1:1/path", "tcp:/127.0.0.1:1", "tcp:// 127.0.0.1:1",
                "tcp://127.0.0.1:1\n", "tcp://localhost\n:1"):
        with pytest.raises(EndpointError) as err:
            canonical_endpoint(bad, local=True, resolve=no_dns)
        assert err.value.field == "control_endpoint"
    with pytest.raises(EndpointError, match="unspecified"):
        canonical_endpoint("tcp://0.0.0.0:1", local=False, resolve=no_dns)


# ---- at a real daemon ---------------------------------------------------------------------------

def _body(kvb: Any, contract: RuntimeContract, inst: str, **change: Any) -> dict[str, Any]:
    body = kvb.body(kvb.register_request(contract, inst, "decode"))
    body.update(change)
    return body


def test_a_live_sessions_every_spelling_is_refused_at_a_local_daemon(http: httpx.Client, kvb: Any,
                                                                     small_contract: RuntimeContract,
                                                                     instance_name: Callable[[str], str]) -> None:
    """The daemon of the tests listens on loopback: local mode. A victim registers a loopback
    session; every spelling of it from another instance is 409 claim_held (naming the victim) or
    400 bad_endpoint, never 201; the stored session is the canonical one."""
    victim = instance_name("victim")
    v = http.post("/v1/ranks", json=_body(kvb, small_contract, victim, session_id=f"LocalHost.:0{P}",
                                          control_endpoint="tcp://localhost:00"))
    assert v.status_code == 201, v.text
    detail = http.get(f"/v1/ranks/{v.json()['rank_id']}").json()
    assert detail["session_id"] == f"127.0.0.1:{P}" and detail["control_endpoint"] == "tcp://127.0.0.1:0"
    statuses: dict[str, int] = {}
    for i, s in enumerate(dict.fromkeys(spellings(LOOPBACK, P) + ISSUE)):
        r = http.post("/v1/ranks", json=_body(kvb, small_contract, instance_name(f"alias{i}"), session_id=s))
        statuses[s] = r.status_code
        if r.status_code == 409:
            assert r.json()["error"] == "claim_held" and v.json()["rank_id"] in r.json()["holder"], r.text
        else:
            assert r.status_code == 400 and r.json()["error"] == "bad_endpoint" and r.json()["field"] == "session_id"
    assert 201 not in statuses.values(), statuses
    assert all(statuses[s] == 409 for s in ISSUE)
    r = http.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("far"), session_id=f"10.0.0.5:{P}"))
    assert r.status_code == 400 and "local mode" in r.json()["message"], r.text


def test_a_network_daemon_refuses_loopback_and_unspecified_sessions(start_daemon: Callable[..., Any], kvb: Any,
                                                                    small_contract: RuntimeContract,
                                                                    instance_name: Callable[[str], str]) -> None:
    d = start_daemon("--endpoints", "network")
    with httpx.Client(base_url=d.url, trust_env=False, timeout=5.0) as h:
        for s in ISSUE + [f"127.0.0.1:{P}", f"[::]:{P}"]:
            r = h.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("loop"), session_id=s,
                                               control_endpoint="tcp://10.0.0.1:1"))
            assert r.status_code == 400 and r.json()["error"] == "bad_endpoint", (s, r.text)
            assert "loopback" in r.json()["message"] or "unspecified" in r.json()["message"]
        r = h.post("/v1/ranks", json=_body(kvb, small_contract, instance_name("net"), session_id=f"010.0.0.07:0{P}",
                                           control_endpoint="tcp://10.0.0.7:0"))
        assert r.status_code == 201, r.text
        assert h.get(f"/v1/ranks/{r.json()['rank_id']}").json()["session_id"] == f"8.0.0.7:{P}"  # 010 is octal 8
