"""Grouped-query decoding without repeated keys: the attention the transformers backends switch to while they decode.

transformers 5.17 (the version vLLM 0.31 allows) runs sdpa with ``enable_gqa`` only when no mask is given; with a
mask (left padding, or the ``[prefix | padding | rest]`` layout of a prefix cache) it first repeats every key and value
head once per query head in its group (``repeat_kv``). A decoding step then copies the whole cache of every row,
which is what made wave-batched decoding with a prefix cache cost as much as the rows one at a time (transformers
5.24 packs the query heads instead; measured in benchmarks/rollout_bench.py). ``grouped_decode_attention`` does that
packing here: for one query token, the g query heads sharing a key head become g query rows of that head, so sdpa
reads each key head once. Longer queries (prefill) go to transformers' sdpa unchanged.

``use_attention(model, name)`` switches a model's attention implementation for one call and back, so the model
never stays on a custom implementation (the trainer's loss forward sees its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_DECODE_NAME = "airline_grouped_decode"


def grouped_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor, scaling: float | None
) -> tuple[torch.Tensor, None]:
    """One decoding step (query [B, H, 1, d]) over unrepeated keys/values [B, Hkv, S, d] with a mask [B, 1, 1, ≥S].

    Returns [B, 1, H, d] like transformers' sdpa."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # [B, Hkv, g, d]: head h uses key head h // g
    mask = attention_mask[:, :, :, -key.shape[2] :]  # the same row for every grouped query
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim), None


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa, except a masked single-token query of grouped-query attention (no ``repeat_kv``)."""
    if query.shape[2] == 1 and attention_mask is not None and query.shape[1] != key.shape[1] and not dropout:
        return grouped_decode_attention(query, key, value, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def register_grouped_decode() -> None:
    """Registers ``GROUPED_DECODE_NAME`` with transformers (sdpa's masks; idempotent)."""
    AttentionInterface.register(GROUPED_DECODE_NAME, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_DECODE_NAME, sdpa_mask)


@contextlib.contextmanager
def use_attention(model: Any, name: str) -> Iterator[None]:
    """``model`` runs with attention implementation ``name`` inside the block and with its own one after it."""
    original = model.config._attn_implementation
    if original == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
