"""kvbridge: move an LLM request's KV cache from prefill ranks to decode ranks."""

from kvbridge.errors import *  # noqa: F401,F403
from kvbridge.errors import __all__ as _errors_all
from kvbridge.layout import PRESETS, PoolSpec, deepseek_pools, preset_pools

__version__ = "0.1.0"

__all__ = [*_errors_all, "PRESETS", "PoolSpec", "deepseek_pools", "preset_pools", "__version__"]
