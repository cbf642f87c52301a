"""A Mamba hybrid (Qwen3-Next class: GDN conv + temporal state beside full-attention k/v pages)
moved END TO END through kvbridge's rooms by kvbridge's SGLang backend: SGLang 0.5.23's REAL
pool classes on the CPU (``HybridLinearKVPool`` + ``MambaPool``, ``MetadataBuffers``), their
``KVArgs`` filled by SGLang's own ``setup_state_kv_args``, kvbridge's real manager, sender and
receiver (through ``get_kv_class``), a prefill and a decode endpoint in this process at one
cluster daemon, real Mooncake TCP on loopback between two engines.

Driven as SGLang's schedulers drive a backend: decode's metadata goes through SGLang's own
``DecodePreallocQueue._send_kv_metadata`` (kvbridge's hook, patches.py, hands the receiver the
token count first; the queue around it is a namespace with what that method reads); prefill sends
two chunks, the last with SGLang's MAMBA state indices (the request's ``MambaPool`` slot, as
``_mamba_payload`` builds them). Every byte decode needs is compared (k/v rows of the request,
both mamba tensors' slot, the metadata row) and every other byte of decode's pools must keep its
poison."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.disaggregation.utils", reason="needs SGLang: make test-sglang")
pytestmark = pytest.mark.sglang

from kvbridge.transfer.engine import mooncake_available  # noqa: E402

if not mooncake_available():
    pytest.skip("Mooncake not installed", allow_module_level=True)

import _sgl_world as world  # noqa: E402
from kvbridge.integrations.sglang.building import building  # noqa: E402
from _sgl_procs import CHILD_ENV, free_port  # noqa: E402

PAGE, TOKENS, SLOTS = 16, 256, 4
Q, K_, V_, HEADS = 32, 32, 64, 4
POISON = 0x5A
RANKS = {"attn_cp_rank": 0, "attn_cp_size": 1, "attn_tp_rank": 0, "attn_tp_size": 1, "attn_dp_rank": 0,
         "attn_dp_size": 1, "pp_rank": 0, "pp_size": 1}  # fmt: skip


WINDOW = 40  # the scheduler's sliding_window_size of the SWA model


def _swa_pool():
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=TOKENS, size_swa=128, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3], device="cpu")


def _mamba_pool():
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=V_, n_groups=2, num_heads=HEADS, head_dim=16,
                                    state_size=16, conv_kernel=4, conv_shard_groups=[Q, K_, V_])
    mp = MambaPool(size=SLOTS, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                   mamba_layer_ids=[0, 2], device="cpu")
    return HybridLinearKVPool(size=TOKENS, dtype=torch.bfloat16, page_size=PAGE, head_num=1, head_dim=8,
                              full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=mp)


class Rank:
    """One SGLang rank of the hybrid model: its pools, metadata rows, KVArgs and kvbridge manager."""

    def __init__(self, role: str, port: int, env: dict[str, str], model: str) -> None:
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.utils import (DisaggregationMode, KVClassType, MetadataBuffers,
                                                     ReqToMetadataIdxAllocator, TransferBackend, build_kv_layer_ids,
                                                     get_kv_class, get_kv_transfer_buf_infos, is_mla_backend,
                                                     setup_state_kv_args)
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, **RANKS)
        self.model = model
        self.pool = _mamba_pool() if model == "mamba" else _swa_pool()
        self.meta = MetadataBuffers(world.META_ROWS, hidden_size=world.HIDDEN, hidden_states_dtype=torch.bfloat16,
                                    max_sampling_mask_tokens=16, max_top_logprobs_num=world.TOP_LOGPROBS,
                                    output_dsa_topk_indices_dim=world.DSA_TOPK, kv_checksum_enabled=False)
        self.meta_alloc = ReqToMetadataIdxAllocator(world.META_ROWS)
        a = KVArgs()  # as PrefillBootstrapQueue._init_kv_manager / DecodePreallocQueue._init_kv_manager fill it
        a.engine_rank, a.pp_rank, a.system_dp_rank, a.kv_cache_dtype_str = 0, 0, 0, "auto"
        a.kv_layout, a.prefill_start_layer, a.prefill_end_layer = None, 0, None
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(self.pool)
        a.num_draft_entries = 0
        a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
                                            num_draft_entries=0, num_hidden_layers=4)
        a.page_size, a.ib_device, a.gpu_id = PAGE, None, 0
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.meta.get_buf_infos()
        setup_state_kv_args(a, self.pool, None, 4, req_to_token_pool=None)
        self.kv_args = a
        args = world.server_args(role, port, port=free_port(), **world.MHA_ARGS)  # (port: names the instance)
        # the queue SGLang's _init_kv_manager runs on (patches.py names it): the SWA pool and the window
        queue = SimpleNamespace(token_to_kv_pool=self.pool, scheduler=SimpleNamespace(sliding_window_size=WINDOW))
        with world.environ(env), building(queue):
            manager = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.MANAGER)
            mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
            self.mgr = manager(a, mode, args, is_mla_backend(self.pool))
        get_parallel().clear_stamp()

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        if self.model == "swa":
            full, swa = self.pool.full_kv_pool, self.pool.swa_kv_pool
            return {"k": list(full.k_buffer), "v": list(full.v_buffer), "swa_k": list(swa.k_buffer),
                    "swa_v": list(swa.v_buffer)}
        c = self.pool.mamba_pool.mamba_cache
        return {"k": list(self.pool.full_kv_pool.k_buffer), "v": list(self.pool.full_kv_pool.v_buffer),
                "conv": [c.conv[0][i] for i in range(2)], "temporal": [c.temporal[i] for i in range(2)]}


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


@contextlib.contextmanager
def _pair(daemon, model: str):
    from sglang.srt.runtime_context import create_context, use_context
    from sglang.srt.server_args import ServerArgs

    from kvbridge.integrations.sglang import install

    install()
    env = {**CHILD_ENV, "KVBRIDGE_BOOTSTRAP_URL": daemon.url}
    port = free_port()
    with use_context(create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")):
        prefill = Rank("prefill", port, env, model)
        try:
            decode = Rank("decode", 8998, env, model)
            try:
                yield SimpleNamespace(prefill=prefill, decode=decode, addr=f"127.0.0.1:{port}")
            finally:
                decode.mgr.close()
        finally:
            prefill.mgr.close()


@pytest.fixture(scope="module")
def mamba(daemon):
    with _pair(daemon, "mamba") as pair:
        yield pair


@pytest.fixture(scope="module")
def swa(daemon):
    with _pair(daemon, "swa") as pair:
        yield pair


def _until(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_mamba_hybrid_moves_every_byte_decode_needs_through_the_rooms(mamba):
    pair = mamba
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.common import kv_to_page_indices

    from kvbridge.integrations.sglang.kvargs import pool_specs

    p, d = pair.prefill, pair.decode
    specs = pool_specs(p.mgr.cache)
    assert {n: s.kind for n, s in specs.items()} == {"k": "paged", "v": "paged", "mamba_0": "state",
                                                     "mamba_1": "state"}
    assert p.mgr.cache.state_of == {"mamba_0": "mamba", "mamba_1": "mamba"}
    room, n, chunk = 2**62 + 77, 50, 32
    src_pages, dst_pages = np.array([3, 9, 1, 6]), np.array([7, 2, 12, 5])
    src_slot, dst_slot = 1, 3
    torch.manual_seed(0)
    for ts in p.tensors().values():
        for t in ts:
            t.copy_(torch.randn_like(t.float()).to(t.dtype))
    for ts in d.tensors().values():
        for t in ts:
            t.view(torch.uint8).fill_(POISON)
    before = {k: [_bytes(t).copy() for t in ts] for k, ts in d.tensors().items()}

    # decode: the receiver, its prefill instance, then SGLang's own _send_kv_metadata (kvbridge's hook inside)
    receiver = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.RECEIVER)(
        mgr=d.mgr, bootstrap_addr=pair.addr, bootstrap_room=room)
    _until(lambda: d.mgr.try_ensure_parallel_info(pair.addr))
    receiver.init(0)
    dst_tokens = torch.as_tensor(np.repeat(dst_pages, PAGE) * PAGE + np.tile(np.arange(PAGE), dst_pages.size))
    queue = SimpleNamespace(req_to_metadata_buffer_idx_allocator=d.meta_alloc, transfer_queue=SimpleNamespace(
        enable_staging=False), _num_published_destinations=0,
        _transfer_page_indices=lambda dr, kv, ps: kv_to_page_indices(kv, ps).astype(np.int32))
    req = SimpleNamespace(origin_input_ids=list(range(n)), output_ids=[], bootstrap_room=room,
                          time_stats=SimpleNamespace(set_decode_transfer_queue_entry_time=lambda: None))
    decode_req = SimpleNamespace(req=req, kv_receiver=receiver, is_rebootstrap=False, metadata_buffer_index=-1)
    DecodePreallocQueue._send_kv_metadata(queue, decode_req, dst_tokens[:n], PAGE, [[np.asarray(dst_slot)]],
                                          decode_prefix_len=0)
    assert receiver.num_tokens == n

    # prefill: bootstrap, two chunks (the last with the MAMBA slot and the metadata row), as SGLang sends them
    sender = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.SENDER)(
        mgr=p.mgr, bootstrap_addr=pair.addr, bootstrap_room=room)
    _until(lambda: int(sender.poll()) == KVPoll.WaitingForInput)
    assert sender.pop_decode_prefix_len() == 0
    meta_idx = p.meta_alloc.alloc()
    sender.init(src_pages.size, meta_idx)
    src_tokens = torch.as_tensor(np.repeat(src_pages, PAGE) * PAGE + np.tile(np.arange(PAGE), src_pages.size))
    sender.send(kv_to_page_indices(src_tokens[:chunk], PAGE), None, num_kv_tokens=chunk)
    p.meta.set_buf(world.metadata_req(room, meta_idx))
    sender.send(kv_to_page_indices(src_tokens[chunk:n], PAGE), [[np.asarray(src_slot)]], num_kv_tokens=n - chunk)
    _until(lambda: int(sender.poll()) in (KVPoll.Success, KVPoll.Failed))
    _until(lambda: int(receiver.poll()) in (KVPoll.Success, KVPoll.Failed))
    assert int(receiver.poll()) == KVPoll.Success, receiver.failure_exception()
    assert int(sender.poll()) == KVPoll.Success
    stats = sender.room_stats

    # every byte decode needs, and nothing else
    src, dst = p.tensors(), d.tensors()
    tok = np.arange(n)
    s_rows, d_rows = src_pages[tok // PAGE] * PAGE + tok % PAGE, dst_pages[tok // PAGE] * PAGE + tok % PAGE
    for name in ("k", "v"):
        for layer, (s, t) in enumerate(zip(src[name], dst[name])):
            assert np.array_equal(_bytes(t[d_rows]), _bytes(s[s_rows])), (name, layer)
            want = before[name][layer].copy()
            want[d_rows] = _bytes(s[s_rows])
            assert np.array_equal(_bytes(t), want), f"{name} layer {layer}: a byte outside the request's rows"
    for name in ("conv", "temporal"):
        for layer, (s, t) in enumerate(zip(src[name], dst[name])):
            assert np.array_equal(_bytes(t[dst_slot]), _bytes(s[src_slot])), (name, layer)
            want = before[name][layer].copy()
            want[dst_slot] = _bytes(s[src_slot])
            assert np.array_equal(_bytes(t), want), f"{name} layer {layer}: a byte outside the request's slot"
    assert not world.metadata_errors(d.meta.get_buf(decode_req.metadata_buffer_index), room)
    # bytes posted: the k/v rows, both tensors' slot of both layers and the aux row, no more
    kv_row = specs["k"].bytes_per_token
    slot = sum(specs[m].bytes_per_token for m in ("mamba_0", "mamba_1"))
    aux = sum(int(x) for x in p.kv_args.aux_item_lens)
    assert stats["bytes"] == 2 * 2 * n * kv_row + 2 * slot + aux, stats
    sender.clear()
    receiver.clear()


def test_a_sliding_window_model_moves_the_window_pages_and_nothing_else_through_the_rooms(swa):
    """gpt-oss class: SWAKVPool, full-attention k/v on layers 1 and 3, SWA k/v on layers 0 and 2 on
    pages of their own pool. The window (the scheduler's sliding_window_size, read off the queue
    that builds the manager) decides what travels: SGLang's _swa_payload hands both sides the SWA
    pages from floor((n - W) / page); kvbridge writes rows [n - W, n) of them, with the last chunk
    (the SWA pages' ids come only then), and nothing of the pages before the window."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.mem_cache.common import kv_to_page_indices

    from kvbridge.integrations.sglang.kvargs import pool_specs

    pair = swa
    p, d = pair.prefill, pair.decode
    specs = pool_specs(p.mgr.cache)
    assert {n: (s.kind, s.window) for n, s in specs.items()} == {
        "k": ("paged", 0), "v": ("paged", 0), "swa_k": ("window", WINDOW), "swa_v": ("window", WINDOW)}
    assert specs["swa_k"].layer_ids == (0, 2)  # the SWA pool's layers_mapping
    room, n, chunk = 2**62 + 91, 100, 64
    src_pages, dst_pages = np.array([3, 9, 1, 6, 11, 2, 8]), np.array([7, 2, 12, 5, 10, 1, 4])
    first = (n - WINDOW) // PAGE  # SGLang's window_start page
    src_swa = np.array([0, 0, 0, 5, 1, 7, 2])  # the SWA pool's pages of the window's logical pages 3..6
    dst_swa = np.array([6, 3, 0, 4])
    torch.manual_seed(1)
    for ts in p.tensors().values():
        for t in ts:
            t.copy_(torch.randn_like(t.float()).to(t.dtype))
    for ts in d.tensors().values():
        for t in ts:
            t.view(torch.uint8).fill_(POISON)
    before = {k: [_bytes(t).copy() for t in ts] for k, ts in d.tensors().items()}

    receiver = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.RECEIVER)(
        mgr=d.mgr, bootstrap_addr=pair.addr, bootstrap_room=room)
    _until(lambda: d.mgr.try_ensure_parallel_info(pair.addr))
    receiver.init(0)
    dst_tokens = torch.as_tensor(np.repeat(dst_pages, PAGE) * PAGE + np.tile(np.arange(PAGE), dst_pages.size))
    queue = SimpleNamespace(req_to_metadata_buffer_idx_allocator=d.meta_alloc, transfer_queue=SimpleNamespace(
        enable_staging=False), _num_published_destinations=0,
        _transfer_page_indices=lambda dr, kv, ps: kv_to_page_indices(kv, ps).astype(np.int32))
    req = SimpleNamespace(origin_input_ids=list(range(n)), output_ids=[], bootstrap_room=room,
                          time_stats=SimpleNamespace(set_decode_transfer_queue_entry_time=lambda: None))
    decode_req = SimpleNamespace(req=req, kv_receiver=receiver, is_rebootstrap=False, metadata_buffer_index=-1)
    DecodePreallocQueue._send_kv_metadata(queue, decode_req, dst_tokens[:n], PAGE, [dst_swa.astype(np.int32)],
                                          decode_prefix_len=0)

    sender = get_kv_class(TransferBackend.KVBRIDGE, KVClassType.SENDER)(
        mgr=p.mgr, bootstrap_addr=pair.addr, bootstrap_room=room)
    _until(lambda: int(sender.poll()) == KVPoll.WaitingForInput)
    assert sender.pop_decode_prefix_len() == 0
    meta_idx = p.meta_alloc.alloc()
    sender.init(-(-n // PAGE), meta_idx)
    src_tokens = torch.as_tensor(np.repeat(src_pages, PAGE) * PAGE + np.tile(np.arange(PAGE), src_pages.size))
    sender.send(kv_to_page_indices(src_tokens[:chunk], PAGE), None, num_kv_tokens=chunk)  # completes window page 3
    p.meta.set_buf(world.metadata_req(room, meta_idx))
    sender.send(kv_to_page_indices(src_tokens[chunk:n], PAGE), [src_swa[first:].astype(np.int32)],
                num_kv_tokens=n - chunk)
    _until(lambda: int(sender.poll()) in (KVPoll.Success, KVPoll.Failed))
    _until(lambda: int(receiver.poll()) in (KVPoll.Success, KVPoll.Failed))
    assert int(receiver.poll()) == KVPoll.Success, receiver.failure_exception()
    assert int(sender.poll()) == KVPoll.Success
    stats = sender.room_stats

    src, dst = p.tensors(), d.tensors()
    tok = np.arange(n)
    s_rows, d_rows = src_pages[tok // PAGE] * PAGE + tok % PAGE, dst_pages[tok // PAGE] * PAGE + tok % PAGE
    win = np.arange(n - WINDOW, n)
    s_win, d_win = src_swa[win // PAGE] * PAGE + win % PAGE, dst_swa[win // PAGE - first] * PAGE + win % PAGE
    for name, (srows, drows) in (("k", (s_rows, d_rows)), ("v", (s_rows, d_rows)), ("swa_k", (s_win, d_win)),
                                 ("swa_v", (s_win, d_win))):
        for layer, (s, t) in enumerate(zip(src[name], dst[name])):
            assert np.array_equal(_bytes(t[drows]), _bytes(s[srows])), (name, layer)
            want = before[name][layer].copy()
            want[drows] = _bytes(s[srows])
            assert np.array_equal(_bytes(t), want), f"{name} layer {layer}: a byte outside what decode needs"
    assert not world.metadata_errors(d.meta.get_buf(decode_req.metadata_buffer_index), room)
    aux = sum(int(x) for x in p.kv_args.aux_item_lens)
    assert stats["bytes"] == 2 * 2 * n * specs["k"].bytes_per_token + 2 * 2 * WINDOW * specs["swa_k"].bytes_per_token \
        + aux, stats
    sender.clear()
    receiver.clear()


@pytest.mark.parametrize("queue", ["sglang.srt.disaggregation.prefill.PrefillBootstrapQueue",
                                   "sglang.srt.disaggregation.decode.DecodePreallocQueue"])
def test_init_kv_manager_names_its_queue_while_sglangs_method_runs(queue):
    """patches.py wraps both queues' _init_kv_manager: inside SGLang's method (where the manager
    is built) building_queue() is that queue; before and after, nobody's."""
    import importlib

    from kvbridge.integrations.sglang import install
    from kvbridge.integrations.sglang.building import building_queue

    install()
    module, name = queue.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    seen = []

    class Queue:
        @property
        def transfer_backend(self):  # the first thing SGLang's method reads
            seen.append(building_queue())
            raise RuntimeError("stop here")

    q = Queue()
    with pytest.raises(RuntimeError, match="stop here"):
        cls._init_kv_manager(q)
    assert seen == [q] and building_queue() is None
