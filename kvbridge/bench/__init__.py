"""``kvbridge bench``: kvbridge end to end vs raw Mooncake batch writes vs memcpy, same buffers and slices."""

from kvbridge.bench.sweep import BenchSpec, run_sweep

__all__ = ["BenchSpec", "run_sweep"]
