"""Scripted agents for the episode runner: an oracle that replays the gold actions, and a no-op baseline.

They need no model, so they check the environment end to end on CPU: the oracle must earn reward 1 on every task
against the scripted user (tools, state, reward and simulator agree), and the no-op agent earns reward exactly on the
tasks whose gold leaves the database untouched and asks nothing to be said (the floor any policy should beat).

Both implement the ``Agent`` protocol of ``tau2_rl.envs.runner`` (``act(episodes) -> list[str]``) and keep their
per-episode state in ``episode.agent_state``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.episode import AGENT_STOP_TOKEN
from tau2_rl.envs.tool_calls import format_tool_call

if TYPE_CHECKING:
    from tau2_rl.envs.data import GoldAction, Task
    from tau2_rl.envs.episode import Episode
    from tau2_rl.envs.runner import Agent

logger = logging.getLogger(__name__)

_AFFIRMATIVE = re.compile(r"\b(?:yes|yeah|yep|sure|ok|okay|confirm|confirmed|go ahead|proceed)\b", re.I)
MAX_CONFIRMATION_ASKS = 3
CLOSING_MESSAGE = "Thank you for contacting us. Is there anything else I can help you with?"


def plan_steps(
    task: Task,
    actions: Sequence[GoldAction] | None = None,
    *,
    explain: bool = False,
    confirm: bool = True,
    communicate: bool = True,
) -> list[dict[str, Any]]:
    """The oracle's steps: ask ids, batched reads, confirm-then-write, say the required info, close or transfer.

    ``actions`` replaces the gold actions (the behaviour corpus of PRM-Lite plays prefixes, reorderings and corrupted
    copies of them); ``explain`` puts a sentence before every tool call, ``confirm=False`` writes without asking, and
    ``communicate=False`` leaves out the required information.
    """
    dialogue = task.spec.dialogue  # the domain's questions and descriptions of its writes
    if actions is None:
        actions = task.actions
        implied = getattr(dialogue, "assertion_actions", None)
        if not actions and task.env_assertions and implied is not None:  # no gold: what its assertions check
            actions = tuple(implied(task))
    steps: list[dict[str, Any]] = [{"kind": "say", "text": dialogue.opening_question(task)}]
    reads: list[GoldAction] = []
    terminal: list[GoldAction] = []

    def flush() -> None:
        if reads:
            step: dict[str, Any] = {"kind": "calls", "calls": [(a.name, a.arguments) for a in reads]}
            if explain:
                step["text"] = "Let me look up the details I need."
            steps.append(step)
            reads.clear()

    for action in actions:
        if action.requestor == "user":  # the user's own tool (its phone): the oracle asks the user to do it
            flush()
            steps.append({"kind": "say", "text": dialogue.ask_user_action(action.name, action.arguments)})
        elif action.name in task.spec.terminal_tools:
            terminal.append(action)  # the conversation ends with it: play it after everything else
        elif action.name in task.write_tools:
            flush()
            description = dialogue.describe_action(action.name, action.arguments)
            if not confirm:
                steps.append(
                    {"kind": "calls", "calls": [(action.name, action.arguments)], "text": f"I will {description}."}
                )
                continue
            question = f"To confirm: I will {description}. Do you confirm (yes/no)?"
            steps.append({"kind": "say", "text": question})
            write: dict[str, Any] = {"kind": "write", "call": (action.name, action.arguments), "question": question}
            if explain:
                write["text"] = f"Thank you, I will now {description}."
            steps.append(write)
        else:
            reads.append(action)
    flush()
    if communicate and task.communicate_info:
        steps.append(
            {"kind": "say", "text": f"Here is the information you asked for: {' and '.join(task.communicate_info)}."}
        )
    if terminal:
        calls = [(a.name, a.arguments) for a in terminal]
        steps.append({"kind": "calls", "calls": calls, "text": "I am transferring you to a human agent now."})
        # τ²: the transfer call ends nothing; the user answers the transfer message with ###TRANSFER###.
        steps.append({"kind": "say", "text": "You are being transferred to a human agent now. Please hold."})
    else:
        steps.append({"kind": "say", "text": CLOSING_MESSAGE})
    return steps


def _last_user_message(episode: Episode) -> str:
    for message in reversed(episode.messages):
        if message["role"] == "user" and message.get("requestor") != "user":  # not a call of the user's own
            return str(message.get("content") or "")
    return ""


class OracleAgent:
    """Plays the task's gold actions, in order and with their exact arguments, inside a polite policy-shaped dialogue.

    It asks for the user id (and the reservation id when the user knows it), runs consecutive read actions in one
    turn, asks an explicit yes/no confirmation before each write and waits for the answer, states every
    ``communicate_info`` string verbatim, then closes (or transfers, when the gold ends with a transfer).
    """

    name = "oracle"

    def __init__(self, plan: Callable[[Task], list[dict[str, Any]]] | None = None) -> None:
        self.plan = plan or plan_steps

    def act(self, episodes: list[Episode]) -> list[str]:
        return [self._turn(episode) for episode in episodes]

    def _turn(self, episode: Episode) -> str:
        state = episode.agent_state
        if "steps" not in state:
            state["steps"] = self.plan(episode.task)
            state["position"] = 0
            state["asks"] = 0
        steps: list[dict[str, Any]] = state["steps"]
        if state["position"] >= len(steps):
            return AGENT_STOP_TOKEN  # the user did not end the conversation after the closing message
        step = steps[state["position"]]
        if step["kind"] == "write" and not _AFFIRMATIVE.search(_last_user_message(episode)):
            state["asks"] += 1
            if state["asks"] < MAX_CONFIRMATION_ASKS:
                return step["question"]  # ask again, without advancing
            logger.warning("task %s: user never confirmed %s; proceeding", episode.task.task_id, step["call"][0])
        state["position"] += 1
        state["asks"] = 0
        if step["kind"] == "say":
            return step["text"]
        calls = step["calls"] if step["kind"] == "calls" else [step["call"]]
        blocks = "\n".join(format_tool_call(name, arguments) for name, arguments in calls)
        return f"{step['text']}\n{blocks}" if step.get("text") else blocks


class NoopAgent:
    """Never calls a tool: declines politely and says goodbye, so the user ends the conversation."""

    name = "noop"
    MESSAGE = "I'm sorry, but I can't help with that request. Goodbye!"

    def act(self, episodes: list[Episode]) -> list[str]:
        for episode in episodes:
            episode.agent_state["turns"] = episode.agent_state.get("turns", 0) + 1
        return [self.MESSAGE for _ in episodes]


AGENTS: dict[str, type] = {"oracle": OracleAgent, "noop": NoopAgent}


def get_agent(name: str, **kwargs: Any) -> Agent:
    """Builds a scripted agent by name; the error lists the valid names."""
    if name not in AGENTS:
        raise ValueError(f"Unknown agent {name!r}; valid agents: {', '.join(sorted(AGENTS))}.")
    return AGENTS[name](**kwargs)
