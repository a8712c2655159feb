"""Statistics of PRM-Lite scores against labels: rule fire rates, AUC, rank correlation, the calibration summary.

``episode_rule_stats`` is what the trainer logs every step; ``calibrate`` is what ``docs/prm_lite.md`` and
``benchmarks/prm_calibration.py`` report on the behaviour corpus (``tau2_rl.rewards.prm.corpus``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tau2_rl.rewards.prm.detectors import is_confirmation
from tau2_rl.rewards.prm.engine import HasDomain, PRMResult, score_episode
from tau2_rl.rewards.prm.rules import DEFAULT_RULE_SET, RULES

if TYPE_CHECKING:
    from tau2_rl.rewards.prm.conversations import ImportReport
    from tau2_rl.rewards.prm.corpus import Trajectory

MIN_FAILURES_FOR_SPEARMAN = 3


def rule_ids(results: Sequence[PRMResult]) -> list[str]:
    """The rule ids the results were scored with, in table order (every result carries all of its set's ids)."""
    seen: dict[str, None] = {}
    for result in results:
        seen.update(dict.fromkeys(result.rule_counts))
    return list(seen) or list(RULES)


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
    for rule_id in rule_ids(results):
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
    ceilings: dict[str, float] = field(default_factory=dict)  # see ``auc_ceilings``
    # (behaviour, task) of a success and of a failure with byte-identical trajectories: see identical_opposite_pairs
    identical_opposite: list[tuple[str, str, str, str]] = field(default_factory=list)
    pair_bound: dict[str, float] = field(default_factory=dict)  # see ``pair_bound``


ORACLES = ("oracle_terse", "oracle_text")


def calibrate(
    corpus: Sequence[Trajectory],
    results: Sequence[PRMResult] | None = None,
    rules: str = DEFAULT_RULE_SET,
    *,
    env: HasDomain,
) -> Calibration:
    """Scores ``corpus`` with rule set ``rules`` (unless ``results`` are given) and computes the report's numbers;
    ``env`` (the corpus's environment) is what the rules read the domain from and the reference sets the tasks."""
    if results is None:
        results = [score_episode(t.record, rules=rules, env=env) for t in corpus]
    results = list(results)
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
        for rule_id in rule_ids(results)
        if rule_id.startswith("P")
    }
    stats = episode_rule_stats(results, labels)
    good = [r for r, ok in zip(results, labels, strict=True) if ok]
    bad = [r for r, ok in zip(results, labels, strict=True) if not ok]

    def rate(group: list[PRMResult], rule_id: str) -> float:
        return sum(r.rule_counts.get(rule_id, 0) > 0 for r in group) / len(group) if group else 0.0

    rule_rates = {
        rule_id: (rate(good, rule_id), rate(bad, rule_id), stats[f"prm/{rule_id}/discriminativeness"])
        for rule_id in rule_ids(results)
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
        ceilings=auc_ceilings(corpus),
        identical_opposite=identical_opposite_pairs(corpus),
        pair_bound=pair_bound(corpus),
    )


# Ceilings of the pooled AUC ------------------------------------------------------------------------------------------

PENALISED_BEHAVIOURS = frozenset(
    {"placeholder_arguments", "staged_failure_farmer", "repeated_reads", "premature_transfer", "rambler"}
)
"""Behaviours the seed intents penalise (placeholder, redundancy, error repetition, premature transfer, length): a
process reward must not rank them above honest work, even where they happen to succeed. The noop is left out (P7 now
charges its blind refusal too) so that the bound assumes the least; counting it in gives a ceiling of about 0.78 as
well."""


def best_auc(
    keys: Sequence[object],
    labels: Sequence[bool],
    demote: Sequence[bool] | None = None,
    above: Sequence[bool] | None = None,
) -> float:
    """The highest pooled AUC of any score that is constant on classes of equal key.

    Ranking the classes by their success rate is optimal (ties inside a class count half, as in ``auc``). With
    ``demote`` and ``above`` (masks over the trajectories), demoted classes must rank below every class of an
    ``above`` trajectory: a demoted class whose rate is at least the lowest such rate moves just below it, keeping
    its order among the demoted; the others already are where the constraint wants them."""
    outcomes: dict[object, list[bool]] = defaultdict(list)
    for key, label in zip(keys, labels, strict=True):
        outcomes[key].append(label)
    rate = {key: sum(values) / len(values) for key, values in outcomes.items()}
    if demote is not None and above is not None:
        demoted = {key for key, down in zip(keys, demote, strict=True) if down}
        floor = min((rate[key] for key, up in zip(keys, above, strict=True) if up and key not in demoted), default=0.0)
        rate = {key: floor - 1e-6 * (2.0 - r) if key in demoted and r >= floor else r for key, r in rate.items()}
    return auc([rate[key] for key in keys], labels)


def _exact_key(trajectory: Trajectory) -> str:
    record = trajectory.record
    calls = [(c.name, c.arguments, c.error) for c in record.tool_calls]
    return json.dumps([record.messages[1:], calls], sort_keys=True, default=str)


def _structure_key(trajectory: Trajectory) -> tuple[object, ...]:
    """What a trajectory looks like without its wording and values: who spoke, which tools, which failed, the stop
    token or confirmation of each user message, turns cut off."""
    record = trajectory.record
    users = []
    for message in record.messages[1:]:
        if message.get("role") == "user":
            text = str(message.get("content") or "")
            users.append(text if text.startswith("###") else "confirms" if is_confirmation(text) else "says")
    turns = tuple(
        (tuple((c.name, c.error) for c in (record.tool_calls[i] for i in turn.tool_call_indices
                                           if 0 <= i < len(record.tool_calls))), turn.truncated)
        for turn in record.turns
    )  # fmt: skip
    return tuple(users), turns


def auc_ceilings(corpus: Sequence[Trajectory]) -> dict[str, float]:
    """Upper bounds of the pooled AUC for scorers that see less than everything (docs/prm_lite.md explains them).

    - ``exact``: any function of the trajectory (identical trajectories must tie);
    - ``structure``: any function of the structure (``_structure_key``), however it is weighted;
    - ``behaviour``: a scorer that knows only which behaviour produced each trajectory;
    - ``behaviour_writes_exact``: knows the behaviour and judges every trajectory that writes perfectly, but cannot
      tell a non-writing trajectory on a read-only task from the same behaviour's on a write task (that needs deciding,
      from the records and the policy, whether the request should have been granted: solving the task);
    - ``..._penalised_below_honest_reads``: the same with the penalised behaviours (``PENALISED_BEHAVIOURS``) ranked
      below every honest trajectory that writes nothing; ``..._penalised_last``: below every honest trajectory.
    """
    labels = [t.success for t in corpus]
    pooled = [t.behaviour if not t.attempts_write else _exact_key(t) for t in corpus]
    penalised = [t.behaviour in PENALISED_BEHAVIOURS for t in corpus]
    honest_reads = [not p and not t.attempts_write for p, t in zip(penalised, corpus, strict=True)]
    honest = [not p for p in penalised]
    return {
        "exact": best_auc([_exact_key(t) for t in corpus], labels),
        "structure": best_auc([_structure_key(t) for t in corpus], labels),
        "behaviour": best_auc([t.behaviour for t in corpus], labels),
        "behaviour_writes_exact": best_auc(pooled, labels),
        "behaviour_writes_exact_penalised_below_honest_reads": best_auc(pooled, labels, penalised, honest_reads),
        "behaviour_writes_exact_penalised_last": best_auc(pooled, labels, penalised, honest),
    }


def identical_opposite_pairs(corpus: Sequence[Trajectory]) -> list[tuple[str, str, str, str]]:
    """(behaviour and task of the success, behaviour and task of the failure) for every pair of byte-identical
    trajectories (messages and calls) with opposite outcomes: no scorer that reads only the trajectory ranks them."""
    by_key: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in corpus:
        by_key[_exact_key(trajectory)].append(trajectory)
    return sorted(
        (good.behaviour, good.task_id, bad.behaviour, bad.task_id)
        for group in by_key.values()
        for good in group
        if good.success
        for bad in group
        if not bad.success
    )


def pair_bound(corpus: Sequence[Trajectory]) -> dict[str, float]:
    """The pooled AUC averages over (success, failure) pairs; two disjoint blocks of them no process reward can win.

    - ``penalised_vs_honest``: a success of a penalised behaviour (``PENALISED_BEHAVIOURS``, lucky on a read-only
      task) against a failure of any other behaviour: lost by every scorer that ranks them below honest work;
    - ``honest_no_write``: a success and a failure of the honest behaviours that write nothing (noop, the read
      farmers, partial oracles that stop before the first write; the oracle excluded): one on a read-only task, one on
      a write task. A scorer whose score of such a trajectory depends on its behaviour only, not on whether its task
      needed a write, loses at least ``honest_no_write_lost`` of them (``best_auc`` with the behaviour as key, on
      that block alone).

    ``bound`` = 1 − (both losses) / ``pairs``: no such scorer exceeds it, however the other pairs go."""
    good = [t for t in corpus if t.success]
    bad = [t for t in corpus if not t.success]
    penalised = sum(g.behaviour in PENALISED_BEHAVIOURS and b.behaviour not in PENALISED_BEHAVIOURS
                    for g in good for b in bad)  # fmt: skip
    block = [
        t
        for t in corpus
        if t.behaviour not in PENALISED_BEHAVIOURS and t.behaviour not in ORACLES and not t.attempts_write
    ]
    block_good = sum(t.success for t in block)
    block_pairs = block_good * (len(block) - block_good)
    best = best_auc([t.behaviour for t in block], [t.success for t in block]) if block_pairs else 1.0
    lost = (1.0 - best) * block_pairs
    pairs = len(good) * len(bad)
    return {
        "pairs": float(pairs),
        "penalised_vs_honest": float(penalised),
        "honest_no_write": float(block_pairs),
        "honest_no_write_lost": lost,
        "bound": 1.0 - (penalised + lost) / pairs if pairs else math.nan,
    }


# Within-group signal: what GRPO can use ------------------------------------------------------------------------------


def _sign(value: float, eps: float = 1e-12) -> int:
    return 0 if abs(value) <= eps else (1 if value > 0 else -1)


def within_group_signal(
    scores: Sequence[float],
    outcomes: Sequence[float],
    groups: Sequence[object],
    rule_counts: Sequence[Mapping[str, int]] | None = None,
) -> dict[str, float]:
    """Whether the process score ranks episodes the way the outcome does *inside* groups (GRPO only compares
    trajectories of one group: the same task), over the groups whose outcomes are mixed.

    - ``within_group_auc``: mean over mixed groups of the AUC of the process score, success (outcome ≥ 1) against
      failure (ties half): 0.5 is no signal, below 0.5 the process reward pushes against the outcome;
    - ``sign_agreement``: share of the mixed groups' episodes whose process advantage (score − group mean) has the
      sign of their outcome advantage (a zero process advantage does not agree);
    - ``rule/<id>/corr``: Pearson correlation, pooled over the mixed groups after subtracting each group's means, of
      "rule fired in the episode" with the outcome: positive is right for a bonus, negative for a penalty (NaN when
      the rule never varies within a mixed group);
    - ``mixed_groups``: how many groups the numbers are over (all NaN when none);
    - ``saturated_groups_with_signal``: of the groups whose outcomes are all equal (GRPO's outcome advantage is zero
      there), the share whose process scores still differ, the signal that breaks saturation (NaN when none), over
      ``saturated_groups`` groups (of two or more episodes).
    """
    if not len(scores) == len(outcomes) == len(groups):
        raise ValueError(f"{len(scores)} scores, {len(outcomes)} outcomes, {len(groups)} group keys")
    members: dict[object, list[int]] = defaultdict(list)
    for i, key in enumerate(groups):
        members[key].append(i)
    mixed = [idx for idx in members.values() if len({outcomes[i] >= 1.0 for i in idx}) == 2]
    stats: dict[str, float] = {"mixed_groups": float(len(mixed))}
    saturated = [idx for idx in members.values() if len(idx) > 1 and len({outcomes[i] for i in idx}) == 1]
    differing = sum(max(scores[i] for i in idx) - min(scores[i] for i in idx) > 1e-12 for idx in saturated)
    stats["saturated_groups"] = float(len(saturated))
    stats["saturated_groups_with_signal"] = differing / len(saturated) if saturated else math.nan
    aucs = [auc([scores[i] for i in idx], [outcomes[i] >= 1.0 for i in idx]) for idx in mixed]
    stats["within_group_auc"] = statistics.fmean(aucs) if aucs else math.nan
    agree = total = 0
    for idx in mixed:
        score_mean = statistics.fmean(scores[i] for i in idx)
        outcome_mean = statistics.fmean(outcomes[i] for i in idx)
        for i in idx:
            total += 1
            agree += _sign(scores[i] - score_mean) == _sign(outcomes[i] - outcome_mean) != 0
    stats["sign_agreement"] = agree / total if total else math.nan
    if rule_counts is not None:
        ids: dict[str, None] = {}
        for counts in rule_counts:
            ids.update(dict.fromkeys(counts))
        for rule_id in ids:
            xs: list[float] = []
            ys: list[float] = []
            for idx in mixed:
                fired = [float(rule_counts[i].get(rule_id, 0) > 0) for i in idx]
                outcome = [float(outcomes[i] >= 1.0) for i in idx]
                fm, om = statistics.fmean(fired), statistics.fmean(outcome)
                xs += [f - fm for f in fired]
                ys += [o - om for o in outcome]
            sxx, syy = sum(x * x for x in xs), sum(y * y for y in ys)
            sxy = sum(x * y for x, y in zip(xs, ys, strict=True))
            stats[f"rule/{rule_id}/corr"] = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan
    return stats


# The real calibration set --------------------------------------------------------------------------------------------

BOOTSTRAP_DRAWS = 2000


@dataclass
class RealCalibration:
    """PRM-Lite on real conversations (``conversations.import_conversations``), labelled by the recorded reward."""

    rules: str
    n_conversations: int
    n_successes: int
    n_tasks: int
    mixed_tasks: list[str]  # tasks with both outcomes: the only ones a within-task number is defined on
    per_task_auc: float  # mean over the mixed tasks of that task's AUC
    per_task_auc_ci: tuple[float, float]  # 95% bootstrap over the mixed tasks
    pooled_auc: float  # every success against every failure, across tasks (confounded by how hard each task is)
    write_auc: float  # the same over the mixed tasks whose τ² task needs a write
    n_write: int
    no_write_auc: float
    n_no_write: int
    same_gold_auc: float  # over the mixed tasks whose τ² gold writes are the source's (``label_notes``)
    n_same_gold: int
    within_task_gap: float  # mean over the mixed tasks of (mean score of successes − mean score of failures)
    mean_success: float
    mean_failure: float
    positive_success: float  # share of successes / failures with a score above 0
    positive_failure: float
    spearman: float  # Spearman(score, reward), pooled
    sign_agreement: float
    rule_rates: dict[str, tuple[float, float, float]]  # rule → (fire rate on successes, on failures, difference)
    rule_corr: dict[str, float]  # rule → within-task correlation with success (``within_group_signal``)
    # "successes" / "failures" -> (n, min, 25th percentile, median, 75th percentile, max) of the clipped score
    score_distribution: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # per task with both outcomes: (task id, needs a write, successes, failures, AUC, mean score of successes, of
    # failures)
    per_task: list[tuple[str, bool, int, int, float, float, float]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    dropped_calls: int = 0
    tool_calls: int = 0
    observation_mismatches: int = 0


def _distribution(values: Sequence[float]) -> tuple[float, ...]:
    """(n, min, 25th percentile, median, 75th percentile, max); NaNs for an empty group."""
    if not values:
        return (0, *[math.nan] * 5)
    if len(values) == 1:
        return (1, *[values[0]] * 5)
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")  # linear between closest ranks
    return (len(values), min(values), low, median, high, max(values))


def bootstrap_mean_ci(values: Sequence[float], draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``values`` (resampled with replacement)."""
    import random

    if not values:
        return math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(draws))
    return means[int(0.025 * draws)], means[min(int(0.975 * draws), draws - 1)]


def calibrate_real(
    report: ImportReport,
    task_writes: Mapping[str, bool],
    rules: str = DEFAULT_RULE_SET,
    weights: dict[str, float] | None = None,
    *,
    env: HasDomain,
) -> RealCalibration:
    """Scores the imported conversations with rule set ``rules`` (``weights`` overriding some of its weights, as the
    config's ``prm_weights`` does) and computes the real-set report.

    ``task_writes`` (τ² task id → whether its gold actions write) only splits the report; the rules never see it
    (the rules read the domain and the reference sets the tasks from ``env``, the environment the conversations were
    replayed in)."""
    conversations = report.conversations
    results = [score_episode(c.record, rules=rules, weights=weights, env=env) for c in conversations]
    scores = [r.process_score for r in results]
    labels = [c.success for c in conversations]
    by_task: dict[str, list[int]] = defaultdict(list)
    for i, conversation in enumerate(conversations):
        by_task[conversation.task_id].append(i)
    mixed = sorted((t for t, idx in by_task.items() if len({labels[i] for i in idx}) == 2), key=lambda t: (len(t), t))
    task_auc = {t: auc([scores[i] for i in by_task[t]], [labels[i] for i in by_task[t]]) for t in mixed}
    # per mixed task: (mean score of its successes, of its failures)
    task_means = {
        t: (
            statistics.fmean(scores[i] for i in by_task[t] if labels[i]),
            statistics.fmean(scores[i] for i in by_task[t] if not labels[i]),
        )
        for t in mixed
    }
    gaps = [good_mean - bad_mean for good_mean, bad_mean in task_means.values()]
    write = [task_auc[t] for t in mixed if task_writes.get(t, False)]
    no_write = [task_auc[t] for t in mixed if not task_writes.get(t, False)]
    same_gold = [task_auc[t] for t in mixed if report.label_notes.get(t) == "identical_writes"]
    good = [s for s, ok in zip(scores, labels, strict=True) if ok]
    bad = [s for s, ok in zip(scores, labels, strict=True) if not ok]
    signal = within_group_signal(
        scores, [float(ok) for ok in labels], [c.task_id for c in conversations], [r.rule_counts for r in results]
    )
    stats = episode_rule_stats(results, labels)
    good_results = [r for r, ok in zip(results, labels, strict=True) if ok]
    bad_results = [r for r, ok in zip(results, labels, strict=True) if not ok]

    def rate(group: list[PRMResult], rule_id: str) -> float:
        return sum(r.rule_counts.get(rule_id, 0) > 0 for r in group) / len(group) if group else 0.0

    ids = rule_ids(results)
    return RealCalibration(
        rules=rules,
        n_conversations=len(conversations),
        n_successes=sum(labels),
        n_tasks=len(by_task),
        mixed_tasks=mixed,
        per_task_auc=statistics.fmean(task_auc.values()) if task_auc else math.nan,
        per_task_auc_ci=bootstrap_mean_ci(list(task_auc.values())),
        pooled_auc=auc(scores, labels) if good and bad else math.nan,
        write_auc=statistics.fmean(write) if write else math.nan,
        n_write=len(write),
        no_write_auc=statistics.fmean(no_write) if no_write else math.nan,
        n_no_write=len(no_write),
        same_gold_auc=statistics.fmean(same_gold) if same_gold else math.nan,
        n_same_gold=len(same_gold),
        within_task_gap=statistics.fmean(gaps) if gaps else math.nan,
        mean_success=statistics.fmean(good) if good else math.nan,
        mean_failure=statistics.fmean(bad) if bad else math.nan,
        positive_success=sum(s > 0 for s in good) / len(good) if good else math.nan,
        positive_failure=sum(s > 0 for s in bad) / len(bad) if bad else math.nan,
        spearman=spearman(scores, [float(ok) for ok in labels]),
        sign_agreement=signal["sign_agreement"],
        rule_rates={
            r: (rate(good_results, r), rate(bad_results, r), stats[f"prm/{r}/discriminativeness"]) for r in ids
        },
        rule_corr={r: signal.get(f"rule/{r}/corr", math.nan) for r in ids},
        score_distribution={"successes": _distribution(good), "failures": _distribution(bad)},
        per_task=[
            (
                t,
                bool(task_writes.get(t, False)),
                sum(labels[i] for i in by_task[t]),
                sum(not labels[i] for i in by_task[t]),
                task_auc[t],
                *task_means[t],
            )
            for t in mixed
        ],
        skipped=list(report.skipped),
        dropped_calls=report.dropped_calls,
        tool_calls=report.tool_calls,
        observation_mismatches=report.observation_mismatches,
    )
