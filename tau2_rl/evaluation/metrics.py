"""The evaluation metrics, computed in one place from the ``tasks`` section of a results file.

Definitions (docs/metrics.md has the long form). A *valid* sample is an episode whose user simulator did not fail
(``user_error`` is null): a simulator failure is not the agent's doing, so such samples are left out of every agent
metric and counted apart. For task t let n_t be its valid samples and c_t its successes (reward 1).

- pass^k: mean over the tasks with a valid sample of C(c_t, k) / C(n_t, k), the unbiased estimate of the chance
  that k independent samples of the task all succeed (τ²-bench's pass^k), reported as τ² reports it: only for
  k ≤ min_t n_t, the smallest number of valid samples of any evaluated task; larger k are null. The other
  convention (for each k, the mean over the tasks with n_t ≥ k) is kept as ``convention="available"``; it can rise
  with k, because the tasks that lost samples drop out. pass^1 is the mean over tasks of c_t / n_t.
- pass^1 per group (covered_seen, uncovered_seen, unseen), per stratum (tasks whose gold actions write to the
  database, and tasks that need no write) and overall.
- generalization pass^1 = (pass^1_uncovered × T_uncovered + pass^1_unseen × T_unseen) / (T_uncovered + T_unseen),
  T = the group's size in the split (``group_sizes``; default: the group's tasks in the results): (×24 + ×10) / 34
  on the seed split. A group's pass^1 is over its tasks with a valid sample; when one of the two groups has none,
  generalization is null (never the other group's pass^1 under its name).
- refusal floor: the pass^1 an agent that never writes and never says anything earns (the noop baseline): the share
  of tasks whose reward needs no database change and no communicated information.
- error rate: the share of valid episodes with at least one failed tool call (parse error, unknown tool, bad
  arguments or execution error); tool-call error rate: failed tool calls / all tool calls of valid episodes.
- reasoning depth: the median (p50) of the policy tokens sampled per assistant turn, over all turns of all valid
  episodes (scripted agents have none: null). Only turns with ≥ 1 sampled token are turns (a budget spent before
  the policy sampled anything ends the episode as ``token_budget``; older files may hold such 0-token entries,
  skipped here).
- PRM-Lite signal (``prm_signal``): each task's valid samples form a group, as in GRPO; over the tasks with both
  outcomes, the mean per-task AUC of the process score against success (``prm_within_group_auc``: 0.5 is no
  signal), the share of episodes whose process and outcome advantages agree in sign, and per rule the within-task
  correlation of "fired" with success (docs/prm_lite.md, "Is the process reward a signal?").
- every task-level computation runs over the task ids in canonical order (``task_order``: numeric ids by value,
  then the others), so a metric never depends on the order of the ``tasks`` mapping (JSON files store it sorted
  as strings: "0", "1", "10", ...).
- 95% confidence intervals of pass^1: percentile bootstrap over tasks and, within each drawn task, over its samples
  (a task's resampled success count is Binomial(n_t, c_t / n_t), which is what resampling its n_t samples with
  replacement gives); generalization is resampled within its two groups, keeping their sizes, and each resample is
  weighted like the point estimate (its weights are fixed).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

GROUPS = ("covered_seen", "uncovered_seen", "unseen")
GENERALIZATION_GROUPS = ("uncovered_seen", "unseen")
STRATA = ("write", "no_write")
PASS1_KEYS = ("overall", *GROUPS, "generalization", *STRATA)
PASS_K_CONVENTIONS = {
    "tau2": "k up to the smallest number of valid samples of a task, mean over every task with a valid sample",
    "available": "every k up to N, mean over the tasks with at least k valid samples",
}


def task_order(task_id: str) -> tuple[int, int, str]:
    """Canonical task order: numeric ids by value ("2" before "10"), then any other id alphabetically."""
    text = str(task_id)
    return (0, int(text), "") if text.isdigit() else (1, 0, text)


# ---------------------------------------------------------------------------------------------------------------------
# pass^k


def pass_hat_k_task(n: int, c: int, k: int) -> float:
    """C(c, k) / C(n, k): the chance that k samples drawn without replacement from the task's n all succeed."""
    if not 1 <= k <= n:
        raise ValueError(f"pass^k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"successes must be in [0, n], got c={c}, n={n}")
    return math.comb(c, k) / math.comb(n, k)


def pass_hat_k(counts: Iterable[tuple[int, int]], k: int, convention: str = "tau2") -> float | None:
    """pass^k of tasks given as (n valid samples, c successes); tasks with n = 0 are left out.

    ``tau2``: the mean over all tasks of C(c, k) / C(n, k), None unless every task has n ≥ k (τ² reports pass^k
    only for k up to the smallest number of trials). ``available``: the mean over the tasks with n ≥ k.
    """
    if convention not in PASS_K_CONVENTIONS:
        raise ValueError(f"unknown pass^k convention {convention!r}; valid: {list(PASS_K_CONVENTIONS)}")
    evaluated = [(n, c) for n, c in counts if n > 0]
    if convention == "tau2" and any(n < k for n, _ in evaluated):
        return None
    values = [pass_hat_k_task(n, c, k) for n, c in evaluated if n >= k]
    return sum(values) / len(values) if values else None


def pass1(outcomes: Sequence[Sequence[bool]]) -> float | None:
    """Mean over tasks of the share of successful samples (tasks without samples are skipped)."""
    rates = [sum(o) / len(o) for o in outcomes if len(o)]
    return sum(rates) / len(rates) if rates else None


def generalization_pass1(group_pass1: Mapping[str, float | None], group_sizes: Mapping[str, int]) -> float | None:
    """(pass^1_uncovered × T_uncovered + pass^1_unseen × T_unseen) / (T_uncovered + T_unseen), T = group sizes.

    None unless both groups have a pass^1 and a positive size: the formula is not silently narrowed to one group.
    """
    values = [group_pass1.get(g) for g in GENERALIZATION_GROUPS]
    sizes = [int(group_sizes.get(g, 0) or 0) for g in GENERALIZATION_GROUPS]
    if any(v is None for v in values) or any(size <= 0 for size in sizes):
        return None
    return sum(v * size for v, size in zip(values, sizes, strict=True)) / sum(sizes)  # type: ignore[operator]


def bootstrap_pass1(
    outcomes: Sequence[Sequence[bool]],
    *,
    strata: Sequence[str] | None = None,
    weights: Mapping[str, float] | None = None,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of pass^1, resampling tasks and then each drawn task's samples.

    With ``strata`` (one label per task) tasks are drawn within each stratum, keeping the strata sizes, and a
    resample's estimate is Σ_s weights[s] × mean_s / Σ_s weights[s] (default weights: the strata sizes, i.e. the
    plain mean). Tasks are drawn by position: callers pass them in canonical order (``task_order``) so the interval
    depends only on the outcomes and ``seed``. None when there is no task with a sample.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    keep = [i for i, o in enumerate(outcomes) if len(o)]
    if not keep:
        return None
    n = np.array([len(outcomes[i]) for i in keep], dtype=np.int64)
    p = np.array([sum(outcomes[i]) / len(outcomes[i]) for i in keep], dtype=np.float64)
    labels = [strata[i] for i in keep] if strata is not None else ["all"] * len(keep)
    rng = np.random.default_rng(seed)
    resamples = max(1, int(num_resamples))
    estimates = np.zeros(resamples)
    total_weight = 0.0
    for label in sorted(set(labels)):
        members = np.array([j for j, lab in enumerate(labels) if lab == label])
        weight = float(len(members) if weights is None else weights[label])
        drawn = members[rng.integers(0, len(members), size=(resamples, len(members)))]
        successes = rng.binomial(n[drawn], p[drawn])
        estimates += weight * (successes / n[drawn]).mean(axis=1)
        total_weight += weight
    estimates /= total_weight
    alpha = (1 - confidence) / 2
    low, high = np.quantile(estimates, [alpha, 1 - alpha])
    return round(float(low), 6), round(float(high), 6)


# ---------------------------------------------------------------------------------------------------------------------
# the whole metrics section


def valid_samples(task: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The samples of a task whose user simulator did not fail."""
    return [s for s in task.get("samples", []) if not failed(s)]


def failed(sample: Mapping[str, Any]) -> bool:
    """Whether the sample's user simulator or served agent endpoint failed (a rerun plays it again)."""
    return bool(sample.get("user_error") or sample.get("agent_error"))


def refusal_passes(task: Mapping[str, Any]) -> bool:
    """Whether an agent that changes nothing and says nothing earns the task's reward (the noop floor)."""
    return bool(task.get("refusal_passes", not task.get("writes") and not task.get("communicate")))


def _median(values: list[int]) -> float | None:
    return float(statistics.median(values)) if values else None


def _pass1_entry(
    outcomes: list[list[bool]],
    bootstrap: Mapping[str, Any],
    strata: list[str] | None = None,
    weights: Mapping[str, float] | None = None,
    value: float | None = None,
) -> dict[str, Any]:
    point = pass1(outcomes) if strata is None else value
    interval = bootstrap_pass1(outcomes, strata=strata, weights=weights, **bootstrap) if point is not None else None
    return {
        "value": point,
        "ci_low": interval[0] if interval else None,
        "ci_high": interval[1] if interval else None,
        "tasks": sum(1 for o in outcomes if o),
    }


def compute_metrics(
    tasks: Mapping[str, Mapping[str, Any]],
    num_samples: int,
    *,
    bootstrap_samples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
    group_sizes: Mapping[str, int] | None = None,
    pass_k_convention: str = "tau2",
) -> dict[str, Any]:
    """Every metric of a results file's ``tasks`` section (see the module docstring for the definitions).

    ``group_sizes``: the split's group sizes, the generalization weights (default: the groups' tasks in ``tasks``).
    """
    bootstrap = {"num_resamples": bootstrap_samples, "confidence": confidence, "seed": seed}
    ids = sorted(tasks, key=task_order)
    outcomes = {t: [bool(s.get("success")) for s in valid_samples(tasks[t])] for t in ids}
    groups = {t: tasks[t].get("group") for t in ids}
    strata = {t: "write" if tasks[t].get("writes") else "no_write" for t in ids}

    def select(predicate: Any) -> list[str]:
        return [t for t in ids if predicate(t)]

    subsets: dict[str, list[str]] = {"overall": ids}
    subsets.update({g: select(lambda t, g=g: groups[t] == g) for g in GROUPS})
    subsets.update({s: select(lambda t, s=s: strata[t] == s) for s in STRATA})

    pass1_section: dict[str, Any] = {}
    for name in ("overall", *GROUPS, *STRATA):
        pass1_section[name] = _pass1_entry([outcomes[t] for t in subsets[name]], bootstrap)
    general_ids = [t for g in GENERALIZATION_GROUPS for t in subsets[g]]
    sizes = {g: int((group_sizes or {}).get(g) or len(subsets[g])) for g in GENERALIZATION_GROUPS}
    general_value = generalization_pass1({g: pass1_section[g]["value"] for g in GENERALIZATION_GROUPS}, sizes)
    pass1_section["generalization"] = _pass1_entry(
        [outcomes[t] for t in general_ids], bootstrap, [groups[t] for t in general_ids], sizes, general_value
    )

    floor: dict[str, float | None] = {}
    for name in PASS1_KEYS:
        members = general_ids if name == "generalization" else subsets[name]
        floor[name] = sum(refusal_passes(tasks[t]) for t in members) / len(members) if members else None

    counts = [(len(outcomes[t]), sum(outcomes[t])) for t in ids]
    valid_counts = [n for n, _ in counts if n > 0]
    samples = [s for t in ids for s in tasks[t].get("samples", [])]
    valid = [s for t in ids for s in valid_samples(tasks[t])]
    calls = sum(int(s.get("tool_calls", 0)) for s in valid)
    errors = sum(int(s.get("tool_errors", 0)) for s in valid)
    turn_tokens = [int(x) for s in valid for x in (s.get("policy_tokens") or []) if x]  # 0: no turn (see above)
    complete = bool(ids) and all(len(outcomes[t]) >= num_samples for t in ids)
    return {
        "tasks": len(ids),
        "tasks_evaluated": sum(1 for t in ids if outcomes[t]),
        "num_samples": num_samples,
        "episodes": len(samples),
        "valid_episodes": len(valid),
        "user_errors": sum(1 for s in samples if s.get("user_error")),
        "agent_errors": sum(1 for s in samples if s.get("agent_error") and not s.get("user_error")),
        "complete": complete,
        "pass_hat_k": {str(k): pass_hat_k(counts, k, pass_k_convention) for k in range(1, num_samples + 1)},
        "pass_hat_k_convention": pass_k_convention,
        "pass_hat_k_max": (min if pass_k_convention == "tau2" else max)(valid_counts, default=0),
        "pass1": pass1_section,
        "refusal_floor": floor,
        "error_rate": sum(1 for s in valid if int(s.get("tool_errors", 0)) > 0) / len(valid) if valid else None,
        "tool_call_error_rate": errors / calls if calls else None,
        "tool_calls": calls,
        "tool_errors": errors,
        "reasoning_depth_p50": _median(turn_tokens),
        "policy_tokens_per_turn_mean": sum(turn_tokens) / len(turn_tokens) if turn_tokens else None,
        "turns_per_episode": sum(int(s.get("turns", 0)) for s in valid) / len(valid) if valid else None,
        "tool_calls_per_episode": calls / len(valid) if valid else None,
        "truncation_rate": (
            sum(1 for s in valid if s.get("termination") == "token_budget") / len(valid) if valid else None
        ),
        "terminations": dict(sorted(Counter(str(s.get("termination")) for s in samples).items())),
        **prm_signal(tasks, ids),
    }


def prm_signal(tasks: Mapping[str, Mapping[str, Any]], ids: Sequence[str]) -> dict[str, Any]:
    """PRM-Lite's within-task signal over the valid samples that carry a ``prm`` entry, each task's samples a group
    (as in a GRPO group): ``prm_within_group_auc``, ``prm_sign_agreement``, ``prm_mixed_groups`` and
    ``prm_rule_corr`` (``tau2_rl.rewards.prm.stats.within_group_signal``; null where undefined)."""
    from tau2_rl.rewards.prm.stats import within_group_signal

    scored = [(t, s) for t in ids for s in valid_samples(tasks[t]) if isinstance(s.get("prm"), Mapping)]
    signal = within_group_signal(
        [float(s["prm"].get("process_score", 0.0)) for _, s in scored],
        [1.0 if s.get("success") else 0.0 for _, s in scored],
        [t for t, _ in scored],
        [dict(s["prm"].get("rule_counts") or {}) for _, s in scored],
    )

    def clean(value: float) -> float | None:
        return None if math.isnan(value) else value

    rules = {key.split("/")[1]: clean(v) for key, v in signal.items() if key.startswith("rule/")}
    return {
        "prm_rules": next((str(s["prm"].get("rules")) for _, s in scored), None),
        "prm_within_group_auc": clean(signal["within_group_auc"]),
        "prm_sign_agreement": clean(signal["sign_agreement"]),
        "prm_mixed_groups": int(signal["mixed_groups"]),
        "prm_rule_corr": rules,
    }
