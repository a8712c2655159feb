"""User simulators, by name. The registry holds import paths, not classes, so that choosing the scripted user never
imports the LLM client (and a simulator module is only loaded when asked for)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airline_rl.envs.users.base import UserSimulator

USER_SIMULATORS: dict[str, str] = {
    "scripted": "airline_rl.envs.users.scripted:ScriptedUser",
    "llm": "airline_rl.envs.users.llm:LLMUser",
}


def get_user_simulator(name: str, **kwargs: Any) -> UserSimulator:
    """Builds the simulator registered as ``name`` with ``kwargs``; an unknown name lists the valid ones."""
    if name not in USER_SIMULATORS:
        raise ValueError(f"Unknown user simulator {name!r}; valid names: {', '.join(sorted(USER_SIMULATORS))}.")
    module_name, _, class_name = USER_SIMULATORS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)
