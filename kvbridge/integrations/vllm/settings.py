"""Everything the vLLM connector reads from vLLM's config and the environment: read once,
when a connector (scheduler or worker side) is built, here and nowhere else.

From ``VllmConfig``: the KV role, the engine id, the model's name and revision, the
block size, the parallel layout (TP size; PP, DCP and PCP are refused), whether the
hybrid KV cache manager is on. From ``kv_connector_extra_config`` (the keys in
``EXTRA_KEYS``, documented in the package docstring), falling back to the
``KVBRIDGE_*`` variables of the SGLang backend where both exist: kvbridge's one settings
convention (``kvbridge.SettingsReader``; kvbridge/integrations/README.md).

What kvbridge's connector does not serve is refused here, naming the setting: pipeline
parallelism, decode/prefill context parallelism, ``kv_both`` (P/D uses producer and
consumer), hybrid groups it does not move (Mamba state, several full-attention groups;
``refuse_hybrid``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge import (STAGING_MODES, ConfigError, DecodeConfig, PrefillConfig, SettingsReader, contract_weights,
                      engine_names)


ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
ENGINES = engine_names("network")  # what a vLLM worker's transfer engine may be (both sides on one)
PEER_TIMEOUT_S = 15.0  # the library's 5 s is tripped by a loaded CPU host (docs/vllm.md, "Liveness")
INSTANCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # what the daemon accepts

# kv_connector_extra_config: key -> (environment fallback, meaning)
EXTRA_KEYS: dict[str, tuple[str, str]] = {
    "bootstrap_url": ("KVBRIDGE_BOOTSTRAP_URL", "the kvbridge bootstrap daemon (`kvbridge bootstrap`), required"),
    "bootstrap_token": ("KVBRIDGE_BOOTSTRAP_TOKEN", "the daemon's bearer token, when it has one"),
    "instance": ("KVBRIDGE_INSTANCE", "this server's instance name at the daemon (default: vLLM's engine_id)"),
    "prefill_instance": ("", "decode: the prefill instance to check the contract against at start-up"),
    "prefill_wait_s": ("", "decode: how long start-up waits for prefill_instance to register (default 60)"),
    "host": ("KVBRIDGE_HOST", "the address of this rank's transfer engine and control socket (default 127.0.0.1)"),
    "engine": ("KVBRIDGE_ENGINE", f"the transfer engine: {' or '.join(ENGINES)} (default mooncake); prefill and "
                                  "decode must use the same one"),
    "protocol": ("KVBRIDGE_PROTOCOL", "Mooncake protocol: tcp (default) or rdma"),
    "device": ("", "the RDMA device name(s) for protocol rdma"),
    "staging": ("KVBRIDGE_STAGING", "staged transfers: auto (default), always, never (docs/staging.md)"),
    "staging_bytes": ("KVBRIDGE_STAGING_BYTES", "registered staging memory in bytes (0: the role's default)"),
    "staging_slot_bytes": ("KVBRIDGE_STAGING_SLOT_BYTES", "staging slot size in bytes (0: the default)"),
    "staging_granted_slots": ("KVBRIDGE_STAGING_GRANTED_SLOTS", "decode: of its staging slots, how many are kept to be "
                              "granted with a room's request, so that each prefill rank's first chunk is written "
                              "without waiting for a grant (0: none; docs/staging.md)"),
    "secret": ("KVBRIDGE_SECRET", "control-channel MAC secret, the same on every server"),
    "lease_ttl": ("KVBRIDGE_LEASE_TTL", "lease of a rank at the daemon, seconds (default 10)"),
    "peer_timeout": ("KVBRIDGE_PEER_TIMEOUT", "silence after which a peer rank counts as dead, and the deadline of "
                                              "a connection's ownership proof, seconds (default 15: a CPU forward "
                                              "pass on a loaded host starves kvbridge's threads past 5)"),
    "room_key": ("KVBRIDGE_ROOM_KEY", "HMAC key shared by the cluster: prefill signs the params it returns and "
                                      "decode refuses params not signed, expired or bound to another prompt; a "
                                      "router-chosen kvbridge_room must then be signed (docs/vllm.md)"),
    "room_ttl_s": ("", "how long the params prefill returns stay valid with room_key, seconds (default 600)"),
    "weights": ("KVBRIDGE_WEIGHTS", "the contract's weights identity: auto (default: kvbridge.weights_digest of the "
                                    "model's local folder, headers + sizes + sampled bytes), off, or a digest to use"),
    "target_timeout": ("", "prefill: how long a finished prompt waits for decode to ask, seconds (default 60)"),
    "transfer_timeout": ("", "decode: how long a room may take once asked, seconds (default 120)"),
    "lease_quarantine": ("", "decode: how long a silent prefill rank's rooms keep their blocks after its lease "
                             "expired (a frozen process may still write), seconds (default 30)"),
    "trace": ("KVBRIDGE_TRACE", "1/true: one trace line per room event"),
    "tp_rank": ("", "the worker's TP rank when vLLM's parallel state is not initialised (external launchers, "
                    "tests); vLLM's own rank wins when it is"),
    "aux_slots": ("", "decode: rooms in flight at once on a rank (default 1024)"),
    "layerwise": ("KVBRIDGE_LAYERWISE", "prefill: auto (default) sends a prompt's last step layer by layer as "
                                        "save_kv_layer fires, except where that measured slower than whole rooms "
                                        "(GPU pools on Mooncake's intra-node NVLink transport: sent whole, logged); "
                                        "true always layer by layer; false all in wait_for_save"),
    "layer_group_bytes": ("", "prefill, layerwise: consecutive layers are posted together until a post carries this "
                              "many bytes of the step's prompts (default 8 MiB: smaller posts cost the forward "
                              "more than their bytes take on the wire)"),
    "layer_pass_bytes": ("", "prefill, layerwise: a step whose prompts carry fewer bytes than this in all is sent as "
                             "one group at its last layer (default 64 MiB: a short forward is bound by its launches, "
                             "and each group's send takes the GIL from it; 0 groups every step)"),
}


@dataclass(frozen=True)
class Settings:
    role: str  # "prefill" | "decode"
    instance: str
    daemon_url: str
    token: str
    host: str
    engine: str
    protocol: str
    device: str
    model_name: str
    revision: str
    block_size: int
    tp_size: int
    prefill_instance: str
    prefill_wait_s: float
    staging: str
    staging_bytes: int
    staging_slot_bytes: int
    staging_granted_slots: int
    secret: bytes | None
    lease_ttl: float
    peer_timeout: float
    target_timeout: float
    transfer_timeout: float
    lease_quarantine: float
    trace: bool
    tp_rank_override: int | None
    aux_slots: int
    vllm_version: str
    layerwise: bool | None = None  # None: auto (layer by layer unless the route measured slower: layerwise_slower)
    layer_group_bytes: int = 8 << 20
    layer_pass_bytes: int = 64 << 20
    room_key: bytes = b""
    room_ttl_s: float = 600.0
    weights: str = "auto"  # auto | off | a digest
    model_path: str = ""  # the model as vLLM names it: a local folder or a hub id (its cached snapshot)

    @property
    def staging_config(self) -> dict[str, Any]:
        given = {"staging_bytes": self.staging_bytes, "staging_slot_bytes": self.staging_slot_bytes,
                 "staging_granted_slots": self.staging_granted_slots}  # (decode's; 0 on prefill)
        return {"staging": self.staging, **{k: v for k, v in given.items() if v}}

    def label(self, tp_rank: int) -> str:
        return f"{self.instance}/tp{tp_rank}"


def read_settings(vllm_config: Any, env: Mapping[str, str] | None = None) -> Settings:
    """The connector's settings from ``VllmConfig`` (and ``env``, default ``os.environ``);
    ConfigError naming the setting for anything refused."""
    import vllm

    kv = vllm_config.kv_transfer_config
    r = SettingsReader(EXTRA_KEYS, kv.kv_connector_extra_config, env, where="kv_connector_extra_config")
    role = ROLES.get(kv.kv_role)
    if role is None:
        raise ConfigError(f"kv_role {kv.kv_role!r}: kvbridge's connector serves prefill as kv_producer and decode as "
                          "kv_consumer (vLLM retires kv_both for P/D disaggregation)", field="kv_role")
    refuse_parallel(vllm_config.parallel_config)
    url = r.text("bootstrap_url")
    if not url:
        raise ConfigError("no bootstrap daemon: set kv_connector_extra_config.bootstrap_url (or "
                          "KVBRIDGE_BOOTSTRAP_URL) to a `kvbridge bootstrap` daemon's URL",
                          field="kv_connector_extra_config.bootstrap_url")
    instance = r.text("instance", kv.engine_id or "")
    if not INSTANCE_NAME.match(instance):
        raise ConfigError(f"instance name {instance!r} must match {INSTANCE_NAME.pattern}", field=r.source("instance"))
    mc = vllm_config.model_config
    names = getattr(mc, "served_model_name", None) or mc.model
    name = names[0] if isinstance(names, (list, tuple)) else str(names)
    secret = r.text("secret")
    s = Settings(
        role=role, instance=instance, daemon_url=url.rstrip("/"), token=r.text("bootstrap_token"),
        host=r.text("host", "127.0.0.1"), engine=r.choice("engine", ENGINES, "mooncake"),
        protocol=r.choice("protocol", ("tcp", "rdma"), "tcp"), device=r.text("device"),
        model_name=name, revision=str(getattr(mc, "revision", None) or "unspecified"),
        block_size=int(vllm_config.cache_config.block_size), tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        prefill_instance=r.text("prefill_instance"), prefill_wait_s=r.number("prefill_wait_s", 60.0),
        staging=r.choice("staging", STAGING_MODES, "auto"), staging_bytes=r.integer("staging_bytes", 0),
        staging_slot_bytes=r.integer("staging_slot_bytes", 0),
        staging_granted_slots=r.integer("staging_granted_slots", 0) if role == "decode" else 0,
        secret=secret.encode() if secret else None,
        lease_ttl=r.number("lease_ttl", 10.0), peer_timeout=r.number("peer_timeout", PEER_TIMEOUT_S),
        target_timeout=r.number("target_timeout", 60.0), transfer_timeout=r.number("transfer_timeout", 120.0),
        lease_quarantine=r.number("lease_quarantine", 30.0),
        trace=r.flag("trace", False),
        tp_rank_override=None if r.raw("tp_rank", None) is None else r.integer("tp_rank", 0),
        aux_slots=r.integer("aux_slots", 1024), vllm_version=str(vllm.__version__),
        layerwise=None if r.text("layerwise", "auto").strip().lower() == "auto" else r.flag("layerwise", True),
        layer_group_bytes=max(1, r.integer("layer_group_bytes", 8 << 20)),
        layer_pass_bytes=r.integer("layer_pass_bytes", 64 << 20),
        room_key=r.text("room_key").encode(),
        room_ttl_s=r.number("room_ttl_s", 600.0), weights=r.text("weights", "auto"), model_path=str(mc.model),
    )  # fmt: skip
    # the role's own config checks the staging sizes (the one rule for staging settings)
    cfg = PrefillConfig if role == "prefill" else DecodeConfig
    cfg(instance=s.instance, **s.staging_config)
    return s


def model_weights(settings: Settings) -> str:
    """The contract's ``model.weights``: ``kvbridge.weights_digest`` of the model's folder (a local
    path, or a hub id's cached snapshot at its revision) with ``weights`` auto; "unspecified" when
    off, or when no local copy or no weight file is found (logged); the given string otherwise.
    Cost: the safetensors headers and 8 x 64 KiB per file (bootstrap/weights.py)."""
    return contract_weights(settings.weights, settings.model_path, settings.revision)


def refuse_parallel(parallel: Any) -> None:
    """Pipeline and context parallelism are not served by kvbridge's vLLM connector."""
    refusals = (
        ("pipeline_parallel_size", "pipeline parallelism (--pipeline-parallel-size > 1): vLLM's stages would each "
                                   "need a kvbridge stage of their own layers, which this connector does not build"),
        ("decode_context_parallel_size", "decode context parallelism (--decode-context-parallel-size > 1): its KV is "
                                         "interleaved over ranks by token, not by kvbridge's page lanes"),
        ("prefill_context_parallel_size", "prefill context parallelism (--prefill-context-parallel-size > 1)"),
    )
    for attr, why in refusals:
        size = int(getattr(parallel, attr, 1) or 1)
        if size > 1:
            raise ConfigError(f"{why} is not supported by kvbridge's vLLM connector; serve with {attr} 1",
                              field=f"parallel_config.{attr}")


def refuse_hybrid(kv_cache_config: Any) -> Any:
    """Each KV cache group mapped onto a kvbridge pool kind (``hybrid.group_specs``): a group with
    no kind, or whose kind the room endpoints do not carry (``kvbridge.ROOM_POOL_KINDS``), is
    refused naming the group, its spec and the kind. One full-attention group (MLA, and a sliding
    window vLLM promoted to full allocation with the hybrid manager off, included) is the paged
    pool the connector moves; under the hybrid manager one full-attention group beside any number
    of sliding-window groups, or of Mamba groups, moves too (``hybrid.group_layout``, returned;
    None for one group). Mamba groups beyond one state slot per request, Mamba beside sliding
    windows, several full-attention groups and attention groups of different block sizes are
    refused by name (``hybrid.py``'s docstring)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvbridge.integrations.vllm.hybrid import group_layout, group_specs, room_pool_kinds

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        return None
    if not groups:
        raise ConfigError("vLLM's KVCacheConfig has no KV cache group", field="kv_cache_config.kv_cache_groups")
    first: dict[int, Any] = {}  # group -> its (first) pool: a Mamba group has one per state (group<i>_state<j>)
    for name, spec in group_specs(kv_cache_config).items():  # ConfigError naming a group without a kind
        first.setdefault(int(name.removeprefix("group").split("_")[0]), spec)
    carried = room_pool_kinds()
    for i, group in enumerate(groups):
        spec = first[i]
        if spec.kind not in carried:
            raise ConfigError(f"KV cache group {i} ({type(group.kv_cache_spec).__name__}, layers "
                              f"{list(spec.layer_ids)}) is a kvbridge {spec.kind!r} pool, and the room endpoints carry "
                              f"only {sorted(carried)} pools (kvbridge.ROOM_POOL_KINDS) in this kvbridge; serve this "
                              "hybrid model with vLLM's NixlConnector or MooncakeConnector",
                              field=f"kv_cache_config.kv_cache_groups[{i}]")
    if len(groups) == 1:
        raise ConfigError(f"KV cache group 0 ({type(groups[0].kv_cache_spec).__name__}) alone: kvbridge's vLLM "
                          "connector moves a sliding-window group only beside one full-attention group",
                          field="kv_cache_config.kv_cache_groups[0]")
    return group_layout(kv_cache_config)
