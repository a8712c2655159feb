"""How a tool call is answered, the same for every domain: τ²'s ``Environment.get_response`` around a domain's tools.

A domain's ``execute_tool`` (``DomainSpec.execute_tool``) finds the tool's method on its toolkit over the episode's
state and hands it to ``respond``, which does what τ² does around every call: an unknown tool, arguments that are not
an object and ``make_tool_call``'s keyword collisions fail before the tool runs; any exception the tool raises is the
observation ``"Error: <message>"`` (with the changes made before it kept: the tools mutate the state in place); a
result is shown as τ²'s ``Environment.to_json_str`` shows it.
"""

from __future__ import annotations

import datetime
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from tau2_rl.envs.state import dump, dumps_unbounded

logger = logging.getLogger(__name__)


class ToolError(ValueError):
    """A tool's own refusal ("User X not found"): τ²'s tools raise ``ValueError`` with that text."""


@dataclass
class ToolResult:
    """What a tool call produced: the observation text shown to the model and whether it failed."""

    content: str
    error: bool
    error_kind: str | None = None  # "unknown_tool", "bad_arguments", "execution"


class Dumped(dict):
    """A record already in ``model_dump`` form (a read returns the stored dict instead of a model)."""


def _jsonable(value: Any) -> Any:
    """τ²'s ``Environment.to_json_str`` conversion: models dumped, top-level scalars as strings, containers walked."""
    if isinstance(value, BaseModel):
        return dump(value)
    if isinstance(value, Dumped):  # τ² would dump a model here: the nested values are not walked
        return dict(value)
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, (int, float, bool)):
        return str(value)
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_jsonable(item) for item in value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, datetime.date):  # a datetime too: τ²'s isoformat (inside a model, default=str's space)
        return value.isoformat()
    raise ValueError(f"Unsupported type: {type(value)}")


def format_observation(value: Any) -> str:
    """τ² shows strings as they are and everything else as ``json.dumps(..., default=str)``."""
    return value if isinstance(value, str) else dumps_unbounded(_jsonable(value), default=str)


def collision(arguments: dict[str, Any]) -> str | None:
    """The TypeError τ²'s ``self.make_tool_call(name, requestor=..., **arguments)`` raises before any tool runs."""
    if "requestor" in arguments:  # a repeated keyword at the call site: Python names the function fully
        return (
            "tau2.environment.environment.Environment.make_tool_call() got multiple values for keyword argument "
            "'requestor'"
        )
    for key in arguments:
        if key in ("self", "tool_name"):
            return f"Environment.make_tool_call() got multiple values for argument '{key}'"
    return None


def bad_binding(method: Callable[..., Any], arguments: dict[str, Any]) -> bool:
    """Whether ``arguments`` cannot be bound to ``method``'s signature (a TypeError of the call, not of the tool)."""
    try:
        inspect.signature(method).bind(**arguments)
    except TypeError:
        return True
    return False


_EXPECTED_ERRORS = (ToolError, ValidationError, TypeError, KeyError, AttributeError, ValueError)


def respond(
    name: str,
    arguments: Any,
    method: Callable[..., Any] | None,
    run: Callable[..., Any] | None = None,
    after: Callable[[], Any] | None = None,
) -> ToolResult:
    """One call answered as τ²'s ``Environment.get_response`` answers it. Never raises.

    ``method``: the tool's bound method on the domain's toolkit (``None``: the domain has no tool ``name``);
    ``run``: what actually computes the result when it is not ``method`` itself (the guarded ``calculate``), called
    only once the arguments bind to ``method``, so binding errors are τ²'s own; ``after``: what τ² runs after a call
    that succeeded, inside the same error handling (``sync_tools``), before the result is shown.
    """
    if method is None:
        return ToolResult(f"Error: Tool '{name}' not found.", True, "unknown_tool")
    if not isinstance(arguments, dict):  # τ²'s ToolCall only holds an object; our parser may hand over anything
        return ToolResult(
            f"Error: Arguments of tool '{name}' must be a JSON object, got {type(arguments).__name__}",
            True,
            "bad_arguments",
        )
    clash = collision(arguments)
    if clash is not None:
        return ToolResult(f"Error: {clash}", True, "bad_arguments")
    try:
        if run is not None and not bad_binding(method, arguments):
            return ToolResult(format_observation(run(**arguments)), False)
        if after is None:
            return ToolResult(format_observation(method(**arguments)), False)
        result = method(**arguments)
        after()
        return ToolResult(format_observation(result), False)
    except Exception as err:  # τ²: any exception is the observation "Error: <str(exception)>"
        kind = (
            "bad_arguments"
            if isinstance(err, ValidationError) or (isinstance(err, TypeError) and bad_binding(method, arguments))
            else "execution"
        )
        if not isinstance(err, _EXPECTED_ERRORS):
            logger.debug("tool %s raised %r on arguments %r", name, err, arguments)
        return ToolResult(f"Error: {err}", True, kind)
