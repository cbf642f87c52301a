"""The staging settings both sides' configs share (staged transfers: docs/staging.md)."""

from __future__ import annotations

from kvbridge.errors import ConfigError

STAGING_MODES = ("auto", "always", "never")


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
