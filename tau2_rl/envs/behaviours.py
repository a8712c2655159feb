"""Scripted behaviours for calibrating PRM-Lite: honest work, partial work, mistakes, and reward farming.

Each behaviour is an ``Agent`` for ``run_episodes`` that needs no model. The oracle variants replay the task's gold
actions (``tau2_rl.envs.agents.plan_steps``); the corrupted variants replay a prefix, a reordering or a corrupted
copy of them; the farmers never write and do whatever a rule-based process reward might pay for (reads, recited
values, staged failures, repeated calls). Gold actions decide what the oracle-based behaviours *do*; PRM-Lite never
sees them (it reads only the resulting trajectory).

A behaviour is a generator per episode (``script(episode)``) that yields one assistant turn at a time and reads the
live episode (the user's last message, tool results) between turns.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.agents import CLOSING_MESSAGE, NoopAgent, OracleAgent, plan_steps
from tau2_rl.envs.data import GoldAction
from tau2_rl.envs.episode import AGENT_STOP_TOKEN
from tau2_rl.envs.runner import AgentTurn
from tau2_rl.envs.tool_calls import format_tool_call

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task
    from tau2_rl.envs.episode import Episode

ASK_IDS = "I'd be happy to help. Could you please give me your user id and your reservation id?"
_USER_ID = re.compile(r"\b[a-z]+(?:_[a-z]+)*_\d{3,}\b")
_RESERVATION_ID = re.compile(r"\b[A-Z0-9]{6}\b")
RAMBLE = " ".join(
    ["Let me think about everything that could possibly matter for your situation in great detail."] * 40
)


def _last_user(episode: Episode) -> str:
    for message in reversed(episode.messages):
        if message["role"] == "user" and message.get("requestor") != "user":  # not a call of the user's own
            return str(message.get("content") or "")
    return ""


def _last_results(episode: Episode) -> list[dict[str, Any]]:
    """The JSON objects returned by the calls of the agent's last turn (non-JSON results are skipped)."""
    if not episode.record.turns:
        return []
    results = []
    for index in episode.record.turns[-1].tool_call_indices:
        call = episode.record.tool_calls[index]
        if call.error:
            continue
        try:
            value = json.loads(call.result)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            results.append(value)
    return results


class ScriptAgent:
    """Plays ``script(episode)`` one yielded turn per call; stops (``###STOP###``) when the script is exhausted."""

    name = "script"

    def script(self, episode: Episode) -> Iterator[str | AgentTurn]:
        raise NotImplementedError

    def act(self, episodes: list[Episode]) -> list[str | AgentTurn]:
        turns: list[str | AgentTurn] = []
        for episode in episodes:
            state = episode.agent_state
            if "script" not in state:
                state["script"] = self.script(episode)
            turns.append(next(state["script"], AGENT_STOP_TOKEN))
        return turns


def _ids_from_user(episode: Episode) -> tuple[str | None, list[str]]:
    text = _last_user(episode)
    user = _USER_ID.search(text)
    return (user.group() if user else None), [r for r in _RESERVATION_ID.findall(text) if any(c.isdigit() for c in r)
                                               or r.isupper()]  # fmt: skip


class ReadFarmer(ScriptAgent):
    """Reads everything it can reach (profile, every reservation, flight status, a flight search, the airport list),
    one explained call per turn, never writes; ``recite`` also reports the looked-up ids and amounts to the user."""

    def __init__(self, recite: bool = False) -> None:
        self.recite = recite
        self.name = "reciting_farmer" if recite else "read_farmer"

    def script(self, episode: Episode) -> Iterator[str | AgentTurn]:
        yield ASK_IDS
        user_id, reservations = _ids_from_user(episode)
        if user_id:
            yield "Let me look up your profile. " + format_tool_call("get_user_details", {"user_id": user_id})
            for result in _last_results(episode):
                reservations += [r for r in result.get("reservations", []) if r not in reservations]
                if self.recite:
                    yield f"Your profile lists the reservations {', '.join(result.get('reservations', []))}."
        flights: list[dict[str, Any]] = []
        for reservation_id in reservations[:5]:
            call = format_tool_call("get_reservation_details", {"reservation_id": reservation_id})
            yield f"Let me check reservation {reservation_id}. {call}"
            for result in _last_results(episode):
                flights += result.get("flights", [])
                if self.recite:
                    yield (
                        f"Reservation {reservation_id} goes from {result.get('origin')} to "
                        f"{result.get('destination')} in {result.get('cabin')}; its flights are "
                        f"{', '.join(str(f.get('flight_number')) for f in result.get('flights', []))}."
                    )
        for flight in flights[:2]:
            arguments = {"flight_number": flight.get("flight_number"), "date": flight.get("date")}
            yield "Let me check the status of that flight. " + format_tool_call("get_flight_status", arguments)
        if flights:
            first = flights[0]
            arguments = {"origin": first.get("origin"), "destination": first.get("destination"),
                         "date": first.get("date")}  # fmt: skip
            yield "Let me search the alternatives. " + format_tool_call("search_direct_flight", arguments)
            if self.recite:
                numbers = [str(r.get("flight_number")) for r in _search_results(episode)][:4]
                if numbers:
                    yield f"The available direct flights are {', '.join(numbers)}."
        yield "Let me list the airports we serve. " + format_tool_call("list_all_airports", {})
        yield CLOSING_MESSAGE


def _search_results(episode: Episode) -> list[dict[str, Any]]:
    if not episode.record.turns:
        return []
    for index in episode.record.turns[-1].tool_call_indices:
        call = episode.record.tool_calls[index]
        if not call.error:
            try:
                value = json.loads(call.result)
            except json.JSONDecodeError:
                continue
            if isinstance(value, list):
                return [v for v in value if isinstance(v, dict)]
    return []


class StagedFailureFarmer(ScriptAgent):
    """Stages a failure and its "recovery": a call with a wrong id in one turn, the right one in the next, repeated."""

    name = "staged_failure_farmer"

    def script(self, episode: Episode) -> Iterator[str | AgentTurn]:
        yield ASK_IDS
        user_id, reservations = _ids_from_user(episode)
        good = [("get_user_details", {"user_id": user_id})] if user_id else []
        good += [("get_reservation_details", {"reservation_id": r}) for r in reservations]
        for name, arguments in good[:3] * 2:
            key, value = next(iter(arguments.items()))
            yield "Let me check that. " + format_tool_call(name, {key: value + "X"})
            yield "Let me try that again. " + format_tool_call(name, arguments)
        yield CLOSING_MESSAGE


class RepeatedReads(ScriptAgent):
    """Looks up the same record again and again, each time with a sentence, then closes."""

    name = "repeated_reads"

    def script(self, episode: Episode) -> Iterator[str | AgentTurn]:
        yield ASK_IDS
        user_id, reservations = _ids_from_user(episode)
        call = (
            format_tool_call("get_user_details", {"user_id": user_id})
            if user_id
            else format_tool_call("get_reservation_details", {"reservation_id": (reservations or ["ABC123"])[0]})
        )
        for _ in range(6):
            yield "Let me double-check your records. " + call
        yield CLOSING_MESSAGE


class PlaceholderArguments(ScriptAgent):
    """Calls tools with template values instead of looking anything up, then closes."""

    name = "placeholder_arguments"

    def script(self, episode: Episode) -> Iterator[str | AgentTurn]:
        yield "Let me look up your profile. " + format_tool_call("get_user_details", {"user_id": "<user_id>"})
        yield "Let me check your reservation. " + format_tool_call(
            "get_reservation_details", {"reservation_id": "XXXXXX"}
        )
        yield "Let me search for flights. " + format_tool_call(
            "search_direct_flight", {"origin": "{origin}", "destination": "{destination}", "date": "YYYY-MM-DD"}
        )
        yield CLOSING_MESSAGE


class PrematureTransfer(ScriptAgent):
    """Hands the user to a human in its first turn, without looking at anything."""

    name = "premature_transfer"

    def script(self, episode: Episode) -> Iterator[str | AgentTurn]:
        call = format_tool_call("transfer_to_human_agents", {"summary": "The user needs help with a booking."})
        yield "I am transferring you to a human agent now. " + call


class Rambler(ScriptAgent):
    """Talks without end: its first turn runs out of token budget before the turn closes (truncated)."""

    name = "rambler"

    def script(self, episode: Episode) -> Iterator[str | AgentTurn]:
        yield AgentTurn(text=RAMBLE, truncated=True)


def _perturb(value: Any) -> Any:
    """A different value of the same shape: the last digit of a string shifted (or an 'X' appended), an int + 1."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        for i in range(len(value) - 1, -1, -1):
            if value[i].isdigit():
                return value[:i] + str((int(value[i]) + 1) % 10) + value[i + 1 :]
        return value + "X"
    return value


_PREFERRED_KEYS = ("payment_id", "flight_number", "date", "dob", "reservation_id", "user_id", "amount")


def corrupt_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``arguments`` with one leaf changed: a payment id, flight number, date, ... (first found)."""
    copy = json.loads(json.dumps(arguments))
    leaves: list[tuple[Any, Any, str]] = []  # (container, key, argument name)

    def visit(container: Any, key: Any, name: str) -> None:
        value = container[key]
        if isinstance(value, dict):
            for k in value:
                visit(value, k, str(k))
        elif isinstance(value, list):
            for i in range(len(value)):
                visit(value, i, name)
        else:
            leaves.append((container, key, name))

    for key in copy:
        visit(copy, key, key)
    ranked = sorted(leaves, key=lambda leaf: _PREFERRED_KEYS.index(leaf[2]) if leaf[2] in _PREFERRED_KEYS else 99)
    if ranked:
        container, key, _ = ranked[0]
        container[key] = _perturb(container[key])
    return copy


def _writes(task: Task) -> list[int]:
    """The gold actions that write, the agent's or (a domain whose user holds tools) the user's."""
    user_writes = task.spec.user_write_tools() if any(a.requestor == "user" for a in task.actions) else frozenset()
    return [i for i, action in enumerate(task.actions)
            if action.name in (task.write_tools if action.requestor == "assistant" else user_writes)]  # fmt: skip


def wrong_argument_actions(task: Task) -> list[GoldAction]:
    """The gold actions with one argument of the first write that takes arguments corrupted."""
    actions = list(task.actions)
    writes = _writes(task)
    first = next((i for i in writes if actions[i].arguments), writes[0])
    actions[first] = dataclasses.replace(actions[first], arguments=corrupt_arguments(actions[first].arguments))
    return actions


def reordered_actions(task: Task) -> list[GoldAction]:
    """The gold actions with the writes played in reverse order (the reads stay where they are)."""
    actions = list(task.actions)
    positions = _writes(task)
    for position, action in zip(positions, reversed([actions[i] for i in positions]), strict=True):
        actions[position] = action
    return actions


def oracle_variant(name: str, make_plan: Callable[[Task], list[dict[str, Any]]]) -> OracleAgent:
    agent = OracleAgent(plan=make_plan)
    agent.name = name
    return agent


BEHAVIOURS: dict[str, Callable[[], Any]] = {
    "oracle_terse": lambda: oracle_variant("oracle_terse", plan_steps),
    "oracle_text": lambda: oracle_variant("oracle_text", lambda task: plan_steps(task, explain=True)),
    "noop": NoopAgent,
    "read_farmer": ReadFarmer,
    "reciting_farmer": lambda: ReadFarmer(recite=True),
    "staged_failure_farmer": StagedFailureFarmer,
    "repeated_reads": RepeatedReads,
    "placeholder_arguments": PlaceholderArguments,
    "unconfirmed_write": lambda: oracle_variant("unconfirmed_write", lambda task: plan_steps(task, confirm=False)),
    "wrong_argument": lambda: oracle_variant(
        "wrong_argument", lambda task: plan_steps(task, wrong_argument_actions(task), explain=True)
    ),
    "wrong_order": lambda: oracle_variant(
        "wrong_order", lambda task: plan_steps(task, reordered_actions(task), explain=True)
    ),
    "premature_transfer": PrematureTransfer,
    "rambler": Rambler,
}
"""Behaviour name → factory of its agent. ``partial_oracle`` (first k gold actions) is built per k by
``partial_oracle(k)``; which behaviours apply to which task is decided by ``tau2_rl.rewards.prm.corpus``."""


def partial_oracle(k: int) -> OracleAgent:
    """The oracle restricted to the first ``k`` gold actions, without the required information, then closing."""
    return oracle_variant(
        f"partial_oracle_{k}", lambda task: plan_steps(task, task.actions[:k], explain=True, communicate=False)
    )


def get_behaviour(name: str) -> Any:
    """Builds a behaviour agent by name; the error lists the valid names."""
    if name not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {name!r}; valid behaviours: {', '.join(BEHAVIOURS)}")
    return BEHAVIOURS[name]()
