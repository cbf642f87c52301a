"""The staging settings both sides' configs share (staged transfers: docs/staging.md)."""

from __future__ import annotations

from kvbridge.errors import ConfigError

STAGING_MODES = ("auto", "always", "never")
# Decode's staging area: 64 MiB in 8 MiB slots, eight chunks in flight at once, which keeps a TCP or
# RDMA link busy while scatters run; a slot carries about 200 page-sized slices of a 42 KB latent
# page, far past where per-slice cost matters. Prefill's gather buffer: two slots, one gathering
# while the other is on the wire.
DEFAULT_SLOT_BYTES = 8 << 20
DEFAULT_BYTES = {"decode": 8 * DEFAULT_SLOT_BYTES, "prefill": 2 * DEFAULT_SLOT_BYTES}


def check_staging(mode: str, nbytes: int, slot_bytes: int, rank: str) -> None:
    """A named ConfigError for a staging setting no endpoint can use."""
    if mode not in STAGING_MODES:
        raise ConfigError(f"staging must be one of {STAGING_MODES}, got {mode!r}", rank=rank, field="staging")
    for name, value in (("staging_bytes", nbytes), ("staging_slot_bytes", slot_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}", rank=rank, field=name)
    if slot_bytes % 16 or nbytes < slot_bytes:
        raise ConfigError(f"staging_slot_bytes {slot_bytes} must be a multiple of 16 and at most staging_bytes "
                          f"{nbytes}", rank=rank, field="staging_slot_bytes")
