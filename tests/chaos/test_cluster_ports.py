"""The chaos cluster's daemon and replicas on private ports: a first start moves to another port
when the one it picked is taken before the daemon binds it; a restart stays on its port."""

from __future__ import annotations

import socket

import pytest

from kvbridge.chaos import cluster
from kvbridge.worker.launch import LaunchError


def test_a_first_start_takes_another_port_when_its_own_is_taken_and_a_restart_keeps_its_port(monkeypatch):
    picks = iter([[21001], [21002], [21003]])
    monkeypatch.setattr(cluster, "private_ports", lambda n, host: next(picks))
    tried = []

    def spawn(port):
        tried.append(port)
        if port == 21001:
            raise LaunchError("bootstrap exited with 2; log tail:\ncannot listen on 127.0.0.1:21001: Address already "
                              "in use [field=port]")

    assert cluster._on_port(0, spawn) == 21002 and tried == [21001, 21002]
    assert cluster._on_port(21001, lambda port: tried.append(port)) == 21001 and tried[-1] == 21001  # no other port

    def broken(port):
        raise LaunchError("bootstrap exited with 1; log tail:\nno such store")

    with pytest.raises(LaunchError, match="no such store"):  # another failure is not retried
        cluster._on_port(0, broken)


def test_a_real_daemon_whose_first_port_is_taken_starts_on_another(tmp_path, monkeypatch):
    """A real ``kvbridge bootstrap`` on a port something else holds exits "Address already in use";
    the first start goes on to the next port picked, and the daemon answers there."""
    from kvbridge.chaos.ports import private_ports
    from kvbridge.worker.cluster import HOST, spawn_bootstrap
    from kvbridge.worker.launch import ProcessGroup

    held, free = private_ports(2, HOST)
    picks = iter([[held], [free]])
    monkeypatch.setattr(cluster, "private_ports", lambda n, host: next(picks))
    group = ProcessGroup(tmp_path)
    with socket.socket() as s:
        s.bind((HOST, held))
        s.listen()
        try:
            urls = []
            port = cluster._on_port(0, lambda p: urls.append(spawn_bootstrap(group, 60, ("--port", str(p)))))
            assert port == free and urls == [f"http://{HOST}:{free}"]
        finally:
            group.stop_all()


def test_spare_ports_are_private_and_never_handed_out_twice(monkeypatch):
    """``spare_port`` draws from ``private_ports`` (below the ephemeral range) and skips a port it
    handed out before, though that one is still free (nobody bound it yet)."""
    from kvbridge.chaos import ports

    low = ports._ephemeral_low()
    first = ports.spare_port()
    assert ports.LOWEST <= first < low
    picks = iter([[first], [first], [first + 1 if first + 1 < low else first - 1]])
    monkeypatch.setattr(ports, "private_ports", lambda n, host: next(picks))
    second = ports.spare_port()
    assert second != first and second in (first + 1, first - 1)
