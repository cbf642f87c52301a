"""One canonical identity for every endpoint a registration names: its transfer-engine
session (``host:port``) and its control endpoint (``tcp://host:port``); a staging area or
any other range is ``(session, base)``, so it is canonical once its session is.

Two spellings of one endpoint must be one claim: the transfer engine resolves every spelling
below to the same process, so the daemon compares (and stores) only the canonical form.

    spelling                         canonical (local mode)    canonical (network mode)
    127.0.0.1:5000                   127.0.0.1:5000            refused: loopback
    localhost:5000  LOCALHOST.:5000  127.0.0.1:5000            refused: loopback
    127.1:5000  127.0.0.2:5000       127.0.0.1:5000            refused: loopback
    0.0.0.0:5000  [::]:5000          127.0.0.1:5000            refused: unspecified
    127.0.0.1:05000                  127.0.0.1:5000            refused: loopback
    [::ffff:127.0.0.1]:5000          127.0.0.1:5000            refused: loopback
    10.0.0.5:5000  012.0.0.5:5000    refused: not loopback     10.0.0.5:5000 (012 is octal 10, as C reads it)
    node-3.cluster.:5000             refused unless loopback   the one address it resolves to, ``a.b.c.d:5000``
    [2001:DB8::1]:5000               refused: not loopback     [2001:db8::1]:5000
    " 10.0.0.5:5000", "10.0.0.5:+5000", "10.0.0.5:99999", "[fe80::1%eth0]:1"   refused: malformed

Rules, in order:
- only printable ASCII without blanks; ``host:port``, ``[v6]:port`` or ``v6:port`` (split at
  the last colon, as ``f"{host}:{port}"`` writes an IPv6 host);
- the port is decimal digits, read as a number (leading zeros go), 1-65535 (a control
  endpoint may say 0: a decode rank listens on nothing);
- an IPv4 host is read the way the C library's resolver reads it (``inet_aton``: ``127.1``,
  ``0x7f.0.0.1``, octal ``0177.0.0.1``, ``2130706433``), so our reading is the engine's; an
  IPv4-mapped IPv6 address is its IPv4 address; IPv6 is written compressed in brackets;
  scoped IPv6 (``%eth0``) is refused;
- a name loses its trailing dot and its case; ``localhost`` and ``*.localhost`` are loopback
  (RFC 6761); any other name is resolved, and must resolve to exactly one address, which is
  what is stored (the name could later resolve elsewhere); without a resolver (the prefill
  side) a name is refused;
- **local mode** (a daemon whose ranks all run on its host: the demo, tests, ``kvbridge
  chaos``, a laptop) accepts only this host: every loopback and unspecified address is the
  one canonical ``127.0.0.1``; any other address is refused, since a non-loopback address of
  this host would be a second spelling of a loopback session. **Network mode** (a daemon
  that listens beyond loopback) refuses loopback and unspecified addresses: to a peer on
  another host they name that peer itself. ``local=None`` accepts both kinds (prefill's
  check that a registration it read is already canonical);
- multicast, broadcast and reserved addresses are refused in either mode;
- opaque sessions of engines that are not addressed over the network are compared exactly:
  ``ipc:...`` (CUDA IPC side channels, named by the engine) and ``nixl:<agent>`` (a NIXL agent:
  its network address is in the agent metadata the registration carries, and a writer refuses
  metadata naming another agent) in either mode, ``local:...`` (an in-process test fabric) in
  local mode.

What this cannot see: two addresses of one multi-homed host (two NICs, IPv4 and IPv6) are
two endpoints here. docs/security.md says what covers that (the ownership proof's channel key
and the network policy), and what does not.

Pure but for the resolver, which is passed in (``resolve_host`` uses the system's).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable

from kvbridge.errors import EndpointError

__all__ = ["LOOPBACK", "Resolver", "canonical_endpoint", "canonical_host", "canonical_session", "is_canonical_session",
           "resolve_host"]

LOOPBACK = "127.0.0.1"  # the one spelling of "this host" in local mode
Resolver = Callable[[str], "list[str]"]  # a host name -> the addresses it resolves to
OPAQUE_ANY = ("ipc:", "nixl:")
OPAQUE_LOCAL = ("local:",)
MAX_LENGTH = 256
# whole-string matches (``fullmatch``): ``$`` would also match before a trailing newline
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_IPV4_CHARS = re.compile(r"[0-9a-fx.]+")
_DIGITS = re.compile(r"[0-9]{1,10}")


def resolve_host(name: str) -> list[str]:
    """The system resolver's addresses for ``name`` (TCP), in its order; [] when it has none."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out


def _ipv4(host: str) -> ipaddress.IPv4Address | None:
    """``host`` as the C library reads an IPv4 literal (inet_aton), else None."""
    if not _IPV4_CHARS.fullmatch(host) or host.startswith(".") or host.endswith(".") or ".." in host:
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A literal address (IPv4-mapped IPv6 as IPv4), None for a name; EndpointError for a scoped one."""
    if ":" in host:
        if "%" in host:
            raise EndpointError(f"host {host!r} is a scoped IPv6 address: its zone means something only on one host",
                                field="host")
        try:
            v6 = ipaddress.IPv6Address(host)
        except ValueError:
            raise EndpointError(f"host {host!r} is not an IPv6 address", field="host") from None
        return v6.ipv4_mapped or v6
    return _ipv4(host.lower())


def _name(host: str) -> str:
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise EndpointError(f"host {host!r} is neither an address nor a valid host name", field="host")
    if labels[-1].isdigit():
        raise EndpointError(f"host {host!r} is not an IPv4 address the resolver reads, nor a host name", field="host")
    return name


def _classify(addr: ipaddress.IPv4Address | ipaddress.IPv6Address, spelled: str, local: bool | None) -> str:
    this_host = addr.is_loopback or addr.is_unspecified
    if this_host:
        if local is False:
            kind = "a loopback" if addr.is_loopback else "an unspecified"
            raise EndpointError(f"host {spelled!r} is {kind} address: to a peer on another host it names that peer "
                                "itself; register an address peers reach (this daemon is in network mode; "
                                "`kvbridge bootstrap --endpoints local` is for a cluster on one host)", field="host")
        return LOOPBACK
    if addr.is_multicast or addr.is_reserved or (addr.version == 4 and addr == ipaddress.IPv4Address("255.255.255.255")):
        raise EndpointError(f"host {spelled!r} ({addr}) is a multicast, broadcast or reserved address", field="host")
    if addr.version == 6 and addr.is_link_local:
        raise EndpointError(f"host {spelled!r} is a link-local IPv6 address (needs a zone)", field="host")
    if local is True:
        raise EndpointError(f"host {spelled!r} ({addr}) is not loopback, and this daemon is in local mode (every "
                            f"rank on its host): register {LOOPBACK}, or run the daemon with `--endpoints network`",
                            field="host")
    return str(addr) if addr.version == 4 else f"[{addr.compressed}]"


def canonical_host(host: str, *, local: bool | None, resolve: Resolver | None = resolve_host) -> str:
    """The canonical spelling of ``host`` (see the module docstring); EndpointError when refused."""
    addr = _address(host)
    if addr is not None:
        return _classify(addr, host, local)
    name = _name(host)
    if name == "localhost" or name.endswith(".localhost"):
        return _classify(ipaddress.IPv4Address(LOOPBACK), host, local)
    if resolve is None:
        raise EndpointError(f"host {host!r} is a name, not an address: a registration stores the address its name "
                            "resolved to", field="host")
    found: set[str] = set()
    for a in resolve(name):
        try:
            parsed = _address(a)
        except EndpointError:
            continue
        if parsed is not None:
            found.add(_classify(parsed, f"{host} -> {a}", local))
    if not found:
        raise EndpointError(f"host {host!r} does not resolve to an address", field="host")
    if len(found) > 1:
        raise EndpointError(f"host {host!r} resolves to {len(found)} addresses ({', '.join(sorted(found))}): one "
                            "endpoint must be one claim; register the address peers should use", field="host")
    return found.pop()


def _split(text: str, what: str) -> tuple[str, str]:
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or text[end + 1 : end + 2] != ":":
            raise EndpointError(f"{what} {text!r} is not [ipv6]:port", field=what)
        return text[1:end], text[end + 2 :]
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise EndpointError(f"{what} {text!r} is not host:port", field=what)
    return host, port


def _port(text: str, spelled: str, what: str, *, allow_zero: bool) -> int:
    if not _DIGITS.fullmatch(text):
        raise EndpointError(f"{what} {spelled!r}: port {text!r} is not a decimal number", field=what)
    port = int(text)
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise EndpointError(f"{what} {spelled!r}: port {port} is outside {0 if allow_zero else 1}-65535", field=what)
    return port


def _checked_text(text: object, what: str) -> str:
    if not isinstance(text, str) or not text:
        raise EndpointError(f"{what} must be a non-empty string, got {text!r:.60}", field=what)
    if len(text) > MAX_LENGTH or not _PRINTABLE.fullmatch(text):
        raise EndpointError(f"{what} {text!r:.80} holds blanks, control or non-ASCII characters, or is over "
                            f"{MAX_LENGTH} characters", field=what)
    return text


def canonical_session(session: str, *, local: bool | None, resolve: Resolver | None = resolve_host) -> str:
    """The canonical transfer-engine session: ``host:port`` as the module docstring says, or an
    opaque ``ipc:`` / ``nixl:`` (any mode) / ``local:`` (local mode) name, unchanged; EndpointError
    (``field="session_id"``) naming why when it is refused."""
    text = _checked_text(session, "session_id")
    if text.startswith(OPAQUE_ANY):
        return text
    if text.startswith(OPAQUE_LOCAL):
        if local is False:
            raise EndpointError(f"session_id {text!r} names an in-process test fabric; this daemon is in network mode",
                                field="session_id")
        return text
    host, port = _split(text, "session_id")
    number = _port(port, text, "session_id", allow_zero=False)
    try:
        canon = canonical_host(host, local=local, resolve=resolve)
    except EndpointError as exc:
        raise EndpointError(f"session_id {text!r}: {exc.reason}", field="session_id") from None
    return f"{canon}:{number}"


def canonical_endpoint(endpoint: str, *, local: bool | None, resolve: Resolver | None = resolve_host) -> str:
    """The canonical control endpoint ``tcp://host:port`` (port 0: listens on nothing);
    EndpointError (``field="control_endpoint"``)."""
    text = _checked_text(endpoint, "control_endpoint")
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() != "tcp" or "/" in rest:
        raise EndpointError(f"control_endpoint {text!r} is not tcp://host:port", field="control_endpoint")
    host, port = _split(rest, "control_endpoint")
    number = _port(port, text, "control_endpoint", allow_zero=True)
    try:
        canon = canonical_host(host, local=local, resolve=resolve)
    except EndpointError as exc:
        raise EndpointError(f"control_endpoint {text!r}: {exc.reason}", field="control_endpoint") from None
    return f"tcp://{canon}:{number}"


def is_canonical_session(session: str) -> bool:
    """``session`` is already in canonical form (either mode, no resolution): what a prefill
    rank asks of a registration it read before it writes there."""
    try:
        return canonical_session(session, local=None, resolve=None) == session
    except EndpointError:
        return False
