"""Statistics of PRM-Lite scores against labels: rule fire rates, AUC, rank correlation, the calibration summary.

``episode_rule_stats`` is what the trainer logs every step; ``calibrate`` is what ``docs/prm_lite.md`` and
``benchmarks/prm_calibration.py`` report on the behaviour corpus (``airline_rl.rewards.prm.corpus``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from airline_rl.rewards.prm.engine import PRMResult, score_episode
from airline_rl.rewards.prm.rules import RULES

if TYPE_CHECKING:
    from airline_rl.rewards.prm.corpus import Trajectory

MIN_FAILURES_FOR_SPEARMAN = 3


def episode_rule_stats(results: Sequence[PRMResult], successes: Sequence[bool]) -> dict[str, float]:
    """Per rule: share of episodes where it fired, and how much more often it fires in successful episodes.

    ``prm/<id>/discriminativeness`` = fire rate among successes − fire rate among failures (0.0 when either group is
    empty): a rule that rewards good process should be positive for bonuses and negative for penalties.
    """
    if len(results) != len(successes):
        raise ValueError(f"{len(results)} results but {len(successes)} success flags")
    stats: dict[str, float] = {}

    def rate(group: list[PRMResult], rule_id: str) -> float:
        return sum(result.rule_counts.get(rule_id, 0) > 0 for result in group) / len(group) if group else 0.0

    good = [result for result, ok in zip(results, successes, strict=True) if ok]
    bad = [result for result, ok in zip(results, successes, strict=True) if not ok]
    for rule_id in RULES:
        stats[f"prm/{rule_id}/fire_rate"] = rate(list(results), rule_id)
        stats[f"prm/{rule_id}/discriminativeness"] = rate(good, rule_id) - rate(bad, rule_id) if good and bad else 0.0
    return stats


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(score of a random positive > score of a random negative), ties counted half (Mann–Whitney U / n⁺n⁻).

    NaN when either class is empty."""
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} scores but {len(labels)} labels")
    ranks = _ranks(scores)
    positives = sum(labels)
    negatives = len(labels) - positives
    if not positives or not negatives:
        return math.nan
    rank_sum = sum(rank for rank, label in zip(ranks, labels, strict=True) if label)
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks); NaN when either side is constant."""
    if len(x) != len(y):
        raise ValueError(f"{len(x)} x values but {len(y)} y values")
    if len(x) < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


@dataclass
class Calibration:
    """The calibration report of a rule set on a labelled corpus (all fields are plain numbers/dicts)."""

    n_trajectories: int
    n_tasks: int
    n_write_tasks: int
    pooled_auc: float
    per_task_auc: float  # mean over tasks with both successes and failures of that task's AUC
    write_task_auc: float  # pooled over the write tasks only
    spearman_mean: float  # mean over tasks of Spearman(process, progress) among that task's failures
    spearman_tasks: int  # tasks where it is defined (≥ 3 failures, progress and score not constant)
    oracle_above_all: int  # tasks where both oracles score strictly above every non-completing trajectory
    oracle_above_all_failed: list[str]
    best_farming: tuple[str, float]  # the behaviour with the highest value in ``nonwriting_means``
    nonwriting_means: dict[str, float]  # behaviour → mean score of its no-write trajectories on write tasks
    penalty_on_oracle: dict[str, float]  # penalty rule → share of oracle trajectories where it fires
    rule_rates: dict[str, tuple[float, float, float]]  # rule → (fire rate on successes, on failures, difference)
    behaviours: dict[str, dict[str, float]] = field(default_factory=dict)  # behaviour → n, success, score stats


ORACLES = ("oracle_terse", "oracle_text")


def calibrate(corpus: Sequence[Trajectory], results: Sequence[PRMResult] | None = None) -> Calibration:
    """Scores ``corpus`` (unless ``results`` are given) and computes the report's numbers."""
    results = list(results) if results is not None else [score_episode(t.record) for t in corpus]
    scores = [r.process_score for r in results]
    labels = [t.success for t in corpus]
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, trajectory in enumerate(corpus):
        by_task[trajectory.task_id].append(i)

    correlations = []
    task_aucs = []
    above, failed = 0, []
    for task_id, indices in by_task.items():
        failures = [i for i in indices if not corpus[i].success]
        task_auc = auc([scores[i] for i in indices], [labels[i] for i in indices])
        if not math.isnan(task_auc):
            task_aucs.append(task_auc)
        if len(failures) >= MIN_FAILURES_FOR_SPEARMAN:
            rho = spearman([scores[i] for i in failures], [corpus[i].progress for i in failures])
            if not math.isnan(rho):
                correlations.append(rho)
        oracle = [scores[i] for i in indices if corpus[i].behaviour in ORACLES]
        others = [scores[i] for i in failures]
        if oracle and all(min(oracle) > s for s in others):
            above += 1
        else:
            failed.append(task_id)

    write_tasks = {t.task_id for t in corpus if t.task_writes}
    nonwriting: dict[str, list[float]] = defaultdict(list)
    for trajectory, score in zip(corpus, scores, strict=True):
        if trajectory.task_id in write_tasks and not trajectory.attempts_write:
            nonwriting[trajectory.behaviour].append(score)
    nonwriting_means = {b: statistics.fmean(v) for b, v in sorted(nonwriting.items())}
    best = max(nonwriting_means.items(), key=lambda item: item[1], default=("none", math.nan))

    oracle_results = [r for t, r in zip(corpus, results, strict=True) if t.behaviour in ORACLES]
    penalty_on_oracle = {
        rule_id: sum(r.rule_counts.get(rule_id, 0) > 0 for r in oracle_results) / max(len(oracle_results), 1)
        for rule_id in RULES
        if rule_id.startswith("P")
    }
    stats = episode_rule_stats(results, labels)
    good = [r for r, ok in zip(results, labels, strict=True) if ok]
    bad = [r for r, ok in zip(results, labels, strict=True) if not ok]

    def rate(group: list[PRMResult], rule_id: str) -> float:
        return sum(r.rule_counts.get(rule_id, 0) > 0 for r in group) / len(group) if group else 0.0

    rule_rates = {
        rule_id: (rate(good, rule_id), rate(bad, rule_id), stats[f"prm/{rule_id}/discriminativeness"])
        for rule_id in RULES
    }
    behaviours: dict[str, dict[str, float]] = {}
    grouped: dict[str, list[int]] = defaultdict(list)
    for i, trajectory in enumerate(corpus):
        grouped[trajectory.behaviour].append(i)
    for name, indices in grouped.items():
        values = sorted(scores[i] for i in indices)
        behaviours[name] = {
            "n": len(indices),
            "success_rate": sum(corpus[i].success for i in indices) / len(indices),
            "mean_progress": statistics.fmean(corpus[i].progress for i in indices),
            "mean": statistics.fmean(values),
            "min": values[0],
            "median": statistics.median(values),
            "max": values[-1],
            "mean_on_write_tasks": statistics.fmean([scores[i] for i in indices if corpus[i].task_writes] or [0.0]),
        }
    return Calibration(
        n_trajectories=len(corpus),
        n_tasks=len(by_task),
        n_write_tasks=len(write_tasks),
        pooled_auc=auc(scores, labels),
        per_task_auc=statistics.fmean(task_aucs) if task_aucs else math.nan,
        write_task_auc=auc(
            [s for s, t in zip(scores, corpus, strict=True) if t.task_writes],
            [t.success for t in corpus if t.task_writes],
        ),
        spearman_mean=statistics.fmean(correlations) if correlations else math.nan,
        spearman_tasks=len(correlations),
        oracle_above_all=above,
        oracle_above_all_failed=sorted(failed, key=lambda t: (len(t), t)),
        best_farming=best,
        nonwriting_means=nonwriting_means,
        penalty_on_oracle=penalty_on_oracle,
        rule_rates=rule_rates,
        behaviours=behaviours,
    )
