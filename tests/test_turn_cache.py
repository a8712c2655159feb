"""``TurnCache`` bookkeeping without a model: which entry a prompt continues, what is freed, what the cap drops."""

from __future__ import annotations

import logging

import pytest
import torch

from tau2_rl.backends.turn_cache import FINGERPRINT, CachedTurn, TurnCache


def _entry(tokens: list[int], born: int = 0) -> CachedTurn:
    kv = [torch.zeros(2, len(tokens), 4)]  # one layer, 2 kv heads, head dim 4
    return CachedTurn(tokens=list(tokens), keys=kv, values=kv, born=born)


def _history(seed: int, n: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def test_a_prompt_reuses_its_episodes_entry_but_always_computes_its_last_token():
    cache = TurnCache(max_tokens=10_000)
    a, b = _history(1, 40), _history(2, 50)
    cache.add(_entry(a))
    cache.add(_entry(b))
    cache.commit()
    entry, reused = cache.lookup(a + [7, 8, 9])
    assert entry is not None and entry.tokens == a and reused == len(a)
    entry, reused = cache.lookup(b[:30])  # shorter than the entry (a repeated prompt): all but the last token
    assert entry.tokens == b and reused == 29
    assert cache.lookup(_history(3, 60)) == (None, 0)  # another episode
    assert cache.lookup(a[:FINGERPRINT]) == (None, 0)  # too short to be worth it
    assert cache.stats["diverged"] == 0


def test_a_prompt_that_rewrites_its_history_reuses_the_common_part_and_says_so_once(caplog):
    cache = TurnCache(max_tokens=10_000)
    history = _history(1, 40)
    cache.add(_entry(history))
    cache.commit()
    rewritten = history[:25] + [5] * 20  # the template re-rendered earlier turns differently
    with caplog.at_level(logging.WARNING, logger="tau2_rl.backends.turn_cache"):
        entry, reused = cache.lookup(rewritten)
        cache.lookup(rewritten)
    assert entry is not None and reused == 25
    assert cache.stats["diverged"] == 2
    assert sum("does not extend" in r.message for r in caplog.records) == 1


def test_a_call_replaces_what_it_continued_a_finished_episode_is_forgotten_and_the_cap_drops_the_oldest():
    cache = TurnCache(max_tokens=100)
    old, young = _history(1, 40), _history(2, 40)
    cache.add(_entry(old, born=0))
    cache.add(_entry(_history(3, 40), born=0))  # an episode that finishes before the next call
    cache.commit()
    assert len(cache) == 2
    cache.forget(_history(3, 45))  # the loop says it finished (its whole history extends its entry)
    assert len(cache) == 1 and cache.lookup(_history(3, 41)) == (None, 0)
    assert cache.lookup(old + [1] * 20)[1] == 40  # the next call continues the oldest episode
    cache.add(_entry(old + [1] * 20, born=0))  # 60 tokens, replacing its 40
    cache.add(_entry(young, born=cache.next_born()))  # 40 tokens, started in this call
    cache.add(_entry(_history(4, 30), born=cache.next_born()))  # 30 tokens: 130 > 100, one entry must go
    cache.commit()
    assert cache.stats["dropped"] == 1 and cache.cached_tokens == 70
    assert cache.lookup(old + [1] * 20 + [2]) == (None, 0)  # dropped: re-prefilled at its next turn
    assert cache.lookup(young + [2])[1] == 40
    assert cache.stats["peak_tokens"] == 80
    cache.clear()
    assert len(cache) == 0


def test_an_episode_left_out_of_a_call_keeps_its_entry():
    """The event-driven loop calls with the ready episodes only: one waiting on its user keeps its cache."""
    cache = TurnCache(max_tokens=10_000)
    ready, waiting = _history(1, 40), _history(2, 40)
    cache.add(_entry(ready))
    cache.add(_entry(waiting))
    cache.commit()
    assert cache.lookup(ready + [5])[1] == 40
    cache.release()  # the call's one batch has copied what it reuses: only that entry goes early
    cache.add(_entry(ready + [5, 6]))
    cache.commit()
    assert cache.lookup(waiting + [7])[1] == 40 and cache.lookup(ready + [5, 6, 8])[1] == 42
    assert len(cache) == 2


def test_a_negative_cap_is_an_error_naming_its_flag(tmp_path):
    from tau2_rl.configs import EvalArguments, MultiTurnGRPOConfig

    with pytest.raises(ValueError, match="--turn_cache_tokens must be >= 0"):
        EvalArguments(turn_cache_tokens=-1)
    with pytest.raises(ValueError, match="--rollout_turn_cache_tokens must be >= 0"):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), rollout_turn_cache_tokens=-1, report_to="none")
    assert EvalArguments().turn_cache_tokens > 0  # on by default
