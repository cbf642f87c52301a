"""The staging settings both sides' configs share (staged transfers: docs/staging.md)."""

from __future__ import annotations

from kvbridge.errors import ConfigError

STAGING_MODES = ("auto", "always", "never")
# Host pages. Decode's staging area: 64 MiB in 8 MiB slots, eight chunks in flight at once, which
# keeps a TCP or RDMA link busy while scatters run; a slot carries about 200 page-sized slices of
# a 42 KB latent page, far past where per-slice cost matters. Prefill's gather buffer: two slots,
# one gathering while the other is on the wire.
DEFAULT_SLOT_BYTES = 8 << 20
DEFAULT_BYTES = {"decode": 8 * DEFAULT_SLOT_BYTES, "prefill": 2 * DEFAULT_SLOT_BYTES}
# GPU pages: 256 MiB slots, four on decode and two per prefill rank (1 GiB and 512 MiB of the GPU).
# Smaller slots leave the slice kernel launch-bound (the staging ceiling of a 128K room: 77 / 295 /
# 587 GB/s at 16 / 64 / 256 MiB) and pay a transport's fixed cost per write (Mooncake's NVLink
# transport: 1.5-1.7 ms per batch) on fewer bytes; twice the slots at half the size (the same memory)
# measured no faster end to end (docs/performance.md, "Staged rooms with credits ..."). Host pages
# keep 8 MiB slots (staging_bench.py's figures). Both per role, set per rank by the configs.
DEFAULT_GPU_SLOT_BYTES = 256 << 20
DEFAULT_GPU_BYTES = {"decode": 4 * DEFAULT_GPU_SLOT_BYTES, "prefill": 2 * DEFAULT_GPU_SLOT_BYTES}


def check_staging(mode: str, nbytes: int, slot_bytes: int, rank: str, granted: int = 0) -> None:
    """A named ConfigError for a staging setting no endpoint can use (0: the default for the
    pages' device, ``staging_sizes``); ``granted``: decode's ``staging_granted_slots`` (whether
    any slot is left for the asks is known only once the area's size is: ``StagingBuffer``)."""
    if mode not in STAGING_MODES:
        raise ConfigError(f"staging must be one of {STAGING_MODES}, got {mode!r}", rank=rank, field="staging")
    for name, value in (("staging_bytes", nbytes), ("staging_slot_bytes", slot_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be a non-negative integer (0: the default for the pages' device), got "
                              f"{value!r}", rank=rank, field=name)
    if slot_bytes % 16 or (nbytes and slot_bytes and nbytes < slot_bytes):
        raise ConfigError(f"staging_slot_bytes {slot_bytes} must be a multiple of 16 and at most staging_bytes "
                          f"{nbytes}", rank=rank, field="staging_slot_bytes")
    if not isinstance(granted, int) or isinstance(granted, bool) or granted < 0:
        raise ConfigError(f"staging_granted_slots must be an integer >= 0 (0: none), got {granted!r}", rank=rank,
                          field="staging_granted_slots")


def staging_sizes(role: str, on_gpu: bool, nbytes: int, slot_bytes: int, rank: str) -> tuple[int, int]:
    """``(nbytes, slot_bytes)`` of a ``role`` rank's staging memory: what was set, and the
    default of the pages' device for what was left 0 (a set slot size keeps the default count
    of slots)."""
    default_slot = DEFAULT_GPU_SLOT_BYTES if on_gpu else DEFAULT_SLOT_BYTES
    default_bytes = (DEFAULT_GPU_BYTES if on_gpu else DEFAULT_BYTES)[role]
    slot = slot_bytes or default_slot
    size = nbytes or default_bytes // default_slot * slot
    if size < slot:
        raise ConfigError(f"staging_bytes {size} is smaller than one {slot}-byte slot", rank=rank,
                          field="staging_bytes")
    return size, slot
