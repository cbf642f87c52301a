"""Fixtures of the transfer tests: ``cluster(**kw)`` builds in-process clusters (``_local.py``)
against the module's bootstrap daemon and closes them at teardown."""

from __future__ import annotations

import pytest

from _local import Cluster


@pytest.fixture
def cluster(daemon, request):
    made = []

    def make(**kw) -> Cluster:
        c = Cluster(daemon.url, f"{request.node.name[:40].replace('[', '-').replace(']', '')}-{len(made)}", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
