"""The tests' own deadlines on a slow or loaded host.

``KVBRIDGE_TEST_TIMEOUT_SCALE`` (default 1) multiplies every deadline a test sets for itself
through :func:`scaled`; start-up waits of kvbridge's processes are readiness waits with
kvbridge's own hang bound (``STARTUP_TIMEOUT_S``) and need no scaling.
"""

from __future__ import annotations

import os

TIMEOUT_SCALE = float(os.environ.get("KVBRIDGE_TEST_TIMEOUT_SCALE", "1") or 1)


def scaled(seconds: float) -> float:
    """A test's own deadline, scaled for a slow host."""
    return seconds * TIMEOUT_SCALE
