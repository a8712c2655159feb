"""Per-episode sampling streams: what an episode samples depends on its own seed, never on its batch.

``TransformersBackend`` used to seed torch's global generator once per ``generate`` call, so the tokens an episode
drew depended on which other episodes shared its waves and on how many calls came before: a resumed evaluation
(a different set of pending episodes, other chunks) sampled other episodes than an uninterrupted one. With per-row
seeds every (episode, turn) draws from its own generator, seeded by ``turn_seed(episode seed, turn)``; the episode
seed is a function of (configuration seed, task, sample index) only (``evaluation.evaluator.episode_seed``). The
trainer's rollouts do the same with episode seeds of (step, the row's global index), so N processes × B rows play
what 1 process × N·B rows plays (``MultiTurnGRPOTrainer._episode_seed``).
"""

from __future__ import annotations

import zlib

import torch


def turn_seed(episode_seed: int, turn: int) -> int:
    """The sampling seed of one policy turn of one episode (stable across processes and batchings)."""
    return zlib.crc32(f"{episode_seed}/{turn}".encode()) & 0x7FFFFFFF


class PerRowSampler:
    """A transformers logits processor that samples each row from its own generator (temperature, top-k, top-p,
    min-p: transformers' order) and returns scores that make greedy decoding pick that token; used with
    ``do_sample=False``.

    Row r's t-th token uses the t-th draw of a generator seeded with ``seeds[r]``, whatever the other rows are.
    """

    def __init__(
        self, seeds: list[int], temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float | None = None
    ) -> None:
        if temperature <= 0:
            raise ValueError("PerRowSampler samples: temperature must be > 0 (greedy needs no seeds)")
        self.seeds = list(seeds)
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = int(top_k or 0)
        self.min_p = min_p
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if len(self.seeds) != scores.shape[0]:
            raise ValueError(f"PerRowSampler has {len(self.seeds)} seeds for a batch of {scores.shape[0]} rows")
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        logits = scores.float() / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True, dim=-1)
            probs = ordered.softmax(dim=-1)
            drop = probs.cumsum(dim=-1) - probs > self.top_p  # keeps the smallest set reaching top_p (≥ 1 token)
            logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        if self.min_p:  # keeps tokens with probability ≥ min_p × the top token's
            probs = probs.masked_fill(probs < self.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        chosen = torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(self.generators)])
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, chosen.unsqueeze(-1), 0.0)
        return out
