"""What the offline scripted parties say in the mock domain: the oracle's questions and confirmations, the scripted
user's answers when asked which user or task.

The mock tasks' scenarios are one paragraph ("Create a new task called 'Important Meeting' for user_1."): the user
and task ids are read from it. The rest of both parties is the domain-neutral ``tau2_rl.envs.users.scripted`` and
oracle.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task

IDENTIFIERS = "user id, task id"
"""The identifying details the LLM user's project-protocol prompt lists as examples (``tau2_rl.envs.users.llm``)."""

_USER_ID = re.compile(r"\buser_\d+\b")
_TASK_ID = re.compile(r"\btask_\d+\b")
_REQUEST = re.compile(r"\?|\bplease (?:provide|share|give|tell)\b|\bi (?:will )?need\b", re.I)
_ASKS_USER = re.compile(r"\buser(?:[ _-]?id)?\b|\bwho\b|\baccount\b", re.I)
_ASKS_TASK = re.compile(r"\btask[ _-]?id\b|\bwhich task\b", re.I)


@dataclass(frozen=True)
class MockIdentity:
    """The user and task ids the scenario names."""

    user_ids: tuple[str, ...]
    task_ids: tuple[str, ...]


def identity(task: Task) -> MockIdentity:
    instr = task.instructions
    text = " ".join((instr.reason_for_call, instr.known_info, instr.task_instructions))
    return MockIdentity(tuple(dict.fromkeys(_USER_ID.findall(text))), tuple(dict.fromkeys(_TASK_ID.findall(text))))


def identity_answer(known: MockIdentity, text: str) -> str:
    """The ids the agent asked for, or "" when it asked for none."""
    if not _REQUEST.search(text):
        return ""
    parts = []
    if _ASKS_USER.search(text) and known.user_ids:
        parts.append(f"It's for {known.user_ids[0]}.")
    if _ASKS_TASK.search(text) and known.task_ids:
        parts.append(f"The task is {known.task_ids[0]}.")
    return " ".join(parts)


def opening_question(task: Task) -> str:
    """The oracle's first question: whose tasks these are."""
    return "I'd be happy to help. Which user is this for (their user id)?"


def describe_action(name: str, args: dict[str, Any]) -> str:
    """A mock write in plain words, for the confirmation question."""
    if name == "create_task":
        return f"create the task {args.get('title')!r} for {args.get('user_id')}"
    if name == "update_task_status":
        return f"mark task {args.get('task_id')} as {args.get('status')}"
    return f"run {name} with {json.dumps(args, sort_keys=True)}"


def assertion_actions(task: Task) -> list[Any]:
    """For a task whose gold names no action, only assertions (``update_task_with_history_and_env_assertions``): the
    write each assertion checks for, which the oracle then plays (a task status asserted → that status set)."""
    from tau2_rl.envs.data import GoldAction

    return [GoldAction(f"assert_{k}", "update_task_status", {"task_id": check.arguments.get("task_id"),
                                                             "status": check.arguments.get("expected_status")})
            for k, check in enumerate(task.env_assertions)
            if check.func_name == "assert_task_status" and check.assert_value]  # fmt: skip
