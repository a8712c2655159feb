"""The user-simulator interface shared by the scripted and the LLM simulators.

A simulator answers the agent's latest message(s) in an episode. The runner asks for the replies of the episodes one
agent call left waiting on their user, together (``submit_batch``), and gets one future per episode: a simulator
behind an HTTP endpoint sends the requests and returns at once, and each episode moves on when its own reply lands
(``tau2_rl.envs.runner``: no episode waits for another's user). An offline simulator answers in the call
(``reply_batch``; its futures are already resolved), which makes the runner's schedule exactly the lock-step waves.
Per-episode memory lives in ``episode.user_state``.

A reply ends the conversation when it contains one of τ²'s stop tokens. A simulator that fails (endpoint down,
retries exhausted) returns ``UserReply(error=...)``: the episode ends as ``user_error`` and is never scored as an agent
failure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.episode import USER_OUT_OF_SCOPE, USER_STOP, USER_TRANSFER
from tau2_rl.envs.protocol import PROTOCOLS, TAU2_RL, Protocol, user_visible_agent_messages

if TYPE_CHECKING:
    from tau2_rl.envs.episode import Episode

STOP_TOKENS = {"###STOP###": USER_STOP, "###TRANSFER###": USER_TRANSFER, "###OUT-OF-SCOPE###": USER_OUT_OF_SCOPE}


def detect_stop(content: str) -> str | None:
    """The termination reason named by a stop token in ``content``, if any."""
    for token, reason in STOP_TOKENS.items():
        if token in content:
            return reason
    return None


@dataclass
class UserReply:
    """One user turn: its text, the termination its stop token asks for, or the simulator's failure; or, for a
    domain whose user holds tools, its own tool calls (name, arguments), which the runner executes before asking the
    user again (τ²: a user message with tool calls goes to the environment, never to the agent)."""

    content: str = ""
    termination: str | None = None
    error: str | None = None
    tool_calls: list[tuple[Any, ...]] | None = None
    """(name, arguments), or (name, arguments, id) as an LLM endpoint named the call."""

    @classmethod
    def from_text(cls, content: str) -> UserReply:
        return cls(content=content, termination=detect_stop(content))


def episode_protocol(episode: Episode) -> Protocol:
    """The protocol an episode is played by (a stand-in episode without one follows ``tau2_rl``)."""
    return getattr(episode, "protocol", None) or PROTOCOLS[TAU2_RL]


def agent_messages_since_user(episode: Episode) -> list[str]:
    """The texts the agent showed the user since the user last spoke (tool calls and results are invisible; under
    the ``tau2`` protocol so is the text of a message that calls tools, which τ² sends to the environment only)."""
    messages = episode.messages  # the user "last spoke" in text: its own tool calls and their results do not count
    start = max((i for i, m in enumerate(messages) if m["role"] == "user" and m.get("requestor") != "user"),
                default=-1) + 1  # fmt: skip
    visible = set(user_visible_agent_messages(messages, episode_protocol(episode)))
    return [messages[i]["content"] for i in range(start, len(messages)) if i in visible and messages[i].get("content")]


def resolved(reply: UserReply) -> Future[UserReply]:
    """A future that already holds ``reply`` (what an offline simulator's ``submit_batch`` returns)."""
    future: Future[UserReply] = Future()
    future.set_result(reply)
    return future


class UserSimulator(ABC):
    """Base class: implement ``reply``; override ``reply_batch`` to answer several episodes concurrently, or
    ``submit_batch`` to return before the replies arrive."""

    name: str = "base"
    answers_at_once: bool = True
    """Whether ``submit_batch`` returns resolved futures (the runner's schedule is then the lock-step waves)."""

    @abstractmethod
    def reply(self, episode: Episode) -> UserReply:
        """The user's next message given ``episode.messages`` (the agent's last turn is the newest)."""

    def reply_batch(self, episodes: list[Episode]) -> list[UserReply]:
        """One reply per episode; the default answers them one after another."""
        return [self.reply(episode) for episode in episodes]

    def submit_batch(self, episodes: list[Episode]) -> list[Future[UserReply]]:
        """One future reply per episode. The default answers here (``reply_batch``); a simulator that returns
        unresolved futures sets ``answers_at_once = False`` and must resolve every one (a failure is a
        ``UserReply(error=...)``, never an exception), also when its requests time out."""
        replies = self.reply_batch(episodes)
        if len(replies) != len(episodes):
            raise RuntimeError(f"user simulator {self.name!r} gave {len(replies)} replies for {len(episodes)} "
                               "episodes")  # fmt: skip
        return [resolved(reply) for reply in replies]

    def stats(self) -> dict[str, Any]:
        """Accounting since the last call (requests, tokens, latency...); empty for offline simulators."""
        return {}
