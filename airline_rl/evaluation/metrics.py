"""The evaluation metrics, computed in one place from the ``tasks`` section of a results file.

Definitions (docs/metrics.md has the long form). A *valid* sample is an episode whose user simulator did not fail
(``user_error`` is null): a simulator failure is not the agent's doing, so such samples are left out of every agent
metric and counted apart. For task t let n_t be its valid samples and c_t its successes (reward 1).

- pass^k (k = 1..N): mean over tasks with n_t ≥ k of C(c_t, k) / C(n_t, k), the unbiased estimate of the chance that
  k independent samples of the task all succeed (τ²-bench's pass^k). pass^1 is the mean over tasks of c_t / n_t.
- pass^1 per group (covered_seen, uncovered_seen, unseen), per stratum (tasks whose gold actions write to the
  database, and tasks that need no write) and overall.
- generalization pass^1 = (pass^1_uncovered × T_uncovered + pass^1_unseen × T_unseen) / (T_uncovered + T_unseen),
  T = tasks in the group: (×24 + ×10) / 34 on the seed split, i.e. pass^1 over the tasks no teacher covered.
- refusal floor: the pass^1 an agent that never writes and never says anything earns (the noop baseline): the share
  of tasks whose reward needs no database change and no communicated information.
- error rate: the share of valid episodes with at least one failed tool call (parse error, unknown tool, bad
  arguments or execution error); tool-call error rate: failed tool calls / all tool calls of valid episodes.
- reasoning depth: the median (p50) of the policy tokens sampled per assistant turn, over all turns of all valid
  episodes (scripted agents have none: null).
- 95% confidence intervals of pass^1: percentile bootstrap over tasks and, within each drawn task, over its samples
  (a task's resampled success count is Binomial(n_t, c_t / n_t), which is what resampling its n_t samples with
  replacement gives); generalization is resampled within its two groups, keeping their sizes (its weights are fixed).
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


# ---------------------------------------------------------------------------------------------------------------------
# pass^k


def pass_hat_k_task(n: int, c: int, k: int) -> float:
    """C(c, k) / C(n, k): the chance that k samples drawn without replacement from the task's n all succeed."""
    if not 1 <= k <= n:
        raise ValueError(f"pass^k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"successes must be in [0, n], got c={c}, n={n}")
    return math.comb(c, k) / math.comb(n, k)


def pass_hat_k(counts: Iterable[tuple[int, int]], k: int) -> float | None:
    """Mean over tasks (given as (n, c)) with n ≥ k of C(c, k) / C(n, k); None when no task has k samples."""
    values = [pass_hat_k_task(n, c, k) for n, c in counts if n >= k]
    return sum(values) / len(values) if values else None


def pass1(outcomes: Sequence[Sequence[bool]]) -> float | None:
    """Mean over tasks of the share of successful samples (tasks without samples are skipped)."""
    rates = [sum(o) / len(o) for o in outcomes if len(o)]
    return sum(rates) / len(rates) if rates else None


def generalization_pass1(group_pass1: Mapping[str, float | None], group_sizes: Mapping[str, int]) -> float | None:
    """(pass^1_uncovered × n_uncovered + pass^1_unseen × n_unseen) / (n_uncovered + n_unseen) over non-empty groups."""
    total = weight = 0.0
    for group in GENERALIZATION_GROUPS:
        value, size = group_pass1.get(group), group_sizes.get(group, 0)
        if value is not None and size:
            total += value * size
            weight += size
    return total / weight if weight else None


def bootstrap_pass1(
    outcomes: Sequence[Sequence[bool]],
    *,
    strata: Sequence[str] | None = None,
    num_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of pass^1, resampling tasks and then each drawn task's samples.

    With ``strata`` (one label per task) tasks are drawn within each stratum, keeping the strata sizes. The result
    depends only on the inputs and ``seed``. None when there is no task with a sample.
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
    sums = np.zeros(resamples)
    for label in sorted(set(labels)):
        members = np.array([j for j, lab in enumerate(labels) if lab == label])
        drawn = members[rng.integers(0, len(members), size=(resamples, len(members)))]
        successes = rng.binomial(n[drawn], p[drawn])
        sums += (successes / n[drawn]).sum(axis=1)
    estimates = sums / len(keep)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(estimates, [alpha, 1 - alpha])
    return round(float(low), 6), round(float(high), 6)


# ---------------------------------------------------------------------------------------------------------------------
# the whole metrics section


def valid_samples(task: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The samples of a task whose user simulator did not fail."""
    return [s for s in task.get("samples", []) if not s.get("user_error")]


def refusal_passes(task: Mapping[str, Any]) -> bool:
    """Whether an agent that changes nothing and says nothing earns the task's reward (the noop floor)."""
    return bool(task.get("refusal_passes", not task.get("writes") and not task.get("communicate")))


def _median(values: list[int]) -> float | None:
    return float(statistics.median(values)) if values else None


def _pass1_entry(
    outcomes: list[list[bool]], strata: list[str] | None, bootstrap: Mapping[str, Any], value: float | None = None
) -> dict[str, Any]:
    point = pass1(outcomes) if value is None else value
    interval = bootstrap_pass1(outcomes, strata=strata, **bootstrap) if point is not None else None
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
) -> dict[str, Any]:
    """Every metric of a results file's ``tasks`` section (see the module docstring for the definitions)."""
    bootstrap = {"num_resamples": bootstrap_samples, "confidence": confidence, "seed": seed}
    ids = list(tasks)
    outcomes = {t: [bool(s.get("success")) for s in valid_samples(tasks[t])] for t in ids}
    groups = {t: tasks[t].get("group") for t in ids}
    strata = {t: "write" if tasks[t].get("writes") else "no_write" for t in ids}

    def select(predicate: Any) -> list[str]:
        return [t for t in ids if predicate(t)]

    subsets: dict[str, list[str]] = {"overall": ids}
    subsets.update({g: select(lambda t, g=g: groups[t] == g) for g in GROUPS})
    subsets.update({s: select(lambda t, s=s: strata[t] == s) for s in STRATA})
    evaluated = {name: [t for t in members if outcomes[t]] for name, members in subsets.items()}

    pass1_section: dict[str, Any] = {}
    for name in ("overall", *GROUPS, *STRATA):
        pass1_section[name] = _pass1_entry([outcomes[t] for t in subsets[name]], None, bootstrap)
    general_ids = [t for g in GENERALIZATION_GROUPS for t in subsets[g]]
    general_value = generalization_pass1(
        {g: pass1_section[g]["value"] for g in GENERALIZATION_GROUPS},
        {g: len(evaluated[g]) for g in GENERALIZATION_GROUPS},
    )
    pass1_section["generalization"] = _pass1_entry(
        [outcomes[t] for t in general_ids], [groups[t] for t in general_ids], bootstrap, general_value
    )

    floor: dict[str, float | None] = {}
    for name in PASS1_KEYS:
        members = general_ids if name == "generalization" else subsets[name]
        floor[name] = sum(refusal_passes(tasks[t]) for t in members) / len(members) if members else None

    counts = [(len(outcomes[t]), sum(outcomes[t])) for t in ids]
    samples = [s for t in ids for s in tasks[t].get("samples", [])]
    valid = [s for t in ids for s in valid_samples(tasks[t])]
    calls = sum(int(s.get("tool_calls", 0)) for s in valid)
    errors = sum(int(s.get("tool_errors", 0)) for s in valid)
    turn_tokens = [int(x) for s in valid for x in (s.get("policy_tokens") or []) if x is not None]
    complete = bool(ids) and all(len(outcomes[t]) >= num_samples for t in ids)
    return {
        "tasks": len(ids),
        "tasks_evaluated": sum(1 for t in ids if outcomes[t]),
        "num_samples": num_samples,
        "episodes": len(samples),
        "valid_episodes": len(valid),
        "user_errors": len(samples) - len(valid),
        "complete": complete,
        "pass_hat_k": {str(k): pass_hat_k(counts, k) for k in range(1, num_samples + 1)},
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
    }
