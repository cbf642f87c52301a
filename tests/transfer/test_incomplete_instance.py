"""A half-registered prefill instance: the daemon's 503 names the missing sender ranks,
the client's InstanceIncomplete carries them, and a decode room that times out in
Bootstrapping says which ranks never came (issue 10, bug 4). Real daemon process,
real endpoints (local engine: no byte moves here)."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.errors import InstanceIncomplete
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint
from kvbridge.transfer.engine import create_engine
from kvbridge.transfer.engine.local import LocalFabric
from kvbridge.transfer.poll import KVPoll
from kvbridge.transfer.prefill import PrefillConfig, PrefillEndpoint
from kvbridge.worker.resources import allocate_buffers, aux_schema_of, build_contract, build_specs

PAGE, LAYERS = 4, 2


def test_bootstrap_timeout_names_the_ranks_that_never_registered(daemon) -> None:
    specs = build_specs("deepseek-v3.2-fp8", LAYERS, PAGE, 1)
    contract = build_contract("deepseek-v3.2-fp8", LAYERS, PAGE, 1, "interleaved")
    schema = aux_schema_of(contract)
    fabric = LocalFabric()
    clients = [BootstrapClient(daemon.url) for _ in range(3)]
    # CP=3 prefill instance, only cp1 comes up
    prefill = PrefillEndpoint(PrefillConfig(instance="half-p", cp_rank=1, cp_size=3), create_engine("local", fabric=fabric),
                              specs, allocate_buffers(specs, 16), contract, clients[0], schema)
    aux = torch.zeros((4, schema.row_bytes), dtype=torch.uint8)
    decode = DecodeEndpoint(DecodeConfig(instance="half-d", bootstrap_timeout=1.0), create_engine("local", fabric=fabric),
                            specs, allocate_buffers(specs, 16), contract, clients[1], aux, schema)
    prefill.start()
    decode.start()
    try:
        with pytest.raises(InstanceIncomplete) as exc:
            clients[2].lookup("half-p", room=5, contract=decode.contract, rank=decode.identity)  # its transport
        assert exc.value.missing == ["half-p/dp0/cp0/tp0/pp0", "half-p/dp0/cp2/tp0/pp0"]
        assert "half-p/dp0/cp0/tp0/pp0" in str(exc.value) and "503" in str(exc.value)
        raw = httpx.post(f"{daemon.url}/v1/lookup", trust_env=False, json={
            "prefill_instance": "half-p", "room": 5, "contract": decode.contract.model_dump(mode="json"),
            "rank": {"instance": "half-d", "role": "decode"}})
        assert raw.status_code == 503 and raw.json()["missing"] == exc.value.missing

        receiver = decode.receiver(5, "half-p")
        deadline = time.monotonic() + 20
        while receiver.poll() != KVPoll.Failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.poll() == KVPoll.Failed
        reason = receiver.failure_reason or ""
        assert "bootstrap timeout" in reason
        assert "half-p/dp0/cp0/tp0/pp0" in reason and "half-p/dp0/cp2/tp0/pp0" in reason, reason
    finally:
        decode.close(timeout=2)
        prefill.close(timeout=2)
        for c in clients:
            c.close()
