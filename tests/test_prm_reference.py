"""The reference process reward (``prm_rules: reference`` / ``reference+v2``): per-turn progress against the task's
gold actions, read through the environment; τ²'s argument comparison; the bound; the corpus and real-set checks.

The corpus checks here are the new sets' share of the acceptance in ``tests/test_prm_calibration.py`` (the corpus is
built once per module, a couple of seconds)."""

from __future__ import annotations

import ast
import inspect
from typing import Any

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline import policy_checks
from tau2_rl.envs.data import GoldAction
from tau2_rl.envs.episode import AGENT_STOP, DomainEnv, EpisodeRecord
from tau2_rl.envs.tool_calls import format_tool_call
from tau2_rl.evaluation.prm_report import main
from tau2_rl.rewards.outcome import matches_gold
from tau2_rl.rewards.prm import detectors, engine, reference, rules, score_episode
from tau2_rl.rewards.prm.corpus import Trajectory, build_corpus
from tau2_rl.rewards.prm.engine import PRM_RULE_SETS, REFERENCE_SETS
from tau2_rl.rewards.prm.reference import MAX_CREDITED_READS, REFERENCE_TERMS, write_order_matters
from tau2_rl.rewards.prm.stats import calibrate

AIRLINE = get_domain("airline")
REAL_TRAJECTORIES, REAL_TASK_MAP = AIRLINE.prm_terms().real_set

ENV = DomainEnv(AIRLINE)
TASK = "15"  # one gold write (update_reservation_flights on M05KNL), no required info
INFO_TASK = "11"  # one gold write and communicate_info ("5244")


def call(name: str, arguments: dict[str, Any]) -> str:
    return format_tool_call(name, arguments)


def gold_call(task_id: str, index: int) -> str:
    action = ENV.domain.get_task(task_id).actions[index]
    return f"Doing it now. {call(action.name, action.arguments)}"


def play(task_id: str, steps: list[str | tuple[str, str]], end: str | None = AGENT_STOP) -> EpisodeRecord:
    """Assistant texts, or ("user", text) replies, played on a fresh episode; ``end`` its termination."""
    episode = ENV.reset(task_id)
    for step in steps:
        if isinstance(step, tuple):
            episode.user_response(step[1])
        else:
            episode.env_response(step)
    if end is not None:
        episode.finish(end)
    return episode.record


YES = ("user", "Yes, please go ahead.")
HELLO = ("user", "Hi, I need to change my flights.")


def test_matches_gold_is_tau2s_comparison() -> None:
    action = GoldAction("a", "cancel_reservation", {"reservation_id": "ABC123"})
    assert matches_gold(action, "cancel_reservation", {"reservation_id": "ABC123"})
    assert not matches_gold(action, "cancel_reservation", {"reservation_id": "ABC124"})
    assert not matches_gold(action, "get_reservation_details", {"reservation_id": "ABC123"})
    # compare_args None compares the call's own arguments: an extra one fails, one the call leaves out is not compared
    assert not matches_gold(action, "cancel_reservation", {"reservation_id": "ABC123", "reason": "x"})
    assert matches_gold(action, "cancel_reservation", {})
    named = GoldAction("b", "get_user_details", {"user_id": "u1", "note": "why"}, compare_args=("user_id",))
    assert matches_gold(named, "get_user_details", {"user_id": "u1", "note": "other"})
    assert not matches_gold(named, "get_user_details", {"user_id": "u2", "note": "why"})
    assert matches_gold(GoldAction("c", "transfer_to_human_agents", {"summary": "s"}, compare_args=()),
                        "transfer_to_human_agents", {"summary": "anything"})  # fmt: skip


def test_matches_gold_agrees_with_tau2_where_installed() -> None:
    tasks = pytest.importorskip("tau2.data_model.tasks")
    message = pytest.importorskip("tau2.data_model.message")
    cases = [
        ({"reservation_id": "A"}, None, {"reservation_id": "A"}),
        ({"reservation_id": "A"}, None, {"reservation_id": "B"}),
        ({"reservation_id": "A"}, None, {"reservation_id": "A", "extra": 1}),
        ({"reservation_id": "A", "x": 1}, None, {"reservation_id": "A"}),
        ({"user_id": "u", "note": "n"}, ["user_id"], {"user_id": "u", "note": "m"}),
        ({"user_id": "u"}, [], {"user_id": "v"}),
        ({"flights": [{"flight_number": "HAT1", "date": "2024-05-01"}]}, None,
         {"flights": [{"date": "2024-05-01", "flight_number": "HAT1"}]}),
    ]  # fmt: skip
    for gold, compare, called in cases:
        theirs = tasks.Action(action_id="a", name="f", arguments=gold, compare_args=compare)
        ours = GoldAction("a", "f", gold, compare_args=None if compare is None else tuple(compare))
        tool_call = message.ToolCall(id="1", name="f", arguments=called)
        assert matches_gold(ours, "f", called) == theirs.compare_with_tool_call(tool_call), (gold, compare, called)


def test_compare_args_are_read_from_the_task_file() -> None:
    transfer = [a for t in ENV.domain.tasks.values() for a in t.actions if a.name == "transfer_to_human_agents"]
    assert transfer and all(a.compare_args == () for a in transfer)  # tasks.json says "compare_args": []
    assert all(a.compare_args is None for a in ENV.domain.get_task(TASK).actions)


def test_a_right_write_is_credited_on_its_turn() -> None:
    record = play(TASK, [HELLO, "Let me check. " + call("get_user_details", {"user_id": "x"}), "Shall I?", YES,
                         gold_call(TASK, 0)])  # fmt: skip
    assert not record.tool_calls[-1].error
    result = score_episode(record, rules="reference", env=ENV)
    assert result.fired[-1] == {"B9": 1} and result.fired[0] == {}  # a failed lookup earns nothing
    assert result.turn_scores == pytest.approx([0.0, 0.0, REFERENCE_TERMS["B9"].weight])
    assert result.process_score == pytest.approx(0.1) and result.rule_counts["P13"] == 0


def test_missing_and_wrong_writes_and_unended_episodes_are_charged() -> None:
    nothing = score_episode(play(TASK, [HELLO, "I cannot help with that."]), rules="reference", env=ENV)
    assert nothing.fired[-1] == {"P13": 1} and nothing.process_score == pytest.approx(-0.05)
    wrong = play(TASK, [HELLO, "Cancelling. " + call("cancel_reservation", {"reservation_id": "M05KNL"})])
    assert not wrong.tool_calls[0].error
    result = score_episode(wrong, rules="reference", env=ENV)
    assert result.fired[-1] == {"P12": 1, "P13": 1} and result.process_score == pytest.approx(-0.15)
    unended = score_episode(play(TASK, [HELLO, gold_call(TASK, 0)], end=None), rules="reference", env=ENV)
    assert unended.fired[-1] == {"B9": 1, "P15": 1} and unended.process_score == pytest.approx(0.0)


def test_write_spamming_and_read_farming_earn_nothing_positive() -> None:
    spam = [gold_call(TASK, 0)] + [
        "More bags. " + call("update_reservation_baggages", {"reservation_id": "M05KNL", "total_baggages": n,
                                                             "nonfree_baggages": 0, "payment_id": "gift_card_8887175"})
        for n in range(1, 4)
    ]  # fmt: skip
    record = play(TASK, [HELLO, *spam])
    result = score_episode(record, rules="reference", env=ENV)
    succeeded = sum(not c.error for c in record.tool_calls)
    assert result.rule_counts["B9"] == 1 and result.rule_counts["P12"] == succeeded - 1 >= 1
    assert result.process_score <= 0.0
    task = ENV.domain.get_task("44")  # 3 gold writes, 16 gold reads: reading everything it reads cannot pay
    reads = [f"Looking. {call(a.name, a.arguments)}" for a in task.actions if a.name.startswith(("get_", "search_"))]
    farmed = score_episode(play("44", [HELLO, *reads]), rules="reference", env=ENV)
    assert farmed.rule_counts["B10"] == MAX_CREDITED_READS and farmed.process_score < 0


def test_communicate_info_is_credited_on_the_turn_that_says_it() -> None:
    (info,) = ENV.domain.get_task(INFO_TASK).communicate_info
    record = play(INFO_TASK, [HELLO, "Let me see.", f"The difference is ${info[0]},{info[1:]}.", f"Again: {info}."])
    result = score_episode(record, rules="reference", env=ENV)
    assert [f.get("B11", 0) for f in result.fired] == [0, 1, 0]  # τ²'s check drops commas; said once is enough


def test_order_matters_only_where_reversing_the_writes_changes_the_database() -> None:
    assert write_order_matters(ENV.base, ENV.domain.get_task("7"))
    assert not write_order_matters(ENV.base, ENV.domain.get_task(TASK))  # one write
    assert not write_order_matters(ENV.base, ENV.domain.get_task("18"))  # five writes that commute


def test_reference_needs_the_environment_and_stays_bounded() -> None:
    record = play(TASK, [HELLO, gold_call(TASK, 0)])
    with pytest.raises(ValueError, match="pass the environment"):
        score_episode(record, rules="reference", spec=AIRLINE)
    with pytest.raises(KeyError, match="valid: v1, v2, reference, reference\\+v2"):
        score_episode(record, rules="gold", spec=AIRLINE)
    tight = score_episode(record, rules="reference", env=ENV, clip=(-0.01, 0.01))
    assert tight.process_score == 0.01 and tight.raw_score == pytest.approx(0.1)
    heavier = score_episode(record, rules="reference", env=ENV, weights={"B9": 0.3})
    assert heavier.process_score == pytest.approx(0.3)
    with pytest.raises(KeyError):
        score_episode(record, rules="reference", env=ENV, weights={"P9": -1.0})  # a v2 rule: not in this set


def test_reference_plus_v2_sums_the_turns_then_clips() -> None:
    record = play(TASK, [HELLO, "Let me check. " + call("get_reservation_details", {"reservation_id": "M05KNL"}),
                         "Shall I change it?", YES, gold_call(TASK, 0)])  # fmt: skip
    v2 = score_episode(record, spec=AIRLINE)
    ref = score_episode(record, rules="reference", env=ENV)
    both = score_episode(record, rules="reference+v2", env=ENV)
    assert both.turn_scores == pytest.approx([a + b for a, b in zip(v2.turn_scores, ref.turn_scores, strict=True)])
    assert both.raw_score == pytest.approx(v2.raw_score + ref.raw_score)
    assert both.process_score == pytest.approx(min(max(both.raw_score, -0.5), 0.5))
    assert set(both.rule_counts) == set(v2.rule_counts) | set(REFERENCE_TERMS)
    assert set(REFERENCE_SETS) <= set(PRM_RULE_SETS) and REFERENCE_SETS["reference+v2"] == "v2"


def test_only_the_reference_module_reads_gold_data() -> None:
    """The rule modules stay pure (``test_rules_never_read_gold``); the engine reaches the task only through the
    reference module, and the reference reads it from the environment object, never from a file."""

    def imports(module: Any) -> set[str]:
        tree = ast.parse(inspect.getsource(module))
        found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        return found | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}

    for module in (detectors, rules, policy_checks):
        assert "tau2_rl.rewards.prm.reference" not in imports(module), module.__name__
    assert "tau2_rl.rewards.prm.reference" in imports(engine)
    source = inspect.getsource(reference)
    assert "open(" not in source and "json" not in imports(reference) and "pathlib" not in imports(reference)


# ---------------------------------------------------------------------------------------------------------------------
# The corpus and the real set


@pytest.fixture(scope="module")
def corpus() -> list[Trajectory]:
    return build_corpus(ENV)


@pytest.mark.parametrize(("rule_set", "oracle_above"), [("reference", 50), ("reference+v2", 48)])
def test_corpus_acceptance_holds_for_the_reference_sets(
    corpus: list[Trajectory], rule_set: str, oracle_above: int
) -> None:
    """Oracle strictly above every non-completing trajectory (reference: every task; reference+v2 loses two 4- and
    5-write tasks to the clip, where v2's bonuses lift a one-wrong-write trajectory to the bound too), no positive
    mean for any non-writing behaviour on the write tasks, failures ranked by progress."""
    cal = calibrate(corpus, rules=rule_set, env=ENV)
    assert cal.oracle_above_all >= oracle_above, cal.oracle_above_all_failed
    assert cal.best_farming[1] < 0.0 and all(mean < 0.0 for mean in cal.nonwriting_means.values())
    assert cal.spearman_mean >= 0.6 and cal.per_task_auc >= 0.9
    assert cal.penalty_on_oracle["P12"] == cal.penalty_on_oracle["P13"] == cal.penalty_on_oracle["P14"] == 0.0
    assert cal.rule_rates["B9"][2] > 0 and cal.rule_rates["P13"][2] < 0


def test_real_set_per_task_auc_of_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's "Done when": the report's last line starts with a per-task AUC ≥ 0.85 (tasks 0–24, untuned)."""
    args = ["--trajectories", str(REAL_TRAJECTORIES), "--task_map", str(REAL_TASK_MAP)]
    lines = {}
    for name in ("v2", "reference", "reference+v2"):
        assert main([*args, "--prm_rules", name]) == 0
        lines[name] = capsys.readouterr().out.strip().splitlines()[-1]
        assert lines[name].endswith(f"rules {name}")
    auc = {name: float(line.split()[0]) for name, line in lines.items()}
    assert auc["reference"] >= 0.85 and auc["reference+v2"] >= 0.85 and auc["reference"] > auc["v2"]
