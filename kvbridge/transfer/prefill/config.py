"""PrefillConfig: one prefill rank's settings (the endpoint's and its rooms')."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.transfer.staging.settings import check_staging


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
    # Pipeline-parallel prefill (docs/pipeline.md): the target layers [start, end) this stage
    # holds and sends; required when pp_size > 1. Index-K layers follow the same split; draft
    # layers and the aux row belong to the last stage (kvbridge.layout.stages).
    pp_layers: tuple[int, int] | None = None
    lane_rule: str = "interleaved"
    host: str = "127.0.0.1"
    control_port: int = 0
    secret: bytes | None = None
    housekeeping_interval: float = 0.5  # how often closed, quiet rooms are forgotten
    lease_ttl: float = 10.0
    target_timeout: float = 60.0  # how long a room waits for its decode ranks to ask
    peer_timeout: float = 5.0  # a decode connection silent this long fails its targets (> decode's ping_interval)
    # a decode connection with nothing sent for this long is closed (0: never); its next room connects and
    # proves the decode rank's memory again, so keep it above decode's keepalive (40 s)
    idle_timeout: float = 120.0
    max_slices_per_call: int = 1024
    aux_slots: int = 1024
    aux_device: str = "cpu"  # aux staging rows; "cuda:N" for transports that move device memory only (NVLink)
    # Staged transfers (docs/staging.md): "auto" chooses per target (choose_path), "always"
    # stages every target whose decode rank offers a staging area, "never" writes directly.
    staging: str = "auto"
    # The gather buffer: registered memory beside the pages cut into slots of staging_slot_bytes;
    # a chunk is at most min(this slot, the decode rank's slot). Two slots keep a chunk gathering
    # while another is on the wire; the defaults (0) are the pages' device's and match decode's
    # slot size there (staging/settings.py).
    staging_bytes: int = 0
    staging_slot_bytes: int = 0
    trace: bool = False

    def __post_init__(self) -> None:
        check_staging(self.staging, self.staging_bytes, self.staging_slot_bytes, self.rank_label)
        if not self.idle_timeout >= 0:  # (NaN too)
            raise ConfigError(f"idle_timeout {self.idle_timeout!r} must be >= 0 seconds (0: never close an idle "
                              "connection)", rank=self.rank_label, field="idle_timeout")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"pp_rank {self.pp_rank} is outside pp_size {self.pp_size}", rank=self.rank_label,
                              field="pp_rank")
        if self.pp_layers is None:
            if self.pp_size > 1:
                raise ConfigError(f"pipeline stage pp{self.pp_rank} of {self.pp_size} needs pp_layers: the target "
                                  "layers [start, end) it holds and sends", rank=self.rank_label, field="pp_layers")
            return
        if (len(self.pp_layers) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in self.pp_layers)
                or not 0 <= self.pp_layers[0] < self.pp_layers[1]):
            raise ConfigError(f"pp_layers {self.pp_layers!r} must be two integers [start, end), 0 <= start < end",
                              rank=self.rank_label, field="pp_layers")

    @property
    def last_stage(self) -> bool:
        """The last pipeline stage: it holds the draft layers and writes the aux row."""
        return self.pp_rank == self.pp_size - 1

    @property
    def rank_label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/cp{self.cp_rank}/tp{self.tp_rank}/pp{self.pp_rank}"
