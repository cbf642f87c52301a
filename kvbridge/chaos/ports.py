"""Loopback ports for the local clusters that chaos runs, tests and benchmarks start: ports that
are free now and lie *below* the kernel's ephemeral range.

A process that comes back on its own port (a daemon restarted, an etcd member rejoining) must find
it free. A port the kernel hands out (``bind(0)``, or any outbound connection's source port) can
be handed to another process in the meantime: suites run side by side, and a CI run once failed
that way ("Address already in use" on a restart, the port answering after the daemon stopped).
The kernel hands no process a port below the ephemeral range unless it asks for it by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["private_ports", "spare_port"]

LOWEST = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def private_ports(n: int, host: str = "127.0.0.1", tries: int = 200) -> list[int]:
    """``n`` distinct ports of ``host`` between 20000 and the ephemeral range, each free when checked
    (bound and released); RuntimeError when ``tries`` picks found fewer."""
    low = _ephemeral_low()
    found: list[int] = []
    for _ in range(tries):
        if len(found) == n:
            break
        port = random.randrange(LOWEST, max(LOWEST + 1, low))
        if port in found:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
    if len(found) < n:
        raise RuntimeError(f"only {len(found)} of {n} free ports between {LOWEST} and {low} in {tries} tries")
    return found


_GIVEN: set[tuple[str, int]] = set()  # what spare_port() handed out in this process


def spare_port(host: str = "127.0.0.1") -> int:
    """One port of ``private_ports``, never one this process handed out before: for a child that
    binds it later (a server's start-up can take minutes), when several are picked before any binds."""
    while (host, port := private_ports(1, host)[0]) in _GIVEN:
        pass
    _GIVEN.add((host, port))
    return port
