"""Window, compressed and state pools through the rooms between real processes over real
Mooncake: prefill CP ranks in child processes (``_kind_prefill_proc.py``), the decode rank in
this one, a real bootstrap daemon. A tiny DeepSeek-V4 (CSA + indexer, HCA, window, compressor
state, draft window) at CP 1, whole chunks and layer-wise (ranges of 2 target layers: each range
its layers of every kind pool), and a hybrid (paged window + Mamba conv/SSM state) at CP 2, chunked:
every byte of decode's pools equals the expected buffers (what decode needs, nothing else), and
the bytes the prefill ranks posted equal ``needed_bytes`` plus the aux row. V4 again staged only
(``staging="always"`` on both sides, 4 KiB slots): the same bytes, every one through a slot."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

import kvbridge as kvb
from _cluster import ChildProc
from _kind_rooms import AUX, buffers, contract, decode_pages, decode_units, differing, expected, model_specs
from kvbridge.bootstrap.client import BootstrapClient
from kvbridge.transfer.decode import DecodeConfig, DecodeEndpoint

pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not kvb.mooncake_available(), reason="Mooncake not installed")]

HERE = Path(__file__).parent


class Proc(ChildProc):
    """One prefill rank of a kind model in a child process (``_kind_prefill_proc.py``)."""

    def __init__(self, url: str, instance: str, model: str, cp_rank: int, cp_size: int, staging: str = "never",
                 slot_bytes: int = 0) -> None:
        cmd = [sys.executable, str(HERE / "_kind_prefill_proc.py"), "--bootstrap", url, "--instance", instance,
               "--model", model, "--cp-rank", str(cp_rank), "--cp-size", str(cp_size), "--staging", staging,
               "--slot-bytes", str(slot_bytes)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
        super().__init__(cmd, f"kind prefill process {instance}/cp{cp_rank}", env)

    def send(self, room: int, n: int, cuts: tuple[int, ...], width: int | None = None) -> None:
        self.command(op="send", room=room, num_tokens=n, cuts=list(cuts), width=width)

    def result(self) -> dict:
        return self._next(120)


@pytest.mark.parametrize("model, cp, rooms, staging, digest", [
    # layer ranges of 2; decode checks the digests of every page and kind unit (verify_digest)
    ("v4", 1, [(131, (40, 96), None), (45, (), None), (131, (40, 96), 2), (45, (), 2)], "never", True),
    ("hybrid", 2, [(30, (13, 21), None), (22, (9,), None)], "never", False),
    # staged only, 4 KiB slots: every write of every kind through decode's staging slots, many chunks
    ("v4", 1, [(131, (40, 96), None), (45, (), None)], "always", True),
])
def test_kind_pools_between_processes_move_exactly_what_decode_needs(daemon, model, cp, rooms, staging, digest):
    specs = model_specs(model)
    instance = f"kmc-{model}-{staging}"
    slot_bytes = 4096 if staging != "never" else 0
    procs, client, d = [], BootstrapClient(daemon.url), None
    try:
        for rank in range(cp):
            procs.append(Proc(daemon.url, instance, model, rank, cp, staging, slot_bytes))
        dst = buffers(specs, None)
        cfg = DecodeConfig(instance=f"{instance}-d", staging=staging, staging_slot_bytes=slot_bytes,
                           verify_digest=digest)
        d = DecodeEndpoint(cfg, kvb.create_engine("mooncake"), specs, dst, contract(specs), client,
                           torch.zeros((4, AUX.row_bytes), dtype=torch.uint8), AUX)
        d.start()
        src = buffers(specs, seed=11)  # what the prefill processes hold
        for i, (n, cuts, width) in enumerate(rooms):
            room = 800 + 10 * cp + i
            for t in dst.values():
                t.view(torch.uint8).zero_()
            rx = d.receiver(room, instance)
            rx.init(decode_pages(n), i % 4, n, kind_units=decode_units(specs, n, slot=3 + i))
            for p in procs:
                p.send(room, n, cuts, width)
            results = [p.result() for p in procs]
            deadline = time.monotonic() + 30
            while rx.poll() not in (kvb.KVPoll.Success, kvb.KVPoll.Failed) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rx.poll() == kvb.KVPoll.Success, rx.failure_reason
            assert all(r["state"] == "Success" for r in results), results
            assert differing(specs, dst, expected(specs, src, n, slot=3 + i)) == []
            needed = sum(kvb.needed_bytes(s, n) for s in specs.values())
            row = 0 if d.aux_inline else AUX.row_bytes  # (inline: the aux row in its report, no byte posted)
            assert sum(r["bytes"] for r in results) == needed + row
            if staging == "always":  # nothing went direct; the state (and a written aux row) rode in the chunks
                assert sum(r["bytes_staged"] for r in results) == needed + row, results
                assert all(set(r["paths"].values()) == {"staged"} for r in results), results
                assert sum(r["chunks"] for r in results) > 2, results
            rx.close()
    finally:
        if d is not None:
            d.close(timeout=2)
        for p in procs:
            p.stop()
        client.close()
