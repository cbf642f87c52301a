"""kvbridge as a vLLM KV connector (vLLM >= 0.32, ``KVConnectorBase_V1``).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"bootstrap_url": "http://127.0.0.1:8998", "instance": "prefill-0"}}'
    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"bootstrap_url": "http://127.0.0.1:8998", "instance": "decode-0",
                                      "prefill_instance": "prefill-0"}}'

with a daemon running (``kvbridge bootstrap --port 8998``). ``"kv_connector": "KVBridgeHMAConnector"``
keeps vLLM's hybrid KV cache manager on (``SupportsHMA``): one full-attention group and its
sliding-window groups move (the window's blocks only), or its Mamba groups (each request's conv
and SSM state slot, prefill one token short; equal TP) (``hybrid.py``, docs/vllm.md). Roles: ``kv_producer``
(prefill) and ``kv_consumer`` (decode); ``kv_both`` is refused.

``kv_connector_extra_config`` keys (``settings.EXTRA_KEYS``; a key not listed is refused):

    bootstrap_url       required: the daemon's URL (or KVBRIDGE_BOOTSTRAP_URL)
    bootstrap_token     the daemon's bearer token, if it has one (or KVBRIDGE_BOOTSTRAP_TOKEN)
    instance            this server's name at the daemon (default: vLLM's engine_id); what
                        prefill returns to the proxy as kvbridge_instance
    prefill_instance    decode: compare contracts with this prefill instance at start-up and
                        refuse a mismatch naming the field; unset: checked at each request
    prefill_wait_s      decode: how long start-up waits for prefill_instance (default 60)
    engine              the transfer engine: mooncake (default) or nixl, the same on both sides
                        (or KVBRIDGE_ENGINE)
    host, protocol, device   the transfer engine: address (default 127.0.0.1), tcp | rdma, RDMA NIC
    staging             auto (default) | always | never; staging_bytes, staging_slot_bytes;
                        staging_granted_slots (decode: slots kept to grant with a room's request,
                        default 0; docs/staging.md)
    secret, lease_ttl, target_timeout (prefill), transfer_timeout (decode), trace
    peer_timeout        silence that counts a peer as dead, and the ownership proof's deadline
                        (default 15 s: a loaded CPU host trips 5)
    room_key            HMAC key of the cluster (or KVBRIDGE_ROOM_KEY): prefill signs the params
                        it returns, decode refuses them unsigned, forged, expired or bound to
                        another prompt; a router's kvbridge_room must be signed (room_ttl_s: 600)
    weights             the contract's model.weights: auto (kvbridge.weights_digest of the
                        model folder), off, or a digest of your own
    tp_rank             a worker's TP rank when vLLM's parallel state is not initialised
    aux_slots           decode: rooms in flight per rank (default 1024)
    layerwise           prefill: true (default) sends a prompt's last step layer by layer, each
                        layer as save_kv_layer fires; false sends it all in wait_for_save
                        (or KVBRIDGE_LAYERWISE)
    layer_group_bytes   prefill, layerwise: consecutive layers are posted together until a
                        post carries this many bytes of the step's prompts (default 8 MiB)

``kv_transfer_params``, vLLM's usual P/D proxy flow:

    1. to prefill (max_tokens 1):  {"do_remote_decode": true}
                                   optional "kvbridge_room": a 63-bit room id (default: drawn
                                   from vLLM's request id); with room_key it must come with
                                   "kvbridge_room_sig" and "kvbridge_room_expires"
    2. prefill's response carries  {"do_remote_prefill": true, "do_remote_decode": false,
                                    "kvbridge_room": R, "kvbridge_instance": "prefill-0",
                                    "kvbridge_num_tokens": N[, "kvbridge_room_sig": ...,
                                    "kvbridge_room_expires": ...]}
    3. to decode: those params as they are (the same prompt: the room is bound to its
       token ids, and a claim from another prompt is refused with nothing loaded)

Decode's blocks reach prefill over kvbridge's control path (decode's receiver asks the
prefill ranks the daemon names, with its block ids), not through the params: the
proxy needs no knowledge of blocks, prefix hits or TP layouts.

Modules: ``settings`` (what is read and refused), ``cache`` (vLLM's tensors -> pool,
buffers, contract), ``meta`` (scheduler -> worker), ``scheduler``, ``worker``,
``connector`` (the class vLLM loads), ``proxy`` (``kvbridge vllm-proxy``: no vLLM import). vLLM is imported by those modules only; this
package imports none of them until ``KVBridgeConnector`` is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVBridgeConnector": "connector",
    "KVBridgeHMAConnector": "connector",
    "EXTRA_KEYS": "settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
