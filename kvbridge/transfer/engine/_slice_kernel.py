"""The slice-copy kernel (Triton); imported by ``slicecopy`` on GPU hosts only."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pieces"])
def copy_pieces(base_w, base_b, table, num_pieces, WORDS: tl.constexpr, BYTES: tl.constexpr):
    """Program p copies pieces p, p + P, ...; ``table[i] = (source, destination, bytes)``, the two
    addresses as byte offsets from ``base`` (``base_w`` its int32 view, ``base_b`` its uint8 view)."""
    step = tl.num_programs(0)
    for i in range(tl.program_id(0), num_pieces, step):
        s = tl.load(table + 3 * i)
        d = tl.load(table + 3 * i + 1)
        n = tl.load(table + 3 * i + 2)
        if ((s | d | n) & 15) == 0:  # all three multiples of 16: 16-byte vectors of four int32 words
            sw = tl.multiple_of(s // 4, 4)
            dw = tl.multiple_of(d // 4, 4)
            nw = tl.multiple_of(n // 4, 4)
            for start in range(0, nw, WORDS):
                start = tl.multiple_of(start, WORDS)
                o = start + tl.arange(0, WORDS)
                m = o < nw
                tl.store(base_w + dw + o, tl.load(base_w + sw + o, mask=m), mask=m)
        else:  # byte by byte (scale bytes of a partial index-K page, an aux row)
            for start in range(0, n, BYTES):
                o = start + tl.arange(0, BYTES)
                m = o < n
                tl.store(base_b + d + o, tl.load(base_b + s + o, mask=m), mask=m)
