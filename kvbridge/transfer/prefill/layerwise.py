"""Layer-wise sends of one forward pass, stream-ordered and off the forward's thread.

    forward thread (the model's)              poster thread (this module's)       engine
    layer l's KV written (kernels queued)
    posts.layer_done(l) --(group, event)-->   sender.send(..., layers=group,  --> pump waits the
      an event recorded on the current          ready_event=event) per room        event, then posts
      stream when l closes a group;
      nothing waits, nothing is planned here
    posts.finish()      <-- first error --    queue drained
    sender.send(empty, is_last=True, aux=row)   the end: the aux row

``layer_done`` costs the forward thread one ``cudaEventRecord`` per group and a queue put: the
slices are planned and submitted on the poster thread, and the bytes are read only once the
event completed (the engine's copy stream waits on it, or its pump thread does: never the
model's stream, never the forward's thread). On host pools (CPU) there is no event: the
layer's writes are done when ``layer_done`` is called, and the poster sends at once.

**Layer groups.** A layer of a short prompt is a few hundred KB (DeepSeek V3.2 fp8: 656 B per
token per layer, 0.6 MiB at 1K tokens): posted alone, the per-post cost dominates. Consecutive
layers are grouped so each post carries at least ``min_bytes`` (``layer_groups``); a group is
sent when its last layer is written.

**The last group** is posted like the others, as its layer is written: the forward's end (the
first token read back) comes after it, and its transfer overlaps that. Holding it back for the
last send (one post instead of two after the forward) measured worse on one H200: the tail
after the forward grew from 1.9 to 3.5 ms at 32K (docs/performance.md).

**CUDA graphs.** ``layer_done`` must run eagerly after each layer's KV write: inside a captured
full-model CUDA graph it runs once at capture, never at replay. An engine that captures prefill
batches whole (vLLM ``cudagraph_mode=FULL``) needs piecewise graphs (attention outside the
graph) for layer-wise sends, or layer-wise off (``cuda_graph_note``).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# A post under this costs more (planning, submit, completion: Python time the poster takes from the
# forward's thread under the GIL) than its bytes take on the wire: measured on one H200 (docs/performance.md,
# "Layer-wise sends on the GPU"), groups of 2 MiB slowed a 1K forward 3x, short forwards being launch-bound
DEFAULT_MIN_BYTES = 8 << 20
_STOP = object()


def layer_groups(num_layers: int, layer_bytes: int, min_bytes: int = DEFAULT_MIN_BYTES,
                 min_pass_bytes: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` runs of consecutive layers, each at least ``min_bytes`` (``layer_bytes`` per
    layer), the last one taking the remainder: 61 layers of 0.6 MiB, 2 MiB -> 4 layers a group.
    A pass of fewer than ``min_pass_bytes`` in all is one group, sent at its last layer."""
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    if layer_bytes <= 0:
        raise ValueError(f"layer_bytes must be positive, got {layer_bytes}")
    if min_pass_bytes < 0:
        raise ValueError(f"min_pass_bytes must be at least 0, got {min_pass_bytes}")
    if num_layers * int(layer_bytes) < min_pass_bytes:
        return [(0, num_layers)]
    per = max(1, -(-int(min_bytes) // int(layer_bytes)))
    starts = list(range(0, num_layers, per))
    groups = [(s, min(s + per, num_layers)) for s in starts]
    if len(groups) > 1 and (groups[-1][1] - groups[-1][0]) * layer_bytes < min_bytes:
        last = groups.pop()
        groups[-1] = (groups[-1][0], last[1])
    return groups


def cuda_graph_note(layerwise: bool, cudagraph_mode: str | None) -> str | None:
    """What layer-wise sends need of the engine's CUDA graphs: None when nothing, else a sentence.
    ``cudagraph_mode``: vLLM's name (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE);
    only FULL replays prefill batches as one graph, where the per-layer hook never runs."""
    mode = (cudagraph_mode or "").upper().rsplit(".", 1)[-1]
    if not layerwise or mode != "FULL":
        return None
    return ("layer-wise sends need the per-layer hook to run at every prefill step: cudagraph_mode=FULL replays "
            "prefill batches as one CUDA graph and the hook runs only at capture; use PIECEWISE or "
            "FULL_AND_PIECEWISE (attention outside the graphs), or layerwise=false")


def layerwise_slower(engine: Any, device: str) -> str | None:
    """Why layer-wise sends are slower than one whole-room send on this rank, or None where nothing
    measured says so. ``engine``: the rank's transfer engine; ``device``: its pools' ("cpu", "cuda:N").

    Slower, measured: GPU pools over Mooncake's intra-node NVLink transport (``protocol rdma`` with
    ``MC_INTRANODE_NVLINK`` set: the engine's ``intranode_nvlink``). That transport copies each slice
    with a synchronous ``cudaMemcpy`` inside the post, so a layer group's copies queue behind the
    forward's kernels, and a staged group needs decode's scatter kernel between the forward's: on one
    H100 (both sides on cuda:0, DeepSeek V3.2 fp8 61+1 layers, random pages) layer-wise put TTFT at
    1.1-2.2x the forward alone, against 1.0-1.1x for whole rooms (docs/performance.md, "Issue 33,
    round 20"). Not measured, so not listed: Mooncake RDMA between hosts (GPUDirect: no copy on
    the GPU), Mooncake TCP from GPU memory, NIXL on the GPU. Host pools and the IPC engine keep
    layer-wise (measured faster)."""
    if not str(device).startswith("cuda") or not getattr(engine, "intranode_nvlink", False):
        return None
    return ("layer-wise sends are slower than whole rooms on Mooncake's intra-node NVLink transport "
            "(MC_INTRANODE_NVLINK): it copies each slice with a synchronous cudaMemcpy behind the forward's "
            "kernels; measured TTFT 1.1-2.2x the forward alone on one H100, against 1.0-1.1x for whole rooms "
            "(docs/performance.md, issue 33 round 20); same-host peers are faster on engine ipc or auto")


@dataclass
class RoomSend:
    """One room's part of a forward pass: its sender and the pages the pass writes; after
    ``finish``, the layer groups handed to its sender and its first error (none sent after it)."""

    sender: Any  # KVSender
    logical: np.ndarray
    local: np.ndarray
    num_tokens: int
    sent: list[tuple[int, int]] = field(default_factory=list)  # groups handed to the sender (poster thread)
    error: BaseException | None = None


class LayerPosts:
    """The poster of one prefill rank: ``begin`` a forward pass with its rooms, ``layer_done`` after
    each layer's KV write (forward thread), ``finish`` at its end; then the last send (the aux row).

    ``device``: the pools' device ("cpu" or "cuda:N"); on CUDA an event is recorded on the current
    stream of that device when a group closes. ``min_pass_bytes``: a pass carrying fewer bytes is
    one group (``layer_groups``): a short forward is bound by its kernel launches on the forward's
    thread, and each group's send takes the GIL from it (1K tokens, 5 groups: TTFT 1.22-1.78x the
    forward alone on one H100, against 1.06-1.23x sent whole; docs/performance.md, "Issue 33, round
    20"); the vLLM connector sets it (``layer_pass_bytes``, 64 MiB)."""

    def __init__(self, num_layers: int, layer_bytes: int, *, device: str = "cpu",
                 min_bytes: int = DEFAULT_MIN_BYTES, min_pass_bytes: int = 0) -> None:
        self.num_layers = num_layers
        self.min_bytes = min_bytes
        self.min_pass_bytes = min_pass_bytes
        self.groups = layer_groups(num_layers, layer_bytes, min_bytes, min_pass_bytes)
        self._closes = {end - 1: (start, end) for start, end in self.groups}
        self._cuda = str(device).startswith("cuda")
        self._rooms: list[RoomSend] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self.posted = 0  # group sends handed to senders (all rooms)
        self._thread = threading.Thread(target=self._run, name="kvb-layer-posts", daemon=True)
        self._thread.start()

    def begin(self, rooms: list[RoomSend], *, layer_bytes: int | None = None) -> None:
        """A forward pass starts with ``rooms``. ``layer_bytes``: this pass's bytes per layer (all its
        rooms), to group layers anew (an engine's steps differ in size); None keeps the groups."""
        self._queue.join()
        if layer_bytes is not None:
            self.groups = layer_groups(self.num_layers, max(1, int(layer_bytes)), self.min_bytes, self.min_pass_bytes)
            self._closes = {end - 1: (start, end) for start, end in self.groups}
        self._rooms = list(rooms)
        self._error = None

    @property
    def active(self) -> bool:
        """A pass is under way (between ``begin`` with rooms and ``finish``)."""
        return bool(self._rooms)

    def layer_done(self, layer: int) -> None:
        """Forward thread, after layer ``layer``'s KV writes are queued: no wait, no planning."""
        group = self._closes.get(layer)
        if group is None or not self._rooms:
            return
        event = None
        if self._cuda:
            import torch

            event = torch.cuda.Event()
            event.record()
        self._queue.put((self._rooms, group, event))

    def finish(self, *, raise_first: bool = True) -> None:
        """The pass ended: wait until every group is handed to its sender; raise the first error
        (``raise_first``; else each room's is in its ``RoomSend.error``). Then the caller's last
        send: no pages, ``is_last=True`` and the aux row (and any layer a room's ``sent`` lacks)."""
        self._queue.join()
        self._rooms = []
        err, self._error = self._error, None
        if err is not None and raise_first:
            raise err

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                rooms, (start, end), event = item
                for r in rooms:
                    if r.error is not None:  # a room whose send failed gets no later group
                        continue
                    try:
                        r.sender.send(r.logical, r.local, num_tokens_ready=r.num_tokens, layers=(start, end),
                                      ready_event=event)
                        r.sent.append((start, end))
                        self.posted += 1
                    except BaseException as exc:  # kept for finish(): the forward thread raises it
                        r.error = exc
                        if self._error is None:
                            self._error = exc
            finally:
                self._queue.task_done()
