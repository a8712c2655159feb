"""Parsing Qwen2.5 / Hermes ``<tool_call>{...}</tool_call>`` blocks out of generated model text.

A policy model's output is untrusted: any text must parse into (message to the user, tool calls) without raising.
A block that cannot be used (bad JSON, no name, arguments not an object, an unclosed tag) becomes a ``ParsedToolCall``
with ``parse_error`` set; the episode runner turns it into an error observation and counts it as a tool error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_NOT_AN_OBJECT = 'Tool call must be a JSON object {"name": ..., "arguments": {...}}'
_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedToolCall:
    """One tool-call block: name and arguments when well-formed, else the reason it is not."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    parse_error: str | None = None


@dataclass
class ParsedTurn:
    """An assistant turn split into the text the user sees and the tool calls, in order."""

    text: str
    tool_calls: list[ParsedToolCall]


def _parse_block(body: str, closed: bool) -> ParsedToolCall:
    raw = body.strip()
    if not closed:
        return ParsedToolCall(name="", raw=raw, parse_error="Tool call block is not closed with </tool_call>")
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as err:  # ValueError: JSONDecodeError, or an int literal over 4300 digits
        return ParsedToolCall(name="", raw=raw, parse_error=f"Tool call is not valid JSON: {err}")
    if not isinstance(payload, dict):
        return ParsedToolCall(name="", raw=raw, parse_error=_NOT_AN_OBJECT)
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ParsedToolCall(name="", raw=raw, parse_error="Tool call has no 'name' string")
    extra = sorted(set(payload) - {"name", "arguments"})
    if extra:
        return ParsedToolCall(name=name, raw=raw, parse_error=f"Tool call has unexpected keys {extra}")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as err:
            return ParsedToolCall(name=name, raw=raw, parse_error=f"Tool call arguments are not valid JSON: {err}")
    if not isinstance(arguments, dict):
        return ParsedToolCall(name=name, raw=raw, parse_error="Tool call 'arguments' must be a JSON object")
    return ParsedToolCall(name=name, arguments=arguments, raw=raw)


def parse_assistant_text(text: str) -> ParsedTurn:
    """Splits model text into the user-facing message and its tool calls (run in the order they appear)."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    calls: list[ParsedToolCall] = []
    outside: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        outside.append(text[position : match.start()])
        calls.append(_parse_block(match.group(1), closed=bool(match.group(2))))
        position = match.end()
    outside.append(text[position:])
    message = "".join(outside).replace(TOOL_CALL_CLOSE, "").strip()
    return ParsedTurn(text=message, tool_calls=calls)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The Hermes block a Qwen2.5 model emits for a call (what the chat template renders for ``tool_calls``)."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"
