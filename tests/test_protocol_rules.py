"""The ``tau2`` protocol's turn rules on single episodes, without τ²'s package (its prompts are not involved).

What τ²'s ``Orchestrator`` does, rule by rule (docs/protocol.md; end to end against τ²'s own code in
test_tau2_equivalence.py): a message with tool calls is for the environment only, every user message, agent
message and environment response is one step, the step and error caps are checked after each step whose message is
not for the environment and override a stop set in the same step, the agent has no stop token, an empty agent
message is an agent error, and a turn whose blocks do not all parse is text for the user.
"""

from __future__ import annotations

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv, EnvConfig, Episode, shared_base
from tau2_rl.envs.protocol import PROTOCOLS, get_protocol
from tau2_rl.envs.tool_calls import format_tool_call
from tau2_rl.envs.users.base import agent_messages_since_user

AIRLINE = get_domain("airline")

READ = format_tool_call("get_user_details", {"user_id": "mia_li_3668"})
BAD = format_tool_call("no_such_tool", {})


def episode(max_steps: int = 200, max_tool_errors: int = 10) -> Episode:
    domain = DomainEnv(AIRLINE).domain  # the tau2_rl env only lends the domain: no τ² prompt is built
    config = EnvConfig(protocol="tau2", max_steps=max_steps, max_tool_errors=max_tool_errors)
    return Episode(domain.get_task("0"), shared_base(AIRLINE), "system", 0, config)


def test_steps_are_counted_as_tau2_counts_them() -> None:
    e = episode()
    e.user_response("Hi, I need help.")  # step 1 (the greeting is not a step)
    assert e.steps == 1
    assert e.env_response("Let me look. " + READ)  # the agent's message and the environment's response: 2 steps
    assert e.steps == 3
    assert e.env_response("Found you. What can I do?") == []  # step 4, then the user speaks
    assert e.steps == 4 and not e.is_completed


def test_text_next_to_tool_calls_never_reaches_the_user() -> None:
    e = episode()
    e.user_response("Hi, I need help.")
    e.env_response("Secret aside. " + READ + READ)  # several calls in one message: both run
    assert len(e.record.tool_calls) == 2
    e.env_response("Which reservation?")
    assert agent_messages_since_user(e) == ["Which reservation?"]
    assert e.record.turns[0].message == "Secret aside."  # it still counts for COMMUNICATE, as in τ²


def test_the_step_cap_overrides_a_user_stop_in_the_same_step() -> None:
    e = episode(max_steps=4)
    e.user_response("Hi.")  # 1
    e.env_response(READ)  # 3
    e.env_response("Done. Anything else?")  # 4 >= 4: τ² ends the run here
    assert e.record.termination == "max_steps"
    e = episode(max_steps=5)
    e.user_response("Hi.")
    e.env_response(READ)
    e.env_response("Done. Anything else?")
    e.user_response("###STOP###", "user_stop")  # step 5: the stop and the cap in one step → max_steps
    assert e.record.termination == "max_steps"


def test_errors_are_counted_per_call_and_checked_after_the_environment() -> None:
    e = episode(max_tool_errors=3)
    e.user_response("Hi.")
    e.env_response(BAD + BAD)
    assert not e.is_completed
    e.env_response(BAD)
    assert e.record.termination == "max_tool_errors"


def test_the_agent_has_no_stop_token_and_an_empty_message_is_an_agent_error() -> None:
    e = episode()
    e.user_response("Hi.")
    assert e.env_response("###STOP###") == [] and not e.is_completed  # text for the user, as τ²'s LLMAgent
    e.user_response("What?")
    e.env_response("   ")
    assert e.record.termination == "agent_error"


def test_a_turn_with_a_malformed_block_is_text_for_the_user() -> None:
    e = episode()
    e.user_response("Hi.")
    text = 'Let me check. <tool_call>{"name": "get_user_details", "arguments": </tool_call>'
    assert e.env_response(READ + "\n" + text) == []  # nothing runs, not even the good call; no error counted
    assert e.record.tool_calls == [] and e.steps == 2
    assert agent_messages_since_user(e) == [(READ + "\n" + text).strip()]


def test_tau2_rl_keeps_its_own_rules() -> None:
    rules = PROTOCOLS["tau2_rl"]
    assert rules.agent_stop_token and rules.text_with_calls_reaches_user and not rules.counts_steps
    with pytest.raises(ValueError, match="--protocol must be one of tau2, tau2_rl"):
        get_protocol("tau3")
