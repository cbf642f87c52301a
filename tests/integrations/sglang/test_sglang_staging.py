"""Staged transfers chosen through the SGLang backend's settings (``KVBRIDGE_STAGING*``): a room
through SGLang's own sender and receiver classes (``_sgl_sched``: the scheduler's calls, SGLang's
pools and metadata buffers) takes the staged path end to end over real Mooncake TCP, every byte
equal on decode; the same servers with the default (``auto``) send these few large slices direct."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from _sgl_inproc import Pair  # noqa: E402

N = 200  # 4 pages of 64 tokens, a partial last page
SLOT = 64 << 10  # every pool's pages of a room take several chunks: the room streams through the area
STAGED = {"KVBRIDGE_STAGING": "always", "KVBRIDGE_STAGING_BYTES": str(4 * SLOT),
          "KVBRIDGE_STAGING_SLOT_BYTES": str(SLOT)}


KEPT = {**STAGED, "KVBRIDGE_STAGING_GRANTED_SLOTS": "1"}  # decode grants one slot with each room's request


@pytest.mark.parametrize("env, path", [(STAGED, "staged"), (KEPT, "staged"), ({}, "direct")],
                         ids=["always", "always-granted", "auto"])
def test_a_room_through_sglangs_classes_takes_the_path_the_settings_choose(daemon, env, path):
    pair = Pair(daemon.url, f"stg-{path}-{len(env)}", env=env)
    try:
        room = 2**61 + 7
        pair.prefill.add(room, N, N)
        pair.decode.add(room, N, 0, pair.addr)
        senders = pair.prefill.reqs[room].senders
        pair.run(lambda: all(pair.done(room)))
        pe, de = pair.done(room)
        assert pe["state"] == "Success", pe["reasons"]
        assert de["state"] == "Success" and de["errors"] == [], de  # every byte of every pool and the aux row
        stats = senders[0].room_stats  # kvbridge's KVSender.stats, read through SGLang's sender
        assert set(stats["paths"].values()) == {path}, stats["paths"]
        if path == "staged":
            assert stats["bytes_staged"] == stats["bytes"] > 0 and stats["chunks"] > 4
            decode = pair.decode.w.mgr.receiver_endpoint(pair.addr)[0]
            area = decode.staging.area
            kept = int(env.get("KVBRIDGE_STAGING_GRANTED_SLOTS", 0))  # the area's last slots, apart from the asks'
            assert area.num_slots == 4 and area.num_free == 4 - kept and area.num_free_reserved == kept
            used = decode.machine.staging.counters["granted_with_request_used"]
            assert used == kept, decode.machine.staging.counters  # the first chunk wrote without a SlotGrant
        else:
            assert stats["bytes_staged"] == 0 and stats["bytes"] > 0
    finally:
        pair.close()
