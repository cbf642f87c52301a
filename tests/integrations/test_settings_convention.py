"""The integrations' one settings convention (``kvbridge.SettingsReader``,
kvbridge/integrations/README.md): a table of keys, the engine's mapping first (unknown keys
refused by name), then the key's variable, then the default; every refusal names where the value
came from. The SGLang, vLLM and model-mode tables follow it (their settings modules import
without their engines)."""

from __future__ import annotations

import pytest

import kvbridge
from kvbridge import ConfigError, SettingsReader

KEYS = {"engine": ("KVBRIDGE_ENGINE", "the engine"), "lease_ttl": ("KVBRIDGE_LEASE_TTL", "seconds"),
        "slots": ("", "how many"), "trace": ("KVBRIDGE_TRACE", "a flag")}


def test_the_mapping_wins_then_the_variable_then_the_default():
    r = SettingsReader(KEYS, {"lease_ttl": 3, "slots": None}, {"KVBRIDGE_LEASE_TTL": "9", "KVBRIDGE_ENGINE": "nixl",
                                                               "OTHER": "x", "KVBRIDGE_UNKNOWN": "y"}, where="extra")
    assert r.number("lease_ttl", 10.0) == 3.0 and r.source("lease_ttl") == "extra.lease_ttl"
    assert r.choice("engine", kvbridge.engine_names("network"), "mooncake") == "nixl"
    assert r.source("engine") == "KVBRIDGE_ENGINE"
    assert r.integer("slots", 7) == 7 and r.source("slots") == "extra.slots"  # None: not given
    assert r.flag("trace", False) is False and SettingsReader(KEYS, {"trace": "on"}).flag("trace", False) is True


@pytest.mark.parametrize(("given", "env", "read", "field", "message"), [
    ({"lease_tll": 1}, {}, None, "extra.lease_tll", r"extra has unknown keys \['lease_tll'\]"),
    ({"lease_ttl": "soon"}, {}, ("number", "lease_ttl", 1.0), "extra.lease_ttl", "extra.lease_ttl='soon' is not a number"),
    ({}, {"KVBRIDGE_LEASE_TTL": "-1"}, ("number", "lease_ttl", 1.0), "KVBRIDGE_LEASE_TTL", "must be at least 0"),
    ({}, {"KVBRIDGE_LEASE_TTL": "0"}, ("positive", "lease_ttl", 1.0), "KVBRIDGE_LEASE_TTL", "must be positive"),
    ({"slots": "2.5"}, {}, ("integer", "slots", 1), "extra.slots", "is not a whole number"),
    ({}, {"KVBRIDGE_ENGINE": "nccl"}, ("engine", "engine", "mooncake"), "KVBRIDGE_ENGINE",
     "KVBRIDGE_ENGINE='nccl' is not one of mooncake, nixl"),
    ({"trace": "maybe"}, {}, ("flag", "trace", False), "extra.trace", "is not true or false"),
    ({}, {}, ("number", "nonsense", 1.0), "nonsense", "not in the settings table of extra"),
])  # fmt: skip
def test_each_refusal_names_where_the_value_came_from(given, env, read, field, message):
    with pytest.raises(ConfigError, match=message) as err:
        r = SettingsReader(KEYS, given, env, where="extra")
        kind, key, default = read
        if kind == "engine":
            r.choice(key, kvbridge.engine_names("network"), default)
        elif kind == "positive":
            r.number(key, default, positive=True)
        else:
            getattr(r, kind)(key, default)
    assert err.value.field == field


def test_the_engine_integrations_follow_it():
    from kvbridge.integrations.sglang import settings as sglang
    from kvbridge.integrations.transformers import models

    # SGLang: its documented variables are its table, one key each (KVBRIDGE_LEASE_TTL -> lease_ttl)
    assert {variable for variable, _ in sglang.KEYS.values()} == {name for name, _ in sglang.ENVIRONMENT}
    assert sglang.KEYS["lease_ttl"][0] == "KVBRIDGE_LEASE_TTL" and sglang.KEYS["engine"][0] == "KVBRIDGE_ENGINE"
    # vLLM: kv_connector_extra_config's keys, with the SGLang backend's variables where both exist
    vllm = pytest.importorskip("kvbridge.integrations.vllm.settings")
    shared = {k: v[0] for k, v in vllm.EXTRA_KEYS.items() if v[0] and k in sglang.KEYS}
    assert {"engine", "lease_ttl", "peer_timeout", "staging", "secret", "host"} <= set(shared)
    assert all(sglang.KEYS[k][0] == variable for k, variable in shared.items())
    # model mode: its one variable
    assert models.KEYS["cache"][0] == "KVBRIDGE_CACHE"
    assert models.cache_root(env={"KVBRIDGE_CACHE": "/tmp/kvb"}).as_posix() == "/tmp/kvb/models"
    assert models.cache_root("/x", env={"KVBRIDGE_CACHE": "/tmp/kvb"}).as_posix() == "/x"
