"""The aux row: per-request metadata that travels beside the KV pages (hard rule 4).

It is written by the CP rank that owns the request's *last valid token*: only
that rank holds the last hidden state (what EAGLE/NextN drafts from). Whether
the hidden state is CP-local is an explicit field, never inferred from a shape.

An aux row is an ordered list of named **regions** (``AuxRegion(name, dtype,
shape)``). Region ``room`` (uint64, first element = the room id) is mandatory:
decode commits a room only when it reads its own id there (the echo). Storage
on either side is one packed row (the regions in order, each naturally aligned,
``AuxSchema.dtype``) or one tensor per region (``[rows, *shape]``, as SGLang's
``MetadataBuffers`` keep them); either way a region's bytes are the same.

``AuxSchema.standard(hidden_size, hidden_dtype, topk)`` is the DeepSeek row:

    room u64 | first_token i32 | num_cached_tokens i32 | hidden_is_cp_local u8 | pad |
    topk i32 | topk_ids i32[K] | topk_probs f32[K] | hidden (bf16 | f32)[H] | pad
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError
from kvbridge.layout.lanes import OwnerLanes

# region element type -> little-endian storage (bf16 travels as its uint16 bits)
AUX_DTYPES = {
    "uint8": "u1", "int8": "i1", "uint16": "<u2", "int16": "<i2", "uint32": "<u4", "int32": "<i4",
    "uint64": "<u8", "int64": "<i8", "float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float64": "<f8",
}  # fmt: skip
HIDDEN_DTYPES = ("bfloat16", "float32")
MAX_ROOM = 2**63 - 1
ROOM = "room"
STANDARD_REGIONS = (
    "room", "first_token", "num_cached_tokens", "hidden_is_cp_local", "topk", "topk_ids", "topk_probs", "hidden",
)  # fmt: skip


@dataclass(frozen=True)
class AuxRegion:
    """One named part of the aux row: ``shape`` elements of ``dtype`` per row."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 64:
            raise LayoutError(f"aux region name must be a non-empty string of <= 64 chars, got {self.name!r}",
                              field="aux.regions")
        if self.dtype not in AUX_DTYPES:
            raise LayoutError(f"aux region {self.name!r}: dtype {self.dtype!r} is not one of {tuple(AUX_DTYPES)}",
                              field=f"aux.regions.{self.name}.dtype")
        shape = tuple(self.shape) if isinstance(self.shape, (list, tuple)) else (self.shape,)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise LayoutError(f"aux region {self.name!r}: shape {self.shape!r} must be non-negative integers",
                              field=f"aux.regions.{self.name}.shape")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    # derived once: a region is immutable, and rows are packed and checked on every room
    @functools.cached_property
    def storage(self) -> np.dtype:
        """The numpy type one element is stored as."""
        return np.dtype(AUX_DTYPES[self.dtype])

    @functools.cached_property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of this region in one row."""
        return self.storage.itemsize * self.count


@dataclass(frozen=True, eq=False)
class AuxRow:
    """One decoded standard aux row; ``topk_ids``/``topk_probs`` hold the ``topk`` valid entries."""

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
    """The aux row as ordered regions; ``to_dict()`` goes into the runtime contract."""

    regions: tuple[AuxRegion, ...]

    def __post_init__(self) -> None:
        regions = tuple(self.regions)
        if not regions or not all(isinstance(r, AuxRegion) for r in regions):
            raise LayoutError("an aux schema is a non-empty sequence of AuxRegion", field="aux.regions")
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise LayoutError(f"aux region names must be distinct: {names}", field="aux.regions")
        room = next((r for r in regions if r.name == ROOM), None)
        if room is None or room.dtype != "uint64" or room.count < 1:
            raise LayoutError("an aux schema needs region 'room' (uint64, first element = the room id): decode "
                              "commits a room only when the row echoes its id (hard rule 4)", field="aux.regions.room")
        object.__setattr__(self, "regions", regions)

    @classmethod
    def standard(cls, hidden_size: int, hidden_dtype: str = "bfloat16", topk: int = 1) -> AuxSchema:
        """The DeepSeek (EAGLE/NextN) row: first token, cached-token count, explicit
        ``hidden_is_cp_local``, top-k draft candidates and the last hidden state."""
        if hidden_dtype not in HIDDEN_DTYPES:
            raise LayoutError(f"aux hidden dtype {hidden_dtype!r} is not one of {HIDDEN_DTYPES}", field="hidden_dtype")
        if hidden_size < 0 or topk < 0:
            raise LayoutError(f"aux hidden_size {hidden_size} and topk {topk} must be non-negative", field="hidden_size")
        return cls((
            AuxRegion("room", "uint64"), AuxRegion("first_token", "int32"), AuxRegion("num_cached_tokens", "int32"),
            AuxRegion("hidden_is_cp_local", "uint8"), AuxRegion("topk", "int32"),
            AuxRegion("topk_ids", "int32", (topk,)), AuxRegion("topk_probs", "float32", (topk,)),
            AuxRegion("hidden", hidden_dtype, (hidden_size,)),
        ))  # fmt: skip

    # -- derived ----------------------------------------------------------------

    @functools.cached_property
    def dtype(self) -> np.dtype:
        """The packed row: a little-endian structured dtype, regions naturally aligned."""
        return np.dtype([(r.name, r.storage, r.shape) for r in self.regions], align=True)

    @functools.cached_property
    def row_bytes(self) -> int:
        return int(self.dtype.itemsize)

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each region inside the packed row."""
        return {name: int(self.dtype.fields[name][1]) for name in self.dtype.names}

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    @functools.cached_property
    def _by_name(self) -> dict[str, AuxRegion]:
        return {r.name: r for r in self.regions}

    def region(self, name: str) -> AuxRegion:
        r = self._by_name.get(name)
        if r is not None:
            return r
        raise LayoutError(f"aux schema has no region {name!r}; regions are {list(self.names)}", field="aux.regions")

    @functools.cached_property
    def is_standard(self) -> bool:
        return self.names == STANDARD_REGIONS and self.region("room").shape == ()

    # -- the contract's form ----------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "regions": [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape), "offset": self.offsets[r.name],
                         "nbytes": r.nbytes} for r in self.regions],
            "row_bytes": self.row_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AuxSchema:
        """The inverse of ``to_dict``; offsets and sizes, when present, must agree."""
        try:
            schema = cls(tuple(AuxRegion(r["name"], r["dtype"], tuple(r.get("shape", ()))) for r in d["regions"]))
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"an aux schema dict is {{'regions': [{{name, dtype, shape}}, ...]}}: {exc!r}",
                              field="aux") from None
        if dict(d) != schema.to_dict() and ("row_bytes" in d or any("offset" in r for r in d["regions"])):
            raise LayoutError(f"aux schema offsets/sizes do not match its regions (row_bytes {d.get('row_bytes')} "
                              f"vs {schema.row_bytes})", field="aux.row_bytes")
        return schema

    # -- rows -------------------------------------------------------------------

    def pack(self, *, room: int, **values: Any) -> np.ndarray:
        """One row as a ``(1,)`` structured array (``.view(np.uint8)`` gives its bytes).
        The standard schema takes its named fields (``hidden_is_cp_local`` explicit);
        any other schema takes one array per region, missing regions stay zero."""
        _check_room(room)
        if self.is_standard:
            return self._pack_standard(room=room, **values)
        row = np.zeros(1, dtype=self.dtype)
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise LayoutError(f"no aux regions {unknown}; regions are {list(self.names)}", room=room, field="aux")
        for name, value in values.items():
            row[name][0] = _stored(self.region(name), value, room)
        row[ROOM].reshape(-1)[0] = room
        return row

    def _pack_standard(self, *, room: int, first_token: int, num_cached_tokens: int, hidden_is_cp_local: bool,
                       hidden: Any, topk_ids: Any = (), topk_probs: Any = ()) -> np.ndarray:
        if not isinstance(hidden_is_cp_local, (bool, np.bool_)):
            raise LayoutError("hidden_is_cp_local must be stated explicitly as a bool", field="hidden_is_cp_local")
        if num_cached_tokens < 0 or not -(2**31) <= first_token < 2**31 or num_cached_tokens >= 2**31:
            raise LayoutError(f"first_token {first_token} / num_cached_tokens {num_cached_tokens} out of int32 range",
                              room=room, field="first_token")
        topk = self.region("topk_ids").count
        ids = np.asarray(topk_ids, dtype=np.int32).reshape(-1)
        probs = np.asarray(topk_probs, dtype=np.float32).reshape(-1)
        if len(ids) != len(probs) or len(ids) > topk:
            raise LayoutError(f"{len(ids)} top-k ids and {len(probs)} probs for a schema of top-k {topk}",
                              room=room, field="topk")
        row = np.zeros(1, dtype=self.dtype)
        row["room"], row["first_token"], row["num_cached_tokens"] = room, first_token, num_cached_tokens
        row["hidden_is_cp_local"], row["topk"] = int(hidden_is_cp_local), len(ids)
        row["topk_ids"][0, : len(ids)], row["topk_probs"][0, : len(probs)] = ids, probs
        row["hidden"][0] = _stored(self.region("hidden"), hidden, room)
        return row

    def record(self, data: Any) -> np.void:
        """One packed row (bytes, a uint8 array, a structured array, a CPU tensor) as a record."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            arr = np.frombuffer(data, dtype=np.uint8)
        else:
            arr = np.asarray(data)
        if arr.nbytes != self.row_bytes:
            raise LayoutError(f"aux row of {arr.nbytes} bytes, the schema's rows are {self.row_bytes}", field="aux")
        return np.ascontiguousarray(arr).reshape(-1).view(np.uint8).view(self.dtype)[0]

    def room_of(self, data: Any) -> int:
        """The room id a packed row echoes."""
        return int(np.asarray(self.record(data)[ROOM]).reshape(-1)[0])

    def unpack_regions(self, data: Any) -> dict[str, np.ndarray]:
        """Every region of a packed row, as arrays of its shape (stored form)."""
        rec = self.record(data)
        return {r.name: np.array(rec[r.name]) for r in self.regions}

    def check_row(self, data: Any) -> np.void:
        """The row as a record, after the checks ``unpack`` makes (a standard row's top-k count
        and flag in range; LayoutError names them): a row that passes unpacks without error."""
        rec = self.record(data)
        if self.is_standard:
            count, flag = int(rec["topk"]), int(rec["hidden_is_cp_local"])
            if not 0 <= count <= self.region("topk_ids").count or flag not in (0, 1):
                raise LayoutError(f"corrupt aux row: topk count {count}, hidden_is_cp_local {flag}",
                                  room=int(rec["room"]), field="aux")
        return rec

    def head(self, row: Any) -> tuple[int, str | None]:
        """The room a packed row (``row_bytes`` contiguous bytes) echoes, and what ``unpack`` would
        refuse in it (None: nothing), read with one ``struct`` call: a decode rank's commit checks
        every row, and decodes it only when the engine reads it (``check_row`` is the same test)."""
        fmt, standard = self._head_format
        values = fmt.unpack_from(row)
        if not standard:
            return values[0], None
        room, flag, count = values
        if not 0 <= count <= self.region("topk_ids").count or flag not in (0, 1):
            return room, f"corrupt aux row: topk count {count}, hidden_is_cp_local {flag}"
        return room, None

    @functools.cached_property
    def _head_format(self) -> tuple[struct.Struct, bool]:
        """``room`` (its first element); for the standard row also the flag and the top-k count."""
        fields = [(self.offsets[ROOM], "Q")]
        if self.is_standard:
            fields += [(self.offsets["hidden_is_cp_local"], "B"), (self.offsets["topk"], "i")]
        fmt, at = "<", 0
        for off, code in sorted(fields):  # (the standard row's regions lie in this order)
            fmt += f"{off - at}x{code}" if off > at else code
            at = off + struct.calcsize("<" + code)
        return struct.Struct(fmt), self.is_standard

    def unpack(self, data: Any) -> AuxRow:
        """Decode one standard row (see ``unpack_regions`` for any schema)."""
        if not self.is_standard:
            raise LayoutError("unpack() decodes the standard aux row; use unpack_regions() for this schema",
                              field="aux")
        rec = self.check_row(data)
        count, flag, room = int(rec["topk"]), int(rec["hidden_is_cp_local"]), int(rec["room"])
        return AuxRow(
            room=room, first_token=int(rec["first_token"]), num_cached_tokens=int(rec["num_cached_tokens"]),
            hidden_is_cp_local=bool(flag), topk_ids=np.array(rec["topk_ids"][:count]),
            topk_probs=np.array(rec["topk_probs"][:count]), hidden=np.array(rec["hidden"]),
            hidden_dtype=self.region("hidden").dtype,
        )  # fmt: skip

    def pack_row(self, row: AuxRow | Mapping[str, Any] | np.ndarray, room: int) -> np.ndarray:
        """An ``AuxRow``, a ``{region: value}`` mapping, or an already packed row (structured
        or ``row_bytes`` uint8) as one packed row; the row must echo ``room``."""
        if isinstance(row, AuxRow):
            packed = self.pack(room=row.room, first_token=row.first_token, num_cached_tokens=row.num_cached_tokens,
                               hidden_is_cp_local=row.hidden_is_cp_local, hidden=row.hidden,
                               topk_ids=row.topk_ids, topk_probs=row.topk_probs)
        elif isinstance(row, Mapping):
            values = dict(row)
            given = values.pop(ROOM, room)
            packed = self.pack(room=int(np.asarray(given).reshape(-1)[0]), **values)
        else:
            arr = np.asarray(row)
            if arr.dtype != self.dtype and not (arr.dtype == np.uint8 and arr.size == self.row_bytes):
                raise LayoutError(f"packed aux row of dtype {arr.dtype} and {arr.nbytes} bytes; expected the "
                                  f"schema's {self.row_bytes}-byte rows", room=room, field="aux")
            packed = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).view(self.dtype).copy()
        echoed = self.room_of(packed)
        if echoed != room:
            raise LayoutError(f"aux row carries room {echoed}", room=room, field="aux.room")
        return packed


def _check_room(room: int) -> None:
    if not isinstance(room, (int, np.integer)) or not 0 <= room <= MAX_ROOM:
        raise LayoutError(f"room {room} is not a 63-bit id", room=None, field="room")


def _stored(region: AuxRegion, value: Any, room: int) -> np.ndarray:
    """``value`` as the region's stored form (floats become bf16 bits for a bfloat16 region)."""
    v = np.asarray(value)
    if v.size != region.count:
        what = "hidden state" if region.name == "hidden" else f"aux region {region.name!r}"
        raise LayoutError(f"{what} of {v.size} elements, expected {region.count}", room=room, field=region.name)
    v = v.reshape(region.shape)
    if region.dtype == "bfloat16":
        if v.dtype == np.uint16:
            return v  # already bf16 bits
        if not np.issubdtype(v.dtype, np.floating):
            raise LayoutError(f"{region.name} dtype {v.dtype} is not floating (or uint16 bf16 bits)", room=room,
                              field=region.name)
        return float32_to_bf16_bits(v)
    if region.name == "hidden" and not np.issubdtype(v.dtype, np.floating):
        raise LayoutError(f"hidden state dtype {v.dtype} is not floating", room=room, field="hidden")
    return v.astype(region.storage)


def aux_dtype(hidden_size: int, hidden_dtype: str = "bfloat16", topk: int = 1) -> np.dtype:
    """The packed dtype of the standard row (``AuxSchema.standard(...).dtype``)."""
    return AuxSchema.standard(hidden_size, hidden_dtype, topk).dtype


def owner_of_last_token(num_tokens: int, page_size: int, lanes: OwnerLanes) -> int:
    """The CP rank that owns the request's last valid token, and so writes the aux row."""
    if num_tokens <= 0 or page_size <= 0:
        raise LayoutError(f"num_tokens {num_tokens} and page_size {page_size} must be positive", field="num_tokens")
    return lanes.owner_of_token(num_tokens - 1, page_size, -(-num_tokens // page_size))


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; NaN stays NaN."""
    arr = np.ascontiguousarray(values, dtype=np.float32)
    bits = arr.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(arr), np.uint16(0x7FC0), rounded)
