"""One episode: the live conversation with its database view, and the record that rewards and metrics read.

Vocabulary (after willccbb/verifiers): ``DomainEnv.reset(task)`` gives an ``Episode``; ``episode.env_response(text)``
applies one assistant turn (runs its tool calls in order) and says whether the user must answer next;
``episode.user_response(reply)`` applies the user's answer; ``episode.is_completed`` tells when to stop. The
``EpisodeRecord`` keeps everything PRM-Lite, the metrics and the trainer need, so nobody re-parses the messages.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from tau2_rl.envs.data import Domain, Task, load_domain
from tau2_rl.envs.protocol import (
    TAU2_RL,
    Protocol,
    agent_system_prompt,
    agent_tool_schemas,
    get_protocol,
    protocol_rules,
)
from tau2_rl.envs.spec import DomainSpec
from tau2_rl.envs.state import CanonicalBase
from tau2_rl.envs.text import clean_text, clean_value
from tau2_rl.envs.tool_calls import ParsedTurn, parse_assistant_text
from tau2_rl.envs.world import WorldBase

logger = logging.getLogger(__name__)

Base = CanonicalBase | WorldBase
"""A domain's shared base: the copy-on-write state's, or a τ² ``Environment``'s (``tau2_rl.envs.world``)."""

GREETING = "Hi! How can I help you today?"
"""τ²'s fixed first agent message; the simulated user answers it with the reason for the call."""

# Termination reasons. Only the first group lets an episode earn reward: τ² scores a conversation only when it ended
# by the agent's stop token or by one of the user's stop tokens (###STOP###, ###TRANSFER###, ###OUT-OF-SCOPE### are
# all τ²'s USER_STOP). A call to transfer_to_human_agents ends nothing by itself; the user answers the transfer.
USER_STOP, USER_TRANSFER, USER_OUT_OF_SCOPE = "user_stop", "user_transfer", "user_out_of_scope"
AGENT_STOP = "agent_stop"
MAX_TURNS, MAX_TOOL_ERRORS, TOKEN_BUDGET, USER_ERROR = "max_turns", "max_tool_errors", "token_budget", "user_error"
MAX_STEPS, AGENT_ERROR = "max_steps", "agent_error"  # protocol tau2: τ²'s step cap; an empty agent message
REWARDABLE_TERMINATIONS = frozenset({USER_STOP, USER_TRANSFER, USER_OUT_OF_SCOPE, AGENT_STOP})
AGENT_STOP_TOKEN = "###STOP###"
USER_SIDE = "user"
MAX_USER_TOOL_ROUNDS = 10
"""Under the project protocol (no step cap), a user that calls its tools more often in a row ends the episode as a
user error."""
"""The ``requestor`` of the user's own tool calls and their results (τ²'s name): messages the agent never sees."""


@dataclass
class ToolCallRecord:
    """One executed (or rejected) tool call."""

    turn: int
    name: str
    arguments: dict[str, Any] | None
    result: str
    error: bool
    error_kind: str | None = None  # "parse", "unknown_tool", "bad_arguments", "execution"
    is_write: bool = False


@dataclass
class TurnRecord:
    """One assistant turn: what was generated, what the user saw, which calls it made."""

    index: int
    raw_text: str
    message: str
    tool_call_indices: list[int] = field(default_factory=list)
    last_user_message: str = ""
    num_policy_tokens: int | None = None
    truncated: bool = False


@dataclass
class EpisodeRecord:
    """Everything about a finished episode that rewards, PRM-Lite, metrics and datasets read."""

    task_id: str
    seed: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    termination: str | None = None
    user_error: str | None = None
    reward: dict[str, Any] | None = None
    agent_error: str | None = None  # a served agent's requests failed: not the policy's doing, not scored
    user_tool_calls: list[ToolCallRecord] = field(default_factory=list)
    """The user's own calls (a domain whose user holds tools): never the agent's, never in ``tool_calls``; each
    ``turn`` is the number of agent turns before it."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The task's message history as τ² records it (``initial_state.message_history``): the conversation the episode
    resumes, in ``messages`` after the system prompt in place of the greeting."""

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def num_tool_errors(self) -> int:
        return sum(call.error for call in self.tool_calls)

    @property
    def truncated(self) -> bool:
        return self.termination == TOKEN_BUDGET

    def agent_messages(self) -> list[str]:
        """Texts the agent showed the user (what τ²'s COMMUNICATE check searches), its history's included."""
        before = [m["content"] for m in self.history if m.get("role") == "assistant" and m.get("content")]
        return [*before, *(turn.message for turn in self.turns if turn.message)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("user_tool_calls", "history"):  # absent where unused: the record as it always was
            if not data[key]:
                del data[key]
        return data

    def history_calls(self) -> list[tuple[str, dict[str, Any]]]:
        """The tool calls of the message history (name, arguments): τ²'s trajectory holds them too."""
        return [(call["name"], call.get("arguments") or {}) for message in self.history
                for call in message.get("tool_calls") or []]  # fmt: skip


@dataclass
class EnvConfig:
    """The protocol (tau2_rl.envs.protocol) and the episode limits.

    ``tau2_rl`` caps assistant turns (``max_turns``); ``tau2`` caps τ²'s orchestrator steps (``max_steps``: every
    user message, agent message and environment response is one step; τ²'s default is 200). Both stop after
    ``max_tool_errors`` failed tool calls (τ²'s ``max_errors``, default 10).
    """

    max_turns: int = 30
    max_tool_errors: int = 10
    protocol: str = TAU2_RL
    max_steps: int = 200


def history_messages(history: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A τ² message history in the episode's message form (one message each: the agent's calls as ``tool_calls``,
    each result a ``tool`` message named after its call)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in history:
        role, content = message.get("role"), message.get("content")
        if role == "tool":
            out.append({"role": "tool", "name": names.get(str(message.get("id")), "tool"), "content": content})
        elif message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                names[str(call.get("id"))] = call["name"]
                calls.append({"type": "function", "function": {"name": call["name"],
                                                               "arguments": call.get("arguments") or {}}})  # fmt: skip
            out.append({"role": role, "content": content or "", "tool_calls": calls})
        else:
            out.append({"role": role, "content": content or ""})
    return out


class Episode:
    """A live episode: conversation, private database view, per-episode agent and user state."""

    def __init__(
        self,
        task: Task,
        base: Base,
        system_prompt: str,
        seed: int,
        config: EnvConfig,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """``tools``: the schemas the policy's prompt shows for this episode (its domain's; ``[]``: none)."""
        self.task = task
        self.state = base.new_state()
        initialize = getattr(self.state, "initialize", None)  # τ²'s Environment: set_state, then sync_tools
        if task.initial_state.features() and (task.unscorable or initialize is None):  # a task the loop cannot set
            # up is refused before any run reaches here
            raise ValueError(f"task {task.task_id}: {task.unscorable or 'its initial state cannot be set up'}")
        if initialize is not None:
            initialize(task)
        self.tools: list[dict[str, Any]] = [] if tools is None else tools
        self._execute = base.spec.execute_tool
        self._write_tools = task.write_tools
        self.seed = seed
        self.config = config
        self.record = EpisodeRecord(task_id=task.task_id, seed=seed)
        history = task.initial_state.message_history
        self.record.messages.append({"role": "system", "content": system_prompt})
        if history:  # the conversation resumes where the task's history ends (τ²: no greeting then)
            self.record.history = [{k: v for k, v in m.items() if k != "turn_idx"} for m in history]
            self.record.messages.extend(history_messages(history))
        else:
            self.record.messages.append({"role": "assistant", "content": GREETING})
        self.agent_state: dict[str, Any] = {}
        self.user_state: dict[str, Any] = {}
        self.protocol: Protocol = protocol_rules(config.protocol)  # DomainEnv has checked the package
        self.steps = 0  # τ²'s orchestrator step count (the greeting is not a step)
        self._errors = 0
        self._user_rounds = 0  # the user's tool-call rounds since it last spoke

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.record.messages

    @property
    def prefix_length(self) -> int:
        """The messages before the first thing the user says: the system prompt and the greeting, or the history."""
        return 1 + (len(self.record.history) if self.record.history else 1)

    @property
    def is_completed(self) -> bool:
        return self.record.termination is not None

    def finish(self, termination: str) -> None:
        if self.record.termination is None:
            self.record.termination = termination

    def _check_tau2_limits(self) -> None:
        """τ²'s checks after a step whose message is not for the environment: the step cap, then the error cap; each
        overrides a stop set in the same step (τ² assigns ``termination_reason`` again)."""
        if self.steps >= self.config.max_steps:
            self.record.termination = MAX_STEPS
        if self._errors >= self.config.max_tool_errors:
            self.record.termination = MAX_TOOL_ERRORS

    def _last_user_message(self) -> str:
        for message in reversed(self.messages):
            if message["role"] == "user" and message.get("requestor") != USER_SIDE:  # not a call of the user's own
                return message["content"]
        return ""

    def _sync(self) -> None:
        """τ²'s ``sync_tools`` after every orchestrator step, for a state that has one (τ²'s Environment)."""
        sync = getattr(self.state, "sync", None)
        if sync is not None:
            sync()

    def env_response(
        self,
        text: str,
        num_policy_tokens: int | None = None,
        truncated: bool = False,
        api_message: ParsedTurn | None = None,
    ) -> list[dict[str, Any]]:
        """Applies one assistant turn; returns the tool messages it produced (empty: the user answers next).

        Ends the episode on the agent's stop token, the turn or tool-error cap, or ``truncated`` (the policy ran out of
        token budget mid-turn: nothing in that turn is executed). A transfer to a human agent is an ordinary tool call.
        A turn in which the policy sampled no token (``num_policy_tokens == 0``: the budget was spent before it
        started) is not a turn: no turn or message is recorded, the episode just ends as ``token_budget`` (so turn
        counts and reasoning depth only see turns the policy actually took).

        ``api_message``: a served agent's reply as its API returned it. Under a protocol that takes it as sent
        (``tau2``, as τ²'s LLMAgent does) it replaces the parse of ``text``: its content unstripped, its structured
        calls, and no tool call read out of the content.
        """
        if self.is_completed:
            raise RuntimeError(f"episode of task {self.task.task_id} is already completed")
        if num_policy_tokens == 0:
            self.finish(TOKEN_BUDGET)
            return []
        text = clean_text(text) if isinstance(text, str) else text
        turn = TurnRecord(
            index=len(self.record.turns),
            raw_text=text,
            message="",
            last_user_message=self._last_user_message(),
            num_policy_tokens=num_policy_tokens,
            truncated=truncated,
        )
        self.record.turns.append(turn)
        if truncated:
            self.messages.append({"role": "assistant", "content": text})
            self.finish(TOKEN_BUDGET)
            return []
        as_sent = api_message is not None and self.protocol.api_messages_as_sent
        parsed = copy.deepcopy(api_message) if as_sent else parse_assistant_text(text)
        for call in parsed.tool_calls:  # JSON escapes such as "\ud800" decode to lone surrogates: never let them in
            call.name, call.arguments = clean_text(call.name), clean_value(call.arguments)
        malformed = any(call.parse_error is not None for call in parsed.tool_calls)
        if malformed and self.protocol.malformed_calls_are_text:  # τ² gets the whole text as a message, no calls
            parsed.tool_calls, parsed.text = [], parsed.text if as_sent else text.strip()
        # what the COMMUNICATE check reads: τ² searches every agent message's text as it is
        turn.message = parsed.text
        if self.protocol.agent_stop_token:
            turn.message = turn.message.replace(AGENT_STOP_TOKEN, "").strip()
        if parsed.tool_calls and not malformed:
            assistant: dict[str, Any] = {
                "role": "assistant",
                "content": parsed.text,
                "tool_calls": [
                    {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                    for call in parsed.tool_calls
                ],
            }
        else:  # keep the raw text so the message renders as what was generated
            assistant = {"role": "assistant", "content": text if parsed.tool_calls else parsed.text}
        self.messages.append(assistant)
        tool_messages = []
        for call in parsed.tool_calls:
            if call.parse_error is not None:
                result, error, kind, arguments = f"Error: {call.parse_error}", True, "parse", None
            else:
                outcome = self._execute(self.state, call.name, call.arguments)
                result, error, kind, arguments = outcome.content, outcome.error, outcome.error_kind, call.arguments
            result = clean_text(result)
            self.record.tool_calls.append(
                ToolCallRecord(
                    turn=turn.index,
                    name=call.name,
                    arguments=arguments,
                    result=result,
                    error=error,
                    error_kind=kind,
                    is_write=call.name in self._write_tools,
                )
            )
            turn.tool_call_indices.append(len(self.record.tool_calls) - 1)
            message = {"role": "tool", "name": call.name or "invalid_tool_call", "content": result}
            self.messages.append(message)
            tool_messages.append(message)
            self._errors += error
        if self.protocol.counts_steps:
            self.steps += 1 + bool(tool_messages)  # the agent's message, then the environment's response
            if not tool_messages and not parsed.text.strip():
                self.finish(AGENT_ERROR)  # τ²: an empty message fails its validate(); the run is an agent error
            else:
                self._check_tau2_limits()
        elif self.protocol.agent_stop_token and AGENT_STOP_TOKEN in parsed.text:
            self.finish(AGENT_STOP)
        elif self._errors >= self.config.max_tool_errors:
            self.finish(MAX_TOOL_ERRORS)
        elif len(self.record.turns) >= self.config.max_turns:
            self.finish(MAX_TURNS)
        self._sync()
        return tool_messages

    def agent_failed(self, error: str) -> None:
        """The agent could not produce a turn (its endpoint kept failing): ends the episode as ``agent_error``
        with the message kept, as τ²'s harness records an infrastructure failure; no turn is recorded."""
        self.record.agent_error = clean_text(str(error))
        self.finish(AGENT_ERROR)

    def user_response(self, content: str, termination: str | None = None, error: str | None = None) -> None:
        """Applies the user's reply (``termination`` from a stop token; ``error`` when the simulator failed)."""
        if error is not None:
            self.record.user_error = clean_text(str(error))
            self.finish(USER_ERROR)
            return
        content = clean_text(content) if isinstance(content, str) else content
        self.messages.append({"role": "user", "content": content})
        self._user_rounds = 0
        if termination is not None:
            self.finish(termination)
        if self.protocol.counts_steps:
            self.steps += 1
            self._check_tau2_limits()
        self._sync()

    def user_acts(self, calls: list[tuple[Any, ...]], content: str | None = None) -> None:
        """Runs the user's own tool calls (a domain whose user holds tools), as τ²'s orchestrator routes a user
        message with tool calls: to the environment, each result back to the user alone (``requestor`` "user"; the
        agent never sees either: ``protocol.agent_view``); the user then speaks again. Its text, if any, is not
        delivered to the agent (τ² sends such a message to the environment only). Two steps (the message and the
        environment's answer); the limits are checked after them; failed calls count toward the error cap."""
        call_messages = []
        for call in calls:  # (name, arguments) or, from an LLM user, (name, arguments, the call's id)
            name, arguments = call[0], call[1]
            entry = {
                "type": "function",
                "function": {"name": clean_text(str(name)), "arguments": clean_value(arguments)},
            }
            if len(call) > 2 and call[2]:
                entry["id"] = clean_text(str(call[2]))
            call_messages.append(entry)
        text = clean_text(content) if isinstance(content, str) and content else None
        self.messages.append({"role": "user", "content": text, "tool_calls": call_messages, "requestor": USER_SIDE})
        user_writes = self.task.spec.user_write_tools()
        for call in call_messages:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            outcome = self.state.call(USER_SIDE, name, arguments)
            result = clean_text(outcome.content)
            self.record.user_tool_calls.append(
                ToolCallRecord(turn=len(self.record.turns), name=name, arguments=arguments, result=result,
                               error=outcome.error, error_kind=outcome.error_kind, is_write=name in user_writes)
            )  # fmt: skip
            self.messages.append({"role": "tool", "name": name, "content": result, "requestor": USER_SIDE})
            self._errors += outcome.error
        self._user_rounds += 1
        if self.protocol.counts_steps:
            self.steps += 2
            self._check_tau2_limits()
        elif self._errors >= self.config.max_tool_errors:
            self.finish(MAX_TOOL_ERRORS)
        elif self._user_rounds > MAX_USER_TOOL_ROUNDS:  # τ²'s step cap ends such a loop; the project protocol has none
            self.record.user_error = f"the user called its tools {self._user_rounds} times in a row without speaking"
            self.finish(USER_ERROR)
        self._sync()


class DomainEnv:
    """One domain's environment: one shared base database, fresh copy-on-write episodes."""

    def __init__(self, spec: DomainSpec, data_dir: str | None = None, config: EnvConfig | None = None) -> None:
        """``spec``: the domain (``tau2_rl.domains.get_domain``); ``data_dir``: its files if not the package's."""
        self.spec = spec
        self.data_dir = data_dir
        self.config = config or EnvConfig()
        self.domain: Domain = load_domain(spec, data_dir)
        self.base = shared_base(spec, data_dir)
        self.protocol = get_protocol(self.config.protocol)
        self.system_prompt = agent_system_prompt(self.config.protocol, self.domain.policy, spec)
        self.tools = agent_tool_schemas(self.config.protocol, spec)  # τ²'s own under tau2

    def reset(self, task_id: str | int, seed: int = 0) -> Episode:
        """A fresh episode of ``task_id``; copies nothing from the base database."""
        task = self.domain.get_task(task_id)
        return Episode(task, self.base, self.system_prompt, seed, self.config, self.tools)

    # What a run reads of its environment, the same whether it holds one domain or several (``MultiDomainEnv``): a
    # task's key in the run (here its plain id), the task, the environment and database it plays in.

    @property
    def members(self) -> list[DomainEnv]:
        """The environment of each domain of the run: this one."""
        return [self]

    @property
    def task_keys(self) -> list[str]:
        """Every task of the run, in the domain's file order."""
        return list(self.domain.tasks)

    def key(self, task: Task) -> str:
        """A task's key in the run: its id."""
        return task.task_id

    def task(self, key: str) -> Task:
        """The task of ``key`` (an unknown key: ``KeyError`` naming the valid ids)."""
        return self.domain.get_task(key)

    def env_of(self, key: str) -> DomainEnv:
        return self

    def base_of(self, key: str) -> Base:
        return self.base

    def __reduce__(self) -> tuple:
        """Pickles as its recipe (domain, data directory, config, the prompt it shows): a rollout worker process
        rebuilds the same environment instead of receiving the database (which holds unpicklable hashes)."""
        return (_rebuilt_env, (self.spec, self.data_dir, self.config, self.system_prompt, self.tools))


def _rebuilt_env(
    spec: DomainSpec, data_dir: str | None, config: EnvConfig, system_prompt: str, tools: list[dict]
) -> DomainEnv:
    env = DomainEnv(spec, data_dir, config)
    env.system_prompt, env.tools = system_prompt, tools
    return env


_BASES: dict[tuple[DomainSpec, str | None], Base] = {}


def shared_base(spec: DomainSpec, data_dir: str | None = None) -> Base:
    """The process-wide base of a domain's data directory (built once: ~0.1 s for the airline): the copy-on-write
    state's ``CanonicalBase``, or for a domain that runs in τ²'s Environment its ``WorldBase``."""
    key = (spec, data_dir)
    if key not in _BASES:
        domain = load_domain(spec, data_dir)
        _BASES[key] = CanonicalBase(domain.db, spec) if spec.environment is None else WorldBase(domain, spec)
    return _BASES[key]
