"""The faults ``kvbridge chaos`` knows, by name (kept light: the command line imports it)."""

from __future__ import annotations

TARGETS = ("prefill", "decode", "daemon")
SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM")
FAULTS: tuple[str, ...] = (*(f"{t} {s}" for t in TARGETS for s in SIGNALS), "engine errors")

# Faults of the store mode (three daemon replicas on a three-member etcd cluster): run when
# asked for by name (``--faults "replica SIGKILL,etcd member SIGKILL,etcd quorum loss"``).
STORE_FAULTS: tuple[str, ...] = ("replica SIGKILL", "etcd member SIGKILL", "etcd quorum loss")
ALL_FAULTS: tuple[str, ...] = (*FAULTS, *STORE_FAULTS)
