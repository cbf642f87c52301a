"""Pool specs: what one page of one layer of a KV pool looks like in bytes.

A pool is a family of buffers, one per layer, each ``capacity_pages`` pages of
``bytes_per_page`` bytes. Two in-page layouts exist:

    rows                 token 0 | token 1 | ... | token ps-1      (bytes_per_token each)
    values_then_scales   values of tokens 0..ps-1 | scales of tokens 0..ps-1
                         |<- ps*value_bytes ----->|<- ps*scale_bytes ----->|

so rows ``[a, b)`` of a ``values_then_scales`` page are two byte ranges, not one.

Page stride (``page_stride``): a page's payload is ``page_size * bytes_per_token`` bytes; a
kernel may pad each page past it (FlashMLA's DeepSeek-V4 pages: whole 576-byte rows), so page
``p`` starts at ``p * page_stride`` and its tail is padding that never travels:

    page p at p * page_stride   | payload: rows (or values | scales) | padding |
                                |<- page_size * bytes_per_token ---->|
                                |<- page_stride ------------------------------>|

``page_stride`` 0 means unpadded (the payload). Paged pools are never padded here: their
planner coalesces runs of whole pages into one slice, which would carry the padding.

Kinds (``kind``; what decode needs of each: ``kvbridge.layout.kinds``): ``paged`` (every
token), ``window`` (the last ``window`` tokens; paged or ring-addressed), ``compressed``
(one entry per ``ratio`` tokens; a "token" of the pool is an entry, a page holds
``page_size`` entries) and ``state`` (one slot per request row: ``page_size`` 1,
``bytes_per_token`` the slot's bytes).

Head-sharded pools (MHA/GQA ``k``/``v`` under tensor parallelism): a row holds KV
heads head-major, and a TP rank's buffers hold only its heads ``[head_start,
head_stop)`` of the ``num_heads`` of the whole row; ``bytes_per_token`` is the
rank's row. ``num_heads == 0``: the row is replicated across TP (MLA latent, index K).

    whole row (num_heads 4)   | h0 | h1 | h2 | h3 |      full_bytes_per_token = 4 * head_bytes
    rank rows (heads [2, 4))            | h2 | h3 |      bytes_per_token      = 2 * head_bytes
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import BufferSpecError, LayoutError, PageRangeError
from kvbridge.layout.buffers import RawBuffer

ROWS = "rows"
PAGED, WINDOW, COMPRESSED, STATE = "paged", "window", "compressed", "state"
KINDS = (PAGED, WINDOW, COMPRESSED, STATE)
VALUES_THEN_SCALES = "values_then_scales"
LAYOUTS = (ROWS, VALUES_THEN_SCALES)

# Storage element types a buffer may have, with their item sizes.
ABI_ITEMSIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of one pool. ``abi`` is the element type the buffer is stored as
    (fp8 payloads are stored as ``uint8``); ``dtype`` is what the bytes mean."""

    name: str
    dtype: str
    abi: str
    bytes_per_token: int
    page_size: int
    layer_ids: tuple[int, ...]
    layout: str = ROWS
    value_bytes_per_token: int = 0
    scale_bytes_per_token: int = 0
    kernel_abi: str = ""
    num_heads: int = 0  # head-sharded across TP: KV heads of the whole row; 0: replicated across TP
    head_start: int = 0  # heads [head_start, head_stop) this rank's rows hold (head_stop 0: all of them)
    head_stop: int = 0
    # pool kind (kvbridge.layout.kinds): which rows of a request decode needs and how they are addressed
    kind: str = PAGED  # paged | window | compressed | state
    window: int = 0  # window: the last `window` tokens are what decode reads
    ring_stride: int = 0  # window: ring-addressed, slot = request row * stride + pos % stride (0: pages)
    ratio: int = 0  # compressed: source tokens per entry (a "token" of this pool is an entry); state: a tail
    # slot of `ratio` rows of per-token state, of which decode needs the first n % ratio
    shard_units: tuple[int, ...] = ()  # state: TP-sharded groups of the slot, in units (empty: replicated)
    unit_bytes: int = 0  # state: bytes of one unit of shard_units
    tp_size: int = 1  # state: the TP size this rank's slot is cut for (each group split into tp_size parts)
    page_stride: int = 0  # bytes from one page to the next when pages are padded past their payload (0: unpadded)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise LayoutError(f"pool {self.name!r}: layout {self.layout!r} is not one of {LAYOUTS}", field="layout")
        if self.abi not in ABI_ITEMSIZE:
            raise LayoutError(f"pool {self.name!r}: abi {self.abi!r} is not one of {tuple(ABI_ITEMSIZE)}", field="abi")
        if self.page_size <= 0 or self.bytes_per_token <= 0:
            raise LayoutError(f"pool {self.name!r}: page_size and bytes_per_token must be positive", field="page_size")
        if self.bytes_per_token % ABI_ITEMSIZE[self.abi]:
            raise LayoutError(
                f"pool {self.name!r}: {self.bytes_per_token} bytes per token is not a whole number of {self.abi}",
                field="bytes_per_token",
            )
        if len(set(self.layer_ids)) != len(self.layer_ids) or not self.layer_ids:
            raise LayoutError(f"pool {self.name!r}: layer ids must be distinct and non-empty", field="layer_ids")
        if self.layout == VALUES_THEN_SCALES:
            if self.value_bytes_per_token + self.scale_bytes_per_token != self.bytes_per_token:
                raise LayoutError(
                    f"pool {self.name!r}: value bytes {self.value_bytes_per_token} + scale bytes "
                    f"{self.scale_bytes_per_token} != bytes per token {self.bytes_per_token}",
                    field="value_bytes_per_token",
                )
        self._check_heads()
        self._check_kind()
        self._check_stride()

    def _check_stride(self) -> None:
        """A padded page: at least its payload, whole storage elements, never a paged or
        head-sharded pool (module docstring)."""
        where = f"pool {self.name!r} ({self.kind})"
        value = self.page_stride
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise LayoutError(f"{where}: page_stride must be a non-negative integer, got {value!r}", field="page_stride")
        if not value:
            return
        payload = self.payload_bytes_per_page
        if value < payload or value % ABI_ITEMSIZE[self.abi]:
            raise LayoutError(f"{where}: page stride {value} B is not whole {self.abi} elements at least the page's "
                              f"payload of {payload} B ({self.page_size} x {self.bytes_per_token} B)",
                              field="page_stride")
        if self.kind == PAGED or self.num_heads or self.shard_units or self.ring_stride:
            raise LayoutError(f"{where}: padded pages (page_stride) are carried for window, compressed and "
                              "replicated state pools only: the paged planner coalesces whole pages, padding "
                              "included, ring slots are addressed by their rows, and head or TP slices change the "
                              "payload", field="page_stride")
        if value == payload:
            object.__setattr__(self, "page_stride", 0)  # one encoding for unpadded pages

    def _check_kind(self) -> None:
        """A kind's own fields, and none of another kind's (a typo must not pass as a paged pool)."""
        where = f"pool {self.name!r} ({self.kind})"
        if self.kind not in KINDS:
            raise LayoutError(f"pool {self.name!r}: kind {self.kind!r} is not one of {KINDS}", field="kind")
        for name in ("window", "ring_stride", "ratio", "unit_bytes", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"{where}: {name} must be a non-negative integer, got {value!r}", field=name)
        own = {PAGED: (), WINDOW: ("window", "ring_stride"), COMPRESSED: ("ratio",),
               STATE: ("shard_units", "unit_bytes", "ratio")}[self.kind]
        for name in ("window", "ring_stride", "ratio", "shard_units", "unit_bytes"):
            if getattr(self, name) and name not in own:
                raise LayoutError(f"{where}: {name} belongs to another pool kind", field=name)
        if self.tp_size != 1 and self.kind != STATE:
            raise LayoutError(f"{where}: tp_size cuts state slots only", field="tp_size")
        if self.kind == WINDOW:
            if self.window <= 0:
                raise LayoutError(f"{where}: a window pool needs window > 0 tokens", field="window")
            if self.ring_stride and (self.ring_stride < self.window or self.ring_stride % self.page_size):
                raise LayoutError(f"{where}: ring stride {self.ring_stride} must hold the window of {self.window} "
                                  f"tokens in whole pages of {self.page_size}", field="ring_stride")
        elif self.kind == COMPRESSED and self.ratio <= 0:
            raise LayoutError(f"{where}: a compressed pool needs ratio > 0 (tokens per entry)", field="ratio")
        elif self.kind == STATE:
            self._check_state(where)

    def _check_state(self, where: str) -> None:
        if self.page_size != 1:
            raise LayoutError(f"{where}: a state pool has one slot per request row (page_size 1), "
                              f"not {self.page_size}", field="page_size")
        if self.layout != ROWS or self.num_heads:
            raise LayoutError(f"{where}: state slots use the rows layout and shard by shard_units, not heads",
                              field="layout")
        if self.tp_size < 1:
            raise LayoutError(f"{where}: tp_size must be at least 1", field="tp_size")
        if self.ratio and (self.shard_units or self.bytes_per_token % self.ratio):
            raise LayoutError(f"{where}: a tail slot is {self.ratio} whole rows of per-token state, replicated "
                              f"across TP; {self.bytes_per_token} B with shard groups {self.shard_units}",
                              field="ratio")
        units = tuple(self.shard_units)
        if not all(isinstance(u, (int, np.integer)) and not isinstance(u, bool) and u > 0 for u in units):
            raise LayoutError(f"{where}: shard_units must be positive integers, got {units!r}", field="shard_units")
        object.__setattr__(self, "shard_units", tuple(int(u) for u in units))
        if not units:
            if self.unit_bytes or self.tp_size != 1:
                raise LayoutError(f"{where}: a replicated state slot has no unit_bytes or tp_size", field="unit_bytes")
            return
        if self.unit_bytes <= 0:
            raise LayoutError(f"{where}: sharded state needs unit_bytes > 0", field="unit_bytes")
        bad = [u for u in units if u % self.tp_size]
        if bad:
            raise LayoutError(f"{where}: shard groups {units} do not split into {self.tp_size} TP parts ({bad[0]})",
                              field="shard_units")
        if self.bytes_per_token != sum(units) // self.tp_size * self.unit_bytes:
            raise LayoutError(f"{where}: a slot of {self.bytes_per_token} B is not 1/{self.tp_size} of groups "
                              f"{units} x {self.unit_bytes} B", field="bytes_per_token")

    def _check_heads(self) -> None:
        where = f"pool {self.name!r}"
        for name in ("num_heads", "head_start", "head_stop"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"{where}: {name} must be a non-negative integer, got {value!r}", field=name)
        if not self.num_heads:
            if self.head_start or self.head_stop:
                raise LayoutError(f"{where}: a head range needs num_heads (the heads of the whole row)",
                                  field="num_heads")
            return
        if self.head_stop == 0:
            object.__setattr__(self, "head_stop", self.num_heads)  # default: every head
        if self.layout != ROWS:
            raise LayoutError(f"{where}: head-sharded pools use the rows layout, not {self.layout}", field="layout")
        if not 0 <= self.head_start < self.head_stop <= self.num_heads:
            raise LayoutError(f"{where}: heads [{self.head_start}, {self.head_stop}) outside the row's "
                              f"{self.num_heads}", field="head_start")
        held = self.head_stop - self.head_start
        if self.bytes_per_token % held or (self.bytes_per_token // held) % ABI_ITEMSIZE[self.abi]:
            raise LayoutError(f"{where}: {self.bytes_per_token} bytes per token are not {held} whole heads of "
                              f"{self.abi}", field="bytes_per_token")

    @property
    def head_sharded(self) -> bool:
        """True when TP ranks hold disjoint heads of the row (``num_heads > 0``)."""
        return self.num_heads > 0

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one row (head-sharded pools)."""
        if not self.num_heads:
            raise LayoutError(f"pool {self.name!r} is not head-sharded", field="num_heads")
        return self.bytes_per_token // (self.head_stop - self.head_start)

    @property
    def head_dim(self) -> int:
        return self.head_bytes // ABI_ITEMSIZE[self.abi]

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes of the whole row, every head (the row itself when not head-sharded; a sharded
        state slot: every TP part of every group)."""
        if self.shard_units:
            return sum(self.shard_units) * self.unit_bytes
        return self.num_heads * self.head_bytes if self.num_heads else self.bytes_per_token

    def with_heads(self, head_start: int, head_stop: int) -> PoolSpec:
        """The spec of a rank whose rows hold heads ``[head_start, head_stop)``."""
        hb = self.head_bytes
        return dataclasses.replace(self, bytes_per_token=(head_stop - head_start) * hb, head_start=head_start,
                                   head_stop=head_stop)

    def full(self) -> PoolSpec:
        """The whole-row spec (every head; a state slot's every TP part): what the contract describes."""
        if self.shard_units:
            return dataclasses.replace(self, bytes_per_token=self.full_bytes_per_token, tp_size=1)
        return self.with_heads(0, self.num_heads) if self.num_heads else self

    @property
    def payload_bytes_per_page(self) -> int:
        """The bytes of a page's rows (what can travel); ``bytes_per_page`` adds the padding."""
        return self.bytes_per_token * self.page_size

    @property
    def bytes_per_page(self) -> int:
        """Bytes from one page to the next in a buffer: the stride of a padded page, else the payload."""
        return self.page_stride or self.bytes_per_token * self.page_size

    @property
    def padding_bytes_per_page(self) -> int:
        return self.bytes_per_page - self.payload_bytes_per_page

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scale block inside a ``values_then_scales`` page."""
        return self.value_bytes_per_token * self.page_size

    def row_ranges(self, start: int, count: int) -> tuple[tuple[int, int], ...]:
        """In-page byte ranges ``(offset, length)`` holding rows ``[start, start+count)``."""
        if start < 0 or count < 0 or start + count > self.page_size:
            raise LayoutError(
                f"pool {self.name!r}: rows [{start}, {start + count}) outside a page of {self.page_size}",
                field="rows",
            )
        if self.layout == ROWS:
            return ((start * self.bytes_per_token, count * self.bytes_per_token),)
        v, s = self.value_bytes_per_token, self.scale_bytes_per_token
        return ((start * v, count * v), (self.scale_offset + start * s, count * s))

    def validate_buffer(self, layer_id: int, buf: Any) -> int:
        """Check one layer's buffer (torch tensor, numpy array or ``RawBuffer``) against the
        spec; returns its capacity in pages. Any contiguous buffer of the pool's storage type
        whose bytes are whole pages is accepted, whatever its shape: page-major
        ``[pages, page_size * row]`` and token-major ``[pages * page_size, row]`` are
        byte-identical. A ``RawBuffer`` (an address) must hold whole pages; of padded pages
        (``page_stride``) the last may end with its payload (a region cut out of a larger page,
        vLLM's Mamba states, ends there)."""
        where = f"pool {self.name!r} layer {layer_id}"
        if layer_id not in self.layer_ids:
            raise BufferSpecError(f"pool {self.name!r} has no layer {layer_id}; layers are {self.layer_ids}", field="layer_id")
        if isinstance(buf, RawBuffer):  # an address has no dtype or shape: whole pages is what can be checked
            if self.page_stride and buf.nbytes % self.page_stride == self.payload_bytes_per_page:
                return buf.nbytes // self.page_stride + 1  # a padded last page may end with its payload
            return buf.whole_items(self.bytes_per_page, f"{where} ({self.page_size} tokens x {self.bytes_per_token} B "
                                                        "per page)", "bytes_per_page")
        dtype = str(buf.dtype).removeprefix("torch.")
        shape = tuple(int(d) for d in buf.shape)
        if dtype != self.abi:
            raise BufferSpecError(
                f"{where}: buffer dtype {dtype}, expected {self.abi}"
                + (" (fp8 payloads travel as uint8 bytes)" if self.abi == "uint8" else "")
                + f"; {self.expected_shapes()}",
                field="dtype",
            )
        is_contig = buf.is_contiguous() if hasattr(buf, "is_contiguous") else bool(buf.flags["C_CONTIGUOUS"])
        if not is_contig:
            raise BufferSpecError(f"{where}: buffer of shape {list(shape)} is not contiguous; {self.expected_shapes()}",
                                  field="shape")
        nbytes = int(np.prod(shape, dtype=np.int64)) * ABI_ITEMSIZE[self.abi] if shape else ABI_ITEMSIZE[self.abi]
        if nbytes < self.bytes_per_page or nbytes % self.bytes_per_page:
            raise BufferSpecError(
                f"{where}: {dtype} buffer of shape {list(shape)} holds {nbytes} bytes, not a whole number of "
                f"{self.bytes_per_page}-byte pages ({self.page_size} tokens x {self.bytes_per_token} B"
                f"{f' padded to {self.page_stride} B' if self.page_stride else ''}); "
                f"{self.expected_shapes()}",
                field="bytes_per_page",
            )
        return nbytes // self.bytes_per_page

    def expected_shapes(self, capacity_pages: str = "pages") -> str:
        """How a buffer of this pool may look, for error messages."""
        row = self.bytes_per_token // ABI_ITEMSIZE[self.abi]
        return (f"expected a contiguous {self.abi} tensor of whole pages, e.g. [{capacity_pages}, "
                f"{self.page_size * row}] or [{capacity_pages} * {self.page_size}, {row}]")

    def write_rows(self, buf: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write token rows into a numpy page buffer the way a KV kernel does:
        row ``i`` (``bytes_per_token`` bytes) goes to cache slot ``slots[i]``
        (``physical_page * page_size + offset``), honouring the in-page layout."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        data = np.ascontiguousarray(rows).view(np.uint8)
        if data.size != len(slots) * self.bytes_per_token:
            raise LayoutError(
                f"pool {self.name!r}: {data.size} row bytes for {len(slots)} slots of {self.bytes_per_token} B",
                field="rows",
            )
        data = data.reshape(len(slots), self.bytes_per_token)
        page, offset = np.divmod(slots, self.page_size)
        cut = 0
        for view, width in zip(self._slot_views(buf, slots), self._part_bytes()):
            view[page, offset] = data[:, cut : cut + width]
            cut += width

    def read_rows(self, buf: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Token rows ``(len(slots), bytes_per_token)`` uint8 read from cache slots."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        page, offset = np.divmod(slots, self.page_size)
        parts = [view[page, offset] for view in self._slot_views(buf, slots)]
        return np.concatenate(parts, axis=1)

    def _part_bytes(self) -> tuple[int, ...]:
        if self.layout == ROWS:
            return (self.bytes_per_token,)
        return (self.value_bytes_per_token, self.scale_bytes_per_token)

    def _slot_views(self, buf: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, ...]:
        """Writable ``(pages, page_size, part bytes)`` views: one for ``rows``,
        values and scales for ``values_then_scales``."""
        arr = np.asarray(buf)
        if not arr.flags["C_CONTIGUOUS"] or arr.nbytes % self.bytes_per_page:
            raise BufferSpecError(f"pool {self.name!r}: buffer is not whole contiguous pages", field="shape")
        pages = arr.reshape(-1).view(np.uint8).reshape(-1, self.bytes_per_page)
        num_slots = pages.shape[0] * self.page_size
        if len(slots) and (slots.min() < 0 or slots.max() >= num_slots):
            bad = slots[(slots < 0) | (slots >= num_slots)][0]
            raise PageRangeError(f"pool {self.name!r}: slot {bad} outside {num_slots} slots", field="slots")
        views, offset = [], 0
        for width in self._part_bytes():
            part = pages[:, offset:]
            views.append(
                np.lib.stride_tricks.as_strided(
                    part, shape=(pages.shape[0], self.page_size, width), strides=(self.bytes_per_page, width, 1)
                )
            )
            offset += self.page_size * width
        return tuple(views)


# DeepSeek V3 / V3.2 geometry (per token, per layer).
MLA_BF16_BYTES = 576 * 2  # kv_lora_rank 512 + rope 64, bf16
MLA_FP8_BYTES = 512 + 4 * 4 + 64 * 2  # 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656
INDEX_K_VALUE_BYTES = 128
INDEX_K_SCALE_BYTES = 4

PRESETS = ("deepseek-v3", "deepseek-v3-fp8", "deepseek-v3.2", "deepseek-v3.2-fp8")


def deepseek_pools(
    num_layers: int = 61,
    page_size: int = 64,
    kv_dtype: str = "bf16",
    index: bool = True,
    draft_layers: int = 1,
) -> dict[str, PoolSpec]:
    """Pool specs of the DeepSeek V3 (``index=False``) / V3.2 family for any
    number of layers and page size. Draft (NextN/EAGLE) layers are numbered
    after the target's: ``num_layers + i``."""
    if num_layers <= 0 or draft_layers < 0:
        raise LayoutError("num_layers must be positive and draft_layers non-negative", field="num_layers")
    if kv_dtype == "bf16":
        mla = dict(dtype="bfloat16", abi="bfloat16", bytes_per_token=MLA_BF16_BYTES, kernel_abi="mla-bf16")
    elif kv_dtype == "fp8":
        mla = dict(dtype="fp8_e4m3_with_scale", abi="uint8", bytes_per_token=MLA_FP8_BYTES, kernel_abi="mla-fp8-656")
    else:
        raise LayoutError(f"kv_dtype {kv_dtype!r} is not 'bf16' or 'fp8'", field="kv_dtype")
    target_ids = tuple(range(num_layers))
    pools = {"target": PoolSpec(name="target", page_size=page_size, layer_ids=target_ids, **mla)}
    if index:
        pools["index"] = PoolSpec(
            name="index",
            dtype="fp8_e4m3",
            abi="uint8",
            bytes_per_token=INDEX_K_VALUE_BYTES + INDEX_K_SCALE_BYTES,
            page_size=page_size,
            layer_ids=target_ids,
            layout=VALUES_THEN_SCALES,
            value_bytes_per_token=INDEX_K_VALUE_BYTES,
            scale_bytes_per_token=INDEX_K_SCALE_BYTES,
            kernel_abi="nsa-index-k-fp8-uint8",
        )
    if draft_layers:
        draft_ids = tuple(range(num_layers, num_layers + draft_layers))
        pools["draft"] = PoolSpec(name="draft", page_size=page_size, layer_ids=draft_ids, **mla)
    return pools


def preset_pools(preset: str, num_layers: int = 61, page_size: int = 64, draft_layers: int = 1) -> dict[str, PoolSpec]:
    """Pools of a named preset: ``deepseek-v3[-fp8]`` (no index K) or ``deepseek-v3.2[-fp8]``."""
    if preset not in PRESETS:
        raise LayoutError(f"unknown preset {preset!r}; presets are {', '.join(PRESETS)}", field="preset")
    return deepseek_pools(
        num_layers=num_layers,
        page_size=page_size,
        kv_dtype="fp8" if preset.endswith("-fp8") else "bf16",
        index=preset.startswith("deepseek-v3.2"),
        draft_layers=draft_layers,
    )
