"""Turn caching: each live episode keeps the key/value cache of its own tokens between waves.

Without it a multi-turn rollout prefills every episode's whole history (everything after the shared system prompt)
again at every wave, so a T-turn episode costs O(T²) prefill. ``TurnCache`` holds, per episode, the KV of the tokens
after the shared prefix that the model has already seen (its history and its own last completion, except the very
last sampled token, which ``generate`` never feeds); the next wave prefills only what was added since (that last
token and the environment's Render-Twice-Diff suffix).

Episodes are recognised by their tokens, not by an id: a wave's prompt continues the cached tokens of its episode,
so the backend protocol stays "prompts in, ids out" and a cache can never be applied to the wrong history.
Entries are bucketed by their first ``FINGERPRINT`` tokens; a prompt reuses the longest entry it extends.

1. A prompt that does not extend its episode's entry (a chat template that rewrites earlier turns, a turn cut to
   its budget after sampling) reuses the common part and re-prefills from the first difference; this is logged once.
2. A call replaces the entries its prompts continued with the ones it produced (``commit``); an entry no prompt of
   the call continued stays, since the event-driven episode loop calls with the ready episodes only. A finished
   episode's entry is freed when the loop says it finished (``forget``, through ``TokenPolicyAgent.release``); under
   the lock-step waves that is before the next call, so the live entries are exactly the previous call's.
3. ``max_tokens`` caps the cached tokens: past it the oldest episodes' entries (the episode's first cached call)
   are dropped and re-prefilled at their next turn; ``stats["dropped"]`` counts them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tau2_rl.backends import _common_prefix_length

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1 << 20
"""Default cap on cached tokens: 2 x layers x kv_heads x head_dim x dtype bytes each, i.e. 12 KiB for Qwen2.5-0.5B
and 56 KiB for Qwen2.5-7B in bfloat16 (12 / 56 GiB at the cap), 512 bytes for the embedded tiny model in float32."""

FINGERPRINT = 16
"""Own tokens that key an entry; an entry or a prompt shorter than this is not cached (nothing worth reusing)."""


@dataclass
class CachedTurn:
    """The KV of one episode's tokens after the shared prefix: per layer, keys and values [kv_heads, len, head_dim]."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    born: int
    """The call at which this episode's cache was started (eviction drops the smallest first)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class TurnCache:
    """Per-episode KV caches between the waves of one rollout (see the module docstring)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: dict[tuple[int, ...], list[CachedTurn]] = {}
        self._pending: list[CachedTurn] = []
        self._continued: list[CachedTurn] = []  # entries the current call's prompts reuse (replaced at commit)
        self._calls = 0
        self._warned = False
        self.stats = {
            "reused_tokens": 0,  # own tokens read from the cache instead of prefilled
            "prefilled_tokens": 0,  # own tokens prefilled (new since the last turn, or re-prefilled)
            "dropped": 0,  # entries dropped by the max_tokens cap
            "diverged": 0,  # prompts that did not extend their episode's cached tokens
            "peak_tokens": 0,  # most tokens cached at once
            "peak_bytes": 0,
        }

    def __len__(self) -> int:
        return sum(len(bucket) for bucket in self._entries.values())

    @property
    def cached_tokens(self) -> int:
        return sum(len(e.tokens) for bucket in self._entries.values() for e in bucket)

    def lookup(self, own: list[int]) -> tuple[CachedTurn | None, int]:
        """The entry ``own`` (a prompt's tokens after the shared prefix) continues and how many of its tokens to
        reuse: at most ``len(own) - 1``, so that the last prompt token is always computed (it gives the logits)."""
        bucket = self._entries.get(tuple(own[:FINGERPRINT])) if len(own) > FINGERPRINT else None
        if not bucket:
            return None, 0
        best, length = None, 0
        for entry in bucket:
            n = len(entry.tokens)
            if n > length and own[:n] == entry.tokens:
                best, length = entry, n
        if best is None:  # no entry is a prefix of the prompt: reuse the longest common part
            for entry in bucket:
                n = _common_prefix_length(own, entry.tokens, len(entry.tokens))
                if n > length:
                    best, length = entry, n
        if best is not None and length < min(len(best.tokens), len(own)):  # neither extends the other
            self.stats["diverged"] += 1
            if not self._warned:
                self._warned = True
                logger.warning(
                    "turn cache: a prompt does not extend its episode's cached tokens (a chat template that rewrites "
                    "earlier turns, or a turn cut after sampling); that episode is re-prefilled from token %d of its "
                    "history (said once)",
                    length,
                )
        length = min(length, len(own) - 1)
        if length < FINGERPRINT:
            return None, 0
        if best is not None:
            self._continued.append(best)
        return best, length

    def add(self, entry: CachedTurn) -> None:
        """Stores an entry produced by the current call (live from ``commit`` on)."""
        if len(entry.tokens) > FINGERPRINT:
            self._pending.append(entry)

    def next_born(self) -> int:
        """The ``born`` of an episode whose cache starts in the current call."""
        return self._calls

    def _entries_list(self) -> list[CachedTurn]:
        return [entry for bucket in self._entries.values() for entry in bucket]

    def _store(self, entries: list[CachedTurn]) -> None:
        self._entries = {}
        for entry in entries:
            self._entries.setdefault(tuple(entry.tokens[:FINGERPRINT]), []).append(entry)

    def _without(self, drop: list[CachedTurn]) -> list[CachedTurn]:
        gone = {id(entry) for entry in drop}
        return [entry for entry in self._entries_list() if id(entry) not in gone]

    def commit(self) -> None:
        """Ends a ``generate`` call: its entries replace those its prompts continued (the others stay), the oldest
        episodes' dropped while more than ``max_tokens`` are cached."""
        self._calls += 1
        pending, self._pending = self._pending, []
        kept = self._without(self._continued)
        self._continued = []
        entries = kept + pending
        total = sum(len(e.tokens) for e in entries)
        if total > self.max_tokens:
            keep = sorted(range(len(entries)), key=lambda i: (entries[i].born, i))
            while keep and total > self.max_tokens:
                total -= len(entries[keep.pop(0)].tokens)
                self.stats["dropped"] += 1
            entries = [entries[i] for i in sorted(keep)]
        self._store(entries)
        self.stats["peak_tokens"] = max(self.stats["peak_tokens"], total)
        self.stats["peak_bytes"] = max(self.stats["peak_bytes"], sum(e.nbytes for e in entries))

    def release(self) -> None:
        """Frees the entries the current call continues early (its only batch has copied what it reuses): less peak
        memory."""
        self._store(self._without(self._continued))
        self._continued = []

    def forget(self, own: list[int]) -> None:
        """A finished episode (``own``: its tokens after the shared prefix): its entry is freed."""
        bucket = self._entries.get(tuple(own[:FINGERPRINT]))
        if not bucket:
            return
        mine = [entry for entry in bucket if own[: len(entry.tokens)] == entry.tokens]
        if mine:
            bucket.remove(max(mine, key=lambda entry: len(entry.tokens)))  # its bucket only, not every entry

    def clear(self) -> None:
        """Drops every entry (the shared prefix or the weights changed: the cached keys are stale)."""
        self._entries, self._pending, self._continued = {}, [], []
