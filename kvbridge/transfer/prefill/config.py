"""PrefillConfig: one prefill rank's settings (the endpoint's and its rooms')."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.transfer.staging_settings import DEFAULT_BYTES, DEFAULT_SLOT_BYTES, check_staging


@dataclass(frozen=True)
class PrefillConfig:
    instance: str
    dp_rank: int = 0
    cp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    lane_rule: str = "interleaved"
    host: str = "127.0.0.1"
    control_port: int = 0
    secret: bytes | None = None
    housekeeping_interval: float = 0.5  # how often closed, quiet rooms are forgotten
    lease_ttl: float = 10.0
    target_timeout: float = 60.0  # how long a room waits for its decode ranks to ask
    peer_timeout: float = 5.0  # a decode connection silent this long fails its targets (> decode's ping_interval)
    max_slices_per_call: int = 1024
    aux_slots: int = 1024
    aux_device: str = "cpu"  # aux staging rows; "cuda:N" for transports that move device memory only (NVLink)
    # Staged transfers (docs/staging.md): "auto" chooses per target (choose_path), "always"
    # stages every target whose decode rank offers a staging area, "never" writes directly.
    staging: str = "auto"
    # The gather buffer: registered host memory cut into slots of staging_slot_bytes; a chunk is
    # at most min(this slot, the decode rank's slot). Two slots keep a chunk gathering while
    # another is on the wire; the default matches the decode default's slot size.
    staging_bytes: int = DEFAULT_BYTES["prefill"]
    staging_slot_bytes: int = DEFAULT_SLOT_BYTES
    trace: bool = False

    def __post_init__(self) -> None:
        check_staging(self.staging, self.staging_bytes, self.staging_slot_bytes, self.rank_label)

    @property
    def rank_label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/cp{self.cp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"
