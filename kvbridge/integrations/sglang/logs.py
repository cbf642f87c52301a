"""kvbridge's log records through SGLang's logging configuration.

SGLang configures the root logger of each of its processes (``configure_logger``: its level is
``--log-level``, its format ``[time TP0] message``, or ``SGLANG_LOGGING_CONFIG_PATH``'s dictConfig).
That format has neither the level nor the process, so a kvbridge WARNING would read like an INFO
line of an unknown process. ``route_logs`` gives the ``kvbridge`` logger one handler that hands
each record to the root logger's handlers as they are when it is emitted (SGLang's, whatever
configured them), its message prefixed with the level, the logger and the process id:

    [2026-12-04 21:10:00 TP0] WARNING kvbridge.integrations.sglang.handles (pid 4242): room 7 on ...

Level: ``KVBRIDGE_LOG_LEVEL`` when set, else SGLang's (the root logger's when a record comes:
``--log-level``, INFO by default), so INFO lines show when asked. A ``kvbridge`` logger that a dictConfig gave handlers
of its own is left as configured.
"""

from __future__ import annotations

import logging

from kvbridge import ConfigError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ThroughEngine(logging.Handler):
    """Hands a kvbridge record to the root logger's handlers (the engine's), tagged."""

    def emit(self, record: logging.LogRecord) -> None:
        tagged = logging.makeLogRecord(record.__dict__)
        tagged.msg = f"{record.levelname} {record.name} (pid {record.process}): {record.getMessage()}"
        tagged.args = None
        tagged.exc_info, tagged.exc_text = record.exc_info, record.exc_text
        handlers = logging.getLogger().handlers or ([logging.lastResort] if logging.lastResort else [])
        for handler in handlers:
            if tagged.levelno >= handler.level:
                handler.handle(tagged)


def route_logs(level: str | None) -> None:
    """Route the ``kvbridge`` logger through SGLang's handlers (module docstring); idempotent."""
    if level is not None and level.upper() not in LEVELS:
        raise ConfigError(f"KVBRIDGE_LOG_LEVEL {level!r} is not one of {', '.join(LEVELS)}",
                          field="KVBRIDGE_LOG_LEVEL")
    ours = logging.getLogger("kvbridge")
    if any(not isinstance(h, ThroughEngine) for h in ours.handlers):
        return  # configured by the user (a dictConfig naming "kvbridge")
    if not ours.handlers:
        ours.addHandler(ThroughEngine())
    if level:
        ours.setLevel(level.upper())  # else NOTSET: the root's level, SGLang's --log-level, when a record comes
    ours.propagate = False
