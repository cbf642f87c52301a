"""What a decode engine can know about a prefill instance before it opens a room:
its sizes and lane rule, as the bootstrap daemon has them.

An engine whose scheduler picks the prefill DP rank of a request itself (SGLang's
decode side does, before it creates a receiver) asks ``PrefillInfo.lookup``, then
``dp_rank_of(room)`` gives the rank kvbridge's own look-up would pick for a room
opened without one (``room % dp_size``, the "follow bootstrap room" rule); an
engine that routes requests otherwise passes its DP rank to ``receiver()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.errors import ConfigError, UnknownInstance


@dataclass(frozen=True)
class PrefillInfo:
    """One registered prefill instance: sizes (``complete`` once every sender rank has
    registered), its contract's fingerprint and owner-lane rule."""

    instance: str
    dp_size: int
    cp_size: int
    tp_size: int
    pp_size: int
    complete: bool
    fingerprint: str
    lane_rule: str

    def dp_rank_of(self, room: int) -> int:
        """The DP rank a room opened without one is looked up in: ``room % dp_size``."""
        return room % self.dp_size

    @classmethod
    def lookup(cls, client: BootstrapClient, instance: str | None = None) -> PrefillInfo:
        """The prefill instance ``instance`` at the daemon; ``None``: the one prefill instance
        registered there (a daemon per prefill instance). UnknownInstance when there is none
        (yet: registration may still be under way), ConfigError when ``None`` is ambiguous,
        BootstrapUnavailable when the daemon does not answer."""
        contracts = {f.instance: f for f in client.fingerprints() if f.role == "prefill"}
        if instance is None:
            if len(contracts) > 1:
                raise ConfigError(f"{len(contracts)} prefill instances registered at {client.base_url} "
                                  f"({', '.join(sorted(contracts))}): name the one to use", field="instance")
            if not contracts:
                raise UnknownInstance(f"no prefill instance registered at {client.base_url} yet", field="instance")
            instance = next(iter(contracts))
        found = contracts.get(instance)
        if found is None:
            raise UnknownInstance(f"no prefill instance {instance!r} registered at {client.base_url}; prefill "
                                  f"instances there: {sorted(contracts) or 'none'}", field="instance")
        view = client.instance(instance)
        topo = view.topology
        return cls(instance=instance, dp_size=topo.dp_size, cp_size=topo.cp_size, tp_size=topo.tp_size,
                   pp_size=topo.pp_size, complete=view.complete, fingerprint=found.fingerprint,
                   lane_rule=found.contract.cp_rule)
