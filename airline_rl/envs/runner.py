"""The one episode loop: policy ↔ tools ↔ user, advancing every active episode together in waves.

The trainer, the evaluator and the trajectory collector all call ``run_episodes``; there is no second loop. Each
wave makes one ``agent.act`` call for all active episodes (one batched generation) and one ``user.reply_batch``
call for the episodes whose agent addressed the user.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm.auto import tqdm

from airline_rl.envs.episode import AirlineEnv, Episode, EpisodeRecord
from airline_rl.envs.users.base import UserSimulator

logger = logging.getLogger(__name__)

Scorer = Callable[[Episode], dict[str, Any]]
"""The reward of a finished episode, as the dict stored in ``EpisodeRecord.reward``."""


@dataclass
class AgentTurn:
    """What an agent produced for one episode: text, and for a policy model its token count and truncation."""

    text: str
    num_tokens: int | None = None
    truncated: bool = False


class Agent(Protocol):
    """Anything that maps a batch of live episodes to one assistant turn each (messages → assistant text)."""

    def act(self, episodes: list[Episode]) -> list[AgentTurn | str]: ...


@dataclass
class RunTimings:
    """Seconds spent per phase of a run (the trainer logs these as its timing split)."""

    agent: float = 0.0
    env: float = 0.0
    user: float = 0.0
    reward: float = 0.0
    waves: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _user_wave(user: UserSimulator, episodes: list[Episode], timings: RunTimings) -> None:
    if not episodes:
        return
    start = time.perf_counter()
    replies = user.reply_batch(episodes)
    timings.user += time.perf_counter() - start
    if len(replies) != len(episodes):
        raise RuntimeError(f"user simulator {user.name!r} gave {len(replies)} replies for {len(episodes)} episodes")
    for episode, reply in zip(episodes, replies, strict=True):
        episode.user_response(reply.content, reply.termination, reply.error)


def run_episodes(
    env: AirlineEnv,
    agent: Agent,
    user: UserSimulator,
    specs: Sequence[tuple[str, int]],
    *,
    score: Scorer,
    progress: bool = False,
    timings: RunTimings | None = None,
    episodes: list[Episode] | None = None,
    on_finished: Callable[[int], Any] | None = None,
) -> list[EpisodeRecord]:
    """Plays one episode per ``(task_id, seed)`` in ``specs`` and scores it; returns the records in order.

    ``score(episode)`` is the reward of a finished episode (its dict goes to ``record.reward``): the callers hand in
    the outcome reward (``airline_rl.rewards.outcome.outcome_reward``). The loop knows no reward of its own, since
    ``rewards/`` reads what ``envs/`` records and never the other way round.

    ``episodes`` may hold pre-made episodes (``env.reset``) for callers that keep references to them;
    ``on_finished(n)`` is called whenever n more episodes finished (a caller's progress bar moves per episode).
    """
    timings = timings if timings is not None else RunTimings()
    episodes = episodes if episodes is not None else [env.reset(task_id, seed) for task_id, seed in specs]
    bar = tqdm(total=len(episodes), desc="episodes", disable=not progress, leave=False)
    _user_wave(user, episodes, timings)  # the user answers the greeting
    done = sum(e.is_completed for e in episodes)
    bar.update(done)
    if on_finished is not None and done:
        on_finished(done)
    while active := [e for e in episodes if not e.is_completed]:
        timings.waves += 1
        start = time.perf_counter()
        turns = agent.act(active)
        timings.agent += time.perf_counter() - start
        if len(turns) != len(active):
            raise RuntimeError(f"agent returned {len(turns)} turns for {len(active)} episodes")
        start = time.perf_counter()
        waiting = []
        for episode, turn in zip(active, turns, strict=True):
            turn = turn if isinstance(turn, AgentTurn) else AgentTurn(text=turn)
            tool_messages = episode.env_response(turn.text, turn.num_tokens, turn.truncated)
            if not episode.is_completed and not tool_messages:
                waiting.append(episode)
        timings.env += time.perf_counter() - start
        _user_wave(user, waiting, timings)
        now_done = sum(e.is_completed for e in episodes)
        bar.update(now_done - done)
        if on_finished is not None and now_done > done:
            on_finished(now_done - done)
        done = now_done
    bar.close()
    start = time.perf_counter()
    for episode in episodes:
        episode.record.reward = score(episode)
    timings.reward += time.perf_counter() - start
    return [episode.record for episode in episodes]
