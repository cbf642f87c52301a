"""``kvbridge chaos``: faults injected into a local cluster under traffic, and what came of them.

    run.py      ChaosSpec (``quick`` fits a 2-core CI budget), run_chaos(spec) -> report dict,
                format_report(report)
    cluster.py  the daemon, a CP prefill instance and a decode rank as restartable processes
    traffic.py  rooms through them over the ops channel
    faults.py   one fault injected during traffic, and its accounting
    names.py    FAULTS: prefill / decode / daemon x SIGKILL / SIGSTOP / SIGTERM, and engine errors;
                STORE_FAULTS (asked for by name): replica SIGKILL, etcd member SIGKILL, etcd quorum loss
    store_faults.py  those three, run on three daemon replicas over a three-member etcd
    etcd.py     EtcdCluster: a local etcd cluster on free loopback ports (also for tests and benches)
    ports.py    private_ports: free loopback ports below the ephemeral range (a restart finds its port free)
    hostile.py  ``--hostile``: attacks (aliasing, pre-auth flood, slow connection, slot exhaustion,
                room collision, read exposure) against a local cluster, defended or not;
                hostile_identity.py: spellings of a live session, a Mooncake-reading attacker
                (spellings.py: the spellings)

The report's ``faults`` list has one entry per fault with at least ``fault``,
``rooms_affected``, ``seconds_to_failed``, ``reason_names_rank``, ``rooms_after_recovery``
and ``late_writes``; ``ok`` is False when any fault misbehaved or no fault hit a moment
with writes in flight. The engine that fails writes on SIGUSR1 lives beside the other
engines (``kvbridge.transfer.engine.faulty``): a worker builds it from its own config.
Importing this package is light; ``run`` pulls in the workers.
"""

from __future__ import annotations

from typing import Any

from kvbridge.chaos.names import FAULTS

__all__ = ["ChaosSpec", "FAULTS", "run_chaos", "format_report"]


def __getattr__(name: str) -> Any:
    if name in ("ChaosSpec", "run_chaos", "format_report"):
        from kvbridge.chaos import run

        return getattr(run, name)
    raise AttributeError(f"module 'kvbridge.chaos' has no attribute {name!r}")
