"""DecodeConfig: one decode rank's settings (the endpoint's and its rooms')."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.transfer.staging.settings import check_staging


@dataclass(frozen=True)
class DecodeConfig:
    instance: str
    dp_rank: int = 0
    tp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    host: str = "127.0.0.1"
    secret: bytes | None = None
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 60.0
    transfer_timeout: float = 120.0
    peer_timeout: float = 5.0
    ping_interval: float = 0.5
    # a prefill rank with no room here is pinged every keepalive seconds (0: never) for keepalive_for
    # seconds after its last room: its connection, and the ownership proof it carries, stay open
    # between rooms (a prefill rank closes a connection silent for 120 s; the next room would prove
    # this rank again, a read of its memory, on its own path)
    keepalive: float = 40.0
    keepalive_for: float = 600.0
    lease_ttl: float = 10.0
    topology_ttl: float = 2.0  # how long one look-up answer serves other rooms of the same DP group
    # (refreshed in the background while the group is in use: rooms do not wait for look-ups)
    # After a silent prefill rank's lease is gone, its rooms' pages stay held this long more
    # (unless it acknowledges the abort): a process that was frozen (SIGSTOP, a paused VM)
    # past its lease still holds queued writes that land the moment it resumes.
    lease_quarantine: float = 30.0
    lookup_threads: int = 4
    verify_digest: bool = False
    # Staged transfers (docs/staging.md): the staging area remote writes land in, registered
    # memory beside the pages of staging_bytes cut into slots of staging_slot_bytes (defaults and
    # why: staging/settings.py). "auto": prefill chooses per target; "always": every page arrives
    # staged (an aborted room's pages free at once); "never": no area, every write direct.
    staging: str = "auto"
    staging_bytes: int = 0  # 0: the default for the pages' device (staging/settings.py)
    staging_slot_bytes: int = 0
    # slots of the staging area kept to be granted with a room's TransferRequest, one to each sender's
    # first chunk of the room (0: none; every chunk asks with a SlotRequest and waits for its grant).
    # Such a chunk is written as soon as it is gathered: the grant's round trip leaves the room's path.
    # A kept slot is never granted to a chunk that asks, and is held from the request until that chunk
    # lands (or the room commits without it): while the prefill computes, so under load most rooms find
    # none free and ask as before. Worth it only where prefill stages (GPU pages over NVLink or RDMA).
    staging_granted_slots: int = 0
    # each room's aux row in the report that carries it, written into its slot here at the commit
    # (where kvbridge can write this rank's aux rows: one packed store, host or CUDA), instead of a
    # remote write into them: the prefill rank's last send after its layers then posts no write
    aux_inline: bool = True
    # with aux_inline, that row in a report of its own, sent once the pages' write is posted, and
    # written into its slot while the pages land rather than at the commit: True, False, or None
    # (the default) for where the rows are device memory (a host -> device copy there waits behind
    # the GPU's other copies; on the host the row rides in the pages' report: no message more)
    aux_ahead: bool | None = None
    trace: bool = False

    def __post_init__(self) -> None:
        for name in ("keepalive", "keepalive_for"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0 (0: none), got {value!r}", field=name,
                                  rank=self.rank_label)
        check_staging(self.staging, self.staging_bytes, self.staging_slot_bytes, self.rank_label,
                      self.staging_granted_slots)

    @property
    def rank_label(self) -> str:
        return f"{self.instance}/dp{self.dp_rank}/tp{self.tp_rank}"
