"""The public surface is pinned: adding or removing a name is a deliberate act.
``import kvbridge`` works without the transfer engine, torch or FastAPI loaded."""

from __future__ import annotations

import subprocess
import sys

import kvbridge
import kvbridge.errors as errors
import kvbridge.transfer as transfer

EXPECTED = {
    *errors.__all__,
    "PRESETS", "STAGING_MODES", "SettingsReader", "WIRE_VERSION", "AuxRegion", "AuxRow", "AuxSchema", "BootstrapClient", "DecodeConfig", "DecodeEndpoint", "HeadGeometry", "KVPoll",
    "KVReceiver", "KVSender", "OwnerLanes", "PoolSpec", "PrefillConfig", "PrefillEndpoint", "PrefillInfo", "RawBuffer",
    "RuntimeContract",
    "__version__", "contract_for", "contract_from_preset", "create_engine", "deepseek_pools", "diff_contracts",
    "engine_names", "fingerprint", "mooncake_available", "preset_pools", "rank_heads", "stage_specs", "start_bootstrap",
    "PRESETS", "WIRE_VERSION", "AuxRegion", "AuxRow", "AuxSchema", "BootstrapClient", "DecodeConfig", "DecodeEndpoint", "HeadGeometry", "KVPoll",
    "KVReceiver", "KVSender", "LayerPosts", "OwnerLanes", "PoolSpec", "PrefillConfig", "PrefillEndpoint", "PrefillInfo", "RawBuffer",
    "RoomSend", "RuntimeContract",
    "__version__", "contract_for", "contract_from_preset", "create_engine", "cuda_graph_note", "deepseek_pools", "diff_contracts",
    "fingerprint", "mooncake_available", "preset_pools", "rank_heads", "stage_specs", "start_bootstrap",
    # pool kinds (issue 30)
    "Extent", "chunk_extent", "compressed_pool", "deepseek_v4_pools", "describe_buffer", "lane_units", "mamba_pools", "needed_bytes", "needed_extent",
    "plan_kind", "state_pool", "state_slices", "state_tp_spec", "window_pool", "ROOM_POOL_KINDS",
    "room_binding", "sign_room", "verify_room", "weights_digest", "contract_weights",
    "layerwise_slower",  # issue 33, round 20: the vLLM connector's layerwise auto
    "signed_room_id", "check_room_id",
}


def test_top_level_names_are_pinned_and_resolve():
    assert set(kvbridge.__all__) == EXPECTED and len(kvbridge.__all__) == len(EXPECTED)
    for name in kvbridge.__all__:
        assert getattr(kvbridge, name) is not None


def test_room_pool_kinds_is_a_frozenset_of_known_kinds():
    from kvbridge.layout.pools import KINDS

    assert isinstance(kvbridge.ROOM_POOL_KINDS, frozenset) and "paged" in kvbridge.ROOM_POOL_KINDS
    assert kvbridge.ROOM_POOL_KINDS <= set(KINDS)


def test_transfer_names_are_pinned():
    assert set(transfer.__all__) == {
        "ENGINE_KINDS", "DecodeConfig", "DecodeEndpoint", "KVPoll", "KVReceiver", "KVSender", "PrefillConfig",
        "PrefillEndpoint", "PrefillInfo", "TransferEngine", "WriteState", "WriteStatus", "create_engine", "mooncake_available",
    }


def test_every_error_descends_from_the_root():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.KVBridgeError)


def test_error_messages_carry_room_rank_and_field():
    err = errors.PageRangeError("page 9 outside 8 pages", room=7, rank="cp1", field="page_ids")
    assert str(err) == "page 9 outside 8 pages [room=7 rank=cp1 field=page_ids]"


def test_import_is_light():
    code = "import sys, kvbridge; print(sorted(m for m in ('torch', 'mooncake', 'fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


# the integrations import only the public names above: tests/integrations/test_public_api_rule.py
