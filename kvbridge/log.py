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


def configure_logging(flag: str | None = None) -> str:
    """Configure the root logger for a command; returns the level used."""
    level = resolve_level(flag)
    logging.basicConfig(level=level, format=FORMAT, stream=sys.stderr, force=True)
    return level
