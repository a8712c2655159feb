"""PRM-Lite against its behaviour corpus: the acceptance conditions of the redesign, the labels, and robustness.

The corpus (``airline_rl.rewards.prm.corpus``) is built once per module: scripted behaviours × 50 tasks × the scripted
user, offline, a couple of seconds. The fuzz tests feed the scorer hostile records built from the parser fuzz
strategies of ``tests/test_tool_call_parsing.py``.
"""

from __future__ import annotations

import ast
import inspect
import math
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airline_rl.envs.behaviours import corrupt_arguments, get_behaviour
from airline_rl.envs.episode import AirlineEnv, EpisodeRecord, ToolCallRecord, TurnRecord
from airline_rl.rewards.prm import RULES, auc, detectors, engine, rules, score_episode, spearman
from airline_rl.rewards.prm.corpus import Trajectory, build_corpus
from airline_rl.rewards.prm.report import CALIBRATION_END, CALIBRATION_START, calibration_markdown, headline
from airline_rl.rewards.prm.stats import Calibration, best_auc, calibrate
from tests.test_tool_call_parsing import json_values, turn_text

ENV = AirlineEnv()


@pytest.fixture(scope="module")
def corpus() -> list[Trajectory]:
    return build_corpus(ENV)


@pytest.fixture(scope="module")
def calibration(corpus: list[Trajectory]) -> Calibration:
    return calibrate(corpus)


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
    for module in (detectors, rules, engine):
        tree = ast.parse(inspect.getsource(module))
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        forbidden = {"airline_rl.envs.data", "airline_rl.rewards.outcome", "airline_rl.rewards.prm.corpus"}
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
    assert set(calibration.penalty_on_oracle) == {f"P{i}" for i in range(1, 9)}
    assert max(calibration.penalty_on_oracle.values()) <= 0.20, calibration.penalty_on_oracle


@pytest.mark.xfail(
    strict=True,
    reason="not reachable by a process reward on this corpus: test_pooled_auc_target_is_above_the_ceiling and "
    "docs/prm_lite.md ('Ceilings of the pooled AUC') give the bound and the argument",
)
def test_pooled_auc(calibration: Calibration) -> None:
    assert calibration.pooled_auc >= 0.80


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


def test_docs_report_matches_the_corpus(calibration: Calibration) -> None:
    """docs/prm_lite.md carries the report generated from the current rules and corpus (regenerate with
    ``python -m airline_rl.rewards.prm_lite --update-docs docs/prm_lite.md``)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "prm_lite.md").read_text(encoding="utf-8")
    block = text.split(CALIBRATION_START, 1)[1].split(CALIBRATION_END, 1)[0]
    assert block.strip() == calibration_markdown(calibration).strip()


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
    result = score_episode(record)
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
    assert score_episode(episode.record).rule_counts["P8"] > 0


def test_benchmark_prints_the_pooled_auc_last(capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    module = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "prm_calibration.py"))
    assert module["main"](["--tasks", "3,7", "--rules"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("pooled AUC success vs failure: ")
    assert any(line.startswith("oracle strictly above") for line in lines)
    with pytest.raises(SystemExit):
        module["main"](["--tasks", "999"])


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
