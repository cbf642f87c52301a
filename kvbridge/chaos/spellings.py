"""Other spellings of one transfer-engine session: what an attacker registers to alias a live
rank (issue 26). The C resolver (and so the transfer engine) reads each as the same
``address:port``; ``kvbridge.bootstrap.endpoints.canonical_session`` must too, or refuse it.

``spellings(address, port)`` is deterministic: the spellings the hostile harness and the tests
try. ``tests/bootstrap/test_bootstrap_endpoints.py`` also draws them at random (hypothesis).
"""

from __future__ import annotations

import ipaddress

__all__ = ["ipv4_forms", "port_forms", "spellings"]


def ipv4_forms(address: str) -> list[str]:
    """``address`` in the forms ``inet_aton`` reads: dotted with octal, hex and padded parts,
    and the 3-, 2- and 1-part forms (``127.1``, ``2130706433``)."""
    a = ipaddress.IPv4Address(address)
    b = list(a.packed)
    n = int(a)
    forms = [
        str(a),
        ".".join(f"{x:03d}" if x < 8 else str(x) for x in b),  # zero-padded parts below 8 read the same in octal
        ".".join(f"0{x:o}" if x else "0" for x in b),  # octal
        ".".join(f"0x{x:x}" for x in b),  # hex
        ".".join(f"0X{x:02X}" for x in b),
        f"{b[0]}.{b[1]}.{(b[2] << 8) | b[3]}",  # a.b.c16
        f"{b[0]}.{(b[1] << 16) | (b[2] << 8) | b[3]}",  # a.b24
        str(n),  # one 32-bit number
        f"0x{n:08x}",
        f"0{n:o}",
    ]
    return list(dict.fromkeys(forms))


def port_forms(port: int) -> list[str]:
    return list(dict.fromkeys([str(port), f"0{port}", f"000{port}"]))


def spellings(address: str, port: int, *, loopback_aliases: bool = True) -> list[str]:
    """Sessions the transfer engine reads as ``address:port``: every IPv4 form, IPv4-mapped
    IPv6 forms, padded ports; for a loopback ``address`` also ``localhost`` in any case with
    or without a trailing dot, other 127/8 addresses, ``[::1]`` and the unspecified addresses
    (each reaches this host's process on that port); and the malformed near-misses that must
    be refused (blanks, upper-case ``LOCALHOST`` inside blanks)."""
    a = ipaddress.IPv4Address(address)
    hosts = ipv4_forms(address)
    mapped = [f"[::ffff:{a}]", f"[::FFFF:{a}]", f"[0:0:0:0:0:ffff:{a}]", f"[::ffff:{int(a) >> 16:x}:{int(a) & 0xFFFF:x}]",
              f"::ffff:{a}"]
    out = [f"{h}:{p}" for h in hosts + mapped for p in port_forms(port)]
    if a.is_loopback:
        names = ["localhost", "LOCALHOST", "LocalHost", "localhost.", "LOCALHOST.", "kvbridge.localhost"]
        others = ["127.0.0.2", "127.1.2.3", "127.255.255.254", "0.0.0.0", "0", "[::1]", "[::]",
                  "[0:0:0:0:0:0:0:1]", "[::ffff:127.0.0.2]"]
        out += [f"{h}:{p}" for h in names + others for p in port_forms(port)] if loopback_aliases else []
    out += [f" {a}:{port}", f"{a}:{port} ", f"{a} :{port}", f"{a}: {port}", f"\t{a}:{port}", f"{a}:{port}\n",
            f" LOCALHOST:{port} "]
    return list(dict.fromkeys(out))
