"""One logging configuration for every kvbridge command.

The level comes from ``--log-level`` when given, else ``KVBRIDGE_LOG_LEVEL``,
else ``INFO``. It is read once, when a command starts.
"""

from __future__ import annotations

import logging
import os
import sys

from kvbridge.errors import ConfigError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def resolve_level(flag: str | None, environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    level = (flag or env.get("KVBRIDGE_LOG_LEVEL") or "INFO").upper()
    if level not in LEVELS:
        raise ConfigError(f"log level {level!r} is not one of {', '.join(LEVELS)}", field="log_level")
    return level


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, so a
    command run in-process (tests, embedding) never logs into a closed stream."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def configure_logging(flag: str | None = None) -> str:
    """Configure the root logger for a command; returns the level used."""
    level = resolve_level(flag)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return level
