"""Prefill and decode with a transformers model around paged pools.

    prefill   run the prompts (one shot or in chunks), keep the model's own cache
              (the colocated reference) and hand every step's new KV to the
              rank writers, which page the rows they own
    rebuild   the model's cache object from pages + page table + num_tokens
    decode    greedy generation from a cache, recording every step's logits

transformers has no paged attention and pads a batch to one length, so each
request runs as a batch of one through the model. The batch is real where
kvbridge sees it: requests share the pools, get interleaved random pages, and a
CP rank writes one step of the whole batch in one call, in rank-local order.

With a NextN/MTP draft (DeepSeek-V3) each prefill step also runs the draft
layer over the step's tokens shifted by one (token ``i+1`` with the last hidden
state of token ``i``, as transformers' MTP candidate generator does), so the
draft cache grows with the target's on the same pages; the last chunk uses the
first generated token. Decode runs the draft after every target step and
records its logits: they can only be bit-equal if the draft pages arrived intact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvbridge as kvb
from kvbridge.integrations.transformers.geometry import CacheGeometry, layer_tensors, merge_head_rows
from kvbridge.integrations.transformers.models import LoadedModel
from kvbridge.integrations.transformers.paged import ChunkKV, PagedKV, RankWriter, slots_of


@dataclass(eq=False)
class Prefilled:
    """One request after prefill on the rank that ran it: what the owner of
    the last token sends in the aux row (first token, last hidden state, the
    draft's logits for the token after), and the model's own caches."""

    index: int
    prompt: torch.Tensor
    first_token: int
    logits: torch.Tensor
    hidden: torch.Tensor
    cache: Any
    draft_cache: Any | None
    draft_logits: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return int(self.prompt.numel())


@dataclass(eq=False)
class Decoded:
    """Greedy decode of one request: ``tokens`` (the first token, then one per
    step), ``logits[i]`` of step ``i``, the draft's ``draft_logits[i]`` after it."""

    tokens: list[int]
    logits: torch.Tensor
    draft_logits: torch.Tensor | None


def _last_layer(lm: LoadedModel) -> list[int]:
    return [int(lm.config.num_hidden_layers) - 1]


def _new_caches(lm: LoadedModel) -> tuple[Any, Any | None]:
    from transformers.cache_utils import DynamicCache, MtpCache

    draft = MtpCache(config=lm.config.get_mtp_config()) if lm.draft is not None else None
    return DynamicCache(config=lm.config), draft


@torch.inference_mode()
def prefill(
    lm: LoadedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    chunk_size: int | None = None,
    writers: Sequence[RankWriter] = (),
    on_step: Callable[[Sequence[ChunkKV], Mapping[int, Prefilled]], None] | None = None,
) -> list[Prefilled]:
    """Prefill every prompt, ``chunk_size`` tokens per step (one shot without);
    after each step of the batch every writer pages the rows it owns, then
    ``on_step(chunks, done)`` runs (``done``: requests whose last chunk ran so far):
    where an engine sends the pages a step completed."""
    if chunk_size is not None and chunk_size < 1:
        raise kvb.ConfigError(f"chunk_size must be positive, got {chunk_size}", field="chunk_size")
    device = lm.device
    ids = [torch.as_tensor(p, dtype=torch.long).reshape(-1).to(device) for p in prompts]
    if any(t.numel() == 0 for t in ids):
        raise kvb.ConfigError("every prompt needs at least one token", field="prompts")
    caches = [_new_caches(lm) for _ in ids]
    done: dict[int, Prefilled] = {}
    longest = max(t.numel() for t in ids)
    step = chunk_size or longest
    for start in range(0, longest, step):  # bounded: ceil(longest / step) steps
        chunks = []
        for q, prompt in enumerate(ids):
            if start < prompt.numel():
                stop = min(start + step, prompt.numel())
                chunks.append(_prefill_chunk(lm, q, prompt, start, stop, *caches[q], done))
        for writer in writers:
            writer.write(chunks)
        if on_step is not None:
            on_step(chunks, done)
    return [done[q] for q in range(len(ids))]


def _prefill_chunk(
    lm: LoadedModel, q: int, prompt: torch.Tensor, start: int, stop: int, cache: Any, draft_cache: Any, done: dict
) -> ChunkKV:
    n = prompt.numel()
    positions = torch.arange(start, stop, device=prompt.device)[None]
    out = lm.model(
        prompt[None, start:stop],
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=_last_layer(lm),
        logits_to_keep=1,  # only the last position's, as generate() does: same shapes, same bits
    )
    hidden = out.hidden_states[-1]
    layers = [(layer.keys[:, :, start:stop], layer.values[:, :, start:stop]) for layer in cache.layers]
    first = int(out.logits[0, -1].argmax()) if stop == n else None
    draft_logits = None
    if lm.draft is not None:
        # draft row i pairs token i+1 with hidden state i; the last one needs the first generated token
        shifted = prompt[start + 1 : stop + 1]
        if stop == n:
            shifted = torch.cat([shifted, shifted.new_tensor([first])])
        _, draft_out, _ = lm.draft(
            input_ids=shifted[None],
            last_hidden_states=hidden,
            attention_mask=torch.ones(1, stop - start, dtype=torch.long, device=prompt.device),
            position_ids=positions + 1,
            mtp_cache=draft_cache,
        )
        draft_logits = draft_out[0, -1]
        layers += [(layer.keys[:, :, start:stop], layer.values[:, :, start:stop]) for layer in draft_cache.layers]
    if stop == n:
        done[q] = Prefilled(
            index=q,
            prompt=prompt,
            first_token=first,  # type: ignore[arg-type]
            logits=out.logits[0, -1].clone(),
            hidden=hidden[0, -1].clone(),
            cache=cache,
            draft_cache=draft_cache,
            draft_logits=draft_logits,
        )
    return ChunkKV(index=q, start=start, stop=stop, layers=layers)


def read_rows(
    geoms: Sequence[CacheGeometry], paged: Sequence[PagedKV], page_table: np.ndarray, num_tokens: int
) -> dict[str, torch.Tensor]:
    """Every pool's rows ``[layers, num_tokens, row_elems]`` of one request from
    its pages; with several decode TP ranks (``paged[j]`` holding the heads of
    ``geoms[j]``) the head slices are merged into whole rows."""
    page_size = next(iter(paged[0].specs.values())).page_size
    slots = slots_of(page_table, np.arange(num_tokens), page_size)
    out = {}
    for pool in paged[0].specs:
        parts = [p.read(pool, slots) for p in paged]
        out[pool] = parts[0] if len(parts) == 1 else merge_head_rows(geoms, parts)
    return out


@torch.inference_mode()
def rebuild_caches(
    lm: LoadedModel, geom: CacheGeometry, rows: dict[str, torch.Tensor]
) -> tuple[Any, Any | None]:
    """The model's cache objects (target ``DynamicCache``, draft ``MtpCache``)
    from whole rows per pool (``read_rows``); ``geom`` holds every head."""
    from transformers.cache_utils import DynamicCache, MtpCache

    device = lm.device
    per_layer = []
    for lid in range(geom.num_layers + (geom.draft_layers if "draft" in rows else 0)):
        pools = {}
        for pool in geom.pools_of_layer(lid):
            spec_ids = _layer_ids(geom, pool)
            pools[pool] = rows[pool][spec_ids.index(lid)].to(device)
        per_layer.append(layer_tensors(geom, lid, pools))
    cache = DynamicCache(ddp_cache_data=per_layer[: geom.num_layers], config=lm.config)
    draft_cache = None
    if lm.draft is not None and "draft" in rows:
        draft_cache = MtpCache(ddp_cache_data=per_layer[geom.num_layers :], config=lm.config.get_mtp_config())
    return cache, draft_cache


def _layer_ids(geom: CacheGeometry, pool: str) -> list[int]:
    if pool == "draft":
        return list(range(geom.num_layers, geom.num_layers + geom.draft_layers))
    return list(range(geom.num_layers))


@torch.inference_mode()
def decode(
    lm: LoadedModel, cache: Any, draft_cache: Any | None, first_token: int, num_tokens: int, max_new_tokens: int
) -> Decoded:
    """Greedy decode ``max_new_tokens`` steps after a prompt of ``num_tokens``
    whose first generated token is ``first_token`` (the aux row's)."""
    device = lm.device
    tokens, logits, draft_logits = [int(first_token)], [], []
    for step in range(max_new_tokens):
        pos = num_tokens + step
        out = lm.model(
            torch.tensor([[tokens[-1]]], device=device),
            position_ids=torch.tensor([[pos]], device=device),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=_last_layer(lm),
        )
        logits.append(out.logits[0, -1])
        tokens.append(int(out.logits[0, -1].argmax()))
        if lm.draft is not None and draft_cache is not None:
            _, d, _ = lm.draft(
                input_ids=torch.tensor([[tokens[-1]]], device=device),
                last_hidden_states=out.hidden_states[-1],
                attention_mask=torch.ones(1, 1, dtype=torch.long, device=device),
                position_ids=torch.tensor([[pos + 1]], device=device),
                mtp_cache=draft_cache,
            )
            draft_logits.append(d[0, -1])
    vocab = int(lm.config.vocab_size)
    return Decoded(
        tokens=tokens,
        logits=torch.stack(logits) if logits else torch.zeros(0, vocab),
        draft_logits=torch.stack(draft_logits) if draft_logits else None,
    )
