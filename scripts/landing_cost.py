#!/usr/bin/env python
"""The host-side numpy work of one staged landing on decode, timed alone (no GPU, no sockets): for
each 64 MiB chunk of a V3.2 fp8 room (61+1 layers, CP 2, random pages, ``staged_layout_bench.build``
on the CPU), ``DecodeStaging.request`` and ``DecodeStaging.landed`` (the scatter list unpacked and
checked inside the slot and the room's pages: in the request from wire 16, in the landing before) and ``CudaStager.copy``'s host work before the kernel (its range checks: ``AddressRanges.hold``
of the entries ``Scatter.unproven`` names, every entry where the tree has no such proof; a copier that
records nothing stands in for the GPU), p50 over ``--reps`` passes; and on prefill's side each rank's
``CudaStager.gather`` of every chunk into its slot (the gather list and its range checks against the
rank's page buffers and gather area, no kernel); and each chunk's SlotRequest sealed (prefill) and
opened (decode) by the control codec with a cluster secret, beside HMAC-SHA256 (wire 16 and
before) and keyed BLAKE3 (wire 17) over the same frame's bytes, so the two MACs are compared in one
run. Run against an older tree (``PYTHONPATH=<tree>``) it times that tree's work the same way.

    PYTHONPATH=$PWD .venv/bin/python scripts/landing_cost.py [--tokens 8192] [--slot-mib 64] [--reps 50]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import sys
import time
from pathlib import Path

import blake3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--slot-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()

    import staged_layout_bench as slb

    from kvbridge.bench.alloc import allocate
    from kvbridge.layout import OwnerLanes, describe_buffer, preset_pools
    from kvbridge.transfer.channel import wire
    from kvbridge.transfer.engine import tensor_region
    from kvbridge.transfer.decode.staging import DecodeStaging
    from kvbridge.transfer.staging import StagingArea
    from kvbridge.transfer.staging.stagers import CudaStager

    class NoCopier:  # the stager's host work only: no kernel, no copies
        def launch(self, src, dst, length):  # noqa: ANN001, ANN202
            return None

        def copy_async(self, dst, src, nbytes):  # noqa: ANN001, ANN202
            raise AssertionError("no entry of these lists lies outside the device ranges")

        def record(self):  # noqa: ANN202
            return None

    w = slb.build(args.tokens, args.slot_mib, "cpu")
    specs = preset_pools(slb.PRESET, num_layers=slb.LAYERS, page_size=slb.PAGE, draft_layers=1)
    dst = [describe_buffer(specs[p], lid, t) for (p, lid), t in w["dst"].items()]
    lanes, num_pages = OwnerLanes(slb.CP), -(-args.tokens // slb.PAGE)
    src_cap = max(1, len(lanes.owned_pages(0, num_pages)))
    page_ids = np.asarray(allocate("random", num_pages, lanes, src_cap, num_pages, seed=args.tokens).page_ids, np.int64)
    slot_bytes, base = args.slot_mib << 20, 1 << 40
    regions = [(d.base, d.capacity_pages * d.bytes_per_page) for d in dst] + [(base, 4 * slot_bytes)]
    stager = CudaStager(copier=NoCopier(), device_ranges=regions)
    try:  # the stager's ranges vouch for the slot and the page buffers: Scatter.unproven
        ds = DecodeStaging(StagingArea(4, slot_bytes), base, dst, "decode", kernel_ranges=stager.ranges)
    except TypeError:  # a tree from before Scatter.unproven: every entry looked up
        ds = DecodeStaging(StagingArea(4, slot_bytes), base, dst, "decode")
    wire16 = "scatter" in wire.SlotRequest.__struct_fields__  # (wire 16: the list comes with the request)
    secret = b"landing-cost-secret"
    codec = wire.codec(secret)
    b3_key = blake3.blake3(secret, derive_key_context="landing_cost").digest()
    asked, landed, hold, slices = [], [], [], set()
    sealed, opened, mac_sha, mac_b3 = [], [], [], []
    n = 0
    for _ in range(args.reps):
        for sp in w["staged"]:
            for k in range(sp.num_chunks):
                off, to, length = sp.scatter(k, 0)
                slices.add(int(length.size))
                out: list = []
                n += 1
                packed = wire.pack_scatter(off, to, length)
                if wire16:  # the request as it travels with a cluster secret: sealed on prefill, opened on decode
                    ask = wire.SlotRequest(room=1, cp_rank=0, chunk=n, num_bytes=int(sp.chunk_span[k]), scatter=packed)
                    t = time.perf_counter()
                    frame = codec.encode(ask)
                    sealed.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    codec.decode(frame)
                    opened.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    hmac.new(secret, frame, hashlib.sha256).digest()
                    mac_sha.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    blake3.blake3(frame, key=b3_key).digest()
                    mac_b3.append(time.perf_counter() - t)
                t = time.perf_counter()
                if wire16:  # the list in the request, checked there; the landing only takes it
                    ds.request(1, (0, 0, 0), "prefill", wire.SlotRequest(room=1, cp_rank=0, chunk=n,
                                                                         num_bytes=int(sp.chunk_span[k]),
                                                                         scatter=packed), page_ids, -1, out)
                else:
                    ds.request(1, (0, 0, 0), "prefill", wire.SlotRequest(room=1, cp_rank=0, chunk=n,
                                                                         num_bytes=int(sp.chunk_span[k])), out)
                asked.append(time.perf_counter() - t)
                slot = out[-1].msg.slot
                if wire16:
                    msg = wire.ChunkLanded(room=1, cp_rank=0, chunk=n, slot=slot, status="ok", reason="")
                    t = time.perf_counter()
                    ds.landed(1, (0, 0, 0), msg, out)
                else:
                    msg = wire.ChunkLanded(room=1, cp_rank=0, chunk=n, slot=slot, status="ok", reason="", scatter=packed)
                    t = time.perf_counter()
                    ds.landed(1, (0, 0, 0), msg, page_ids, -1, out)
                landed.append(time.perf_counter() - t)
                sc = out[-1]
                unproven = getattr(sc, "unproven", None)
                t = time.perf_counter()
                if unproven is None:
                    stager.copy(sc.src, sc.dst, sc.length)
                else:
                    stager.copy(sc.src, sc.dst, sc.length, unproven=unproven)
                hold.append(time.perf_counter() - t)
                ds.scattered(1, slot, [])
    turn = np.add(landed, hold)
    # prefill's side: each rank's gathers into its slot, the stager's ranges its page buffers and its
    # gather area (what StagingBuffer gives it): the gather list and its range checks, no kernel
    gathers = []
    for r, sp in enumerate(w["staged"]):
        mine = [tensor_region(t) for t in w["src"][r].values()] + [(base, 2 * slot_bytes)]
        gstager = CudaStager(copier=NoCopier(), device_ranges=mine)
        for _ in range(args.reps):
            for k in range(sp.num_chunks):
                t = time.perf_counter()
                gstager.gather(sp, k, base)
                gathers.append(time.perf_counter() - t)
    print(f"{args.tokens} tokens, {args.slot_mib} MiB chunks ({min(slices)}-{max(slices)} slices), {len(landed)} "
          f"landings: DecodeStaging.request p50 {np.median(asked) * 1e3:.3f} ms (wire {16 if wire16 else '<16'}: "
          f"{'the list checked here' if wire16 else 'no list'}), "
          f"DecodeStaging.landed p50 {np.median(landed) * 1e3:.3f} ms, CudaStager.copy (range checks) p50 "
          f"{np.median(hold) * 1e3:.3f} ms, both p50 {np.median(turn) * 1e3:.3f} ms; {len(gathers)} gathers on "
          f"prefill: CudaStager.gather (the list and its range checks) p50 {np.median(gathers) * 1e3:.3f} ms")
    if sealed:
        print(f"SlotRequest with a cluster secret, {len(sealed)} chunks: sealed p50 {np.median(sealed) * 1e3:.3f} ms, "
              f"opened p50 {np.median(opened) * 1e3:.3f} ms (this tree's MAC); over the same frames HMAC-SHA256 p50 "
              f"{np.median(mac_sha) * 1e3:.3f} ms, keyed BLAKE3 p50 {np.median(mac_b3) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
