"""One convention for an engine integration's settings (kvbridge/integrations/README.md).

An integration writes its keys down once, as a table ``key -> (environment variable or "",
meaning)``, and reads them once, at start-up, into a frozen dataclass of its own:

    KEYS = {"engine": ("KVBRIDGE_ENGINE", "the transfer engine"), "lease_ttl": ("KVBRIDGE_LEASE_TTL", "...")}
    r = SettingsReader(KEYS, given=extra_config, env=os.environ, where="kv_connector_extra_config")
    Settings(engine=r.choice("engine", kvbridge.engine_names("network"), "mooncake"),
             lease_ttl=r.number("lease_ttl", 10.0, positive=True))

- ``given`` is the mapping the engine hands over (vLLM's ``kv_connector_extra_config``; None where
  the engine has none, as SGLang): a key the table does not list is refused by name.
- The environment is read for the table's variables only, and only where ``given`` has no value:
  other variables are the process's business, never an error.
- Every refusal is a ``ConfigError`` whose field names where the value came from: the mapping's key
  (``kv_connector_extra_config.peer_timeout``) or the variable (``KVBRIDGE_LEASE_TTL``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge.errors import ConfigError

__all__ = ["SettingsReader"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingsReader:
    """Typed reads of an integration's settings: ``given`` first, then the key's variable, then
    the default (see the module docstring)."""

    def __init__(self, keys: Mapping[str, tuple[str, str]], given: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, *, where: str = "settings") -> None:
        import os

        self.keys = dict(keys)
        self.given = dict(given or {})
        self.env = os.environ if env is None else env
        self.where = where
        unknown = sorted(set(self.given) - set(self.keys))
        if unknown:
            raise ConfigError(f"{where} has unknown keys {unknown}; kvbridge reads {sorted(self.keys)}",
                              field=f"{where}.{unknown[0]}")

    def source(self, key: str) -> str:
        """Where ``key``'s value comes from, as a refusal names it: ``where.key`` when given, else
        its variable (set or not: what the operator would set), else ``where.key``."""
        if key in self.given and self.given[key] not in (None, ""):
            return f"{self.where}.{key}"
        return self._variable(key) or f"{self.where}.{key}"

    def raw(self, key: str, default: Any = "") -> Any:
        """The value as given (any type), its variable's text, or ``default``."""
        if key in self.given and self.given[key] not in (None, ""):
            return self.given[key]
        variable = self._variable(key)
        if variable and self.env.get(variable):
            return self.env[variable]
        return default

    def text(self, key: str, default: str = "") -> str:
        return str(self.raw(key, default))

    def choice(self, key: str, choices: Sequence[str], default: str) -> str:
        value = self.text(key, default)
        if value not in choices:
            raise ConfigError(f"{self.source(key)}={value!r} is not one of {', '.join(choices)}", field=self.source(key))
        return value

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        """A number, >= 0 (> 0 with ``positive``)."""
        raw = self.raw(key, default)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.source(key)}={raw!r} is not a number", field=self.source(key)) from None
        if value < 0 or (positive and value == 0):
            raise ConfigError(f"{self.source(key)}={raw!r} must be {'positive' if positive else 'at least 0'}",
                              field=self.source(key))
        return value

    def integer(self, key: str, default: int) -> int:
        """A whole number >= 0."""
        raw = self.raw(key, default)
        try:
            value = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.source(key)}={raw!r} is not a whole number", field=self.source(key)) from None
        if value < 0:
            raise ConfigError(f"{self.source(key)}={raw!r} must be at least 0", field=self.source(key))
        return value

    def flag(self, key: str, default: bool) -> bool:
        raw = self.raw(key, default)
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ConfigError(f"{self.source(key)}={raw!r} is not true or false", field=self.source(key))

    def _variable(self, key: str) -> str:
        if key not in self.keys:
            raise ConfigError(f"{key!r} is not in the settings table of {self.where}", field=key)
        return self.keys[key][0]
