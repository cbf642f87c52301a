"""Synthetic KV: bytes that a decode rank can check without a model.

Every byte is a pure function of (room, pool, layer, token, byte):

    token_bytes(room, pool, layer, tokens)[t, j] = mix(seed, token_t)[j % 8] ^ pattern(seed)[j]
    seed = splitmix64(room, crc32(pool), layer)

``mix`` is a bijection of the token number, so two tokens never carry the same
bytes and a page landing on the wrong slot, layer or pool is caught. A
head-sharded pool's rank holds its heads' bytes of the whole row (the row is
generated whole, then sliced), so a decode TP rank checks its head slice
whatever the prefill TP size was. Pages are
laid out like the pool's kernels expect (``PoolSpec.row_ranges``):

    rows                 [tok0 | tok1 | ... ]
    values_then_scales   [values tok0..ps-1 | scales tok0..ps-1]

Rows past the request's last token are *compute padding* on the prefill side
(filled with PAD_BYTE); a decode rank pre-fills the last destination page with
SENTINEL_BYTE, so after a transfer those rows must still read SENTINEL_BYTE
(hard rule 1: dummy rows are never written).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.layout.aux import AuxRow, AuxSchema
from kvbridge.layout.pools import ROWS, PoolSpec

PAD_BYTE = 0xEE  # prefill: compute-padding rows (must never arrive)
SENTINEL_BYTE = 0x5A  # decode: what a destination row holds until a valid row lands

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser (a bijection on uint64)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def stream_seed(room: int, pool: str, layer_id: int) -> np.uint64:
    key = np.array([room & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    key = splitmix64(key ^ np.uint64(zlib.crc32(pool.encode())))
    key = splitmix64(key ^ np.uint64(layer_id & 0xFFFFFFFF))
    return key[0]


def token_bytes(room: int, pool: str, layer_id: int, tokens: np.ndarray, bytes_per_token: int) -> np.ndarray:
    """The ``bytes_per_token`` bytes of each token in ``tokens``: shape (len(tokens), bytes_per_token), uint8."""
    seed = stream_seed(room, pool, layer_id)
    words = -(-bytes_per_token // 8)
    pattern = splitmix64(seed ^ np.arange(1, words + 1, dtype=np.uint64)).view(np.uint8)[:bytes_per_token]
    with np.errstate(over="ignore"):
        tok = splitmix64(np.asarray(tokens, dtype=np.uint64) * _M2 + seed)
    tok8 = tok.view(np.uint8).reshape(-1, 8)
    return np.tile(tok8, (1, words))[:, :bytes_per_token] ^ pattern


def rows_to_pages(spec: PoolSpec, rows: np.ndarray) -> np.ndarray:
    """Lay ``(num_pages * page_size, bytes_per_token)`` token rows out as pages ``(num_pages, bytes_per_page)``."""
    num_pages = rows.shape[0] // spec.page_size
    if spec.layout == ROWS:
        return rows.reshape(num_pages, spec.bytes_per_page)
    v = spec.value_bytes_per_token
    values = rows[:, :v].reshape(num_pages, spec.page_size * v)
    scales = rows[:, v:].reshape(num_pages, spec.page_size * spec.scale_bytes_per_token)
    return np.concatenate([values, scales], axis=1)


def page_images(
    spec: PoolSpec, room: int, layer_id: int, logical_pages: np.ndarray, num_tokens: int, fill: int
) -> np.ndarray:
    """Expected page images of ``logical_pages``; rows at or past ``num_tokens`` hold ``fill``."""
    logical_pages = np.asarray(logical_pages, dtype=np.int64)
    tokens = (logical_pages[:, None] * spec.page_size + np.arange(spec.page_size)).reshape(-1)
    rows = token_bytes(room, spec.name, layer_id, tokens, spec.full_bytes_per_token)
    if spec.head_sharded:  # this rank's heads of the whole row
        rows = np.ascontiguousarray(rows[:, spec.head_start * spec.head_bytes : spec.head_stop * spec.head_bytes])
    rows[tokens >= num_tokens] = fill
    return rows_to_pages(spec, rows)


def as_bytes(buf, bytes_per_page: int | None = None) -> np.ndarray:
    """A ``(pages, bytes_per_page)`` uint8 numpy view of a torch tensor or numpy array (no copy).
    Without ``bytes_per_page`` the first dimension is taken as pages; with it, any contiguous
    buffer of whole pages (token-major ``[pages * page_size, ...]`` too)."""
    if hasattr(buf, "numpy"):  # torch.Tensor of any dtype (bf16 has no numpy twin)
        import torch

        buf = buf.view(torch.uint8).numpy()
    arr = np.asarray(buf)
    if bytes_per_page is not None:
        return arr.reshape(-1).view(np.uint8).reshape(-1, bytes_per_page)
    return arr.view(np.uint8).reshape(arr.shape[0], -1)


def fill_pages(
    spec: PoolSpec, buf, room: int, layer_id: int, logical_pages: np.ndarray, local_pages: np.ndarray, num_tokens: int
) -> None:
    """Prefill side: store the synthetic KV of ``logical_pages`` at ``local_pages``; padding rows get PAD_BYTE."""
    if len(logical_pages):
        as_bytes(buf, spec.bytes_per_page)[np.asarray(local_pages)] = page_images(spec, room, layer_id, logical_pages, num_tokens, PAD_BYTE)


def prepare_destination(spec: PoolSpec, buf, page_ids: np.ndarray, num_tokens: int) -> None:
    """Decode side, before a transfer: the last page's tail rows get SENTINEL_BYTE (only a partial page has any)."""
    num_pages = len(page_ids)
    if num_pages and num_tokens % spec.page_size:
        as_bytes(buf, spec.bytes_per_page)[int(page_ids[num_pages - 1])] = SENTINEL_BYTE


@dataclass(frozen=True)
class Verdict:
    """Outcome of checking one pool layer of one room. ``bytes_checked`` counts the valid
    bytes (what a transfer writes); the untouched padding rows are checked on top."""

    bytes_checked: int
    bad_bytes: int = 0
    first_error: str = ""

    @property
    def ok(self) -> bool:
        return self.bad_bytes == 0


def verify_pages(spec: PoolSpec, buf, room: int, layer_id: int, page_ids: np.ndarray, num_tokens: int,
                 first_page: int = 0) -> Verdict:
    """Decode side: check every byte of the room's pages (``page_ids[i]`` holds logical page
    ``first_page + i``; pages below ``first_page`` are a decode prefix, not checked here).

    Valid rows must equal the synthetic KV; tail rows of a partial last page
    must still hold SENTINEL_BYTE (see ``prepare_destination``)."""
    page_ids = np.asarray(page_ids, dtype=np.int64)
    logical = np.arange(first_page, first_page + len(page_ids))
    expected = page_images(spec, room, layer_id, logical, num_tokens, SENTINEL_BYTE)
    actual = as_bytes(buf, spec.bytes_per_page)[page_ids]
    diff = actual != expected
    bad = int(np.count_nonzero(diff))
    checked = max(0, num_tokens - first_page * spec.page_size) * spec.bytes_per_token
    if not bad:
        return Verdict(checked)
    row, offset = (int(i) for i in np.argwhere(diff)[0])
    page = first_page + row
    token, part = _locate(spec, page, offset)
    what = "padding row written" if token >= num_tokens else "valid row wrong"
    return Verdict(
        checked,
        bad,
        f"room {room} pool {spec.name} layer {layer_id}: {bad} bad bytes; first at logical page {page} "
        f"(slot {int(page_ids[row])}) byte {offset} = token {token} {part}: {what}, "
        f"expected {int(expected[row, offset]):#04x} got {int(actual[row, offset]):#04x}",
    )


def _locate(spec: PoolSpec, page: int, offset: int) -> tuple[int, str]:
    """Token number and part (row/value/scale) of byte ``offset`` of logical page ``page``."""
    if spec.layout == ROWS:
        return page * spec.page_size + offset // spec.bytes_per_token, "row"
    if offset < spec.scale_offset:
        return page * spec.page_size + offset // spec.value_bytes_per_token, "value"
    return page * spec.page_size + (offset - spec.scale_offset) // spec.scale_bytes_per_token, "scale"


# ---- the aux row -------------------------------------------------------------------------------
VOCAB = 129_280  # DeepSeek V3 vocabulary


def aux_fields(schema: AuxSchema, room: int, num_tokens: int) -> dict:
    """Synthetic aux row of a room: the standard row's fields, or for any other schema
    deterministic bytes in every region (the ``room`` region echoes the room)."""
    seed = stream_seed(room, "aux", 0)
    if not schema.is_standard:
        out: dict = {}
        for i, region in enumerate(schema.regions):
            if region.name == "room":
                continue
            words = splitmix64(np.arange(-(-region.nbytes // 8), dtype=np.uint64) + seed + np.uint64(i << 32))
            out[region.name] = words.view(np.uint8)[: region.nbytes].view(region.storage).reshape(region.shape)
        return dict(room=room, **out)
    hidden_size, topk = schema.region("hidden").count, schema.region("topk_ids").count
    words = splitmix64(np.arange(hidden_size + 2 * topk + 1, dtype=np.uint64) + seed)
    ids = (words[1 : 1 + topk] % np.uint64(VOCAB)).astype(np.int32)
    probs = (words[1 + topk : 1 + 2 * topk] % np.uint64(1000)).astype(np.float32) / 1000
    rest = words[1 + 2 * topk :]
    if schema.region("hidden").dtype == "bfloat16":
        hidden = (rest & np.uint64(0x3FFF)).astype(np.uint16)  # finite bf16 bit patterns
    else:
        hidden = (rest % np.uint64(1 << 20)).astype(np.float32) / (1 << 20)
    return dict(
        room=room,
        first_token=int(words[0] % np.uint64(VOCAB)),
        num_cached_tokens=num_tokens,
        hidden_is_cp_local=True,
        hidden=hidden,
        topk_ids=ids,
        topk_probs=probs,
    )


def make_aux(schema: AuxSchema, room: int, num_tokens: int) -> np.ndarray:
    """The room's synthetic aux row, packed."""
    return schema.pack(**aux_fields(schema, room, num_tokens))


def verify_aux(schema: AuxSchema, row: Any, room: int, num_tokens: int) -> str:
    """'' when the received aux row (an ``AuxRow``, region arrays, or packed bytes) is the
    room's synthetic one, else which region differs."""
    if row is None:
        return f"room {room}: no aux row"
    if isinstance(row, AuxRow):
        row = schema.pack_row(row, row.room)
    got = row if isinstance(row, dict) else schema.unpack_regions(row)
    want = schema.unpack_regions(make_aux(schema, room, num_tokens))
    for name, value in want.items():
        if np.asarray(got.get(name)).tobytes() != value.tobytes():
            shown = got.get(name) if value.size == 1 else "differs"
            return f"room {room}: aux {name} = {shown!r}, expected {value!r}" if value.size == 1 \
                else f"room {room}: aux {name} differs"
    return ""
