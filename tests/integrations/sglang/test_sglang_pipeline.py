"""G6: a pipeline-parallel prefill (``--pp-size 2``) through SGLang's classes, decode at PP 1.

Each prefill stage is a ``RankWorld`` with ``pp_rank`` stamped: SGLang's ``DSATokenToKVPool``
holding the stage's share of a 3-layer model as ``get_pp_indices`` splits it (pp0 layer 0,
pp1 layers 1-2), ``KVArgs`` with ``prefill_start_layer``/``prefill_end_layer``, and the NextN
draft pool listed on every stage (CUDA without ``SGLANG_ENABLE_PP_SPEC``) or on the last only
(with it). The harness drives them as ``event_loop_pp_disagg_prefill`` does (``_sgl_sched``):
PP rank 0's bootstrap poll for every stage, every stage sending its own layers and filling its
own metadata row (a stage but the last writes a row that is not the room's), release once every
stage is final. Decode checks every byte of every layer it holds (target 0-2, index 0-2, the
draft layer 3) and that its metadata row is the room's: the last stage's. With a decode prefix,
stage 1 may bootstrap before decode asked it (PP rank 0's poll decides): its sender answers
prefix 0 then (checked on a sender no decode rank asks), the stage hands in every page, and
kvbridge still writes only the pages after decode's prefix (that room forces it on stage 1).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from sglang.srt.disaggregation import utils as disagg_utils  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402

from _sgl_inproc import Pair  # noqa: E402
from _sgl_world import PAGE  # noqa: E402
from kvbridge import BootstrapClient, fingerprint  # noqa: E402

ROOMS = iter(range(2**62 + 5001, 2**62 + 6000, 7))
LAYERS = 3


@pytest.mark.parametrize("stage_draft", [True, False], ids=["draft-on-every-stage", "draft-on-last-stage"])
def test_each_stage_sends_its_layers_and_decode_commits(daemon, stage_draft):
    pair = Pair(daemon.url, f"pp-{stage_draft}", pp=2, layers=LAYERS, stage_draft=stage_draft)
    try:
        first, last = (w.mgr.endpoint for w in pair.prefill.worlds)
        assert {k: v.layer_ids for k, v in first.specs.items()} == {"target": (0,), "index": (0,)}
        assert {k: v.layer_ids for k, v in last.specs.items()} == {"target": (1, 2), "index": (1, 2), "draft": (3,)}
        assert first.fingerprint == last.fingerprint == fingerprint(pair.decode.w.mgr.contract("replicated")[2])
        with BootstrapClient(daemon.url) as c:
            ranks = [r for i in c.instances() if i.name == pair.addr for r in i.ranks]
        assert sorted((r.pp_rank, r.pp_layers.start, r.pp_layers.end) for r in ranks) == [(0, 0, 1), (1, 1, 3)]
        for n, chunk, prefix in ((150, 100, 0), (300, 128, 0), (260, 128, PAGE)):
            room = next(ROOMS)
            pair.prefill.add(room, n, chunk)
            if prefix:  # stage 1 bootstraps before decode asked it: what its sender answers then
                pair.prefill.reqs[room].senders[1].pop_decode_prefix_len = lambda: 0
            pair.decode.add(room, n, prefix, pair.addr)
            pair.run(lambda: all(pair.done(room)))
            pe, de = pair.done(room)
            assert pe["state"] == de["state"] == "Success" and de["errors"] == [], (pe, de)
            assert pe["prefix"] == [prefix, 0], pe  # stage 1 handed in every page
            sent = [m["transfer_total_bytes"] for m in pe["metrics"]]
            assert 0 < sent[0] < sent[1], sent  # each stage its own layers: pp1 holds two and the draft
        assert pair.decode.untouched() == []
        # a stage decode has not asked yet: prefix 0 (every page handed in), not a failure
        sender = disagg_utils.get_kv_class(disagg_utils.TransferBackend.KVBRIDGE, disagg_utils.KVClassType.SENDER)
        early = sender(mgr=pair.prefill.worlds[1].mgr, bootstrap_addr=pair.addr, bootstrap_room=next(ROOMS))
        assert early.poll() == KVPoll.Bootstrapping and early.pop_decode_prefix_len() == 0
        assert early.poll() == KVPoll.Bootstrapping
        early.clear()
    finally:
        pair.close()


def test_a_stage_without_its_last_stage_fails_by_name(daemon, monkeypatch):
    """A stage but the last takes the model's layers from the last stage's contract: without it
    the wait is bounded and the start-up error names the stage, the instance and why."""
    from sglang.srt.runtime_context import get_parallel

    import _sgl_world as world
    from _sgl_inproc import RANKS
    from _sgl_procs import CHILD_ENV, free_port
    from kvbridge import InstanceIncomplete
    from kvbridge.integrations.sglang import install
    from kvbridge.integrations.sglang import manager

    install()
    monkeypatch.setattr(manager, "DAEMON_WAIT_S", 0.5)
    env = {**CHILD_ENV, "KVBRIDGE_BOOTSTRAP_URL": daemon.url}
    try:
        with world.environ(env), pytest.raises(InstanceIncomplete, match=r"pipeline stage pp0 of 2 .* no stage "
                                               r"registered the model's contract .* the last stage pp1 registers it"):
            world.RankWorld("prefill", world.server_args("prefill", free_port()), {**RANKS, "pp_size": 2}, env,
                            layers=LAYERS)
    finally:
        get_parallel().clear_stamp()
