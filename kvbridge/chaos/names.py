"""The faults ``kvbridge chaos`` knows, by name (kept light: the command line imports it)."""

from __future__ import annotations

TARGETS = ("prefill", "decode", "daemon")
SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM")
FAULTS: tuple[str, ...] = (*(f"{t} {s}" for t in TARGETS for s in SIGNALS), "engine errors")
