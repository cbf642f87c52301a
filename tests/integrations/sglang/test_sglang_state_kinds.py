"""SGLang's MAMBA state component as kvbridge state pools (integrations/sglang/state_kinds.py),
from ``KVArgs.state_*`` as SGLang 0.5.23's ``MambaPool`` fills them (tensor-major x layer, one
slot per item, the conv tensor's q/k/v sub-block dims); SGLang's ``MambaPool`` needs its model's
cache params to construct, so the lists are written here as its methods return them. A TP-2
rank's slot and a TP-1 rank's describe one contract, and ``state_slices`` moves a TP-2 prefill
rank pair's slots into a TP-1 decode slot."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvbridge as kvb
from kvbridge import ConfigError
from kvbridge.integrations.sglang.state_kinds import mamba_state_specs

KEY, VALUE, HEADS, HEAD_V, HEAD_K, CONV_K = 32, 64, 4, 16, 16, 4  # GDN: conv channels = 2*key + value


def _kv_args(tp: int, layers=(0, 2, 4)):
    conv_local = (2 * KEY + VALUE) // tp
    conv_item = conv_local * (CONV_K - 1) * 2  # bf16 [channels, K-1]
    ssm_item = HEADS // tp * HEAD_V * HEAD_K * 4  # fp32 [heads, v, k]
    n = len(layers)
    return SimpleNamespace(
        state_types=[SimpleNamespace(value="mamba")],
        state_item_lens=[[conv_item] * n + [ssm_item] * n],
        state_layer_ids=[list(layers) * 2],
        state_dim_per_tensor=[[conv_local] * n + [HEADS // tp] * n],
        state_slice_outer_counts=[[1] * 2 * n],
        state_conv_shard_groups=[[[KEY, KEY, VALUE]] * n + [None] * n],
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mamba_tensors_become_state_pools(tp):
    specs = mamba_state_specs(_kv_args(tp), tp)
    conv, ssm = specs["mamba_0"], specs["mamba_1"]
    assert (conv.kind, conv.shard_units, conv.unit_bytes, conv.layer_ids) == ("state", (KEY, KEY, VALUE), 6, (0, 2, 4))
    assert (ssm.shard_units, ssm.unit_bytes) == ((HEADS,), HEAD_V * HEAD_K * 4)
    aux = kvb.AuxSchema.standard(0, "bfloat16", 0)
    assert kvb.contract_for(specs, model="m", aux=aux).fingerprint() == \
        kvb.contract_for(mamba_state_specs(_kv_args(1), 1), model="m", aux=aux).fingerprint()


def test_a_tp2_prefill_pair_fills_a_tp1_decode_slot():
    full = mamba_state_specs(_kv_args(1), 1)["mamba_0"]
    whole = np.arange(full.bytes_per_token, dtype=np.int64)
    ub = full.unit_bytes

    def part(tp, r):
        out, at = [], 0
        for g in full.shard_units:
            out.append(whole[at + r * g // tp * ub: at + (r + 1) * g // tp * ub])
            at += g * ub
        return np.concatenate(out)

    got = np.full(len(whole), -1)
    for p in range(2):
        src = part(2, p)
        for so, do, ln in zip(*kvb.state_slices(full, 2, p, 1, 0)):
            got[do: do + ln] = src[so: so + ln]
    assert (got == whole).all()


def test_what_does_not_fit_is_refused_by_name():
    args = _kv_args(2)
    args.state_slice_outer_counts = [[3] * 6]
    with pytest.raises(ConfigError) as err:
        mamba_state_specs(args, 2)
    assert err.value.field == "pools.mamba_0.state_slice_outer_counts"
    args = _kv_args(2)
    args.state_conv_shard_groups = [[[KEY, KEY, 2 * VALUE]] * 3 + [None] * 3]
    with pytest.raises(ConfigError, match="do not add up"):
        mamba_state_specs(args, 2)
    with pytest.raises(ConfigError, match="no mamba state"):
        mamba_state_specs(SimpleNamespace(state_types=["swa"]), 1)
