"""Episodes that run in τ²'s own ``Environment``: a domain's toolkits on fresh copies of its databases.

Why two kinds of episode state: the airline and retail answer thousands of resets per training step from a 7 MB
database, so their episodes write through a copy-on-write view (``tau2_rl.envs.state``). A domain whose databases are
small and whose environment does more than answer the agent's calls (τ²'s mock and telecom: functions run at reset,
assertions on the final state, a user holding tools, ``sync_tools`` after each call) instead runs one τ²
``Environment`` per episode, built by its ``DomainSpec.environment`` on deep copies of the loaded databases: every
observation, initial state, synchronisation, assertion and hash is then τ²'s by construction, and the project adds
only the copies and the call guards of ``tau2_rl.envs.toolkit.respond``.

A ``WorldBase`` is such a domain's shared, read-only base (``DomainEnv.base``); its ``new_state`` is a ``World``, what
``Episode.state`` holds. Both answer what the rest of the package asks of a state: the tools (``call``), the reward's
database hash (``db_hash``: the agent's and the user's, as τ²'s DB check compares both), the gold replay
(``gold_state``) and the environment assertions (``assertion``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.protocol import tau2_module
from tau2_rl.envs.toolkit import ToolResult, respond

if TYPE_CHECKING:
    from tau2_rl.envs.data import Domain, EnvCall, Task
    from tau2_rl.envs.spec import DomainSpec


@functools.cache
def toolkit_tool_types(toolkit: type) -> dict[str, str]:
    """A τ² toolkit class's tools → τ²'s tool type (``read``, ``write``, ``generic``, ``think``), in τ²'s order."""
    attribute = tau2_module("tau2.environment.toolkit").TOOL_TYPE_ATTR
    return {name: getattr(func, attribute).value for name, func in toolkit(None)._func_tools.items()}


class WorldBase:
    """A domain's base databases as τ²'s models (never mutated) and the τ² task models of its tasks."""

    def __init__(self, domain: Domain, spec: DomainSpec) -> None:
        if spec.environment is None:
            raise ValueError(f"the {spec.name} domain does not run in τ²'s Environment (DomainSpec.environment)")
        self.spec = spec
        self.domain = domain
        self.db = spec.db_model().model_validate(domain.db)
        self.user_db: Any = None  # the user's database, for a domain whose user holds tools
        if domain.user_db is not None and spec.user_db_model is not None:
            self.user_db = spec.user_db_model().model_validate(domain.user_db)
        self._tau2_tasks: dict[str, Any] = {}
        self.base_hash = World(self).db_hash()

    def environment(self) -> Any:
        """A fresh τ² ``Environment`` of the domain on deep copies of the base databases."""
        user_db = None if self.user_db is None else self.user_db.model_copy(deep=True)
        return self.spec.environment(self.db.model_copy(deep=True), user_db, self.domain.policy)  # type: ignore[misc]

    def new_state(self) -> World:
        return World(self)

    def tau2_task(self, task: Task) -> Any:
        """τ²'s ``Task`` model of ``task`` (validated once per task)."""
        model = self._tau2_tasks.get(task.task_id)
        if model is None:
            model = tau2_module("tau2.data_model.tasks").Task.model_validate(task.raw)
            self._tau2_tasks[task.task_id] = model
        return model

    def gold_state(self, task: Task) -> World:
        """τ²'s gold environment: the task's initial state, then each gold action by its requestor, without the
        synchronisation a conversation's calls get (a failing action is skipped, as τ² logs and skips it)."""
        world = World(self)
        world.initialize(task)
        for action in task.actions:
            try:
                world.env.make_tool_call(action.name, requestor=action.requestor, **action.arguments)
            except Exception:  # noqa: BLE001 (τ²'s EnvironmentEvaluator catches everything here)
                continue
        return world


class World:
    """One episode's τ² ``Environment``."""

    __slots__ = ("base", "env")

    def __init__(self, base: WorldBase) -> None:
        self.base = base
        self.env = base.environment()

    def call(self, requestor: str, name: str, arguments: Any) -> ToolResult:
        """One call of ``requestor``'s tool as τ²'s ``Environment.get_response`` answers it (a call that succeeds is
        followed by ``sync_tools``, whose failure makes the call's observation an error, as in τ²)."""
        toolkit = self.env.tools if requestor == "assistant" else self.env.user_tools
        method = toolkit.tools.get(name) if toolkit is not None else None
        return respond(name, arguments, method, after=self.env.sync_tools)

    def sync(self) -> None:
        """τ²'s ``sync_tools`` (the orchestrator runs it after every step)."""
        self.env.sync_tools()

    def initialize(self, task: Task) -> None:
        """τ²'s ``set_state``: the task's initialization data and actions (each followed by ``sync_tools``), then the
        tool calls of its message history replayed strictly (τ² raises where one answers otherwise than recorded)."""
        state = self.base.tau2_task(task).initial_state
        if state is None:
            return
        self.env.set_state(state.initialization_data, state.initialization_actions, state.message_history or [])

    def assertion(self, check: EnvCall) -> bool:
        """τ²'s ``run_env_assertion`` of one environment assertion (its function's own exception propagates)."""
        models = tau2_module("tau2.data_model.tasks")
        assertion = models.EnvAssertion(env_type=check.env_type, func_name=check.func_name,
                                        arguments=check.arguments, assert_value=check.assert_value,
                                        message=check.message or None)  # fmt: skip
        return bool(self.env.run_env_assertion(assertion, raise_assertion_error=False))

    def db_hash(self) -> str:
        """τ²'s agent database hash and user database hash (None when the domain's user holds no tools) in one
        string: equal strings are τ²'s DB match (both hashes equal)."""
        return f"{self.env.get_db_hash()}|{self.env.get_user_db_hash()}"

    def fingerprint(self) -> bytes:
        return self.db_hash().encode()


def world_tool(state: World, name: str, arguments: Any) -> ToolResult:
    """``DomainSpec.execute_tool`` of a domain that runs in τ²'s Environment: the agent's call."""
    return state.call("assistant", name, arguments)
