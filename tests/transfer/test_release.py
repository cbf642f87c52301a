"""Decode tells prefill at once when it needs nothing (``wire.Release``, ``KVReceiver.release``):
through real endpoints in one process (local engine, real bootstrap daemon), the prefill rooms of
a bound request end within a bounded wait (not after ``target_timeout``) and are counted; a
release presenting another request's digest, or naming a room that is not open, is refused and
counted, and the room goes on to serve its owner."""

from __future__ import annotations

import numpy as np

from _cluster import wait_final, wait_until
from _local import PAGE
from kvbridge import KVPoll, room_binding
from kvbridge.transfer.channel import wire
from kvbridge.worker.synthetic import SENTINEL_BYTE, as_bytes

PROMPT = list(range(300, 314))  # 14 tokens: 4 pages of 4


def released(c) -> int:
    return sum(ep.counters["rooms_released"] for ep in c.prefill)


def refused(c) -> int:
    return sum(ep.counters["releases_refused"] for ep in c.prefill)


def test_a_release_ends_every_prefill_room_at_once_and_is_counted(cluster):
    c = cluster(prefill_cfg={"target_timeout": 600.0})  # the room would otherwise wait 10 minutes
    room, n = 0x7171, 14
    senders = c.send(room, n, binding=room_binding(PROMPT))
    r = c.decode.receiver(room, f"{c.name}-p")
    r.release(binding=room_binding(PROMPT), reason="full local prefix hit")
    wait_final([r], 20)  # once the topology is known (looked up first here)
    assert r.poll() == KVPoll.Success and r.aux is None  # nothing asked: nothing can land
    r.close()
    wait_final(senders, 20)  # bounded: the prefill rooms end on the release, not on their timeout
    assert all(s.poll() == KVPoll.Success for s in senders)
    assert all("full local prefix hit" in s.stats["released"] and s.stats["bytes"] == 0 for s in senders)
    assert released(c) == len(c.prefill) and refused(c) == 0
    for b in c.dbufs.values():
        assert (as_bytes(b) == SENTINEL_BYTE).all()  # nothing written anywhere on decode
    for s in senders:
        s.close()
    # a late claim of the released room meets its tombstone: refused, nothing written
    late = c.decode.receiver(room, f"{c.name}-p", wait=10)
    late.init(np.arange(-(-n // PAGE)) + 20, 0, n, binding=room_binding(PROMPT))
    wait_final([late], 20)
    assert late.poll() == KVPoll.Failed


def test_a_release_with_another_digest_is_refused_counted_and_the_owner_served(cluster):
    c = cluster(prefill_cfg={"target_timeout": 600.0})
    room, n = 0x7172, 14
    pages = np.arange(-(-n // PAGE)) + 20
    senders = c.send(room, n, binding=room_binding(PROMPT))
    forged = c.decode.receiver(room, f"{c.name}-p")
    forged.release(binding=room_binding(PROMPT[:-1] + [1]), reason="forged")
    wait_final([forged], 20)
    forged.close()
    assert wait_until(lambda: refused(c) == len(c.prefill), 20), c.prefill[0].counters
    assert released(c) == 0 and all(s.poll() not in (KVPoll.Success, KVPoll.Failed) for s in senders)
    # an unknown room: refused and counted too
    nobody = c.decode.receiver(0x7173, f"{c.name}-p")
    nobody.release(binding=room_binding(PROMPT), reason="forged")
    wait_final([nobody], 20)
    nobody.close()
    assert wait_until(lambda: refused(c) == 2 * len(c.prefill), 20), c.prefill[0].counters
    owner = c.decode.receiver(room, f"{c.name}-p", wait=10)
    owner.init(pages, 1, n, binding=room_binding(PROMPT))
    wait_final([owner, *senders], 30)
    assert owner.poll() == KVPoll.Success, owner.failure_reason
    assert c.verified(room, n, pages)


def test_release_is_a_message_of_the_registration():
    """The Release names the decode registration and the room's binding on the wire."""
    msg = wire.Release(room=5, decode_rank="d/tp0", decode_rank_id="r1", reason="x", binding=b"\x01" * 16)
    assert wire.decode(wire.encode(msg)) == msg


# -- prefill's machine, no I/O: who may release a room ---------------------------------------------

def _machine(hello):
    from dataclasses import replace

    from _machines import prefill_machine
    from test_prefill_room import AUX, ME, SPECS, bufs, peer
    from kvbridge.transfer.prefill.config import PrefillConfig

    m = prefill_machine(PrefillConfig(instance="p", peer_timeout=5.0, target_timeout=60.0), SPECS, bufs(0), AUX, "x",
                        hello_of=hello.get, endpoint=lambda: ME)
    m.peers.entries["r1"] = peer()
    m.peers.entries["r2"] = replace(peer(), rank_id="r2", label="e/dp0/tp0", instance="e")
    for ident, rank_id in hello.items():
        m.admission.prove(ident, rank_id)
    return m


def test_prefill_releases_only_for_the_binding_and_the_instance_that_may_claim():
    from kvbridge.transfer.prefill import events as pe
    from kvbridge.transfer.prefill.events import ReleaseAux
    from test_prefill_room import msgs, request

    D, E = b"decode-d", b"decode-e"
    m = _machine({D: "r1", E: "r2"})
    b = room_binding(PROMPT)

    def release(ident, room, binding, rank_id, label="d/dp0/tp0"):
        msg = wire.Release(room=room, decode_rank=label, decode_rank_id=rank_id, reason="prefix hit", binding=binding)
        return m.message(ident, msg, 1.0)

    def opened(room):
        r = m.open(room, 1.0)
        m.feed(pe.EngineInit(r, 14, None, 1.0, 0, b))
        return r

    r = opened(1)
    (err,) = msgs(release(D, 1, room_binding(PROMPT[:-1]), "r1"), wire.ErrorReply)  # another request's digest
    assert "bound to another request" in err.reason and err.ref_type == "release"
    (err,) = msgs(release(D, 1, b, "r2"), wire.ErrorReply)  # names a registration its connection is not
    assert "r2" in err.reason and not r.state.final
    (err,) = msgs(release(D, 99, b, "r1"), wire.ErrorReply)  # no such room
    assert "not open" in err.reason
    assert m.counters["releases_refused"] == 3 and m.counters["rooms_released"] == 0
    acts = release(D, 1, b, "r1")
    assert r.state.state == KVPoll.Success and ReleaseAux(1) in acts and "prefix hit" in r.released
    assert release(D, 1, b, "r1") == () and m.counters["rooms_released"] == 1  # again (another rank): nothing
    # a room claimed by instance d: instance e's release is refused, the room goes on
    r2 = opened(2)
    import msgspec

    assert not msgs(m.message(D, msgspec.structs.replace(request(2, num_tokens=14), binding=b), 1.0), wire.ErrorReply)
    assert r2.holder[0] == "d"
    (err,) = msgs(release(E, 2, b, "r2", "e/dp0/tp0"), wire.ErrorReply)
    assert "claimed by decode instance d" in err.reason and not r2.state.final
    assert m.counters["releases_refused"] == 4
