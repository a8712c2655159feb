"""An episode's conversation as τ² records it: the messages its ``SimulationRun`` holds, which its evaluators read.

The τ² export (``tau2_rl.evaluation.tau2_export``) writes them; the NL-assertion judge (``tau2_rl.rewards.judge``)
shows them to its LLM as τ²'s ``NLAssertionsEvaluator`` does. Built from the ``EpisodeRecord`` alone, with nothing
of τ²'s package.
"""

from __future__ import annotations

from typing import Any

from tau2_rl.envs.episode import GREETING, EpisodeRecord
from tau2_rl.envs.tool_calls import parse_assistant_text


def tau2_messages(record: EpisodeRecord) -> list[dict[str, Any]]:
    """The episode's conversation as τ² message dicts (``turn_idx`` numbered as τ²'s ``get_trajectory`` does)."""
    messages = record.messages
    out: list[dict[str, Any]] = [dict(message) for message in record.history]  # as the task records it (ids kept)
    turns = iter(record.turns)
    user_calls = iter(record.user_tool_calls)
    index, greeted, rounds = 0, False, 0
    if record.history:  # the resumed conversation: its messages follow the system prompt, no greeting
        index, greeted = 1 + len(record.history), True
    while index < len(messages):
        message = messages[index]
        role = message["role"]
        index += 1
        if role == "system":
            continue
        if role == "user" and message.get("requestor") == "user":  # the user's own calls, then their results
            calls = [next(user_calls) for _ in message.get("tool_calls") or []]
            ids = [call.get("id") or f"user_call_{rounds}_{k}" for k, call in enumerate(message["tool_calls"])]
            rounds += 1
            out.append({"role": "user", "content": message.get("content") or None, "tool_calls": [
                {"id": call_id, "name": call.name, "arguments": call.arguments or {}, "requestor": "user"}
                for call_id, call in zip(ids, calls, strict=True)]})  # fmt: skip
            for call_id, call in zip(ids, calls, strict=True):
                out.append({"id": call_id, "role": "tool", "content": call.result, "requestor": "user",
                            "error": call.error})  # fmt: skip
            index += len(calls)  # their tool messages follow
            continue
        if role == "user":
            out.append({"role": "user", "content": message.get("content")})
            continue
        if role == "tool":  # tool messages are emitted with their assistant message below
            raise ValueError(f"task {record.task_id}: a tool message without its assistant message")
        if not greeted:
            greeted = True
            out.append({"role": "assistant", "content": message.get("content") or GREETING})
            continue
        turn = next(turns)
        calls = [record.tool_calls[i] for i in turn.tool_call_indices]
        index += len(calls)  # their tool messages follow this assistant message
        parsed = [call for call in calls if call.error_kind != "parse"]
        content = message.get("content")
        if calls and "tool_calls" not in message and parsed:  # some blocks did not parse: the text around them
            content = parse_assistant_text(turn.raw_text).text
        ids = [f"call_{turn.index}_{k}" for k in range(len(parsed))]
        out.append(
            {
                "role": "assistant",
                "content": content if content else None,
                "tool_calls": [
                    {"id": call_id, "name": call.name, "arguments": call.arguments or {}, "requestor": "assistant"}
                    for call_id, call in zip(ids, parsed, strict=True)
                ]
                or None,
            }
        )
        for call_id, call in zip(ids, parsed, strict=True):
            out.append(
                {"id": call_id, "role": "tool", "content": call.result, "requestor": "assistant", "error": call.error}
            )
    for position, message in enumerate(out):
        message["turn_idx"] = position
    return out
