"""Pure geometry and planning: pools, pages, owner lanes, row domains and
transfer plans. No I/O, no threads, no device calls."""

from kvbridge.layout.pools import PRESETS, PoolSpec, deepseek_pools, preset_pools

__all__ = ["PRESETS", "PoolSpec", "deepseek_pools", "preset_pools"]
