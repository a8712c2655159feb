"""Episodes that run in τ²'s own ``Environment``: a domain's toolkits on fresh copies of its databases.

Why two kinds of episode state: the airline and retail answer thousands of resets per training step from a 7 MB
database, so their episodes write through a copy-on-write view (``tau2_rl.envs.state``). A domain whose databases are
small and whose environment does more than answer the agent's calls (τ²'s mock and telecom: functions run at reset,
assertions on the final state, a user holding tools, ``sync_tools`` after each call) instead runs one τ²
``Environment`` per episode, built by its ``DomainSpec.environment`` on deep copies of the loaded databases: every
observation, initial state, synchronisation, assertion and hash is then τ²'s by construction, and the project adds
only the copies and the call guards of ``tau2_rl.envs.toolkit.respond``.

Both sides' states are copy-on-write per episode, at the grain of the whole environment: every episode of a task
starts on one shared, initialized τ² ``Environment`` (the task's initial state, built once by ``WorldBase.initial``)
and answers its tools of τ²'s type ``read`` there; its first call of any other tool (a write, a transfer, a toggle on
the phone) gives it its own deep copy first. A shared state is synchronised already (τ²'s orchestrator ends its
initialization with ``sync_tools``, and synchronising twice changes nothing), and a read leaves both databases as they
were (tests/test_telecom.py checks both on every tool and assertion of every task), so an episode that only reads
runs, synchronises and hashes exactly as on a copy of its own. A GRPO group's episodes of one task share one
initialization; an episode that never writes never copies.

A ``WorldBase`` is such a domain's shared, read-only base (``DomainEnv.base``); its ``new_state`` is a ``World``, what
``Episode.state`` holds. Both answer what the rest of the package asks of a state: the tools (``call``), the reward's
database hash (``db_hash``: the agent's and the user's, as τ²'s DB check compares both), the gold replay
(``gold_state``) and the environment assertions (``assertion``).
"""

from __future__ import annotations

import copy
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


class Snapshot:
    """A shared environment that no episode writes to, and its hash (computed once)."""

    __slots__ = ("env", "_hash")

    def __init__(self, env: Any) -> None:
        self.env = env
        self._hash: str | None = None

    def db_hash(self) -> str:
        if self._hash is None:
            self._hash = environment_hash(self.env)
        return self._hash


def environment_hash(env: Any) -> str:
    """τ²'s agent database hash and user database hash (None when the domain's user holds no tools) in one string:
    equal strings are τ²'s DB match (both hashes equal)."""
    return f"{env.get_db_hash()}|{env.get_user_db_hash()}"


class WorldBase:
    """A domain's base databases as τ²'s models (never mutated), the τ² task models of its tasks and the tasks'
    shared initial states (module docstring: copy-on-write)."""

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
        self._initial: dict[str, Snapshot] = {}
        self.pristine = Snapshot(self.environment())
        env = self.pristine.env
        self.read_tools: dict[str, frozenset[str]] = {  # requestor → its tools of τ²'s type ``read``
            side: frozenset(name for name, kind in toolkit_tool_types(type(toolkit)).items() if kind == "read")
            for side, toolkit in (("assistant", env.tools), ("user", env.user_tools)) if toolkit is not None
        }  # fmt: skip
        self.base_hash = self.pristine.db_hash()

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

    def initial(self, task: Task) -> Snapshot:
        """``task``'s initial state, built once and shared by its episodes: τ²'s orchestrator's initialization, that
        is ``set_state`` (the task's initialization data and actions, each followed by ``sync_tools``, then the tool
        calls of its message history replayed strictly: τ² raises where one answers otherwise than recorded), then
        ``sync_tools``."""
        snapshot = self._initial.get(task.task_id)
        if snapshot is None:
            env = self.environment()
            state = self.tau2_task(task).initial_state
            if state is not None:
                env.set_state(state.initialization_data, state.initialization_actions, state.message_history or [])
            env.sync_tools()
            snapshot = self._initial[task.task_id] = Snapshot(env)
        return snapshot

    def gold_state(self, task: Task) -> World:
        """τ²'s gold environment: ``set_state`` with the task's initial state, then each gold action by its requestor,
        without the synchronisation a conversation's calls get (a failing action is skipped, as τ² logs and skips
        it)."""
        env = self.environment()
        state = self.tau2_task(task).initial_state
        if state is not None:
            env.set_state(state.initialization_data, state.initialization_actions, state.message_history or [])
        for action in task.actions:
            try:
                env.make_tool_call(action.name, requestor=action.requestor, **action.arguments)
            except Exception:  # noqa: BLE001 (τ²'s EnvironmentEvaluator catches everything here)
                continue
        return World(self, Snapshot(env), own=True)


class World:
    """One episode's τ² ``Environment``: a shared snapshot until its first call of a tool that is not a read, then
    its own deep copy of it (module docstring)."""

    __slots__ = ("base", "_snapshot", "own")

    def __init__(self, base: WorldBase, snapshot: Snapshot | None = None, own: bool = False) -> None:
        self.base = base
        self._snapshot = base.pristine if snapshot is None else snapshot
        self.own = own  # whether ``env`` is this episode's alone

    @property
    def env(self) -> Any:
        """The τ² ``Environment`` the episode stands on (shared while ``own`` is False: read it, never write it)."""
        return self._snapshot.env

    def _written(self) -> Any:
        """The episode's own environment, copied from the shared one on the first write (the copy holds every piece
        of the environment's state: both databases and whatever else its toolkits keep, such as telecom's VPN
        details)."""
        if not self.own:
            self._snapshot = Snapshot(copy.deepcopy(self._snapshot.env))
            self.own = True
        return self._snapshot.env

    def call(self, requestor: str, name: str, arguments: Any) -> ToolResult:
        """One call of ``requestor``'s tool as τ²'s ``Environment.get_response`` answers it (a call that succeeds is
        followed by ``sync_tools``, whose failure makes the call's observation an error, as in τ²). A read, or a
        name the side has no tool of, runs on the shared state without the synchronisation, which would change
        nothing there."""
        reads = self.base.read_tools.get(requestor, frozenset())
        if self.own or (name not in reads and self._has_tool(requestor, name)):
            env = self._written()
            after = env.sync_tools
        else:
            env, after = self.env, None
        toolkit = env.tools if requestor == "assistant" else env.user_tools
        method = toolkit.tools.get(name) if toolkit is not None else None
        return respond(name, arguments, method, after=after)

    def _has_tool(self, requestor: str, name: str) -> bool:
        toolkit = self.env.tools if requestor == "assistant" else self.env.user_tools
        return toolkit is not None and name in toolkit.tools

    def sync(self) -> None:
        """τ²'s ``sync_tools`` (the orchestrator runs it after every step; a shared state is synchronised already)."""
        if self.own:
            self._snapshot.env.sync_tools()

    def initialize(self, task: Task) -> None:
        """The task's initial state (``WorldBase.initial``), shared until the episode's first write."""
        self._snapshot = self.base.initial(task)
        self.own = False

    def assertion(self, check: EnvCall) -> bool:
        """τ²'s ``run_env_assertion`` of one environment assertion (its function's own exception propagates)."""
        models = tau2_module("tau2.data_model.tasks")
        assertion = models.EnvAssertion(env_type=check.env_type, func_name=check.func_name,
                                        arguments=check.arguments, assert_value=check.assert_value,
                                        message=check.message or None)  # fmt: skip
        return bool(self.env.run_env_assertion(assertion, raise_assertion_error=False))

    def db_hash(self) -> str:
        """Both sides' hashes as τ² computes them (``environment_hash``; a shared state's, once per state)."""
        return environment_hash(self.env) if self.own else self._snapshot.db_hash()

    def fingerprint(self) -> bytes:
        return self.db_hash().encode()


def world_tool(state: World, name: str, arguments: Any) -> ToolResult:
    """``DomainSpec.execute_tool`` of a domain that runs in τ²'s Environment: the agent's call."""
    return state.call("assistant", name, arguments)
