"""Prefill and decode on different transfer engines: refused at the handshake (409) with the
field diff, never a hang or a write. The endpoints stamp their engine's transport into the
contract; a Mooncake contract keeps the fingerprint it had before the field existed."""

from __future__ import annotations

import numpy as np
import pytest

from _cluster import DecodeRank, PrefillProc
from _engines import needs_mooncake, needs_nixl
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.bootstrap.contract import canonical_json
from kvbridge.bootstrap.diff import diff_contracts
from kvbridge.errors import ContractMismatch
from kvbridge.worker.resources import build_contract


def test_the_transport_is_in_the_fingerprint_except_mooncakes() -> None:
    contract = build_contract("deepseek-v3.2-fp8", 2, 4, 1, "interleaved")
    assert contract.transport == "mooncake"
    assert contract.with_transport("mooncake") is contract
    assert b"transport" not in canonical_json(contract)  # the encoding of contracts before the field
    on_nixl = contract.with_transport("nixl")
    assert on_nixl.fingerprint() != contract.fingerprint()
    assert b'"transport":"nixl"' in canonical_json(on_nixl)
    (d,) = diff_contracts(contract, on_nixl)
    assert (d.path, d.prefill, d.decode) == ("transport", "mooncake", "nixl")
    assert "different transfer engines" in d.breaks


@pytest.mark.parametrize(("prefill_engine", "decode_engine"), [pytest.param("mooncake", "nixl",
                                                                            marks=[*needs_mooncake, *needs_nixl])])
def test_sides_on_different_engines_are_refused_at_the_handshake_with_the_diff(daemon, prefill_engine,
                                                                               decode_engine) -> None:
    p = PrefillProc(daemon.url, 0, 1, instance="mismatch-p", engine=prefill_engine)
    d = DecodeRank(daemon.url, instance="mismatch-d", engine=decode_engine)
    try:
        r = d.ep.receiver(9001, "mismatch-p")
        r.init(np.arange(4), 0, 16)
        with pytest.raises(ContractMismatch) as err:
            r.wait_bootstrapped(20)
        paths = {(x["path"], x["prefill"], x["decode"]) if isinstance(x, dict) else (x.path, x.prefill, x.decode)
                 for x in err.value.diff}
        assert ("transport", prefill_engine, decode_engine) in paths, paths
        assert d.untouched_except(np.array([], dtype=np.int64))
        # the daemon keeps the refusal, with its diff, for the diagnostics endpoint
        with BootstrapClient(daemon.url) as c:
            recent = c.mismatches()
        assert any("transport" in str(m) for m in recent)
    finally:
        d.close()
        p.stop()
