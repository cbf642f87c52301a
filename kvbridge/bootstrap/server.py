"""Run the daemon under uvicorn on a socket we bind ourselves, so ``port=0``
works (the kernel picks a free port) and the bound port can be published in a
file for whoever started us (tests, scripts) without guessing free ports."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from kvbridge.bootstrap.app import BootstrapSettings, create_app, make_store
from kvbridge.errors import ConfigError

__all__ = ["bind_socket", "serve"]

log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only
    # when the listener says TCP; without it every response waits ~40 ms (Nagle + delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart on the same port past TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}", field="port") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _publish_port(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)  # atomic: a reader sees no file or the whole number


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the
    process would die of the signal (exit 143). A daemon that shut down cleanly
    on request exits 0: forget the captured signals before uvicorn re-raises them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


def serve(
    settings: BootstrapSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8998,
    port_file: Path | None = None,
    log_level: str = "INFO",
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn shuts down gracefully on both)."""
    if not _is_loopback(host) and settings.token is None:
        log.warning("listening on %s without a token: anyone who reaches this port can register ranks", host)
    if not _is_loopback(host) and not (settings.token or settings.read_token or settings.admin_token):
        log.warning("listening on %s without any token: anyone who reaches this port can read every rank's session "
                    "id, endpoints and buffer addresses", host)
    if settings.endpoints == "auto":  # every rank on this host when nothing else can reach the daemon
        settings = dataclasses.replace(settings, endpoints="local" if _is_loopback(host) else "network")
    log.info("registrations name %s endpoints (--endpoints)", "loopback (local mode)" if settings.local_endpoints
             else "network (loopback refused)")
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    settings = dataclasses.replace(settings, replica=settings.replica or f"{socket.gethostname()}:{bound}",
                                   url=settings.url or url)
    store = make_store(settings)
    try:
        store.start()  # an unreachable etcd: StoreUnavailable names it, and the daemon exits non-zero
    except BaseException:
        sock.close()
        raise
    if settings.etcd is not None:
        log.info("registry on etcd %s (prefix %s) as replica %s", ",".join(settings.etcd.urls), settings.etcd.prefix,
                 settings.replica)
    log.info("kvbridge bootstrap listening on http://%s:%d (docs at /docs)", host if ":" not in host else f"[{host}]", bound)
    if port_file is not None:
        _publish_port(port_file, bound)
    config = uvicorn.Config(
        create_app(settings, store=store),
        log_level=log_level.lower(),
        access_log=log_level.upper() == "DEBUG",
        lifespan="on",
        timeout_graceful_shutdown=5,
        server_header=False,
    )
    try:
        _Server(config).run(sockets=[sock])
    finally:
        sock.close()
