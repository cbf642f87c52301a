"""Mooncake's own log lines (glog, printed by its C++ code straight to file
descriptor 2), kept out of an engine's output unless kvbridge logs at DEBUG.

What it prints, measured with mooncake-transfer-engine 0.3.x:

    at every engine start   I.. W.. lines (topology, ports), "WARNING: Logging before
                            InitGoogleLogging()", and an alarming but harmless
                            "E.. Local segment descriptor not found"
    at every batch          I.. "Batch Transfer completed!"

``GLOG_minloglevel`` does not reach it. ``MC_LOG_LEVEL`` (TRACE, INFO, WARNING,
ERROR) does, but only when set before ``mooncake.engine`` is imported (any
``mooncake_available()`` check imports it). glog's own ``FLAGS_minloglevel`` in
the bundled libglog works at any time. So, unless the ``kvbridge.transfer.engine``
logger is enabled for DEBUG (``--log-level debug``) or the operator set
``MC_LOG_LEVEL``: Mooncake logs ERROR and above only, and whatever the engine
prints while it starts is captured and handed to that logger at DEBUG
(an unexpected ERROR line at WARNING; a line that is not Mooncake's is written
back to stderr). ``MC_LOG_DIR`` is not used: two engines in one process then
abort ("InitGoogleLogging() twice").
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

log = logging.getLogger("kvbridge.transfer.engine")

GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d")
HARMLESS = ("Local segment descriptor not found", "Logging before InitGoogleLogging")
GLOG_ERROR = 2
_FD_LOCK = threading.Lock()  # fd 2 is one per process: one redirection at a time


def verbose() -> bool:
    return log.isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def quiet_native_logs(error_level: int = logging.WARNING) -> Iterator[None]:
    """Around an engine's creation (or any Mooncake call): keep Mooncake's lines off stderr (see
    module doc). An unexpected ERROR line goes to our log at ``error_level``: DEBUG where the caller
    reports the failure itself (``kvbridge doctor``'s probes)."""
    if verbose():
        yield
        return
    if "MC_LOG_LEVEL" not in os.environ:
        set_min_level(GLOG_ERROR)
    with _FD_LOCK, tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            _hand_over(captured.read().decode(errors="replace"), error_level)


def set_min_level(level: int) -> bool:
    """Set glog's minimum level in the libglog Mooncake loaded (Linux); False when not found."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libglog" in line and "/" in line), None)
        if path is None:
            return False
        ctypes.c_int32.in_dll(ctypes.CDLL(path), "_ZN3fLI17FLAGS_minloglevelE").value = level
    except (OSError, ValueError):  # no /proc, or a glog without the symbol: keep its default
        return False
    return True


def _hand_over(text: str, error_level: int = logging.WARNING) -> None:
    for line in text.splitlines():
        if not line.strip():
            continue
        if any(h in line for h in HARMLESS) or (GLOG_LINE.match(line) and line[0] in "IW"):
            log.debug("mooncake: %s", line)
        elif GLOG_LINE.match(line):
            log.log(error_level, "mooncake: %s", line)
        else:  # not Mooncake's (another thread wrote meanwhile): give it back
            os.write(2, (line + "\n").encode())
