"""kvbridge: move an LLM request's KV cache from prefill ranks to decode ranks.

The public surface, re-exported here (pinned by tests/test_exports.py):

- errors: ``KVBridgeError`` and its tree (see ``kvbridge.errors``);
- geometry: ``PoolSpec``, ``preset_pools``, ``OwnerLanes``, ``AuxSchema``/``AuxRegion``, ``AuxRow``,
  ``RawBuffer`` (a buffer given as an address), ``HeadGeometry``/``rank_heads`` (the heads a TP rank holds
  in an MHA/GQA row: heterogeneous TP), ``stage_specs`` (a pipeline stage's layers of every pool: the
  buffers a stage registers, docs/pipeline.md); pool kinds beyond paged KV: ``window_pool``,
  ``compressed_pool``, ``state_pool``, ``mamba_pools``, ``deepseek_v4_pools``, what decode needs of each
  (``needed_extent``/``needed_bytes``, ``chunk_extent`` per prefill chunk) and the plan that moves it
  (``plan_kind`` over ``describe_buffer``'s descriptors; ``state_slices``/``state_tp_spec`` for state
  slots across TP sizes; docs/models.md); ``ROOM_POOL_KINDS``, the kinds the room endpoints carry;
- contract: ``RuntimeContract``, ``contract_for`` (any model's pools), ``contract_from_preset``,
  ``fingerprint``, ``diff_contracts``, ``weights_digest`` (a checkpoint's identity for ``model.weights``), ``contract_weights`` (an engine's weights setting to it);
- integrations: ``SettingsReader`` (the one settings convention, kvbridge/integrations/README.md);
- bootstrap: ``BootstrapClient``, ``start_bootstrap`` (a daemon process for a ``with`` block);
- data path: ``create_engine`` and ``engine_names`` (the engine registry's names, by kind),
  ``STAGING_MODES`` (the ``staging`` setting's values), ``PrefillEndpoint``/``KVSender``, ``DecodeEndpoint``/``KVReceiver``, ``KVPoll``,
  ``PrefillInfo`` (a prefill instance's sizes and lane rule, before a room is opened);
- rooms bound to their request: ``room_binding`` (a request's digest, passed to ``init(binding=)`` on both
  sides), ``sign_room``/``verify_room`` (room ids a router chooses, signed with the cluster's room key),
  ``signed_room_id``/``check_room_id`` (the signature inside the id: engines that carry the id alone, SGLang).
"""

from kvbridge._version import WIRE_VERSION, __version__
from kvbridge.bootstrap import (
    BootstrapClient,
    RuntimeContract,
    contract_for,
    contract_from_preset,
    contract_weights,
    diff_contracts,
    fingerprint,
    weights_digest,
)
from kvbridge.errors import *  # noqa: F401,F403
from kvbridge.errors import __all__ as _errors_all
from kvbridge.layout import (
    PRESETS,
    Extent,
    chunk_extent,
    compressed_pool,
    deepseek_v4_pools,
    describe_buffer,
    lane_units,
    mamba_pools,
    needed_bytes,
    needed_extent,
    plan_kind,
    state_pool,
    state_slices,
    state_tp_spec,
    window_pool,
    AuxRegion,
    AuxRow,
    AuxSchema,
    HeadGeometry,
    OwnerLanes,
    PoolSpec,
    RawBuffer,
    deepseek_pools,
    preset_pools,
    rank_heads,
    stage_specs,
)
from kvbridge.transfer import (
    DecodeConfig,
    DecodeEndpoint,
    KVPoll,
    KVReceiver,
    KVSender,
    PrefillConfig,
    PrefillEndpoint,
    PrefillInfo,
    create_engine,
    mooncake_available,
)
from kvbridge.settings import SettingsReader
from kvbridge.transfer.engine.registry import engine_names
from kvbridge.transfer.staging.settings import STAGING_MODES
from kvbridge.transfer.prefill.layerwise import LayerPosts, RoomSend, cuda_graph_note, layerwise_slower
from kvbridge.bootstrap.starter import start_bootstrap
from kvbridge.transfer.binding import check_room_id, room_binding, sign_room, signed_room_id, verify_room
from kvbridge.transfer.registration import ROOM_POOL_KINDS

__all__ = [
    *_errors_all,
    "PRESETS",
    "ROOM_POOL_KINDS",
    "STAGING_MODES",
    "SettingsReader",
    "WIRE_VERSION",
    "AuxRegion",
    "AuxRow",
    "AuxSchema",
    "BootstrapClient",
    "DecodeConfig",
    "DecodeEndpoint",
    "HeadGeometry",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "LayerPosts",
    "OwnerLanes",
    "PoolSpec",
    "PrefillConfig",
    "PrefillEndpoint",
    "PrefillInfo",
    "RawBuffer",
    "RoomSend",
    "RuntimeContract",
    "__version__",
    "contract_for",
    "contract_from_preset",
    "create_engine",
    "cuda_graph_note",
    "deepseek_pools",
    "diff_contracts",
    "engine_names",
    "fingerprint",
    "layerwise_slower",
    "mooncake_available",
    "preset_pools",
    "rank_heads",
    "room_binding",
    "sign_room",
    "signed_room_id",
    "check_room_id",
    "stage_specs",
    "start_bootstrap",
    "Extent",
    "compressed_pool",
    "deepseek_v4_pools",
    "describe_buffer",
    "lane_units",
    "mamba_pools",
    "needed_bytes",
    "needed_extent",
    "chunk_extent",
    "plan_kind",
    "state_pool",
    "state_slices",
    "state_tp_spec",
    "window_pool",
    "verify_room",
    "contract_weights",
    "weights_digest",
]
