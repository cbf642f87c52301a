"""``kvbridge.transfer.prefill.layerwise``: layer groups, the CUDA-graph note, and ``LayerPosts``
(the poster thread) on host pools (no event: the CPU fallback of the GPU path) with a recording
sender; on a CUDA device (skipped without one) the events on the forward's stream, nothing
synchronising it. The GPU path end to end (the IPC engine's copy stream waiting on the events)
is measured by ``scripts/layerwise_gpu_bench.py`` on a device host."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvbridge.errors import LayerRangeError
from kvbridge.transfer.prefill.layerwise import (
    DEFAULT_MIN_BYTES,
    LayerPosts,
    RoomSend,
    cuda_graph_note,
    layer_groups,
    layerwise_slower,
)


def test_groups_cover_every_layer_once_in_order():
    for layers, layer_bytes, least in [(61, 656 * 1024, 2 << 20), (61, 656 * 32768, 2 << 20), (5, 1, 100), (1, 10, 5)]:
        groups = layer_groups(layers, layer_bytes, least)
        flat = [i for a, b in groups for i in range(a, b)]
        assert flat == list(range(layers))
        assert all(b > a for a, b in groups)
        if len(groups) > 1:  # every group carries at least the least bytes, the last one included
            assert all((b - a) * layer_bytes >= least for a, b in groups)


def test_groups_of_one_layer_when_a_layer_is_big_enough():
    assert layer_groups(4, 10 << 20, 8 << 20) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_small_layers_are_grouped_and_the_remainder_joins_the_last_group():
    # 61 layers of 0.64 MiB (V3.2 fp8 at 1K tokens), 2 MiB: 4 layers a group, 61 = 15 x 4 + 1
    groups = layer_groups(61, 656 * 1024, 2 << 20)
    assert groups[0] == (0, 4) and groups[-1] == (56, 61) and len(groups) == 15


@pytest.mark.parametrize("layers, layer_bytes", [(0, 1), (3, 0), (-1, 5)])
def test_groups_refuse_nonsense(layers, layer_bytes):
    with pytest.raises(ValueError):
        layer_groups(layers, layer_bytes)


def test_a_pass_under_the_least_pass_bytes_is_one_group_and_the_rest_are_grouped_as_before():
    # 61 layers at 1K tokens (0.77 MiB a layer, 47 MiB a pass) against 2K (94 MiB), 64 MiB the least pass
    assert layer_groups(61, 788 * 1024, 8 << 20, 64 << 20) == [(0, 61)]
    assert layer_groups(61, 788 * 2048, 8 << 20, 64 << 20) == layer_groups(61, 788 * 2048, 8 << 20) != [(0, 61)]
    assert layer_groups(4, 16 << 20, 1, 64 << 20) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # exactly the least: grouped
    with pytest.raises(ValueError, match="min_pass_bytes"):
        layer_groups(4, 1, 1, -1)


def test_a_short_pass_is_posted_once_at_its_last_layer_and_a_longer_one_is_regrouped():
    posts = LayerPosts(6, 1 << 20, min_bytes=1 << 20, min_pass_bytes=16 << 20)
    try:
        r = Recorder()
        posts.begin([RoomSend(r, np.arange(2), np.arange(2), 64)])  # 6 MiB a pass: under 16 MiB
        for layer in range(6):
            posts.layer_done(layer)
        posts.finish()
        assert [s["layers"] for s in r.sends] == [(0, 6)]  # one send, at the last layer
        posts.begin([], layer_bytes=4 << 20)  # 24 MiB a pass: groups of one layer (1 MiB the least post)
        assert posts.groups == [(i, i + 1) for i in range(6)]
    finally:
        posts.close()


def test_cuda_graph_note_only_for_full_graphs_with_layerwise_on():
    assert cuda_graph_note(True, "FULL")
    assert cuda_graph_note(True, "CUDAGraphMode.FULL")  # vLLM's enum as str()
    for mode in ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", None, ""):
        assert cuda_graph_note(True, mode) is None
    assert cuda_graph_note(False, "FULL") is None


class Recorder:
    """A KVSender that records its sends and the thread they came from."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.sends: list[dict] = []
        self.fail_at = fail_at

    def send(self, logical, local, *, num_tokens_ready=None, is_last=False, aux=None, ready_event=None, layers=None):
        if self.fail_at is not None and layers is not None and layers[0] <= self.fail_at < layers[1]:
            raise LayerRangeError(f"layers {layers} refused", field="layers")
        self.sends.append({"layers": layers, "event": ready_event, "thread": threading.current_thread().name,
                           "pages": np.asarray(logical).copy(), "tokens": num_tokens_ready})


@pytest.mark.parametrize("protocol,env,slower", [
    ("rdma", {"MC_INTRANODE_NVLINK": "1"}, True),  # Mooncake's intra-node NVLink transport (set at all)
    ("rdma", {}, False),  # RDMA between hosts: not measured, layer-wise kept
    ("tcp", {"MC_INTRANODE_NVLINK": "1"}, False),
    ("rdma", {"MC_INTRANODE_NVLINK": "1", "MC_FORCE_TCP": "1"}, False),  # Mooncake then carries it over TCP
])  # fmt: skip
def test_layerwise_is_slower_only_for_gpu_pools_on_mooncakes_intranode_nvlink(monkeypatch, protocol, env, slower):
    """The rule the vLLM worker's ``layerwise`` auto reads, on real Mooncake engines (rdma starts
    here without a NIC): a reason naming the transport for CUDA pools on the NVLink transport only;
    host pools and other transports keep layer-wise."""
    from kvbridge import create_engine

    for name in ("MC_INTRANODE_NVLINK", "MC_FORCE_TCP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine = create_engine("mooncake", host="127.0.0.1", protocol=protocol)
    try:
        assert engine.intranode_nvlink is slower
        reason = layerwise_slower(engine, "cuda:0")
        assert (reason is not None) is slower
        if slower:
            assert "intra-node NVLink" in reason and "MC_INTRANODE_NVLINK" in reason and "whole rooms" in reason
        assert layerwise_slower(engine, "cpu") is None
    finally:
        engine.close()


def test_layerwise_is_kept_on_engines_without_the_nvlink_transport():
    from kvbridge import create_engine

    engine = create_engine("local")
    try:
        assert layerwise_slower(engine, "cuda:0") is None and layerwise_slower(engine, "cpu") is None
    finally:
        engine.close()


def test_posts_send_each_group_off_the_callers_thread():
    posts = LayerPosts(10, 3 << 20, min_bytes=6 << 20)  # groups of 2 layers
    try:
        a, b = Recorder(), Recorder()
        pages = np.arange(4, dtype=np.int64)
        posts.begin([RoomSend(a, pages, pages + 10, 256), RoomSend(b, pages, pages + 20, 256)])
        for layer in range(10):
            posts.layer_done(layer)
        posts.finish()
        for r in (a, b):
            assert [s["layers"] for s in r.sends] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
            assert {s["thread"] for s in r.sends} == {"kvb-layer-posts"}
            assert all(s["event"] is None and s["tokens"] == 256 for s in r.sends)  # host pools: no event
        # the next pass starts clean
        c = Recorder()
        posts.begin([RoomSend(c, pages, pages, 64)])
        for layer in range(10):
            posts.layer_done(layer)
        posts.finish()
        assert len(c.sends) == 5 and len(a.sends) == 5
    finally:
        posts.close()


def test_a_refused_send_is_raised_by_finish_and_no_later_group_of_the_pass_is_sent():
    posts = LayerPosts(8, 1 << 20, min_bytes=1 << 20)
    try:
        r = Recorder(fail_at=3)
        posts.begin([RoomSend(r, np.arange(2), np.arange(2), 128)])
        for layer in range(8):
            posts.layer_done(layer)
        with pytest.raises(LayerRangeError, match=r"layers \(3, 4\)"):
            posts.finish()
        assert [s["layers"] for s in r.sends] == [(0, 1), (1, 2), (2, 3)]
    finally:
        posts.close()


def test_layers_done_outside_a_pass_send_nothing():
    posts = LayerPosts(4, DEFAULT_MIN_BYTES)
    try:
        for layer in range(4):
            posts.layer_done(layer)
        posts.finish()
        assert posts.posted == 0
    finally:
        posts.close()


def test_a_failed_room_stops_alone_and_each_room_says_what_it_sent():
    """Two rooms in one pass: the one whose send is refused gets no later group and keeps its error;
    the other is sent every group (the vLLM worker fails that room alone and completes the other)."""
    posts = LayerPosts(8, 1 << 20, min_bytes=2 << 20)  # groups of 2 layers
    try:
        bad, good = Recorder(fail_at=3), Recorder()
        rooms = [RoomSend(bad, np.arange(2), np.arange(2), 128), RoomSend(good, np.arange(2), np.arange(2), 128)]
        posts.begin(rooms)
        for layer in range(8):
            posts.layer_done(layer)
        assert posts.active
        posts.finish(raise_first=False)
        assert not posts.active
        assert isinstance(rooms[0].error, LayerRangeError) and rooms[0].sent == [(0, 2)]
        assert rooms[1].error is None and rooms[1].sent == [(0, 2), (2, 4), (4, 6), (6, 8)]
        assert [s["layers"] for s in good.sends] == rooms[1].sent
    finally:
        posts.close()


def test_begin_regroups_by_the_pass_bytes():
    """An engine's steps differ in size: ``begin(layer_bytes=)`` groups this pass's layers anew."""
    posts = LayerPosts(6, 1 << 20, min_bytes=4 << 20)
    try:
        assert posts.groups == [(0, 6)]
        r = Recorder()
        posts.begin([RoomSend(r, np.arange(2), np.arange(2), 64)], layer_bytes=4 << 20)
        assert posts.groups == [(i, i + 1) for i in range(6)]
        for layer in range(6):
            posts.layer_done(layer)
        posts.finish()
        assert [s["layers"] for s in r.sends] == posts.groups
    finally:
        posts.close()


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device (torch with CUDA)")
def test_on_the_gpu_each_group_waits_on_an_event_of_the_forward_stream_and_nothing_synchronises_it():
    """CUDA pools: ``layer_done`` records an event on the current stream and returns; the poster
    sends with that event, before the forward's queued work has run (no synchronise); each event
    completes once the stream reaches it, and the bytes it guards are then written."""
    import torch

    posts = LayerPosts(4, 1 << 20, device="cuda:0", min_bytes=1 << 20)
    try:
        stream = torch.cuda.Stream()
        kv = torch.zeros(4, 1 << 20, dtype=torch.uint8, device="cuda:0")
        big = torch.randn(4096, 4096, device="cuda:0")
        r = Recorder()
        posts.begin([RoomSend(r, np.arange(1), np.arange(1), 64)])
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued ahead of the layers
            for layer in range(4):
                big = big @ big  # the layer's compute
                kv[layer].fill_(layer + 1)  # its KV write
                posts.layer_done(layer)
        posts.finish()  # every group handed to the sender: the stream is still busy
        events = [s["event"] for s in r.sends]
        assert [s["layers"] for s in r.sends] == [(0, 1), (1, 2), (2, 3), (3, 4)]
        assert all(isinstance(e, torch.cuda.Event) for e in events)
        assert not events[-1].query(), "the poster ran after the forward's stream: something synchronised it"
        events[-1].synchronize()
        assert all(e.query() for e in events)
        assert kv[:, 0].tolist() == [1, 2, 3, 4]
    finally:
        posts.close()
