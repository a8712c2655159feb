"""Evaluation metrics on hand-made results: pass^k against brute force, the generalization formula, the bootstrap
intervals, error rates, reasoning depth and the noop floor. No episode is played: this file runs in about a second."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from tau2_rl.evaluation.metrics import (
    bootstrap_pass1,
    compute_metrics,
    generalization_pass1,
    pass1,
    pass_hat_k,
    pass_hat_k_task,
)


def brute_force_pass_k(outcomes: list[bool], k: int) -> float:
    """Share of the k-subsets of the samples in which every sample succeeded."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(all(s) for s in subsets) / len(subsets)


def sample(success: bool, *, tool_calls: int = 0, tool_errors: int = 0, tokens: list[int] | None = None, **extra):
    return {
        "success": success,
        "tool_calls": tool_calls,
        "tool_errors": tool_errors,
        "policy_tokens": tokens or [],
        "turns": len(tokens or []) or 1,
        "termination": extra.pop("termination", "user_stop"),
        "user_error": extra.pop("user_error", None),
        **extra,
    }


def task(group: str, outcomes: list[bool], *, writes: bool = True, communicate: bool = False, **kwargs) -> dict:
    return {
        "group": group,
        "writes": writes,
        "communicate": communicate,
        "refusal_passes": not writes and not communicate,
        "samples": [sample(o, **kwargs) for o in outcomes],
    }


# ---------------------------------------------------------------------------------------------------------------------
# pass^k


def test_pass_hat_k_estimator_matches_brute_force_enumeration() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        outcomes = [rng.random() < 0.6 for _ in range(n)]
        for k in range(1, n + 1):
            expected = brute_force_pass_k(outcomes, k)
            assert pass_hat_k_task(n, sum(outcomes), k) == pytest.approx(expected, abs=1e-12)


def test_pass_hat_k_is_the_mean_over_tasks_up_to_the_smallest_sample_count() -> None:
    tasks = [[True, True, False, True], [False, False, False, False], [True, True, True, True]]
    counts = [(len(o), sum(o)) for o in tasks]
    for k in range(1, 5):
        expected = sum(brute_force_pass_k(o, k) for o in tasks) / len(tasks)
        assert pass_hat_k(counts, k) == pytest.approx(expected)
    assert pass_hat_k(counts, 1) == pytest.approx((3 / 4 + 0 + 1) / 3)
    assert pass_hat_k(counts, 4) == pytest.approx((0 + 0 + 1) / 3)
    # τ²'s convention: pass^k only for k up to the smallest number of valid samples (here 2), over every task
    assert pass_hat_k([(4, 4), (2, 0)], 2) == 0.5
    assert pass_hat_k([(4, 4), (2, 0)], 3) is None
    assert pass_hat_k([(4, 4), (2, 0), (0, 0)], 2) == 0.5  # a task without a valid sample is left out
    assert pass_hat_k([(2, 1)], 3) is None
    # the other convention, by name only: for each k, the tasks with at least k valid samples
    assert pass_hat_k([(4, 4), (2, 0)], 3, "available") == 1.0
    with pytest.raises(ValueError, match="convention"):
        pass_hat_k([(4, 4)], 1, "tasks_with_k")


def test_pass_hat_k_never_rises_with_k_under_the_tau2_convention() -> None:
    """Tasks that lost samples to user-simulator failures: the 'available' convention can rise with k (the hard
    tasks drop out), τ²'s stops at the smallest sample count."""
    counts = [(12, 12), (12, 9), (10, 1), (10, 0), (11, 2), (11, 3)]
    available = [pass_hat_k(counts, k, "available") for k in range(1, 13)]
    assert available[11] > available[10] > available[9]  # k = 10, 11, 12: rises
    tau2 = [pass_hat_k(counts, k) for k in range(1, 13)]
    assert all(v is not None for v in tau2[:10]) and tau2[10:] == [None, None]
    assert all(a >= b for a, b in itertools.pairwise(tau2[:10]))


def test_pass_hat_k_task_rejects_impossible_arguments() -> None:
    with pytest.raises(ValueError, match="k"):
        pass_hat_k_task(3, 1, 4)
    with pytest.raises(ValueError, match="successes"):
        pass_hat_k_task(3, 4, 1)


def test_pass_hat_k_decreases_with_k() -> None:
    rng = random.Random(1)
    counts = [(8, rng.randint(0, 8)) for _ in range(30)]
    values = [pass_hat_k(counts, k) for k in range(1, 9)]
    assert all(a >= b for a, b in itertools.pairwise(values))


# ---------------------------------------------------------------------------------------------------------------------
# generalization, groups, strata


def test_generalization_formula_on_the_seed_split_sizes() -> None:
    value = generalization_pass1({"uncovered_seen": 0.5, "unseen": 0.2}, {"uncovered_seen": 24, "unseen": 10})
    assert value == pytest.approx((0.5 * 24 + 0.2 * 10) / 34)
    # a group without any task with a valid sample: the formula is undefined, not narrowed to the other group
    assert generalization_pass1({"uncovered_seen": None, "unseen": 0.3}, {"uncovered_seen": 24, "unseen": 10}) is None
    assert generalization_pass1({"uncovered_seen": 0.5, "unseen": 0.3}, {"uncovered_seen": 0, "unseen": 10}) is None
    assert generalization_pass1({}, {}) is None


def test_generalization_weights_are_the_split_group_sizes() -> None:
    """A sample of 3 of the 24 uncovered tasks (as the in-training evaluation may use) and 2 of 10 unseen ones with
    one task lacking a valid sample: group pass^1 over the tasks with samples, weights 24 and 10."""
    tasks = {f"u{i}": task("uncovered_seen", o) for i, o in enumerate([[True, True], [True, False], [False, False]])}
    tasks["s0"] = task("unseen", [True, False])
    tasks["s1"] = {"group": "unseen", "writes": True, "samples": [sample(False, user_error="down")]}
    metrics = compute_metrics(tasks, 2, bootstrap_samples=200, group_sizes={"uncovered_seen": 24, "unseen": 10})
    general = metrics["pass1"]["generalization"]
    assert general["value"] == pytest.approx((0.5 * 24 + 0.5 * 10) / 34)
    assert general["tasks"] == 4 and general["ci_low"] <= general["value"] <= general["ci_high"]
    unweighted = compute_metrics(tasks, 2, bootstrap_samples=200)["pass1"]["generalization"]
    assert unweighted["value"] == pytest.approx((0.5 * 3 + 0.5 * 2) / 5)  # default sizes: the groups' tasks here
    del tasks["s0"]  # unseen has no task with a valid sample left
    assert (
        compute_metrics(tasks, 2, group_sizes={"uncovered_seen": 24, "unseen": 10})["pass1"]["generalization"]["value"]
        is None
    )


def test_compute_metrics_groups_strata_generalization_and_floor() -> None:
    tasks = {}
    # 2 covered (all succeed), 3 uncovered (1/2 each), 1 unseen (0/2); writes alternate
    for i in range(2):
        tasks[f"c{i}"] = task("covered_seen", [True, True], writes=False)
    for i in range(3):
        tasks[f"u{i}"] = task("uncovered_seen", [True, False], writes=i != 0, communicate=i == 1)
    tasks["s0"] = task("unseen", [False, False], writes=True)
    metrics = compute_metrics(tasks, 2, bootstrap_samples=200)
    p1 = metrics["pass1"]
    assert p1["overall"]["value"] == pytest.approx((1 + 1 + 0.5 * 3 + 0) / 6)
    assert p1["covered_seen"]["value"] == 1.0
    assert p1["uncovered_seen"]["value"] == 0.5
    assert p1["unseen"]["value"] == 0.0
    assert p1["generalization"]["value"] == pytest.approx((0.5 * 3 + 0.0 * 1) / 4)
    assert p1["generalization"]["tasks"] == 4
    assert p1["no_write"]["value"] == pytest.approx((1 + 1 + 0.5) / 3)  # c0, c1, u0
    assert p1["write"]["value"] == pytest.approx((0.5 + 0.5 + 0) / 3)  # u1, u2, s0
    assert metrics["pass_hat_k"]["2"] == pytest.approx((1 + 1 + 0 + 0 + 0 + 0) / 6)
    floor = metrics["refusal_floor"]
    assert floor["write"] == 0.0
    assert floor["no_write"] == 1.0  # c0, c1 and u0 need no write and nothing said
    assert floor["overall"] == pytest.approx(3 / 6)
    assert metrics["complete"] is True and metrics["tasks_evaluated"] == 6


def test_user_simulator_failures_are_left_out_and_counted() -> None:
    tasks = {
        "a": {
            "group": "unseen",
            "writes": True,
            "samples": [sample(True), sample(False, user_error="endpoint down", termination="user_error")],
        },
        "b": task("unseen", [False, False]),
    }
    metrics = compute_metrics(tasks, 2, bootstrap_samples=100)
    assert metrics["user_errors"] == 1 and metrics["valid_episodes"] == 3
    assert metrics["pass1"]["overall"]["value"] == pytest.approx((1.0 + 0.0) / 2)  # task a: 1 of 1 valid sample
    assert metrics["pass_hat_k"]["2"] is None  # task a has 1 valid sample: τ² reports pass^k for k <= 1 only
    assert metrics["pass_hat_k_max"] == 1 and metrics["pass_hat_k_convention"] == "tau2"
    assert metrics["complete"] is False  # task a still lacks a valid second sample


# ---------------------------------------------------------------------------------------------------------------------
# error rates and reasoning depth


def test_error_rate_is_the_share_of_episodes_with_a_tool_error() -> None:
    tasks = {
        "a": {"group": "unseen", "samples": [sample(True, tool_calls=4, tool_errors=0, tokens=[10, 30]),
                                              sample(False, tool_calls=2, tool_errors=2, tokens=[20])]},
        "b": {"group": "unseen", "samples": [sample(False, tool_calls=0, tool_errors=0, tokens=[40, 50, 60]),
                                              sample(False, tool_calls=4, tool_errors=1, tokens=[5])]},
    }  # fmt: skip
    metrics = compute_metrics(tasks, 2, bootstrap_samples=50)
    assert metrics["error_rate"] == pytest.approx(2 / 4)
    assert metrics["tool_call_error_rate"] == pytest.approx(3 / 10)
    assert metrics["tool_calls"] == 10 and metrics["tool_errors"] == 3
    assert metrics["reasoning_depth_p50"] == pytest.approx(30.0)  # median of 5, 10, 20, 30, 40, 50, 60
    assert metrics["turns_per_episode"] == pytest.approx((2 + 1 + 3 + 1) / 4)


def test_turns_without_sampled_tokens_do_not_enter_reasoning_depth() -> None:
    """Files written before 0-token turns stopped being recorded hold 0 entries: they are no turns."""
    tasks = {"a": {"group": "unseen", "samples": [sample(False, tokens=[10, 20, 30, 0], termination="token_budget")]}}
    metrics = compute_metrics(tasks, 1, bootstrap_samples=10)
    assert metrics["reasoning_depth_p50"] == 20.0 and metrics["policy_tokens_per_turn_mean"] == 20.0


def test_scripted_agents_have_no_reasoning_depth_and_no_calls_give_no_call_error_rate() -> None:
    metrics = compute_metrics({"a": task("unseen", [True])}, 1, bootstrap_samples=10)
    assert metrics["reasoning_depth_p50"] is None
    assert metrics["tool_call_error_rate"] is None
    assert metrics["error_rate"] == 0.0


def test_empty_results_give_missing_values() -> None:
    metrics = compute_metrics({"a": {"group": "unseen", "samples": []}}, 3, bootstrap_samples=10)
    assert metrics["pass1"]["overall"]["value"] is None and metrics["pass1"]["overall"]["ci_low"] is None
    assert metrics["pass_hat_k"] == {"1": None, "2": None, "3": None}
    assert metrics["complete"] is False and metrics["error_rate"] is None


# ---------------------------------------------------------------------------------------------------------------------
# bootstrap


def _random_outcomes(seed: int, tasks: int = 40, n: int = 4) -> list[list[bool]]:
    rng = random.Random(seed)
    difficulty = [rng.random() for _ in range(tasks)]
    return [[rng.random() < d for _ in range(n)] for d in difficulty]


def test_bootstrap_interval_contains_the_point_estimate_and_is_deterministic() -> None:
    for seed in range(5):
        outcomes = _random_outcomes(seed)
        point = pass1(outcomes)
        low, high = bootstrap_pass1(outcomes, num_resamples=1000, seed=7)
        assert low <= point <= high
        assert 0.0 <= low < high <= 1.0
        assert bootstrap_pass1(outcomes, num_resamples=1000, seed=7) == (low, high)
    other = bootstrap_pass1(_random_outcomes(0), num_resamples=1000, seed=8)
    assert other != bootstrap_pass1(_random_outcomes(0), num_resamples=1000, seed=7)


def test_bootstrap_interval_width_behaves() -> None:
    outcomes = _random_outcomes(3, tasks=40)
    low95, high95 = bootstrap_pass1(outcomes, num_resamples=2000, confidence=0.95)
    low50, high50 = bootstrap_pass1(outcomes, num_resamples=2000, confidence=0.5)
    assert low95 <= low50 <= high50 <= high95
    # four times the tasks (same difficulty mix) → about half the width
    wide = high95 - low95
    low, high = bootstrap_pass1(outcomes * 4, num_resamples=2000)
    assert (high - low) < 0.7 * wide
    # all successes (or all failures): a degenerate interval at the estimate
    assert bootstrap_pass1([[True] * 4] * 10) == (1.0, 1.0)
    assert bootstrap_pass1([[False] * 4] * 10) == (0.0, 0.0)
    assert bootstrap_pass1([]) is None
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_pass1(outcomes, confidence=1.5)


def test_bootstrap_resamples_samples_within_tasks() -> None:
    """One task, many samples: only the within-task resampling can give the interval any width."""
    outcomes = [[True, False] * 10]
    low, high = bootstrap_pass1(outcomes, num_resamples=4000, seed=0)
    # Binomial(20, 0.5) / 20 has standard deviation ~0.11: a 95% interval of about ±0.2
    assert low < 0.4 and high > 0.6
    assert math.isclose(pass1(outcomes), 0.5)


def test_stratified_bootstrap_keeps_group_sizes() -> None:
    outcomes = [[True] * 4] * 24 + [[False] * 4] * 10
    strata = ["uncovered_seen"] * 24 + ["unseen"] * 10
    assert bootstrap_pass1(outcomes, strata=strata) == (pytest.approx(24 / 34), pytest.approx(24 / 34))
    low, high = bootstrap_pass1(outcomes)
    assert low < 24 / 34 < high  # unstratified: the group mix varies


def test_no_metric_depends_on_the_order_of_the_tasks() -> None:
    """The bootstrap draws tasks by position: metrics must be computed over a canonical task order, so a results
    file (stored with keys sorted as strings: "0", "1", "10", ...) gives the numbers the run computed."""
    rng = random.Random(5)
    groups = ["covered_seen"] * 16 + ["uncovered_seen"] * 24 + ["unseen"] * 10
    tasks = {}
    for i, group in enumerate(groups):
        p = rng.random()
        tasks[str(i)] = task(group, [rng.random() < p for _ in range(4)], writes=i % 2 == 0, tokens=[i + 1, 7])
    reference = compute_metrics(tasks, 4, bootstrap_samples=500)
    for seed in range(3):
        ids = list(tasks)
        random.Random(seed).shuffle(ids)
        assert compute_metrics({t: tasks[t] for t in ids}, 4, bootstrap_samples=500) == reference
    assert compute_metrics(dict(sorted(tasks.items())), 4, bootstrap_samples=500) == reference  # JSON's order


def test_weighted_stratified_bootstrap_matches_the_weighted_estimate() -> None:
    outcomes = [[True] * 4] * 3 + [[False] * 4] * 2
    strata = ["uncovered_seen"] * 3 + ["unseen"] * 2
    weights = {"uncovered_seen": 24, "unseen": 10}
    assert bootstrap_pass1(outcomes, strata=strata, weights=weights) == (
        pytest.approx(24 / 34),
        pytest.approx(24 / 34),
    )


def test_prm_signal_over_the_samples_of_each_task() -> None:
    """Each task's samples are a group: the within-group AUC of the process score, the sign agreement, the rules'
    correlations; samples without a ``prm`` entry (older files) and user-simulator failures are left out."""

    def scored(success: bool, score: float, **extra) -> dict:
        fired = {"B5": int(success), "P9": int(not success)}
        return sample(success, prm={"rules": "v2", "process_score": score, "rule_counts": fired}, **extra)

    tasks = {
        "0": {**task("unseen", []), "samples": [scored(True, 0.2), scored(False, -0.1), scored(False, 0.0)]},
        "1": {**task("unseen", []), "samples": [scored(True, -0.3), scored(False, 0.1)]},  # inverted
        "2": {**task("unseen", []), "samples": [scored(True, 0.1), scored(True, 0.2)]},  # not mixed
        "3": {**task("unseen", []), "samples": [sample(True), sample(False), scored(True, 9.0, user_error="x")]},
    }
    metrics = compute_metrics(tasks, 3, bootstrap_samples=10)
    assert metrics["prm_rules"] == "v2" and metrics["prm_mixed_groups"] == 2
    assert metrics["prm_within_group_auc"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["prm_sign_agreement"] == pytest.approx(3 / 5)  # task 0: all three agree; task 1: neither
    assert metrics["prm_rule_corr"] == {"B5": pytest.approx(1.0), "P9": pytest.approx(-1.0)}
    empty = compute_metrics({"a": task("unseen", [True, False])}, 2, bootstrap_samples=10)
    assert empty["prm_within_group_auc"] is None and empty["prm_mixed_groups"] == 0 and empty["prm_rules"] is None
