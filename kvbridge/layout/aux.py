"""The aux row: per-request metadata that travels beside the KV pages (hard rule 4).

It is written by the CP rank that owns the request's *last valid token*: only
that rank holds the last hidden state (what EAGLE/NextN drafts from). Whether the
hidden state is CP-local is an explicit field, never inferred from a shape.

One row is a little-endian numpy structured record with natural alignment:

    room u64 | first_token i32 | num_cached_tokens i32 | hidden_is_cp_local u8 | pad |
    topk i32 | topk_ids i32[K] | topk_probs f32[K] | hidden (bf16 bits u16 | f32)[H] | pad
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError
from kvbridge.layout.lanes import OwnerLanes

# hidden-state element type -> how it is stored (bf16 travels as its uint16 bits)
HIDDEN_DTYPES = {"bfloat16": "<u2", "float32": "<f4"}
MAX_ROOM = 2**63 - 1


def aux_dtype(hidden_size: int, hidden_dtype: str = "bfloat16", topk: int = 1) -> np.dtype:
    """The structured dtype of one aux row."""
    if hidden_dtype not in HIDDEN_DTYPES:
        raise LayoutError(
            f"aux hidden dtype {hidden_dtype!r} is not one of {tuple(HIDDEN_DTYPES)}", field="hidden_dtype"
        )
    if hidden_size < 0 or topk < 0:
        raise LayoutError(f"aux hidden_size {hidden_size} and topk {topk} must be non-negative", field="hidden_size")
    fields = [
        ("room", "<u8"),
        ("first_token", "<i4"),
        ("num_cached_tokens", "<i4"),
        ("hidden_is_cp_local", "u1"),
        ("topk", "<i4"),
        ("topk_ids", "<i4", (topk,)),
        ("topk_probs", "<f4", (topk,)),
        ("hidden", HIDDEN_DTYPES[hidden_dtype], (hidden_size,)),
    ]
    return np.dtype(fields, align=True)


def owner_of_last_token(num_tokens: int, page_size: int, lanes: OwnerLanes) -> int:
    """The CP rank that owns the request's last valid token, and so writes the aux row."""
    if num_tokens <= 0 or page_size <= 0:
        raise LayoutError(f"num_tokens {num_tokens} and page_size {page_size} must be positive", field="num_tokens")
    return lanes.owner_of_token(num_tokens - 1, page_size, -(-num_tokens // page_size))


@dataclass(frozen=True, eq=False)
class AuxRow:
    """One decoded aux row; ``topk_ids``/``topk_probs`` hold the ``topk`` valid entries."""

    room: int
    first_token: int
    num_cached_tokens: int
    hidden_is_cp_local: bool
    topk_ids: np.ndarray
    topk_probs: np.ndarray
    hidden: np.ndarray  # stored form: uint16 bf16 bits or float32
    hidden_dtype: str = "bfloat16"

    @property
    def hidden_float32(self) -> np.ndarray:
        if self.hidden_dtype == "float32":
            return self.hidden.astype(np.float32)
        return (self.hidden.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class AuxSchema:
    """Shape of the aux row; ``to_dict()`` goes into the runtime contract."""

    hidden_size: int
    hidden_dtype: str = "bfloat16"
    topk: int = 1

    def __post_init__(self) -> None:
        aux_dtype(self.hidden_size, self.hidden_dtype, self.topk)  # validates

    @property
    def dtype(self) -> np.dtype:
        return aux_dtype(self.hidden_size, self.hidden_dtype, self.topk)

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        dt = self.dtype
        fields = [
            {"name": name, "dtype": sub.base.str, "shape": list(sub.shape), "offset": int(off)}
            for name, (sub, off) in dt.fields.items()
        ]
        return {
            "hidden_size": self.hidden_size,
            "hidden_dtype": self.hidden_dtype,
            "topk": self.topk,
            "row_bytes": dt.itemsize,
            "fields": fields,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AuxSchema:
        schema = cls(int(d["hidden_size"]), str(d["hidden_dtype"]), int(d["topk"]))
        if "fields" in d and schema.to_dict() != dict(d):
            raise LayoutError("aux schema fields do not match its hidden_size/hidden_dtype/topk", field="aux")
        return schema

    def pack(
        self,
        *,
        room: int,
        first_token: int,
        num_cached_tokens: int,
        hidden_is_cp_local: bool,
        hidden: np.ndarray,
        topk_ids: Any = (),
        topk_probs: Any = (),
    ) -> np.ndarray:
        """One row as a ``(1,)`` structured array; ``.view(np.uint8)`` gives its bytes."""
        if not isinstance(hidden_is_cp_local, (bool, np.bool_)):
            raise LayoutError("hidden_is_cp_local must be stated explicitly as a bool", field="hidden_is_cp_local")
        if not 0 <= room <= MAX_ROOM:
            raise LayoutError(f"room {room} is not a 63-bit id", room=room, field="room")
        if num_cached_tokens < 0 or not -(2**31) <= first_token < 2**31 or num_cached_tokens >= 2**31:
            raise LayoutError(
                f"first_token {first_token} / num_cached_tokens {num_cached_tokens} out of int32 range",
                room=room,
                field="first_token",
            )
        ids = np.asarray(topk_ids, dtype=np.int32).reshape(-1)
        probs = np.asarray(topk_probs, dtype=np.float32).reshape(-1)
        if len(ids) != len(probs) or len(ids) > self.topk:
            raise LayoutError(
                f"{len(ids)} top-k ids and {len(probs)} probs for a schema of top-k {self.topk}",
                room=room,
                field="topk",
            )
        row = np.zeros(1, dtype=self.dtype)
        row["room"], row["first_token"], row["num_cached_tokens"] = room, first_token, num_cached_tokens
        row["hidden_is_cp_local"], row["topk"] = int(hidden_is_cp_local), len(ids)
        row["topk_ids"][0, : len(ids)], row["topk_probs"][0, : len(probs)] = ids, probs
        row["hidden"][0] = self._stored_hidden(hidden, room)
        return row

    def unpack(self, data: Any) -> AuxRow:
        """Decode one row from bytes, a uint8 array or a structured array."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            arr = np.frombuffer(data, dtype=np.uint8)
        else:
            arr = np.asarray(data)  # numpy array, or anything with __array__ (a CPU tensor)
        if arr.nbytes != self.row_bytes:
            raise LayoutError(f"aux row of {arr.nbytes} bytes, the schema's rows are {self.row_bytes}", field="aux")
        rec = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).view(self.dtype)[0]
        count, flag = int(rec["topk"]), int(rec["hidden_is_cp_local"])
        room = int(rec["room"])
        if not 0 <= count <= self.topk or flag not in (0, 1):
            raise LayoutError(f"corrupt aux row: topk count {count}, hidden_is_cp_local {flag}", room=room, field="aux")
        return AuxRow(
            room=room,
            first_token=int(rec["first_token"]),
            num_cached_tokens=int(rec["num_cached_tokens"]),
            hidden_is_cp_local=bool(flag),
            topk_ids=np.array(rec["topk_ids"][:count]),
            topk_probs=np.array(rec["topk_probs"][:count]),
            hidden=np.array(rec["hidden"]),
            hidden_dtype=self.hidden_dtype,
        )

    def _stored_hidden(self, hidden: Any, room: int) -> np.ndarray:
        h = np.asarray(hidden).reshape(-1)
        if h.shape != (self.hidden_size,):
            raise LayoutError(
                f"hidden state of {h.size} elements, expected {self.hidden_size}", room=room, field="hidden"
            )
        if self.hidden_dtype == "bfloat16" and h.dtype == np.uint16:
            return h  # already bf16 bits
        if not np.issubdtype(h.dtype, np.floating):
            raise LayoutError(
                f"hidden state dtype {h.dtype} is not floating (or uint16 bf16 bits)", room=room, field="hidden"
            )
        if self.hidden_dtype == "float32":
            return h.astype(np.float32)
        return float32_to_bf16_bits(h)


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
