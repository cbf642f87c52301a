"""G4: SGLang's release_memory_occupation / resume_memory_occupation (memory saver, RL weight
updates) call the manager's deregister_buffer_to_engine / register_buffer_to_engine. No
registration may outlive the memory: on release every endpoint of the rank stops, its rank
leaves the daemon and its engine closes; a room opened meanwhile is refused with a clear
reason; after resume rooms move again, every byte checked.

SGLang's own queue methods are called (``PrefillBootstrapQueue.release_memory_occupation`` and
``resume_memory_occupation``, ``DecodePreallocQueue.resume_memory_occupation``) on an object
holding what they read; decode's release is the manager call it ends with (its queue clean-up
needs a radix cache this harness does not have)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from sglang.srt.disaggregation import utils as disagg_utils  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.decode import DecodePreallocQueue  # noqa: E402
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue  # noqa: E402

from _sgl_inproc import Pair  # noqa: E402
from kvbridge import BootstrapClient  # noqa: E402

ROOMS = iter(range(2**62 + 1001, 2**62 + 2000))


@pytest.fixture
def pair(daemon):
    p = Pair(daemon.url, "release")
    yield p
    p.close()


def transfer(pair: Pair, n: int = 150, chunk: int = 100) -> tuple[dict, dict]:
    room = next(ROOMS)
    pair.prefill.add(room, n, chunk)
    pair.decode.add(room, n, 0, pair.addr)
    pair.run(lambda: all(pair.done(room)))
    return pair.done(room)


def prefill_ranks(url: str, instance: str) -> int:
    with BootstrapClient(url) as c:
        return sum(i.num_ranks for i in c.instances() if i.name == instance)


def test_release_and_resume_leave_no_stale_registration(pair, daemon):
    p_mgr, d_mgr = pair.prefill.worlds[0].mgr, pair.decode.w.mgr
    pe, de = transfer(pair)
    assert pe["state"] == de["state"] == "Success" and de["errors"] == [], de
    assert prefill_ranks(daemon.url, pair.addr) == 1

    PrefillBootstrapQueue.release_memory_occupation(types.SimpleNamespace(queue=[], kv_manager=p_mgr))
    d_mgr.deregister_buffer_to_engine()
    assert p_mgr.released and p_mgr.endpoint is None and p_mgr._engines == []
    assert d_mgr.released and d_mgr._endpoints == {} and d_mgr.prefill_info_table == {}
    assert prefill_ranks(daemon.url, pair.addr) == 0  # the rank left the daemon: no decode rank finds it

    room = next(ROOMS)  # a prefill request while released: refused, naming why
    pair.prefill.add(room, 150, 100)
    pair.run(lambda: pair.done(room)[0] is not None)
    pe = pair.done(room)[0]
    assert pe["state"] == "Failed" and any("released this rank's KV memory" in r for r in pe["reasons"]), pe
    receiver_cls = disagg_utils.get_kv_class(disagg_utils.TransferBackend.KVBRIDGE, disagg_utils.KVClassType.RECEIVER)
    receiver = receiver_cls(mgr=d_mgr, bootstrap_addr=pair.addr, bootstrap_room=next(ROOMS))
    assert d_mgr.try_ensure_parallel_info(pair.addr) is False
    receiver.init(0)
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(Exception, match="kvbridge decode rank .*released this rank's KV memory"):
        receiver.failure_exception()

    PrefillBootstrapQueue.resume_memory_occupation(types.SimpleNamespace(kv_manager=p_mgr))
    DecodePreallocQueue.resume_memory_occupation(types.SimpleNamespace(kv_manager=d_mgr))
    assert not p_mgr.released and not d_mgr.released and prefill_ranks(daemon.url, pair.addr) == 1
    for n, chunk in ((150, 100), (300, 128)):
        pe, de = transfer(pair, n, chunk)
        assert pe["state"] == de["state"] == "Success" and de["errors"] == [], de
