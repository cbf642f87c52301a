"""Model mode: a transformers causal LM produces and consumes the KV pages that
kvbridge moves, so a disaggregated run can be compared with a colocated one
byte for byte, logit for logit and token for token.

    models.py     tiny-qwen2 / tiny-deepseek-v3 (built locally, cached) or a local HF directory
    geometry.py   what the model caches, as pools (GQA k/v, MLA target + draft), rows <-> cache tensors
    paged.py      a rank's paged pools, page allocator, CP rank writer (owned pages only)
    runner.py     prefill (one shot or chunked) -> pages; pages -> cache; greedy decode
    check.py      bytes equal, poison intact, logits bit-equal, tokens equal
    rank.py       one rank: model + pools + paged buffers + contract (contract_for) + aux row
    v4.py         DeepSeek-V4's cache <-> its window, compressed and state pools; v4_rooms.py: through the rooms
    kind_rooms.py any model's pools through the rooms at any prefill CP size (CP simulated); hybrid.py: HybridRooms

``import kvbridge`` never imports this package; this package imports torch, and
transformers (an optional extra, ``pip install kvbridge[model]``) only when a
model is built, loaded or run.
"""

from kvbridge.integrations.transformers.check import (
    RequestCheck,
    bits_equal,
    check_request,
    colocated_rows,
    compare_pages,
    rows_diff,
    untouched_bytes,
)
from kvbridge.integrations.transformers.geometry import (
    GQA,
    MLA,
    CacheGeometry,
    cache_geometry,
    layer_rows,
    layer_tensors,
    merge_head_rows,
    model_pools,
    pools_of,
)
from kvbridge.integrations.transformers.models import (
    TINY_MODELS,
    LoadedModel,
    cache_root,
    load_model,
    model_identity,
    tiny_model_dir,
    weights_digest,
)
from kvbridge.integrations.transformers.paged import (
    DST_POISON,
    SRC_STALE,
    ChunkKV,
    PageAllocator,
    PagedKV,
    RankWriter,
    slots_of,
)
from kvbridge.integrations.transformers.rank import ModelRank, aux_values, model_aux_schema, model_contract
from kvbridge.integrations.transformers.runner import Decoded, Prefilled, decode, prefill, read_rows, rebuild_caches

__all__ = [
    "DST_POISON",
    "GQA",
    "MLA",
    "ModelRank",
    "SRC_STALE",
    "TINY_MODELS",
    "aux_values",
    "CacheGeometry",
    "ChunkKV",
    "Decoded",
    "LoadedModel",
    "PageAllocator",
    "PagedKV",
    "Prefilled",
    "RankWriter",
    "RequestCheck",
    "bits_equal",
    "cache_geometry",
    "cache_root",
    "check_request",
    "colocated_rows",
    "compare_pages",
    "decode",
    "layer_rows",
    "layer_tensors",
    "load_model",
    "merge_head_rows",
    "model_aux_schema",
    "model_contract",
    "model_identity",
    "model_pools",
    "pools_of",
    "prefill",
    "read_rows",
    "rebuild_caches",
    "rows_diff",
    "slots_of",
    "tiny_model_dir",
    "untouched_bytes",
    "weights_digest",
]
