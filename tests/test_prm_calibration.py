"""PRM-Lite against its behaviour corpus: the acceptance conditions of the redesign, the labels, and robustness.

The corpus (``tau2_rl.rewards.prm.corpus``) is built once per module: scripted behaviours × 50 tasks × the scripted
user, offline, a couple of seconds. The fuzz tests feed the scorer hostile records built from the parser fuzz
strategies of ``tests/test_tool_call_parsing.py``.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tau2_rl.domains import get_domain
from tau2_rl.envs.behaviours import corrupt_arguments, get_behaviour
from tau2_rl.envs.episode import DomainEnv, EpisodeRecord, ToolCallRecord, TurnRecord
from tau2_rl.envs.state import EpisodeState
from tau2_rl.rewards.prm import RULES, auc, detectors, engine, rules, score_episode, spearman
from tau2_rl.rewards.prm.conversations import import_conversations
from tau2_rl.rewards.prm.corpus import Trajectory, build_corpus
from tau2_rl.rewards.prm.engine import PRM_RULE_SETS
from tau2_rl.rewards.prm.report import (
    CALIBRATION_END,
    CALIBRATION_START,
    calibration_markdown,
    docs_calibration_markdown,
    headline,
    real_headline,
)
from tau2_rl.rewards.prm.stats import Calibration, RealCalibration, best_auc, calibrate, calibrate_real
from tests.test_tool_call_parsing import json_values, turn_text

AIRLINE = get_domain("airline")
REAL_TRAJECTORIES, REAL_TASK_MAP = map(Path, AIRLINE.prm_terms().real_set)

ENV = DomainEnv(AIRLINE)


@pytest.fixture(scope="module")
def corpus() -> list[Trajectory]:
    return build_corpus(ENV)


@pytest.fixture(scope="module")
def calibration(corpus: list[Trajectory]) -> Calibration:
    return calibrate(corpus, env=ENV)


@pytest.fixture(scope="module")
def real() -> dict[str, RealCalibration]:
    """Every rule set on the 100 real conversations (tests/data/real_trajectories), replayed once."""
    imported = import_conversations(REAL_TRAJECTORIES, REAL_TASK_MAP, ENV)
    writes = {task_id: task.writes for task_id, task in ENV.domain.tasks.items()}
    return {name: calibrate_real(imported, writes, rules=name, env=ENV) for name in PRM_RULE_SETS}


# ---------------------------------------------------------------------------------------------------------------------
# The corpus and its labels


def test_corpus_covers_every_behaviour_on_every_task(corpus: list[Trajectory]) -> None:
    tasks = {t.task_id for t in corpus}
    assert len(tasks) == 50
    by_behaviour: dict[str, set[str]] = defaultdict(set)
    for trajectory in corpus:
        by_behaviour[trajectory.behaviour].add(trajectory.task_id)
    everywhere = ("oracle_terse", "oracle_text", "noop", "read_farmer", "reciting_farmer", "staged_failure_farmer",
                  "repeated_reads", "placeholder_arguments", "premature_transfer", "rambler")  # fmt: skip
    for name in everywhere:
        assert by_behaviour[name] == tasks, name
    write_tasks = {t.task_id for t in corpus if t.task_writes}
    assert len(write_tasks) == 26
    assert by_behaviour["unconfirmed_write"] == by_behaviour["wrong_argument"] == write_tasks
    assert by_behaviour["wrong_order"] and by_behaviour["wrong_order"] <= write_tasks
    # the partial oracle plays every k < n: as many trajectories per task as the task has gold actions
    partial = defaultdict(int)
    for trajectory in corpus:
        partial[trajectory.task_id] += trajectory.behaviour == "partial_oracle"
    assert all(partial[t] == len(ENV.domain.get_task(t).actions) for t in tasks)


def test_labels(corpus: list[Trajectory]) -> None:
    for trajectory in corpus:
        assert 0.0 <= trajectory.progress <= 1.0 and trajectory.reward in (0.0, 1.0)
        if trajectory.behaviour.startswith("oracle"):
            assert trajectory.success and trajectory.progress == 1.0
        if trajectory.behaviour == "rambler":
            assert not trajectory.success and trajectory.record.truncated
        if trajectory.success:  # a success reproduced the gold database, hence every gold write
            assert trajectory.progress == 1.0 or not trajectory.task_writes
    # partial oracles make progress in k: never less progress with more gold actions played
    partial: dict[str, list[float]] = defaultdict(list)
    for trajectory in corpus:
        if trajectory.behaviour == "partial_oracle":
            partial[trajectory.task_id].append(trajectory.progress)
    for task_id, values in partial.items():
        assert values == sorted(values), task_id


def test_rules_never_read_gold() -> None:
    """The rule modules import nothing that holds gold data (tasks, outcome reward, corpus)."""
    for module in (detectors, rules, engine):  # the engine reaches the task only through prm.reference
        tree = ast.parse(inspect.getsource(module))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        forbidden = {"tau2_rl.envs.data", "tau2_rl.rewards.outcome", "tau2_rl.rewards.prm.corpus"}
        assert not imported & forbidden, module.__name__


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance conditions of the redesign


def test_oracle_strictly_above_every_non_completing_behaviour(calibration: Calibration) -> None:
    assert calibration.oracle_above_all >= 48, calibration.oracle_above_all_failed


def test_no_writing_means_no_positive_score_on_write_tasks(calibration: Calibration) -> None:
    assert len(calibration.nonwriting_means) >= 9
    for behaviour, mean in calibration.nonwriting_means.items():
        assert mean <= 0.0, (behaviour, mean)


def test_process_score_ranks_failures_by_progress(calibration: Calibration) -> None:
    assert calibration.spearman_tasks >= 10
    assert calibration.spearman_mean >= 0.5


def test_no_penalty_fires_on_more_than_a_fifth_of_oracle_trajectories(calibration: Calibration) -> None:
    assert set(calibration.penalty_on_oracle) == {f"P{i}" for i in range(1, 12)}
    assert max(calibration.penalty_on_oracle.values()) <= 0.20, calibration.penalty_on_oracle
    assert calibration.penalty_on_oracle["P9"] == 0.0  # the gold actions break no policy check
    # the oracle's listing quotes no price it does not charge, and the scripted user states no spending limit
    assert calibration.penalty_on_oracle["P10"] == calibration.penalty_on_oracle["P11"] == 0.0


def test_corpus_acceptance_holds_for_both_rule_sets(corpus: list[Trajectory], calibration: Calibration) -> None:
    """Issue #21 withdrew the pooled-AUC target (GRPO compares trajectories of one task only): what is kept on the
    scripted corpus, for v2 (the default, ``calibration``) and v1."""
    v1 = calibrate(corpus, rules="v1", env=ENV)
    for cal in (calibration, v1):
        assert cal.oracle_above_all >= 48, cal.oracle_above_all_failed
        assert cal.best_farming[1] <= 0.0, cal.best_farming
        assert cal.spearman_mean >= 0.5
        assert cal.per_task_auc >= 0.75


def test_pooled_auc_target_is_above_the_ceiling(calibration: Calibration) -> None:
    """Why test_pooled_auc fails: every scorer that ranks the penalised behaviours below honest work and cannot tell a
    non-writing trajectory of a read-only task from one of a write task stays below 0.80 (stats.pair_bound)."""
    bound = calibration.pair_bound
    good = round(sum(d["n"] * d["success_rate"] for d in calibration.behaviours.values()))
    assert bound["pairs"] == pytest.approx(good * (calibration.n_trajectories - good))
    assert 0 < bound["honest_no_write_lost"] <= bound["honest_no_write"] / 2
    assert bound["bound"] < 0.80
    assert calibration.pooled_auc <= bound["bound"]
    ceilings = calibration.ceilings
    assert ceilings["exact"] < 1.0  # byte-identical trajectories with opposite outcomes exist ...
    assert {(good_task, bad_task) for _, good_task, _, bad_task in calibration.identical_opposite} == {("34", "33")}
    assert ceilings["structure"] < 0.80  # ... structure alone does not reach the target ...
    # ... and knowing the behaviour does only by ranking penalised behaviours above honest work
    assert ceilings["behaviour_writes_exact"] >= 0.80 > ceilings["behaviour_writes_exact_penalised_below_honest_reads"]
    assert (
        ceilings["behaviour_writes_exact_penalised_last"]
        <= ceilings["behaviour_writes_exact_penalised_below_honest_reads"]
    )


def test_docs_report_matches_the_corpus(
    corpus: list[Trajectory], calibration: Calibration, real: dict[str, RealCalibration]
) -> None:
    """docs/prm_lite.md carries the reports generated from the current rules, the corpus and the real set
    (regenerate with ``python prm_report.py --update-docs docs/prm_lite.md``)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "prm_lite.md").read_text(encoding="utf-8")
    block = text.split(CALIBRATION_START, 1)[1].split(CALIBRATION_END, 1)[0]
    corpus_cals = {name: calibrate(corpus, rules=name, env=ENV) for name in PRM_RULE_SETS}
    assert block.strip() == docs_calibration_markdown(corpus_cals, real).strip()
    assert calibration_markdown(calibration).strip() in block


def test_success_ranks_above_failure_within_tasks(calibration: Calibration) -> None:
    """What GRPO compares (groups are per task), and the pooled numbers the report prints."""
    assert calibration.per_task_auc >= 0.75
    assert calibration.write_task_auc >= 0.75
    assert calibration.pooled_auc > 0.5
    assert headline(calibration)[-1][0] == "pooled AUC success vs failure"


def test_bonuses_fire_more_on_success_and_penalties_more_on_failure(calibration: Calibration) -> None:
    for rule_id in ("B2", "B3", "B5", "B6"):
        assert calibration.rule_rates[rule_id][2] > 0, rule_id
    for rule_id in ("P6", "P8"):
        assert calibration.rule_rates[rule_id][2] < 0, rule_id


# ---------------------------------------------------------------------------------------------------------------------
# Statistics


def test_best_auc() -> None:
    labels = [True, False, True, True, False]
    # classes a (1 of 2 succeed), b (2 of 2), c (0 of 1): ranked c < a < b, the a-pair ties
    assert best_auc(["a", "a", "b", "b", "c"], labels) == pytest.approx((0.5 + 1 + 1 + 1 + 1 + 1) / 6)
    assert best_auc(list(range(5)), labels) == 1.0  # every trajectory its own class: a perfect ranking exists
    # b must rank below a: it moves just below a's rate and stays above c ...
    keys, down = ["a", "a", "b", "b", "c"], [False, False, True, True, False]
    assert best_auc(keys, labels, down, [True, True, False, False, False]) == pytest.approx((0.5 + 1 + 1 + 1) / 6)
    # ... below every other class: below c too
    assert best_auc(keys, labels, down, [True] * 5) == pytest.approx((0.5 + 1) / 6)


def test_auc_and_spearman() -> None:
    assert auc([0.1, 0.9, 0.5, 0.2], [False, True, True, False]) == 1.0
    assert auc([0.0, 0.0], [True, False]) == 0.5  # a tie counts half
    assert auc([0.3, 0.1, 0.2], [False, True, False]) == 0.0
    assert math.isnan(auc([1.0], [True]))
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ties get their average rank: x ranks 1, 2.5, 2.5, 4
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="labels"):
        auc([1.0], [])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: hostile records are scored without an exception


def _check(record: EpisodeRecord) -> None:
    result = score_episode(record, spec=AIRLINE)
    assert len(result.turn_scores) == len(record.turns) == len(result.fired)
    assert -0.5 <= result.process_score <= 0.5 and math.isfinite(result.raw_score)
    assert set(result.rule_counts) == set(RULES)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(turns=st.lists(turn_text, min_size=1, max_size=4), task=st.integers(0, 49), confirm=st.booleans())
def test_fuzz_generated_turns_are_scored(turns: list[str], task: int, confirm: bool) -> None:
    """Malformed tool calls, bad JSON, unknown tools, empty turns: whatever the parser made of them."""
    episode = ENV.reset(str(task))
    episode.user_response("Hi, my user id is mia_li_3668." + (" Yes, go ahead." if confirm else ""))
    for text in turns:
        if episode.is_completed:
            break
        if not episode.env_response(text) and not episode.is_completed:
            episode.user_response("Yes, please proceed." if confirm else "")
    _check(episode.record)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    results=st.lists(st.one_of(st.text(max_size=30), json_values.map(repr)), min_size=1, max_size=6),
    names=st.lists(st.sampled_from(["get_reservation_details", "cancel_reservation", "", "nope"]), min_size=6),
    arguments=st.lists(
        st.one_of(
            st.none(), st.dictionaries(st.sampled_from(["reservation_id", "user_id", "payment_id"]), json_values)
        ),
        min_size=6,
    ),  # fmt: skip
    errors=st.lists(st.booleans(), min_size=6),
)
def test_fuzz_non_json_results_and_odd_arguments(
    results: list[str], names: list[str], arguments: list, errors: list[bool]
) -> None:
    """Records written by hand: results that are not JSON, arguments of any shape, calls with no name."""
    record = EpisodeRecord(task_id="x", seed=0, messages=[{"role": "system", "content": "s"},
                                                          {"role": "user", "content": None}])  # fmt: skip
    for k, result in enumerate(results):
        call = ToolCallRecord(turn=k, name=names[k], arguments=arguments[k], result=result, error=errors[k],
                              is_write=names[k] == "cancel_reservation")  # fmt: skip
        record.tool_calls.append(call)
        record.turns.append(TurnRecord(index=k, raw_text="", message="", tool_call_indices=[k, 99]))
        record.messages += [{"role": "assistant", "content": ""}, {"role": "tool", "content": result}]
    _check(record)


def test_two_hundred_turns_are_scored() -> None:
    episode = ENV.reset("1")
    episode.config = type(episode.config)(max_turns=1000, max_tool_errors=1000)
    episode.user_response("Hi, my user id is mia_li_3668.")
    for k in range(200):
        if k % 3 == 0:
            episode.env_response('<tool_call>{"name": "get_user_details", "arguments": {"user_id": "mia_li_3668"}}')
        elif k % 3 == 1:
            episode.env_response("")  # an empty turn
            episode.user_response("Hello?")
        else:
            episode.env_response("<tool_call>{not json</tool_call>")
    assert len(episode.record.turns) == 200 and not episode.is_completed
    _check(episode.record)
    assert score_episode(episode.record, spec=AIRLINE).rule_counts["P8"] > 0


def test_benchmark_prints_the_real_set_per_task_auc_last(
    capsys: pytest.CaptureFixture[str], real: dict[str, RealCalibration]
) -> None:
    import runpy

    module = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "prm_calibration.py"))
    assert module["main"](["--tasks", "3,7", "--rules"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"real-set per-task AUC: {real_headline(real['v2'])}"
    assert float(lines[-1].split(": ", 1)[1].split()[0]) == pytest.approx(real["v2"].per_task_auc, abs=5e-4)
    assert sum(line.strip().startswith("oracle strictly above") for line in lines) == len(PRM_RULE_SETS)
    with pytest.raises(SystemExit):
        module["main"](["--tasks", "999"])
    with pytest.raises(SystemExit):
        module["main"](["--trajectories", "/nonexistent.json"])


def test_behaviour_registry_and_corrupted_arguments() -> None:
    with pytest.raises(ValueError, match="valid behaviours: oracle_terse"):
        get_behaviour("bogus")
    arguments = {"reservation_id": "ABC123", "flights": [{"flight_number": "HAT001", "date": "2024-05-01"}],
                 "payment_id": "credit_card_7", "cabin": "economy"}  # fmt: skip
    corrupted = corrupt_arguments(arguments)
    assert corrupted["payment_id"] == "credit_card_8"  # the preferred leaf, one digit shifted
    assert {k: v for k, v in corrupted.items() if k != "payment_id"} == {
        k: v for k, v in arguments.items() if k != "payment_id"
    }
    assert arguments["payment_id"] == "credit_card_7"  # the gold arguments are not mutated
    assert corrupt_arguments({"total_baggages": 2}) == {"total_baggages": 3}


# ---------------------------------------------------------------------------------------------------------------------
# The real calibration set (issue #21): 100 GPT-4o conversations of τ-bench v1 tasks 0–24


def test_real_set_within_task_targets(real: dict[str, RealCalibration]) -> None:
    """What v2 achieves within task on real agents, and that it improves on v1 where the real set said v1 was wrong
    (numbers: docs/prm_lite.md). The issue's full targets are ``test_real_set_issue_targets``."""
    v1, v2 = real["v1"], real["v2"]
    assert v2.n_conversations == 100 and len(v2.mixed_tasks) == 11 and v2.n_write + v2.n_no_write == 11
    assert v2.within_task_gap > 0  # successes score above failures within task on average
    assert v2.within_task_gap > v1.within_task_gap + 0.05
    assert v2.per_task_auc > v1.per_task_auc and v2.per_task_auc_ci[0] > v1.per_task_auc_ci[0]
    # where τ² expects the writes v1 did, the recorded label is the one our environment would give
    assert v2.n_same_gold == 9 and v2.same_gold_auc > v1.same_gold_auc + 0.1
    assert v2.write_auc >= 0.75 and v2.mean_success > v2.mean_failure and v2.spearman > 0 > v1.spearman
    # a policy-violating write: on failures, and on the one recorded success that breaks the policy its agent was
    # given (a $50-per-passenger delay certificate without a change or cancellation; τ² expects no write there)
    assert v2.rule_rates["P9"][0] <= 1 / 31 < 0.2 < v2.rule_rates["P9"][1]
    assert v2.rule_corr["P9"] < 0 < v2.rule_corr["B8"]
    assert v2.rule_rates["P7"][0] < v1.rule_rates["P7"][0]  # fewer justified refusals charged as premature


def test_real_set_issue_targets(real: dict[str, RealCalibration]) -> None:
    """Issue #21's acceptance on the real set (docs/prm_lite.md, "What the real set taught": P10 and P11 were
    written from these failures, so this calibrates; the held-out tasks are the independent check)."""
    v2 = real["v2"]
    assert v2.per_task_auc >= 0.75 and v2.per_task_auc_ci[0] > 0.5 and v2.no_write_auc >= 0.70
    assert v2.within_task_gap > 0


def test_charges_the_user_did_not_agree_to_fire_on_failures_only(real: dict[str, RealCalibration]) -> None:
    v2 = real["v2"]
    for rule_id in ("P10", "P11"):
        on_successes, on_failures, _ = v2.rule_rates[rule_id]
        assert on_successes == 0.0 < on_failures and v2.rule_corr[rule_id] < 0, rule_id


def test_importer_replays_every_conversation() -> None:
    imported = import_conversations(REAL_TRAJECTORIES, REAL_TASK_MAP, ENV)
    assert len(imported.conversations) == 100 and imported.skipped == []
    assert sum(c.success for c in imported.conversations) == 31
    assert imported.dropped_calls == 58  # v1's think tool: no τ² counterpart
    assert all(call.name != "think" for c in imported.conversations for call in c.record.tool_calls)
    assert imported.tool_calls == 563
    for conversation in imported.conversations:
        record = conversation.record
        assert record.reward == {"reward": conversation.reward, "source": "recorded"}
        assert record.task_id == conversation.task_id and conversation.task_id in ENV.domain.tasks
        assert all(0 <= i < len(record.tool_calls) for turn in record.turns for i in turn.tool_call_indices)
        assert score_episode(record, spec=AIRLINE).turn_scores.__len__() == len(record.turns)
    # our observations mostly say what v1's did: the differences are v1's update tools echoing the old cabin, a few
    # searches, the airport list's shape and one reservation τ² changed (docs/prm_lite.md)
    assert imported.observation_mismatches < 0.1 * imported.tool_calls


def _write(tmp_path: Path, name: str, value: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def test_importer_names_file_conversation_and_field(tmp_path: Path) -> None:
    from tau2_rl.rewards.prm.conversations import ConversationFileError

    task_map = _write(tmp_path, "map.json", {"0": {"tau2_task": "20"}, "1": "19", "2": {"tau2_task": "no-such"}})
    hello = {"role": "user", "content": "Hi, I am mia_li_3668."}
    good_call = {"function": {"name": "get_user_details", "arguments": '{"user_id": "mia_li_3668"}'}}
    right = {"function": {"name": "get_user_details", "arguments": '{"user_id": "mia_li_3668"}'}}
    profile = AIRLINE.execute_tool(EpisodeState(ENV.base), "get_user_details", {"user_id": "mia_li_3668"}).content
    think = {"function": {"name": "think", "arguments": '{"thought": "hmm"}'}}
    conversations = [
        {"task_id": 0, "reward": 1.0, "trial": 0, "traj": [hello, {"role": "assistant", "content": None,
         "tool_calls": [think]}, {"role": "tool", "name": "think", "content": ""},
         {"role": "assistant", "content": "", "tool_calls": [good_call]}, {"role": "tool", "name":
         "get_user_details", "content": "Error: user not found"}, {"role": "assistant", "content": "Done."}]},
        {"task_id": 0, "reward": 0.0},  # no traj
        {"task_id": 9, "reward": 0.0, "traj": []},  # not in the map
        {"task_id": 0, "reward": 1.0, "traj": [hello, {"role": "assistant", "content": "", "tool_calls": [right]},
         {"role": "tool", "name": "get_user_details", "content": profile}, {"role": "assistant", "content": "Hi"}]},
        {"task_id": 1, "reward": 0.0, "traj": [hello, {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_user_details", "arguments": "{not json"}}]}]},
        {"task_id": 1, "reward": "yes", "traj": []},
        "not an object",
        {"task_id": 1, "reward": 0.0, "traj": [{"role": "robot", "content": "beep"}]},
    ]  # fmt: skip
    path = _write(tmp_path, "conversations.json", conversations)
    imported = import_conversations(path, task_map, ENV)
    assert [c.index for c in imported.conversations] == [0, 3]
    first, matching = imported.conversations
    assert matching.observation_mismatches == 0 and len(matching.record.tool_calls) == 1
    assert first.dropped_calls == 1 and [c.name for c in first.record.tool_calls] == ["get_user_details"]
    assert len(first.record.turns) == 2  # the think-only message is gone
    assert first.observation_mismatches == 1  # the recorded error is not what our tool says
    expected = [
        "conversation 1: missing field 'traj'",
        "conversation 2.task_id: '9' is not in the task map",
        "conversation 4: traj[1].tool_calls[0].function.arguments: arguments are not JSON",
        "conversation 5.reward: expected a number, got 'yes'",
        "conversation 6: must be an object, got str",
        "conversation 7: traj[0].role: expected system, user, assistant or tool, got 'robot'",
    ]
    assert len(imported.skipped) == len(expected)
    for line, want in zip(imported.skipped, expected, strict=True):
        assert line.startswith(f"{path}: ") and want in line, line
    # a conversation mapped to a task the domain does not have: the whole file is refused, with the count
    unknown = _write(tmp_path, "unknown.json", [conversations[3], {"task_id": 2, "reward": 0.0, "traj": []}])
    with pytest.raises(ConversationFileError, match=r"1 of 2 conversations map to tasks the airline domain does not "
                       r"have \('2' → 'no-such'\)"):  # fmt: skip
        import_conversations(unknown, task_map, ENV)
    # replays that disagree with their record on most observations: not this domain's conversations
    wrong = _write(tmp_path, "wrong.json", [conversations[0]])
    with pytest.raises(ConversationFileError, match="1 of the 1 replayed tool observations differ"):
        import_conversations(wrong, task_map, ENV)
    with pytest.raises(ConversationFileError, match="--trajectories: no such file"):
        import_conversations(tmp_path / "missing.json", task_map, ENV)
    with pytest.raises(ConversationFileError, match="must be a JSON list"):
        import_conversations(_write(tmp_path, "obj.json", {"a": 1}), task_map, ENV)
    with pytest.raises(ConversationFileError, match="--task_map: .* is not valid JSON"):
        (tmp_path / "bad_map.json").write_text("{", encoding="utf-8")
        import_conversations(path, tmp_path / "bad_map.json", ENV)


def test_report_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], real: dict[str, RealCalibration]) -> None:
    from tau2_rl.evaluation.prm_report import main

    args = ["--trajectories", str(REAL_TRAJECTORIES), "--task_map", str(REAL_TASK_MAP), "--prm_rules", "v2"]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == real_headline(real["v2"]) and out[-1].startswith(f"{real['v2'].per_task_auc:.3f} per-task AUC")
    successes = next(line for line in out if line.startswith("| successes | "))
    assert successes.startswith(f"| successes | {real['v2'].n_successes} | ")  # the score distribution
    task_rows = [line for line in out if re.match(r"\| \d+ \| (yes|no) \| ", line)]
    assert [row.split(" | ")[0][2:] for row in task_rows] == real["v2"].mixed_tasks  # one row per mixed task
    assert main([*args[:-2], "--prm_rules", "v1"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"{real['v1'].per_task_auc:.3f} ")
    assert main(["--trajectories", str(tmp_path / "missing.json"), "--task_map", str(REAL_TASK_MAP)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trajectories: no such file" in err[0]
    nothing = _write(tmp_path, "none.json", [{"task_id": 99, "reward": 1.0, "traj": []}])
    assert main(["--trajectories", str(nothing), "--task_map", str(REAL_TASK_MAP)]) == 2
    err = capsys.readouterr().err
    assert "not replayed" in err and "conversation 0.task_id" in err and "1 of the 1 conversations could not" in err
    some = _write(tmp_path, "some.json", [*json.loads(REAL_TRAJECTORIES.read_text())[:3], {"task_id": 0}])
    assert main(["--trajectories", str(some), "--task_map", str(REAL_TASK_MAP)]) == 2  # no figure over the 3
    captured = capsys.readouterr()
    assert "1 of the 4 conversations could not be replayed" in captured.err and "AUC" not in captured.out
    with pytest.raises(SystemExit):
        main(["--trajectories", str(REAL_TRAJECTORIES)])  # --task_map missing


def test_rule_modules_read_no_task_trajectory_or_gold_file() -> None:
    """The rule modules read only the trajectory: no file access at all, no task / trajectory / corpus / outcome
    module, and no string in the code (docstrings aside: they show examples) that names a user or a reservation of
    the real calibration set."""
    from tau2_rl.domains.airline import consent, policy_checks

    forbidden_modules = {"tau2_rl.envs.data", "tau2_rl.rewards.outcome", "tau2_rl.rewards.prm.corpus",
                         "tau2_rl.rewards.prm.conversations", "tau2_rl.rewards.prm.report",
                         "tau2_rl.evaluation.prm_report", "tau2_rl.data.tau2_results"}  # fmt: skip
    conversations = json.loads(REAL_TRAJECTORIES.read_text(encoding="utf-8"))
    ids = {entry["user_id"] for entry in json.loads(REAL_TASK_MAP.read_text(encoding="utf-8")).values()}
    for conversation in conversations:
        for message in conversation["traj"]:
            ids.update(re.findall(r"\b[A-Z0-9]{6}\b", str(message.get("content") or "")))
    ids = {i for i in ids if any(c.isdigit() for c in i) or "_" in i}  # ids, not words such as "PLEASE"
    for module in (detectors, rules, engine, policy_checks, consent):
        source = inspect.getsource(module)
        tree = ast.parse(source)
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not imported & forbidden_modules, module.__name__
        calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                 for node in ast.walk(tree) if isinstance(node, ast.Call)}  # fmt: skip
        assert not calls & {"open", "read_text", "read_bytes", "load", "loads_file", "files"}, module.__name__
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        strings = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        ]
        for text in strings:
            assert ".json" not in text and "real_trajectories" not in text, (module.__name__, text)
            assert not any(i in text for i in ids), (module.__name__, text)


def test_within_group_signal() -> None:
    from tau2_rl.rewards.prm.stats import within_group_signal

    scores = [0.3, 0.1, -0.2, 0.0, 0.5, 0.5, 0.2, 0.1]
    outcomes = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    groups = ["a", "a", "a", "b", "b", "c", "c", "c"]
    rules_fired = [{"B5": 1, "P9": 0}, {"B5": 0, "P9": 0}, {"B5": 0, "P9": 1}, {"B5": 1, "P9": 0},
                   {"B5": 1, "P9": 0}, {"B5": 1, "P9": 0}, {"B5": 0, "P9": 1}, {"B5": 0, "P9": 0}]  # fmt: skip
    signal = within_group_signal(scores, outcomes, groups, rules_fired)
    # groups a (1 success of 3) and c (1 of 3) are mixed, b (2 of 2) is not
    assert signal["mixed_groups"] == 2.0
    assert signal["within_group_auc"] == pytest.approx(1.0)  # the success tops both mixed groups
    # advantages in a: +0.233, +0.033, -0.267 vs outcome +0.667, -0.333, -0.333 -> 2 of 3 agree; c: 3 of 3
    assert signal["sign_agreement"] == pytest.approx(5 / 6)
    assert signal["rule/B5/corr"] == pytest.approx(1.0)  # fires exactly on the successes of the mixed groups
    assert signal["rule/P9/corr"] < 0
    inverted = within_group_signal([-s for s in scores], outcomes, groups)
    assert inverted["within_group_auc"] == pytest.approx(0.0) and "rule/B5/corr" not in inverted
    flat = within_group_signal([0.0] * 4, [1.0, 0.0, 1.0, 0.0], ["a", "a", "b", "b"], [{"B5": 1}] * 4)
    assert flat["within_group_auc"] == 0.5 and flat["sign_agreement"] == 0.0 and math.isnan(flat["rule/B5/corr"])
    none = within_group_signal([0.1, 0.2], [1.0, 1.0], ["a", "a"])
    assert none["mixed_groups"] == 0 and math.isnan(none["within_group_auc"]) and math.isnan(none["sign_agreement"])
    # saturated groups (equal outcomes): b (two successes) scores 0.0 and 0.5, so 1 of 1 carries a signal
    assert signal["saturated_groups"] == 1.0 and signal["saturated_groups_with_signal"] == 1.0
    assert none["saturated_groups"] == 1.0 and none["saturated_groups_with_signal"] == 1.0
    saturated = within_group_signal([0.1, 0.1, 0.0, 0.2, 0.3], [0.0] * 4 + [1.0], ["a", "a", "b", "b", "c"])
    assert saturated["saturated_groups"] == 2.0 and saturated["saturated_groups_with_signal"] == 0.5  # c: one episode
    assert math.isnan(flat["saturated_groups_with_signal"]) and flat["saturated_groups"] == 0.0
    with pytest.raises(ValueError, match="group keys"):
        within_group_signal([0.1], [1.0, 0.0], ["a", "a"])
