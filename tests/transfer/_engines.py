"""Marks for tests that need a real transfer engine: Mooncake tests skip without it; NIXL tests
skip without it too, except under CI=true, where they run and fail (create_engine names what to
install): kvbridge[nixl] is part of the set-up, so a missing NIXL there is a broken set-up."""

from __future__ import annotations

import os

import pytest

from kvbridge.transfer.engine import mooncake_available, nixl_available

needs_mooncake = [pytest.mark.mooncake, pytest.mark.skipif(not mooncake_available(), reason="Mooncake not installed")]
needs_nixl = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available() and os.environ.get("CI") != "true",
                                                   reason="NIXL not importable (pip install kvbridge[nixl])")]
ENGINES = [pytest.param("mooncake", marks=needs_mooncake), pytest.param("nixl", marks=needs_nixl)]
