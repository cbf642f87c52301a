"""Endpoints compare pool specs, aux schema, aux storage and lane rule with the contract
when they are built (issue 8 bugs 3 and 4): a ConfigError names the field, both values
and what it would break, before anything is registered or sent."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from _models import kv_fp32, region_tensors, token_major_buffers
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.errors import ConfigError
from kvbridge.layout import AuxSchema
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine import create_engine
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint
from kvbridge.worker.resources import allocate_buffers, build_contract, build_specs

NOWHERE = "http://127.0.0.1:9"  # never contacted: every check runs before the endpoint talks to anyone


@pytest.fixture
def client():
    c = BootstrapClient(NOWHERE)
    c.engine = create_engine("local")  # one engine for every endpoint a test builds (none is started)
    yield c
    c.engine.close()
    c.close()


def prefill(client, specs, contract, aux_schema, buffers=None, **cfg):
    engine = client.engine if client is not None else create_engine("local")
    try:
        return PrefillEndpoint(PrefillConfig(instance="p", **cfg), engine, specs,
                               buffers if buffers is not None else allocate_buffers(specs, 8), contract, client,
                               aux_schema)
    finally:
        if client is None:
            engine.close()


def decode(client, specs, contract, aux_schema, aux_buffer):
    return DecodeEndpoint(DecodeConfig(instance="d"), client.engine, specs, token_major_buffers(specs, 8),
                          contract, client, aux_buffer, aux_schema)


def test_a_lane_rule_other_than_the_contracts_is_refused(client):
    """Bug 3: contiguous lanes under an interleaved contract wrote every page, then failed on decode."""
    specs = build_specs("deepseek-v3.2-fp8", 2, 4, 1)
    contract = build_contract("deepseek-v3.2-fp8", 2, 4, 1, "interleaved")
    with pytest.raises(ConfigError, match="cp_rule: the lane_rule says 'contiguous', the contract says 'interleaved': "
                                          "decode would expect each logical page from a different CP owner") as err:
        prefill(client, specs, contract, contract.aux.to_schema(), cp_size=2, lane_rule="contiguous")
    assert err.value.field == "cp_rule" and err.value.rank == "p/dp0/cp0/tp0/pp0"


def test_pool_specs_other_than_the_contracts_are_refused(client):
    """Bug 4: bf16 specs under a float32 contract transferred with Success."""
    specs, contract, aux = kv_fp32(2, 4)
    bf16 = {name: dataclasses.replace(s, dtype="bfloat16", abi="bfloat16") for name, s in specs.items()}
    with pytest.raises(ConfigError, match="pools.k.dtype: the endpoint says 'bfloat16', the contract says 'float32': "
                                          "'k' pages would be reinterpreted as another element type") as err:
        prefill(client, bf16, contract, aux)
    assert err.value.field == "pools.k.dtype"
    with pytest.raises(ConfigError, match=r"pools: the endpoint says \['k'\], the contract says \['k', 'v'\]"):
        decode(client, {"k": specs["k"]}, contract, aux, region_tensors(aux, 4))


def test_an_aux_schema_other_than_the_contracts_is_refused(client):
    """Bug 4: a 288-byte aux row under a 24-byte contract transferred with Success."""
    specs = build_specs("deepseek-v3", 2, 4, 0)
    contract = build_contract("deepseek-v3", 2, 4, 0, "interleaved")  # no speculation: the 24-byte row
    wide = AuxSchema.standard(128, "bfloat16", 1)
    assert (wide.row_bytes, contract.aux.row_bytes) == (288, 24)
    with pytest.raises(ConfigError, match="aux.row_bytes: the endpoint says 288, the contract says 24: the aux row"):
        prefill(client, specs, contract, wide)
    renamed = AuxSchema(tuple(dataclasses.replace(r, name="first") if r.name == "first_token" else r
                              for r in AuxSchema.standard(0, "bfloat16", 0).regions))  # same size, another meaning
    with pytest.raises(ConfigError, match="aux.regions: the endpoint says .*'first:int32'.*the contract says"):
        prefill(client, specs, contract, renamed)


def test_aux_storage_that_does_not_fit_the_schema_is_refused(client):
    specs, contract, aux = kv_fp32(2, 4)
    with pytest.raises(ConfigError, match=rf"aux rows must be a contiguous uint8 tensor \[rows, {aux.row_bytes}\]"):
        decode(client, specs, contract, aux, torch.zeros((4, 24), dtype=torch.uint8))
    regions = region_tensors(aux, 4)
    regions["room"] = torch.zeros((4, 8), dtype=torch.int64)
    with pytest.raises(ConfigError, match=r"aux region 'room': expected a contiguous uint64 tensor \[rows, 8\], got "
                                          r"int64 \[4, 8\]") as err:
        decode(client, specs, contract, aux, regions)
    assert err.value.field == "aux_buffer['room']"
    with pytest.raises(ConfigError, match=r"aux regions \['room'\] given, the schema has"):
        decode(client, specs, contract, aux, {"room": regions["room"]})
    packed = decode(client, specs, contract, aux, np.zeros((4, aux.row_bytes), dtype=np.uint8))
    assert packed.aux.packed and packed.aux.capacity_rows == 4


def test_a_prefill_endpoint_needs_a_bootstrap_client():
    specs, contract, aux = kv_fp32(2, 4)
    with pytest.raises(ConfigError, match="needs a BootstrapClient"):
        prefill(None, specs, contract, aux, buffers=token_major_buffers(specs, 8))
