"""The generated parts of docs/prm_lite.md (rule table, calibration report) and the command line that writes them.

One source of truth: the table comes from ``RULES`` and the calibration numbers from scoring the behaviour corpus, so
``python -m airline_rl.rewards.prm_lite --update-docs docs/prm_lite.md`` regenerates both, and a test checks that the
committed page matches the code.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from airline_rl.rewards.prm.rules import RULES
from airline_rl.rewards.prm.stats import Calibration

DOCS_START, DOCS_END = "<!-- rules:start -->", "<!-- rules:end -->"
CALIBRATION_START, CALIBRATION_END = "<!-- calibration:start -->", "<!-- calibration:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rules_markdown() -> str:
    """The rule table as markdown (the generated part of docs/prm_lite.md)."""
    lines = ["| ID | Name | Weight | Trigger | Rationale |", "|---|---|---|---|---|"]
    for rule in RULES.values():
        weight = f"{rule.weight:+.3f}".rstrip("0") + (" per count" if rule.rule_id in ("P8", "B3") else "")
        trigger, rationale = _cell(rule.trigger), _cell(rule.rationale)
        lines.append(f"| {rule.rule_id} | `{rule.name}` | {weight} | {trigger} | {rationale} |")
    return "\n".join(lines) + "\n"


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def update_docs(path: str | Path, calibration: Calibration | None = None) -> None:
    """Rewrites the rule table (and, given ``calibration``, the report) between the markers of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--update-docs: no such file {path}")
    text = _replace_between(path.read_text(encoding="utf-8"), DOCS_START, DOCS_END, rules_markdown(), path)
    if calibration is not None:
        text = _replace_between(text, CALIBRATION_START, CALIBRATION_END, calibration_markdown(calibration), path)
    _write_atomic(path, text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PRM-Lite rule table and calibration report.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the rule table as markdown")
    group.add_argument("--calibration", action="store_true", help="build the corpus and print the report")
    group.add_argument(
        "--update-docs", metavar="PATH", help="rewrite the rule table and the calibration report between the markers"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(rules_markdown())
        return 0
    from airline_rl.rewards.prm.corpus import build_corpus
    from airline_rl.rewards.prm.stats import calibrate

    calibration = calibrate(build_corpus())
    if args.calibration:
        sys.stdout.write(calibration_markdown(calibration))
    else:
        update_docs(args.update_docs, calibration)
    return 0
