"""The generated parts of docs/prm_lite.md (rule tables, calibration reports) as markdown.

One source of truth: the tables come from ``RULES`` and the calibration numbers from scoring the behaviour corpus and
real agents' conversations; ``python prm_report.py --update-docs docs/prm_lite.md`` (``tau2_rl.evaluation.prm_report``,
the command line, which reads the domains and their files) regenerates them, and a test checks that the committed page
matches the code. Nothing here reads a domain, a file or a flag: what to write is handed in.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tau2_rl.files import mkstemp_honouring_umask
from tau2_rl.rewards.prm.reference import REFERENCE_TERMS, ReferenceTerm
from tau2_rl.rewards.prm.rules import DEFAULT_RULE_SET, RULE_SETS, Rule
from tau2_rl.rewards.prm.stats import Calibration, RealCalibration

DOCS_START, DOCS_END = "<!-- rules:start -->", "<!-- rules:end -->"
CALIBRATION_START, CALIBRATION_END = "<!-- calibration:start -->", "<!-- calibration:end -->"
RESULTS_START, RESULTS_END = "<!-- real_results:start -->", "<!-- real_results:end -->"

PER_COUNT_RULES = ("P8", "B3", "P9", "P10", "P11", "B9", "P12", "B10", "B11", "P14", "P13")
"""Rules that fire more than once a turn (per call, per tool, per write): the table says "per count"."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rule_table(rules: Mapping[str, Rule | ReferenceTerm]) -> list[str]:
    lines = ["| ID | Name | Weight | Trigger | Rationale |", "|---|---|---|---|---|"]
    for rule in rules.values():
        per_count = rule.rule_id in PER_COUNT_RULES
        weight = f"{rule.weight:+.3f}".rstrip("0") + (" per count" if per_count else "")
        trigger, rationale = _cell(rule.trigger), _cell(rule.rationale)
        lines.append(f"| {rule.rule_id} | `{rule.name}` | {weight} | {trigger} | {rationale} |")
    return lines


def rules_markdown(policies: Mapping[str, Any]) -> str:
    """The rule tables of every version, default first, then the reference terms, as markdown (the generated part
    of docs/prm_lite.md); ``policies``: each domain's name → its ``DomainPolicy`` (None: P9 is off there)."""
    lines: list[str] = []
    for name in sorted(RULE_SETS, key=lambda n: n != DEFAULT_RULE_SET):
        default = " (default of the rule sets that read only the trajectory: evaluation's verdicts)" if (
            name == DEFAULT_RULE_SET) else ""  # fmt: skip
        lines += [f"**Rule set {name}**{default}", "", *_rule_table(RULE_SETS[name]), ""]
    title = ("**Rule set reference** (the task's gold actions: training only, and `prm_rules`' default for prm_lite "
             "and joint; `reference+v2` adds the v2 table)")  # fmt: skip
    lines += [title, "", *_rule_table(REFERENCE_TERMS), ""]
    for name, policy in policies.items():
        checks = "; ".join(f"{key}: {text}" for key, text in policy.violations.items()) if policy else "none (off)"
        lines += [f"P9's checks on {name}: {checks}", ""]
    return "\n".join(lines).rstrip() + "\n"


def _f(value: float, digits: int = 3) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.{digits}f}"


def headline(cal: Calibration) -> list[tuple[str, str]]:
    """The report's headline numbers as (name, value) pairs, pooled AUC last."""
    name, score = cal.best_farming
    return [
        ("trajectories", f"{cal.n_trajectories} on {cal.n_tasks} tasks ({cal.n_write_tasks} write tasks)"),
        ("oracle strictly above every non-completing trajectory", f"{cal.oracle_above_all}/{cal.n_tasks} tasks"),
        ("tasks where it is not", ", ".join(cal.oracle_above_all_failed) or "none"),
        ("best farming (mean score of no-write trajectories over the write tasks)", f"{name} {_f(score)}"),
        (
            "Spearman(process, progress) among failures of a task, mean",
            f"{_f(cal.spearman_mean)} over {cal.spearman_tasks} tasks",
        ),  # fmt: skip
        (
            "largest penalty fire rate on oracle trajectories",
            "{} {:.0%}".format(*max(cal.penalty_on_oracle.items(), key=lambda item: item[1])),
        ),  # fmt: skip
        ("AUC success vs failure, mean over tasks with both", _f(cal.per_task_auc)),
        ("AUC success vs failure, write tasks pooled", _f(cal.write_task_auc)),
        (
            "ceiling of the pooled AUC for a process reward (see below)",
            _f(cal.pair_bound.get("bound", math.nan)),
        ),  # fmt: skip
        ("pooled AUC success vs failure", _f(cal.pooled_auc)),
    ]


def calibration_markdown(cal: Calibration) -> str:
    """The calibration report (headline, per-rule fire rates, per-behaviour score distribution) as markdown."""
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in headline(cal)]
    lines += [
        "",
        "Per rule: share of successful and of failed trajectories in which it fires at least once, their difference "
        "(discriminativeness: positive is right for a bonus, negative for a penalty), and for penalties the share of "
        "oracle trajectories it fires on.",
        "",
        "| rule | fires on successes | fires on failures | discriminativeness | fires on oracle |",
        "|---|---|---|---|---|",
    ]
    for rule_id, (good, bad, diff) in cal.rule_rates.items():
        oracle = f"{cal.penalty_on_oracle[rule_id]:.0%}" if rule_id in cal.penalty_on_oracle else ""
        lines.append(f"| {rule_id} | {good:.0%} | {bad:.0%} | {diff:+.2f} | {oracle} |")
    lines += [
        "",
        "Per behaviour: trajectories, success rate, mean progress, and the distribution of the clipped process score "
        "(all tasks; the last column over the write tasks only).",
        "",
        "| behaviour | n | success | progress | mean | min | median | max | mean on write tasks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for behaviour, d in cal.behaviours.items():
        lines.append(
            f"| {behaviour} | {int(d['n'])} | {d['success_rate']:.0%} | {d['mean_progress']:.2f} | {_f(d['mean'])} | "
            f"{_f(d['min'])} | {_f(d['median'])} | {_f(d['max'])} | {_f(d['mean_on_write_tasks'])} |"
        )
    lines += ["", *ceilings_markdown(cal)]
    return "\n".join(lines) + "\n"


def _ci(cal: RealCalibration) -> str:
    low, high = cal.per_task_auc_ci
    return f"{_f(low)[1:] if low >= 0 else _f(low)}–{_f(high)[1:] if high >= 0 else _f(high)}"


def real_headline(cal: RealCalibration) -> str:
    """The real-set report's last line: the per-task AUC first."""
    return (
        f"{cal.per_task_auc:.3f} per-task AUC (95% CI {_ci(cal)}) over {len(cal.mixed_tasks)} tasks with both"
        f" outcomes; pooled AUC {cal.pooled_auc:.3f} over {cal.n_conversations} conversations;"
        f" write tasks {cal.write_auc:.3f} ({cal.n_write}),"
        f" no-write tasks {cal.no_write_auc:.3f} ({cal.n_no_write});"
        f" within-task gap {_f(cal.within_task_gap)}; rules {cal.rules}"
    )


def real_markdown(cal: RealCalibration) -> str:
    """The calibration report of PRM-Lite on real conversations, as markdown; the last line is ``real_headline``."""
    dropped = f"{cal.dropped_calls} `think` calls dropped (no τ² counterpart); " if cal.dropped_calls else ""
    lines = [
        f"{cal.n_conversations} conversations ({cal.n_successes} successes) on {cal.n_tasks} tasks, "
        f"{cal.tool_calls} tool calls replayed; {dropped}"
        f"{cal.observation_mismatches} replayed results say something else than the recorded ones; "
        f"{len(cal.skipped)} conversations not replayed.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| per-task AUC, success vs failure of the same task (mean over {len(cal.mixed_tasks)} tasks with both) | "
        f"{_f(cal.per_task_auc)} (95% bootstrap CI {_ci(cal)}) |",
        f"| pooled AUC, every success against every failure (across tasks: confounded by task difficulty) | "
        f"{_f(cal.pooled_auc)} |",
        f"| per-task AUC on tasks that need a write / need none | {_f(cal.write_auc)} ({cal.n_write} tasks) / "
        f"{_f(cal.no_write_auc)} ({cal.n_no_write} tasks) |",
        f"| per-task AUC on the tasks whose τ² gold writes are the source task's (the recorded label is τ²'s) | "
        f"{_f(cal.same_gold_auc)} ({cal.n_same_gold} tasks) |",
        f"| successes minus failures, mean score within task | {_f(cal.within_task_gap)} |",
        f"| mean score of successes / failures | {_f(cal.mean_success)} / {_f(cal.mean_failure)} |",
        f"| share scoring above 0: successes / failures | {cal.positive_success:.0%} / {cal.positive_failure:.0%} |",
        f"| Spearman(score, reward), pooled | {_f(cal.spearman)} |",
        f"| episodes whose process and outcome advantages agree in sign (mixed tasks) | {cal.sign_agreement:.0%} |",
        "",
        "Per rule: fire rate on successes and failures, their difference, and the within-task correlation of "
        '"fired" with success (`prm/rule/<id>/corr`; positive is right for a bonus, negative for a penalty).',
        "",
        "| rule | fires on successes | fires on failures | difference | within-task corr |",
        "|---|---|---|---|---|",
    ]
    for rule_id, (good, bad, diff) in cal.rule_rates.items():
        corr = cal.rule_corr.get(rule_id, math.nan)
        lines.append(f"| {rule_id} | {good:.0%} | {bad:.0%} | {diff:+.2f} | {_f(corr, 2)} |")
    lines += [
        "",
        "Score distribution (the clipped process score):",
        "",
        "| | n | min | 25% | median | 75% | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for group, (n, *quantiles) in cal.score_distribution.items():
        lines.append(f"| {group} | {int(n)} | " + " | ".join(_f(q) for q in quantiles) + " |")
    lines += [
        "",
        "Per task with both outcomes (the source task's id is in the task map):",
        "",
        "| τ² task | needs a write | successes | failures | AUC | mean score of successes | of failures |",
        "|---|---|---|---|---|---|---|",
    ]
    for task_id, writes, n_good, n_bad, task_auc, good_mean, bad_mean in cal.per_task:
        lines.append(
            f"| {task_id} | {'yes' if writes else 'no'} | {n_good} | {n_bad} | {task_auc:.2f} | {_f(good_mean)} | "
            f"{_f(bad_mean)} |"
        )
    if cal.skipped:
        lines += ["", "Not replayed (not scored):", "", *(f"- {reason}" for reason in cal.skipped)]
    lines += ["", real_headline(cal)]
    return "\n".join(lines) + "\n"


def acceptance_markdown(corpus: dict[str, Calibration], real: dict[str, RealCalibration]) -> str:
    """The issue's acceptance numbers for every rule set on both sets, side by side."""
    names = list(corpus)
    head = "| condition | target | " + " | ".join(names) + " |"
    rows = [head, "|---|---|" + "---|" * len(names)]

    def row(label: str, target: str, values: list[str]) -> None:
        rows.append(f"| {label} | {target} | " + " | ".join(values) + " |")

    row("corpus: oracle above every non-completing trajectory", "≥ 48/50",
        [f"{corpus[n].oracle_above_all}/{corpus[n].n_tasks}" for n in names])  # fmt: skip
    row("corpus: best non-writing mean on write tasks", "≤ 0",
        [f"{corpus[n].best_farming[0]} {_f(corpus[n].best_farming[1])}" for n in names])  # fmt: skip
    row("corpus: Spearman(process, progress) among failures", "≥ 0.5", [_f(corpus[n].spearman_mean) for n in names])
    row("corpus: per-task AUC", "", [_f(corpus[n].per_task_auc) for n in names])
    row("real: per-task AUC (95% CI)", "≥ 0.75, low > 0.5",
        [f"{_f(real[n].per_task_auc)} ({_ci(real[n])})" for n in names])  # fmt: skip
    row("real: per-task AUC, write / no-write tasks", "— / ≥ 0.70",
        [f"{_f(real[n].write_auc)} / {_f(real[n].no_write_auc)}" for n in names])  # fmt: skip
    row("real: per-task AUC where τ²'s gold writes are v1's", "",
        [f"{_f(real[n].same_gold_auc)} ({real[n].n_same_gold})" for n in names])  # fmt: skip
    row("real: successes minus failures within task", "> 0", [_f(real[n].within_task_gap) for n in names])
    row("real: Spearman(score, reward)", "", [_f(real[n].spearman) for n in names])
    return "\n".join(rows) + "\n"


def docs_calibration_markdown(corpus: dict[str, Calibration], real: dict[str, RealCalibration]) -> str:
    """The generated calibration section of docs/prm_lite.md: acceptance table, then each report, default first."""
    order = sorted(corpus, key=lambda n: n != DEFAULT_RULE_SET)
    parts = [acceptance_markdown({n: corpus[n] for n in order}, {n: real[n] for n in order})]
    for name in order:
        parts += [f"### Scripted corpus, rules {name}\n", calibration_markdown(corpus[name])]
    for name in order:
        parts += [f"### Real conversations, rules {name}\n", real_markdown(real[name])]
    return "\n".join(parts)


_CEILING_ROWS = (
    ("exact", "the whole trajectory (identical trajectories tie)"),
    ("structure", "its structure only: who spoke, which tools, which failed, stop tokens and confirmations"),
    ("behaviour", "which behaviour produced it, nothing else"),
    (
        "behaviour_writes_exact",
        "the behaviour, and a perfect verdict on every trajectory that writes; a non-writing trajectory cannot be "
        "told apart across tasks",
    ),
    (
        "behaviour_writes_exact_penalised_below_honest_reads",
        "the same, penalised behaviours below honest non-writing ones",
    ),
    ("behaviour_writes_exact_penalised_last", "the same, penalised behaviours below all honest work"),
)


def ceilings_markdown(cal: Calibration) -> list[str]:
    """Why the pooled AUC target is out of reach for a process reward: ceilings and the pair bound, with numbers."""
    if not cal.ceilings or not cal.pair_bound:
        return []
    b = cal.pair_bound
    identical = sorted({(good_task, bad_task) for _, good_task, _, bad_task in cal.identical_opposite})
    behaviours = sorted({behaviour for behaviour, *_ in cal.identical_opposite})
    lines = [
        "**Ceilings of the pooled AUC.** The best pooled AUC of any score that is a function of what the first column "
        "names (ranking classes of trajectories that look alike by their success rate is optimal; ties count half):",
        "",
        "| the scorer may use | ceiling |",
        "|---|---|",
    ]
    lines += [f"| {label} | {_f(cal.ceilings[key])} |" for key, label in _CEILING_ROWS if key in cal.ceilings]
    lines += [
        "",
        f"**The argument.** The pooled AUC averages over {b['pairs']:,.0f} (success, failure) pairs, so 0.80 allows "
        f"losing at most {0.2 * b['pairs']:,.0f}. Two disjoint blocks of pairs are lost by any scorer that (i) ranks "
        "the penalised behaviours (placeholder arguments, staged failures, repeated reads, premature transfer, "
        'rambler) below honest work, as the seed intents and the goal "no cheap behaviour out-scores honest work" '
        "demand, and (ii) scores a trajectory that writes nothing by what its behaviour does, not by whether its "
        "task needed a write:",
        f"{b['penalised_vs_honest']:,.0f} pairs of a lucky penalised success (on a read-only task) against an honest "
        f"failure, all lost by (i); and of the {b['honest_no_write']:,.0f} pairs of an honest non-writing success "
        "(noop, read farmers, partial oracles; one on a read-only task) against an honest non-writing failure (one on "
        f"a write task), at least {b['honest_no_write_lost']:,.0f} are lost by (ii), by the best ordering of those "
        f"behaviours. Hence pooled AUC ≤ {b['bound']:.3f} for every such scorer, whatever it does "
        "with the other pairs. Dropping (i) lifts the ceiling only to the `behaviour_writes_exact` row, reached by "
        "ranking placeholder calls and staged failures above honest partial work (their success rate on this corpus "
        "is higher); dropping (ii) means deciding, from the records read and the policy, whether the user's request "
        "should have been granted — solving the task, i.e. an outcome model rather than process rules — and a "
        "trajectory that read nothing does not even hold the records.",
    ]
    if identical:
        pairs = ", ".join(f"{good} (success) / {bad} (failure)" for good, bad in identical)
        lines += [
            "",
            f"Byte-identical trajectories with opposite outcomes: {len(cal.identical_opposite)} pairs "
            f"({', '.join(behaviours)}) on tasks {pairs}: the same conversation succeeds on one task and fails on "
            "the other, so no scorer of the trajectory can rank them.",
        ]
    return lines


def _replace_between(text: str, start_marker: str, end_marker: str, body: str, path: Path) -> str:
    if start_marker not in text or end_marker not in text:
        raise ValueError(f"{path} lacks the markers {start_marker} ... {end_marker}")
    start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
    return text[:start] + "\n" + body + text[end:]


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = mkstemp_honouring_umask(path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def update_docs(path: str | Path, sections: Mapping[tuple[str, str], str]) -> None:
    """Rewrites each generated section of ``path`` (``(start marker, end marker)`` → its new body), atomically."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--update-docs: no such file {path}")
    text = path.read_text(encoding="utf-8")
    for (start, end), body in sections.items():
        text = _replace_between(text, start, end, body, path)
    _write_atomic(path, text)


def results_table_markdown(rows: Sequence[tuple[str, str, Mapping[str, RealCalibration]]]) -> str:
    """The per-domain table of real agents' τ² results: per rule set, the per-task AUC (success against failure of
    the same task, mean over the tasks with both outcomes, 95% bootstrap CI over them) and the pooled AUC. ``rows``:
    (domain, what its conversations are, rule set → its calibration)."""
    names = list(rows[0][2]) if rows else []
    lines = [
        "| domain | conversations (successes), tasks with both outcomes | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for domain, what, calibrations in rows:
        first = next(iter(calibrations.values()))
        cells = [f"**{c.per_task_auc:.3f}** ({_ci(c)}); pooled {c.pooled_auc:.3f}" for c in calibrations.values()]
        lines.append(
            f"| {domain} | {what}: {first.n_conversations} ({first.n_successes}), {len(first.mixed_tasks)} | "
            + " | ".join(cells) + " |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"
