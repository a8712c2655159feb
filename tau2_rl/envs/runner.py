"""The one episode loop: policy ↔ tools ↔ user, each episode advancing on its own (event-driven).

The trainer, the evaluator and the trajectory collector all call ``run_episodes``; there is no second loop.

How it schedules. An episode is in one of three places: *ready* (the agent acts next), *waiting* on its user (a
future from ``user.submit_batch``) or *finished*. The agent is called with the ready episodes, in the order of
``specs``, as soon as one of these holds (``Schedule``):

- every unfinished episode is ready;
- ``min_ready`` episodes are ready;
- ``batch_window`` seconds have passed since the longest-ready one became ready.

Tool results are immediate: an episode whose turn called tools is ready again at once. A user reply makes its
episode ready when it lands; finished episodes leave as they finish (``agent.release``: a turn cache frees them).
A user simulator that answers at once (the scripted user) resolves its futures before the loop looks at them, so
every unfinished episode is always ready: the schedule is the lock-step waves, one agent call per turn for all
active episodes, exactly as before this loop was event-driven. ``Schedule(mode="waves")`` forces that schedule with
any user (the benchmark's baseline): each call then waits for the slowest reply.

What it guarantees. Every episode sees the same sequence of messages whatever the schedule, as long as its agent
samples per episode (``TokenPolicyAgent(per_episode_seeds=True)``: turn t of an episode draws from its own seeded
generator, on the evaluator's engine, the trainer's prefix-reuse rollouts and colocated vLLM) and its user answers
a conversation independently of the others (the LLM user's request seed is the episode's). An agent that samples per
batch (TRL's generate on vLLM server mode or PEFT) makes transcripts depend on the schedule; the loop says so once.
A failed or timed-out user request ends only its own episode (``user_error``). An exception (Ctrl-C) cancels the
requests in flight before it propagates.

``RunTimings`` splits the wall time: ``agent`` (inside ``agent.act``), ``user`` (blocked on user replies, or
answering them for an offline simulator), ``env``, ``reward``; ``agent_idle_fraction`` and the mean and peak of user
requests in flight (docs/metrics.md).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tqdm.auto import tqdm

from tau2_rl.envs.episode import DomainEnv, Episode, EpisodeRecord
from tau2_rl.envs.tool_calls import ParsedTurn
from tau2_rl.envs.users.base import UserReply, UserSimulator, resolved

logger = logging.getLogger(__name__)

Scorer = Callable[[Episode], dict[str, Any]]
"""The reward of a finished episode, as the dict stored in ``EpisodeRecord.reward``."""

SCHEDULES = ("events", "waves")
POLL_S = 0.5
"""Longest single wait on the user futures: a signal that lands on another thread (Ctrl-C, SIGTERM) is acted on
within this, since Python runs signal handlers in the main thread only when it wakes."""
_SAID: set[str] = set()  # what the loop says once per process


@dataclass
class AgentTurn:
    """What an agent produced for one episode: text, and for a policy model its token count and truncation."""

    text: str
    num_tokens: int | None = None
    truncated: bool = False
    error: str | None = None
    """The agent failed (a served model's requests kept failing): the episode ends as ``agent_error`` with this
    message, which evaluate.py leaves out of pass^k and retries on a rerun, as a user simulator's failure."""
    api_message: ParsedTurn | None = None
    """A served agent's reply as its API returned it (content as sent, structured calls); under ``tau2`` the
    environment takes it instead of parsing ``text`` (``Protocol.api_messages_as_sent``)."""


class Agent(Protocol):
    """Anything that maps a batch of live episodes to one assistant turn each (messages → assistant text).

    Optional: ``release(episodes)`` (those episodes finished: free what is kept for them) and
    ``schedule_invariant`` (True when an episode's turns do not depend on which episodes share its call)."""

    def act(self, episodes: list[Episode]) -> list[AgentTurn | str]: ...


@dataclass(frozen=True)
class Schedule:
    """When the agent acts on the ready episodes (see the module docstring).

    The defaults act on whatever is ready as soon as anything is: measured with ``benchmarks/rollout_bench.py
    --user_latency``, waiting for more only delays the episodes that are ready, since the next call batches whatever
    became ready during this one."""

    mode: Literal["events", "waves"] = "events"
    min_ready: int = 1
    batch_window: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in SCHEDULES:
            raise ValueError(f"schedule mode must be one of {', '.join(SCHEDULES)}, got {self.mode!r}")
        if self.min_ready < 1:
            raise ValueError(f"min_ready must be >= 1, got {self.min_ready}")
        if self.batch_window < 0:
            raise ValueError(f"batch_window must be >= 0 seconds, got {self.batch_window}")


@dataclass
class RunTimings:
    """Seconds spent per phase of a run (the trainer logs these as its timing split), summed over calls."""

    agent: float = 0.0
    env: float = 0.0
    user: float = 0.0
    reward: float = 0.0
    waves: int = 0
    """Agent calls (one batched generation each; a wave of the lock-step schedule)."""
    wall: float = 0.0
    """Seconds inside the loop (from the greeting's replies to the last episode's end, before scoring)."""
    in_flight_seconds: float = 0.0
    """The integral of the user requests in flight over ``wall`` (their mean is this / ``wall``)."""
    max_in_flight: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def agent_idle_fraction(self) -> float:
        """The share of the loop's wall time in which the agent was not acting (waiting on users, tools, itself)."""
        return max(0.0, 1.0 - self.agent / self.wall) if self.wall > 0 else 0.0

    @property
    def mean_in_flight(self) -> float:
        return self.in_flight_seconds / self.wall if self.wall > 0 else 0.0

    def schedule_summary(self) -> dict[str, float | int]:
        """What results.json and the trainer's metrics record of the schedule."""
        return {
            "agent_idle_fraction": round(self.agent_idle_fraction, 4),
            "user_requests_in_flight": round(self.mean_in_flight, 3),
            "user_requests_in_flight_max": self.max_in_flight,
        }


class _Loop:
    """One ``run_episodes`` call's state: which episodes are ready, which wait on which future."""

    def __init__(
        self,
        agent: Agent,
        user: UserSimulator,
        episodes: list[Episode],
        schedule: Schedule,
        timings: RunTimings,
        finished: Callable[[int], None],
    ) -> None:
        self.agent, self.user, self.episodes = agent, user, episodes
        self.schedule, self.timings, self.finished = schedule, timings, finished
        self.ready: dict[int, float] = {}  # episode index → when it became ready
        self.waiting: dict[concurrent.futures.Future[UserReply], int] = {}
        self.unfinished = sum(not e.is_completed for e in episodes)
        self._spans: list[tuple[float, int]] = []
        self._release = getattr(agent, "release", None)

    def _submitted(self, future: concurrent.futures.Future[UserReply]) -> None:
        """Times a request that is in flight (one answered at once never was)."""
        if future.done():
            return
        self._spans.append((time.perf_counter(), 1))
        future.add_done_callback(lambda _: self._spans.append((time.perf_counter(), -1)))  # on the user's thread

    def account_in_flight(self) -> None:
        """The requests-in-flight integral and peak of this call, from the submit and landing times."""
        level = peak = 0
        last = area = 0.0
        for moment, step in sorted(self._spans):
            area += level * (moment - last)
            level += step
            peak = max(peak, level)
            last = moment
        self.timings.in_flight_seconds += area
        self.timings.max_in_flight = max(self.timings.max_in_flight, peak)

    def _leave(self, indices: list[int]) -> None:
        if not indices:
            return
        self.unfinished -= len(indices)
        if self._release is not None:
            self._release([self.episodes[i] for i in indices])
        self.finished(len(indices))

    def ask_users(self, indices: list[int]) -> None:
        """Submits the replies of ``indices`` (in order) and takes in those that are already there."""
        if not indices:
            return
        start = time.perf_counter()
        episodes = [self.episodes[i] for i in indices]
        submit = getattr(self.user, "submit_batch", None)  # a duck-typed user may only have ``reply_batch``
        futures = submit(episodes) if submit is not None else [resolved(r) for r in self.user.reply_batch(episodes)]
        self.timings.user += time.perf_counter() - start
        if len(futures) != len(indices):
            name = getattr(self.user, "name", type(self.user).__name__)
            raise RuntimeError(f"user simulator {name!r} gave {len(futures)} replies for {len(indices)} episodes")
        for future, index in zip(futures, indices, strict=True):
            self.waiting[future] = index
            self._submitted(future)
        self.take_replies()

    def take_replies(self) -> None:
        """Applies every reply that has landed, in episode order (so an offline user's wave reads as before)."""
        landed = sorted((index, future) for future, index in self.waiting.items() if future.done())
        done_now, again = [], []
        now = time.perf_counter()
        for index, future in landed:
            del self.waiting[future]
            reply = future.result()
            episode = self.episodes[index]
            if reply.tool_calls and reply.error is None:  # the user acts on its own tools, then speaks again
                start = time.perf_counter()
                episode.user_acts(reply.tool_calls, reply.content)
                self.timings.env += time.perf_counter() - start
                (done_now if episode.is_completed else again).append(index)
                continue
            episode.user_response(reply.content, reply.termination, reply.error)
            if episode.is_completed:
                done_now.append(index)
            else:
                self.ready[index] = now
        self._leave(done_now)
        self.ask_users(again)

    def _due(self, now: float) -> float | None:
        """Seconds until the agent should act (0: now; None: only when a reply lands)."""
        if not self.ready:
            return None
        if len(self.ready) >= self.unfinished:
            return 0.0
        if self.schedule.mode == "waves":
            return None
        if len(self.ready) >= self.schedule.min_ready:
            return 0.0
        return max(0.0, min(self.ready.values()) + self.schedule.batch_window - now)

    def wait(self) -> None:
        """Blocks until the agent should act: a reply lands, or the batching window of the ready ones runs out."""
        while self.unfinished:
            due = self._due(time.perf_counter())
            if due == 0.0:
                return
            if not self.waiting:
                raise RuntimeError("episode loop: unfinished episodes neither ready nor waiting on their user")
            start = time.perf_counter()
            timeout = POLL_S if due is None else min(due, POLL_S)
            concurrent.futures.wait(list(self.waiting), timeout=timeout, return_when=FIRST_COMPLETED)
            self.timings.user += time.perf_counter() - start
            self.take_replies()

    def act(self) -> None:
        """One agent call on the ready episodes; routes each to its tools (ready again), its user or its end."""
        indices = sorted(self.ready)
        self.ready.clear()
        active = [self.episodes[i] for i in indices]
        self.timings.waves += 1
        start = time.perf_counter()
        turns = self.agent.act(active)
        self.timings.agent += time.perf_counter() - start
        if len(turns) != len(active):
            raise RuntimeError(f"agent returned {len(turns)} turns for {len(active)} episodes")
        start = time.perf_counter()
        to_user, done_now = [], []
        for index, episode, turn in zip(indices, active, turns, strict=True):
            turn = turn if isinstance(turn, AgentTurn) else AgentTurn(text=turn)
            if turn.error is not None:
                episode.agent_failed(turn.error)
                tool_messages = []
            else:
                tool_messages = episode.env_response(
                    turn.text, turn.num_tokens, turn.truncated, api_message=turn.api_message
                )
            if episode.is_completed:
                done_now.append(index)
            elif tool_messages:
                self.ready[index] = time.perf_counter()
            else:
                to_user.append(index)
        self.timings.env += time.perf_counter() - start
        self._leave(done_now)
        self.ask_users(to_user)

    def cancel(self) -> None:
        for future in self.waiting:
            future.cancel()
        self.waiting.clear()


def _say_once(agent: Agent, user: UserSimulator, schedule: Schedule) -> None:
    if getattr(user, "answers_at_once", True) or schedule.mode == "waves":
        return
    if getattr(agent, "schedule_invariant", True):
        return
    reason = getattr(agent, "schedule_reason", "the agent samples per batch")
    if reason not in _SAID:
        _SAID.add(reason)
        logger.info("episodes run event-driven against the %s user and %s: a transcript depends on which "
                    "episodes share a generation call, so on the user's reply times (said once)", user.name,
                    reason)  # fmt: skip


def run_episodes(
    env: DomainEnv,
    agent: Agent,
    user: UserSimulator,
    specs: Sequence[tuple[str, int]],
    *,
    score: Scorer,
    progress: bool = False,
    timings: RunTimings | None = None,
    episodes: list[Episode] | None = None,
    on_finished: Callable[[int], Any] | None = None,
    schedule: Schedule | None = None,
) -> list[EpisodeRecord]:
    """Plays one episode per ``(task_id, seed)`` in ``specs`` and scores it; returns the records in order.

    ``score(episode)`` is the reward of a finished episode (its dict goes to ``record.reward``): the callers hand in
    the outcome reward (``tau2_rl.rewards.outcome.scorer``); a scorer with a ``prepare(episodes)`` gets the finished
    batch first (the NL judge sends its requests together). The loop knows no reward of its own, since
    ``rewards/`` reads what ``envs/`` records and never the other way round.

    ``episodes`` may hold pre-made episodes (``env.reset``) for callers that keep references to them;
    ``on_finished(n)`` is called whenever n more episodes finished (a caller's progress bar moves per episode);
    ``schedule`` says when the agent acts (default: ``Schedule()``, event-driven; see the module docstring).
    """
    timings = timings if timings is not None else RunTimings()
    episodes = episodes if episodes is not None else [env.reset(task_id, seed) for task_id, seed in specs]
    schedule = schedule or Schedule()
    on_schedule = getattr(agent, "on_schedule", None)
    if on_schedule is not None:  # calls carry only the ready episodes when a user answers later
        on_schedule(schedule.mode == "events" and not getattr(user, "answers_at_once", True))
    _say_once(agent, user, schedule)
    bar = tqdm(total=len(episodes), desc="episodes", disable=not progress, leave=False)

    def finished(n: int) -> None:
        bar.update(n)
        if on_finished is not None:
            on_finished(n)

    loop = _Loop(agent, user, episodes, schedule, timings, finished)
    start = time.perf_counter()
    try:
        loop.ask_users([i for i, e in enumerate(episodes) if not e.is_completed])  # the user answers the greeting
        while loop.unfinished:
            loop.wait()
            if loop.unfinished:
                loop.act()
    except BaseException:
        loop.cancel()  # no request outlives the loop that asked for it
        raise
    finally:
        timings.wall += time.perf_counter() - start
        loop.account_in_flight()
        bar.close()
    start = time.perf_counter()
    prepare = getattr(score, "prepare", None)
    if prepare is not None:  # a scorer that asks an endpoint (the NL judge) sends the batch's requests at once
        prepare(episodes)
    for episode in episodes:
        episode.record.reward = score(episode)
    timings.reward += time.perf_counter() - start
    return [episode.record for episode in episodes]
