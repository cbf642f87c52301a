"""G3: SGLang's KV checksum with a decode prefix cache. Decode holds the first two pages (its
radix cache) and tells prefill in ``send_metadata(decode_prefix_len=)``; prefill's
``pop_decode_prefix_len()`` must give SGLang that prefix, so that SGLang's own
``send_kv_chunk`` digests and sends tokens ``[prefix, n)``, and decode's digest of the same
range of its own pages (``_verify_kv_checksums``: from ``cache_protected_len``, the prefix)
matches the one that arrived in the metadata row.

SGLang's ``send_kv_chunk``/``_send_kv_chunk`` run here on a scheduler object holding what they
read, with SGLang's ``KvChecksumComputer`` built from ``KVArgs`` as ``prefill.py`` builds it;
its Adler-32 kernel is CUDA-only, so ``compute`` digests the same items (page p of buffer b:
``item_len`` bytes at ``ptr + p * item_len``) on the host. Decode's side is what
``_verify_kv_checksums`` computes, with SGLang's ``page_indices_for_request`` and
``state_indices_for_request``.

Prefill has attention TP 2 (an MLA cache: TP rank 0 sends, TP rank 1 has no endpoint). Rank 1
is asked by no decode rank and says prefix 0, so SGLang digests tokens ``[0, n)`` there, into
rank 1's own metadata row; decode receives rank 0's row, digested over ``[prefix, n)``.
"""

from __future__ import annotations

import ctypes
import types
import zlib

import numpy as np
import pytest

pytest.importorskip("sglang.srt.disaggregation.prefill", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

import torch  # noqa: E402

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

from sglang.srt.disaggregation.checksum import (  # noqa: E402
    KvChecksumComputer,
    page_indices_for_request,
    state_indices_for_request,
)
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as Mixin  # noqa: E402
from sglang.srt.disaggregation.utils import kv_layout_signature  # noqa: E402

from _sgl_inproc import Pair  # noqa: E402
from _sgl_world import PAGE, metadata_req  # noqa: E402

PREFIX = 2 * PAGE  # decode's radix cache holds the first two pages


class HostChecksum(KvChecksumComputer):
    """``KvChecksumComputer.compute`` on the host: the same items in the same order."""

    def compute(self, kv_page_indices_gpu: torch.Tensor, state_indices_gpu: torch.Tensor | None = None) -> int:
        items = [(ptr, n, kv_page_indices_gpu) for ptr, n in zip(self._kv_data_ptrs, self._kv_item_lens)]
        items += [(ptr, n, state_indices_gpu) for ptr, n in zip(self._state_data_ptrs, self._state_item_lens)]
        digest = 1
        for ptr, item_len, pages in items:
            for p in pages.tolist():
                digest = zlib.adler32(ctypes.string_at(ptr + p * item_len, item_len), digest)
        return digest


def computer(world) -> HostChecksum:
    """As ``PrefillBootstrapQueue.__init__`` / ``DecodePreallocQueue.__init__`` build it."""
    a = world.kv_args
    return HostChecksum(device=torch.device("cpu"), kv_data_ptrs=a.kv_data_ptrs, kv_item_lens=a.kv_item_lens,
                        state_data_ptrs=a.state_data_ptrs, state_item_lens=a.state_item_lens)


def req_to_token(pages: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(np.repeat(pages, PAGE) * PAGE + np.tile(np.arange(PAGE), pages.size))[None]


def scheduler(world, rows: torch.Tensor) -> types.SimpleNamespace:
    """What SGLang's ``send_kv_chunk`` -> ``_send_kv_chunk`` and the checksum helpers read on a
    Scheduler (no overlap, no staging; the checksum on)."""
    s = types.SimpleNamespace(
        enable_overlap=False, enable_staging=False, kv_checksum_computer=computer(world),
        disagg_metadata_buffers=world.meta, disagg_prefill_pending_chunk_rids=set(),
        disagg_prefill_bootstrap_queue=types.SimpleNamespace(kv_checksum_signature=kv_layout_signature(world.kv_args),
                                                             kv_manager=world.mgr),
        token_to_kv_pool_allocator=types.SimpleNamespace(page_size=PAGE, translate_kv_indices_for_transfer=lambda x: x,
                                                         get_kvcache=lambda: world.pool),
        req_to_token_pool=types.SimpleNamespace(req_to_token=rows))  # fmt: skip
    for name in ("send_kv_chunk", "_send_kv_chunk"):
        setattr(s, name, types.MethodType(getattr(Mixin, name), s))
    return s


@pytest.fixture(scope="module")
def pair(daemon):
    """Page size 64 with the checksum on, which start-up refuses (partial last pages, below): the
    refusal is lifted here alone, to show what the two digests agree on and why it exists."""
    from kvbridge.integrations.sglang import settings

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "refuse_checksum_of_partial_pages", lambda kv_checksum, page_size: None)
        p = Pair(daemon.url, "g3", prefill_tp=2, disaggregation_enable_kv_checksum=True)
    yield p
    p.close()


def test_the_checksum_with_pages_above_one_token_is_refused_at_start_up(daemon):
    """What the last test shows is refused by name before any room: the flag, the page size, why
    and what to use instead."""
    from kvbridge import ConfigError

    with pytest.raises(ConfigError) as err:
        Pair(daemon.url, "g3-refused", disaggregation_enable_kv_checksum=True)
    msg = str(err.value)
    assert "--disaggregation-enable-kv-checksum with --page-size 64" in msg and "--page-size 1" in msg
    assert err.value.field == "--disaggregation-enable-kv-checksum"


def transfer(pair: Pair, room: int, n: int) -> tuple[dict, dict, int]:
    """One request with a decode prefix hit: bootstrapped through the harness, then its whole
    prompt sent by SGLang's own ``send_kv_chunk(last_chunk=True)``; (prefill event, decode
    event, the digest decode computes over ``[prefix, n)`` of its own pages)."""
    pair.prefill.add(room, n, n, hold_after=0)  # bootstraps, then waits for the test
    pair.decode.add(room, n, PREFIX, pair.addr)
    r, d = pair.prefill.reqs[room], pair.decode.reqs[room]
    pair.run(lambda: not r.pending_bootstrap and d.phase == "transfer")
    assert r.decode_prefix == [PREFIX, 0] and r.start_send_idx == [PREFIX, 0]  # pop_decode_prefix_len()
    digests = []
    for i, w in enumerate(pair.prefill.worlds):  # every TP rank: its own Req, its own metadata row
        w.write_rows(room, r.pages, 0, n, n, 1)  # the forward pass (the latent is replicated over TP)
        req = metadata_req(room, r.meta_idx[i])
        for k, v in dict(rid=f"g3-{room}", extend_end=n, origin_input_ids=list(range(n)), kv=types.SimpleNamespace(
                req_pool_idx=0), start_send_idx=r.start_send_idx[i], disagg_decode_prefix_len=r.decode_prefix[i],
                disagg_kv_sender=r.senders[i]).items():  # fmt: skip
            setattr(req, k, v)
        scheduler(w, req_to_token(r.pages)).send_kv_chunk(req, last_chunk=True)  # SGLang's own code path
        assert req.start_send_idx == n
        digests.append(w.meta.get_kv_checksum(r.meta_idx[i])[0])
    assert digests[0] != digests[1]  # [prefix, n) on rank 0, [0, n) on rank 1
    r.phase, r.extend_end = "inflight", n
    pair.run(lambda: all(pair.done(room)))
    pe, de = pair.done(room)
    assert de["state"] == "Success", de
    assert de["checksum"][0] == digests[0]  # rank 0's row is the one decode has; rank 1's reaches nobody
    dw = pair.decode.w
    dsched = scheduler(dw, req_to_token(np.concatenate([d.prefix_pages, d.pages])))
    dreq = types.SimpleNamespace(kv=types.SimpleNamespace(req_pool_idx=0))
    actual = dsched.kv_checksum_computer.compute(page_indices_for_request(dsched, dreq, n, start_idx=PREFIX),
                                                 state_indices_for_request(dsched, dreq, n, start_idx=PREFIX))
    return pe, de, actual


def test_the_checksum_covers_what_follows_the_decode_prefix_on_both_sides(pair):
    """256 tokens (4 whole pages), decode holds pages 0, 1: pages 2, 3 move, decode's prefix pages
    keep their own bytes, and decode's digest of [128, 256) is the one prefill wrote."""
    pe, de, actual = transfer(pair, 2**62 + 31, 4 * PAGE)
    assert pe["state"] == "Success" and pe["prefix"] == [PREFIX, 0], pe["reasons"]
    assert de["state"] == "Success" and de["errors"] == [], de
    digest, signature = de["checksum"]
    assert signature == kv_layout_signature(pair.decode.w.kv_args)  # _kv_checksum_comparable
    assert digest != 0 and actual == digest


def test_a_partial_last_page_is_digested_whole_by_sglang_but_moves_only_its_valid_rows(pair):
    """Why start-up refuses the checksum above page size 1: SGLang digests whole pages, and kvbridge writes only
    the valid rows of a partial last page (hard rule 1), so decode's rows past the request's end
    keep decode's own bytes and the digests differ: a request of 200 tokens at page size 64 would
    be aborted as a checksum mismatch. Every transferred byte is right."""
    pe, de, actual = transfer(pair, 2**62 + 37, 200)
    assert pe["state"] == "Success" and de["state"] == "Success" and de["errors"] == [], de
    assert actual != de["checksum"][0]
