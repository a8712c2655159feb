"""The user-simulator interface shared by the scripted and the LLM simulators.

A simulator answers the agent's latest message(s) in an episode. Replies are requested in waves: the runner asks for
one reply per episode that waits on its user, all at once (``reply_batch``), so that a simulator behind an HTTP
endpoint can send them concurrently. Per-episode memory lives in ``episode.user_state``.

A reply ends the conversation when it contains one of τ²'s stop tokens. A simulator that fails (endpoint down,
retries exhausted) returns ``UserReply(error=...)``: the episode ends as ``user_error`` and is never scored as an agent
failure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airline_rl.envs.episode import USER_OUT_OF_SCOPE, USER_STOP, USER_TRANSFER
from airline_rl.envs.protocol import AIRLINE_RL, PROTOCOLS, Protocol, user_visible_agent_messages

if TYPE_CHECKING:
    from airline_rl.envs.episode import Episode

STOP_TOKENS = {"###STOP###": USER_STOP, "###TRANSFER###": USER_TRANSFER, "###OUT-OF-SCOPE###": USER_OUT_OF_SCOPE}


def detect_stop(content: str) -> str | None:
    """The termination reason named by a stop token in ``content``, if any."""
    for token, reason in STOP_TOKENS.items():
        if token in content:
            return reason
    return None


@dataclass
class UserReply:
    """One user turn: its text, the termination its stop token asks for, or the simulator's failure."""

    content: str = ""
    termination: str | None = None
    error: str | None = None

    @classmethod
    def from_text(cls, content: str) -> UserReply:
        return cls(content=content, termination=detect_stop(content))


def episode_protocol(episode: Episode) -> Protocol:
    """The protocol an episode is played by (a stand-in episode without one follows ``airline_rl``)."""
    return getattr(episode, "protocol", None) or PROTOCOLS[AIRLINE_RL]


def agent_messages_since_user(episode: Episode) -> list[str]:
    """The texts the agent showed the user since the user last spoke (tool calls and results are invisible; under
    the ``tau2`` protocol so is the text of a message that calls tools, which τ² sends to the environment only)."""
    messages = episode.messages
    start = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1) + 1
    visible = set(user_visible_agent_messages(messages, episode_protocol(episode)))
    return [messages[i]["content"] for i in range(start, len(messages)) if i in visible and messages[i].get("content")]


class UserSimulator(ABC):
    """Base class: implement ``reply``; override ``reply_batch`` to answer a wave concurrently."""

    name: str = "base"

    @abstractmethod
    def reply(self, episode: Episode) -> UserReply:
        """The user's next message given ``episode.messages`` (the agent's last turn is the newest)."""

    def reply_batch(self, episodes: list[Episode]) -> list[UserReply]:
        """One reply per episode; the default answers them one after another."""
        return [self.reply(episode) for episode in episodes]

    def stats(self) -> dict[str, Any]:
        """Accounting since the last call (requests, tokens, latency...); empty for offline simulators."""
        return {}
