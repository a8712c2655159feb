"""User simulators, by name. The registry holds import paths, not classes, so that choosing the scripted user never
imports the LLM client (and a simulator module is only loaded when asked for)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.users.base import UserSimulator

USER_SIMULATORS: dict[str, str] = {
    "scripted": "tau2_rl.envs.users.scripted:ScriptedUser",
    "llm": "tau2_rl.envs.users.llm:LLMUser",
}


def get_user_simulator(name: str, **kwargs: Any) -> UserSimulator:
    """Builds the simulator registered as ``name`` with ``kwargs``; an unknown name lists the valid ones."""
    if name not in USER_SIMULATORS:
        raise ValueError(f"Unknown user simulator {name!r}; valid names: {', '.join(sorted(USER_SIMULATORS))}.")
    module_name, _, class_name = USER_SIMULATORS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)


def check_user_endpoint(user: UserSimulator, timeout: float) -> None:
    """The simulator's endpoint check (the LLM user's ``GET /models``), before any episode: evaluate.py, collection
    and train_grpo.py refuse an unreachable endpoint instead of playing nothing but user errors.

    Raises the check's ``EndpointUnreachableError`` (a ``ConnectionError``) or ``ValueError`` (the endpoint does not
    serve the model), after closing the simulator."""
    check = getattr(user, "check_endpoint", None)
    if check is None:
        return
    try:
        check(timeout=timeout)
    except Exception:
        close = getattr(user, "close", None)
        if close is not None:
            close()
        raise
