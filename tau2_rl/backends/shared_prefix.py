"""``SharedPrefixTransformersBackend``: batched generation that reads the shared system-prompt KV once per step.

``TransformersBackend`` with ``prefix_cache=True`` computes the key/value cache of the prompt prefix that every
episode shares (system prompt, policy, tool schemas, greeting: about 7,000 tokens for the tiny tokenizer, 4,000 for
Qwen2.5) once, but then copies it into every row of the batch: ``generate`` concatenates the whole cache again at
every decoding step, so a batch of B rows moves B × prefix bytes per step. On a CPU that memory traffic, not compute,
is the cost, and batching 40 episodes saves next to nothing over playing them one at a time.

This backend keeps the prefix's keys and values once (batch 1) and gives ``generate`` only the per-episode rest:
the cache holds each row's own tokens, position ids start after the prefix, and a registered attention function
("airline_shared_prefix") attends to both parts and merges them exactly (cascade attention: one softmax over the
concatenation, computed from the two partial log-sum-exps). The prefix part is one attention call per layer with
every row's queries stacked (torch's fused CPU kernel, which also returns the log-sum-exp; two matrix products on
other devices), so the prefix is read once per step whatever the batch size. Queries are processed in chunks to bound
the score matrices. A batch of one row uses the parent's path (one copy of the prefix, fused sdpa).
The model runs on that attention only inside this backend's calls (``use_attention``); building the prefix, one-row
batches and anything else the model does (the trainer's loss) keep its own implementation.

Correctness: on its first use the backend compares the next-token logits of one prompt through this path and through
the parent's materialised-prefix path and falls back to the parent (with a warning) if they differ; models with
sliding-window layers use the parent directly. Outputs equal plain ``generate`` up to float rounding.

Turn caching (``turn_cache_tokens`` > 0, ``tau2_rl.backends.turn_cache``): each episode's own KV (after the
prefix) is kept between waves, so a wave prefills only the tokens added since the episode's last turn. A batch then
starts from a cache holding every row's reused tokens, right-aligned, ``[padding | cached]``, followed by the new
tokens ``[padding | new]``; the mask and the position ids (continuing each row's own count) make every row see
exactly its unpadded sequence. One-row batches take this path too while turn caching is on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401 - tests wrap it
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from tau2_rl.backends import TransformersBackend, _StepClock
from tau2_rl.backends.attention import grouped_sdpa_attention, use_attention
from tau2_rl.backends.turn_cache import DEFAULT_MAX_TOKENS, CachedTurn, TurnCache

logger = logging.getLogger(__name__)

ATTENTION_NAME = "airline_shared_prefix"
PREFIX_ATTRIBUTE = "_airline_shared_prefix_kv"
MAX_SCORE_ELEMENTS = 1 << 24
"""Largest score matrix (elements) one query chunk may build; bounds memory during long prefills."""


def _full_bool_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """``sdpa_mask`` that always materialises the boolean mask (the attention below needs it explicitly)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""torch's fused CPU attention kernel; unlike ``scaled_dot_product_attention`` it also returns the log-sum-exp."""


def _prefix_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of scaled ``queries`` [Hkv, N, d] over the whole prefix [Hkv, P, d]: (output, log-sum-exp).

    On CPU the fused kernel never builds the [N, P] score matrix (measured 5x faster than the matmuls for a prefill
    chunk of 16 rows); elsewhere two matrix products."""
    if fused:
        out, lse = _FUSED_CPU(queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), scale=1.0)
        return out[0], lse[0]
    scores = torch.bmm(queries, keys.transpose(1, 2))
    top = scores.amax(-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(-1, keepdim=True)
    return torch.bmm(weights, values) / total, (top + total.log()).squeeze(-1)


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over [shared prefix (batch 1) | each row's own keys]; sdpa when the module has no prefix attached.

    query [B, H, q, d]; key/value [B, Hkv, S, d] (the row's own tokens); the prefix [1, Hkv, P, d] is visible to every
    query; ``attention_mask`` [B, 1, q, S] (True: attend) covers the row's own part. Returns [B, q, H, d] like sdpa.
    """
    prefix = getattr(module, PREFIX_ATTRIBUTE, None)
    if prefix is None:
        return grouped_sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    prefix_keys, prefix_values = prefix
    batch, heads, q_len, dim = query.shape
    kv_heads, own_len, prefix_len = key.shape[1], key.shape[2], prefix_keys.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    # [B, Hkv, g, q, d]: query head h uses key head h // g (as repeat_kv does)
    grouped = query.reshape(batch, kv_heads, groups, q_len, dim)
    mask = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:  # an additive float mask: keep the positions that are not -inf-like
            attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        mask = attention_mask[..., -own_len:].expand(batch, 1, q_len, own_len)
    fused = query.device.type == "cpu" and _FUSED_CPU is not None
    # score elements one query builds: the own part, plus the prefix part unless a fused kernel attends to it
    per_query = batch * heads * (own_len if fused else prefix_len + own_len)
    chunk = max(1, MAX_SCORE_ELEMENTS // max(1, per_query))
    outputs = []
    pk, pv = prefix_keys[0].float(), prefix_values[0].float()  # [Hkv, P, d]
    own_keys, own_values = key.float().transpose(2, 3), value.float()
    for start in range(0, q_len, chunk):
        q = grouped[:, :, :, start : start + chunk].float() * scale  # [B, Hkv, g, c, d]
        c = q.shape[3]
        # prefix: every row's queries stacked per key head → one read of the prefix
        stacked = q.permute(1, 0, 2, 3, 4).reshape(kv_heads, batch * groups * c, dim)
        prefix_out, prefix_lse = _prefix_attention(stacked, pk, pv, fused)  # [Hkv, B·g·c, d], [Hkv, B·g·c]
        prefix_out = prefix_out.view(kv_heads, batch, groups, c, dim).permute(1, 0, 2, 3, 4)
        prefix_lse = prefix_lse.view(kv_heads, batch, groups, c).permute(1, 0, 2, 3)
        # own part: per row
        own_scores = torch.matmul(q.reshape(batch, kv_heads, groups * c, dim), own_keys)
        own_scores = own_scores.view(batch, kv_heads, groups, c, own_len)
        if mask is not None:
            own_scores.masked_fill_(~mask[:, :, start : start + c].unsqueeze(1), float("-inf"))
        # merge the two softmaxes through the prefix's log-sum-exp; finite: the prefix is always visible
        top = torch.maximum(prefix_lse, own_scores.amax(-1))  # [B, Hkv, g, c]
        prefix_weight = (prefix_lse - top).exp()
        own_weights = own_scores.sub_(top.unsqueeze(-1)).exp_()
        own_out = torch.matmul(own_weights.view(batch, kv_heads, groups * c, own_len), own_values)
        own_out = own_out.view(batch, kv_heads, groups, c, dim)
        denominator = prefix_weight + own_weights.sum(-1)
        outputs.append((prefix_out * prefix_weight.unsqueeze(-1) + own_out) / denominator.unsqueeze(-1))
    out = torch.cat(outputs, dim=3).reshape(batch, heads, q_len, dim).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Registers the attention and mask functions under ``ATTENTION_NAME`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _full_bool_mask)


def _attention_modules(model: Any) -> dict[int, torch.nn.Module]:
    return {
        int(module.layer_idx): module
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups") and hasattr(module, "q_proj")
    }


def supports_shared_prefix(model: Any) -> str | None:
    """None when the model can use this backend, else why not."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                               or []):  # fmt: skip
        return "the model has sliding-window attention layers"
    if getattr(config, "is_encoder_decoder", False):
        return "the model is an encoder-decoder"
    layers = _attention_modules(model)
    if len(layers) != getattr(config, "num_hidden_layers", -1):
        return "its attention modules were not recognised"
    return None


class SharedPrefixTransformersBackend(TransformersBackend):
    """``TransformersBackend`` whose batches read the shared prefix's KV once per step (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *args: Any,
        tolerance: float | None = None,
        turn_cache_tokens: int = DEFAULT_MAX_TOKENS,
        **kwargs: Any,
    ) -> None:
        """``turn_cache_tokens``: most tokens of per-episode KV kept between waves (0: re-prefill every wave)."""
        kwargs["prefix_cache"] = True
        super().__init__(model, tokenizer, *args, **kwargs)
        self.turn_cache = TurnCache(turn_cache_tokens) if turn_cache_tokens > 0 else None
        self._one_batch = False  # the current generate call is one batch (its old turn caches can go early)
        self._layers: dict[int, torch.nn.Module] = {}
        reason = supports_shared_prefix(model)
        self.enabled = reason is None
        self.checked = False
        self.tolerance = tolerance
        if reason:
            logger.warning("shared-prefix attention is off (%s): using the materialised prefix cache", reason)
            return
        register_attention()
        self._layers = _attention_modules(model)

    @property
    def turn_cache_stats(self) -> dict[str, int]:
        """Counters of the turn cache (empty when it is off): reused / prefilled own tokens, entries dropped by the
        cap, prompts that did not extend their episode's cache, peak cached tokens and bytes."""
        return dict(self.turn_cache.stats) if self.turn_cache is not None else {}

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], None]:
        self._one_batch = len(prompts) <= self.max_batch_size
        try:
            return super().generate(prompts, max_new_tokens, seeds)
        finally:
            if self.turn_cache is not None:
                self.turn_cache.commit()  # this call's episodes stay cached (finished ones are freed by ``release``)

    def release(self, prompts: list[list[int]]) -> None:
        """Finished episodes (their whole token lists): their turn caches are freed."""
        if self.turn_cache is None or not self._prefix:
            return
        n = len(self._prefix)
        for prompt in prompts:
            if prompt[:n] == self._prefix:
                self.turn_cache.forget(prompt[n:])

    def _build_prefix(self, prefix: list[int]) -> None:
        if self.turn_cache is not None:
            self.turn_cache.clear()  # positions and attention of every cached episode depend on the prefix
        super()._build_prefix(prefix)

    def reset_prefix_cache(self) -> None:
        if getattr(self, "turn_cache", None) is not None:
            self.turn_cache.clear()
        super().reset_prefix_cache()

    # -- prefix attachment ----------------------------------------------------------------------------------------

    def _attach(self, prefix_length: int) -> None:
        assert self._prefix_kv is not None
        for index, module in self._layers.items():
            keys, values = self._prefix_kv[index]
            # float32 once per call (a no-op for a float32 model), not once per layer and step
            prefix = (
                keys[:, :, :prefix_length].float().contiguous(),
                values[:, :, :prefix_length].float().contiguous(),
            )
            setattr(module, PREFIX_ATTRIBUTE, prefix)

    @contextlib.contextmanager
    def _prefix_attached(self, prefix_length: int) -> Iterator[None]:
        """The model attends through ``shared_prefix_attention`` to the first ``prefix_length`` cached tokens inside
        the block only: prefix building, one-row batches and the trainer's loss keep the model's own attention."""
        self._attach(prefix_length)
        try:
            with use_attention(self.model, ATTENTION_NAME):
                yield
        finally:
            self._detach()

    def _detach(self) -> None:
        for module in self._layers.values():
            if hasattr(module, PREFIX_ATTRIBUTE):
                delattr(module, PREFIX_ATTRIBUTE)

    def _inputs_after_prefix(
        self, prompts: list[list[int]], prefix_length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ids, mask and position ids (continuing after the prefix) of each prompt's own tokens."""
        rests = [p[prefix_length:] for p in prompts]
        width = max(len(r) for r in rests)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, rest in enumerate(rests):
            input_ids[row, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            attention[row, width - len(rest) :] = 1
        positions = prefix_length + (attention.cumsum(-1) - 1).clamp(min=0)
        return input_ids, attention, positions

    @torch.no_grad()
    def _shared_logits(self, prompts: list[list[int]], prefix_length: int) -> torch.Tensor:
        input_ids, attention, positions = self._inputs_after_prefix(prompts, prefix_length)
        device = self.model.device
        with self._prefix_attached(prefix_length):
            output = self.model(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                position_ids=positions.to(device),
                past_key_values=DynamicCache(config=self.model.config),
                use_cache=True,
                logits_to_keep=1,
            )
        return output.logits[:, -1].float()

    def _self_check(self, prompts: list[list[int]], prefix_length: int) -> None:
        """Compares one prompt's next-token logits with the parent's path; disables this backend on a mismatch."""
        self.checked = True
        sample = prompts[:1]
        expected = super().next_token_logits(sample)
        got = self._shared_logits(sample, prefix_length)
        tolerance = self.tolerance
        if tolerance is None:
            tolerance = 1e-3 if self.model.dtype == torch.float32 else 5e-2
        scale = max(1.0, float(expected.abs().max()))
        error = float((got - expected).abs().max()) / scale
        if error > tolerance:
            logger.warning(
                "shared-prefix attention differs from the reference by %.3g (> %.3g): falling back to the "
                "materialised prefix cache",
                error,
                tolerance,
            )
            self.enabled = False

    # -- generation -----------------------------------------------------------------------------------------------

    def _generate_batch(
        self, prompts: list[list[int]], max_new_tokens: int, prefix_length: int = 0
    ) -> list[list[int]]:
        if not prefix_length or not self.enabled or (len(prompts) == 1 and self.turn_cache is None):
            # one row: copying the prefix costs one copy, and fused sdpa beats the two-part attention
            return super()._generate_batch(prompts, max_new_tokens, prefix_length)
        if not self.checked:
            self._self_check(prompts, prefix_length)
            if not self.enabled:
                return super()._generate_batch(prompts, max_new_tokens, prefix_length)
        if self.turn_cache is not None:
            return self._generate_turn_cached(prompts, max_new_tokens, prefix_length, self.turn_cache)
        input_ids, attention, positions = self._inputs_after_prefix(prompts, prefix_length)
        cache = DynamicCache(config=self.model.config)
        output, clock = self._generate_after_prefix(
            input_ids, attention, positions, cache, max_new_tokens, prefix_length
        )
        return self._completions(output, input_ids.shape[1], clock)

    def _generate_after_prefix(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        max_new_tokens: int,
        prefix_length: int,
    ) -> tuple[Any, _StepClock]:
        """``generate`` on the rows' tokens after the shared prefix (attached for the call), from ``cache``."""
        device = self.model.device
        clock = _StepClock()
        with self._prefix_attached(prefix_length):
            output = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                position_ids=positions.to(device),
                past_key_values=cache,
                streamer=clock,
                **self._generate_kwargs(max_new_tokens),
            )
        return output, clock

    def _generate_turn_cached(
        self, prompts: list[list[int]], max_new_tokens: int, prefix_length: int, turns: TurnCache
    ) -> list[list[int]]:
        """``_generate_batch`` starting each row from its episode's cached KV; stores every row's KV afterwards."""
        device = self.model.device
        owns = [p[prefix_length:] for p in prompts]
        matches = [turns.lookup(own) for own in owns]
        past = max(length for _, length in matches)
        news = [own[length:] for own, (_, length) in zip(owns, matches, strict=True)]
        width = max(len(new) for new in news)
        batch = len(prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((batch, past + width), dtype=torch.long)
        positions = torch.full((batch, width), prefix_length, dtype=torch.long)
        for row, ((_, reused), new) in enumerate(zip(matches, news, strict=True)):
            input_ids[row, width - len(new) :] = torch.tensor(new, dtype=torch.long)
            attention[row, past - reused : past] = 1
            attention[row, past + width - len(new) :] = 1
            positions[row, width - len(new) :] = torch.arange(len(new)) + prefix_length + reused
            turns.stats["reused_tokens"] += reused
            turns.stats["prefilled_tokens"] += len(new)
        cache = DynamicCache(config=self.model.config)
        if past:
            for index in sorted(self._layers):
                assert self._prefix_kv is not None
                like = self._prefix_kv[index][0]  # [1, Hkv, P, d]: the layer's dtype, device and head shape
                keys = like.new_zeros((batch, like.shape[1], past, like.shape[3]))
                values = like.new_zeros((batch, like.shape[1], past, like.shape[3]))
                for row, (entry, reused) in enumerate(matches):
                    if entry is not None:
                        keys[row, :, past - reused :] = entry.keys[index][:, :reused]
                        values[row, :, past - reused :] = entry.values[index][:, :reused]
                cache.update(keys, values, index)
        born = [turns.next_born() if entry is None else entry.born for entry, _ in matches]
        del matches
        if self._one_batch:  # the batch cache holds every reused key now: the old entries are garbage
            turns.release()
        output, clock = self._generate_after_prefix(
            input_ids, attention, positions, cache, max_new_tokens, prefix_length
        )
        completions = self._completions(output, width, clock)
        fed = cache.get_seq_length() - past - width  # generated tokens the model has seen (not the last one)
        for row, (own, new, completion) in enumerate(zip(owns, news, completions, strict=True)):
            kept = min(len(completion), fed)
            start = past - (len(own) - len(new))
            index = torch.cat(
                [torch.arange(start, past), torch.arange(past + width - len(new), past + width + kept)]
            ).to(device)
            turns.add(
                CachedTurn(
                    tokens=own + completion[:kept],
                    keys=[cache.layers[i].keys[row].index_select(1, index) for i in sorted(self._layers)],
                    values=[cache.layers[i].values[row].index_select(1, index) for i in sorted(self._layers)],
                    born=born[row],
                )
            )
        return completions

    def close(self) -> None:
        """Drops the prefix tensors attached to the model (it runs on its own attention outside ``generate``) and
        the episodes' turn caches."""
        self._detach()
        if self.turn_cache is not None:
            self.turn_cache.clear()
