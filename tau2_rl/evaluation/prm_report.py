"""``python prm_report.py``: PRM-Lite's rule tables and its calibration, on the scripted corpus and on real agents'
conversations, as markdown (the command line behind docs/prm_lite.md's generated sections).

    python prm_report.py --trajectories results.json [more.json ...]      # τ² results files (tau2 run's format)
    python prm_report.py --trajectories chat.json --task_map map.json     # τ-bench v1's chat format
    python prm_report.py --update-docs docs/prm_lite.md                   # every generated section of the page

τ² results files go through the one reader of them (``tau2_rl.data.tau2_results``): the file's own domain and tasks
(another task set is refused in one line naming ``--task_set``), each conversation replayed with the task's initial
state and both sides' calls, observations and rewards checked, the label the re-scored reward. Files of several
agents on the same tasks are pooled: a per-task AUC compares a task's successes with its failures, so it needs tasks
that hold both; with none, the report refuses (exit 2) and names why, never prints a figure of nothing. The pooled AUC
(every success against every failure, across tasks) is printed beside it.

This module sits above ``rewards/`` (it reads domains, files and flags); ``tau2_rl.rewards.prm.report`` only turns
what it is handed into markdown.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tau2_rl.rewards.prm.conversations import ConversationFileError, ImportedConversation, ImportReport
from tau2_rl.rewards.prm.engine import PRM_RULE_SETS, TRAINING_RULE_SET
from tau2_rl.rewards.prm.report import (
    CALIBRATION_END,
    CALIBRATION_START,
    DOCS_END,
    DOCS_START,
    RESULTS_END,
    RESULTS_START,
    calibration_markdown,
    docs_calibration_markdown,
    real_markdown,
    results_table_markdown,
    update_docs,
)
from tau2_rl.rewards.prm.report import rules_markdown as _rules_markdown
from tau2_rl.rewards.prm.stats import Calibration, RealCalibration

TABLE_RULE_SETS = ("reference", "reference+v2", "v2", "v1")
"""The rule sets the per-domain table of real agents' τ² results compares, the training default first."""


class NothingToRank(ValueError):
    """Real conversations among which no task holds both a success and a failure: no per-task AUC exists."""


def domain_policies() -> dict[str, Any]:
    """Each domain of the registry (policy variants left out: theirs are their domain's) → its PRM-Lite policy
    checks (None: P9-P11 and B8 are off there)."""
    from tau2_rl.domains import DOMAINS, get_domain
    from tau2_rl.rewards.prm.vocabulary import vocabulary

    return {name: vocabulary(get_domain(name)).policy for name in DOMAINS if not get_domain(name).variant_of}


def rules_markdown() -> str:
    """The rule tables of docs/prm_lite.md, with every domain's P9 checks."""
    return _rules_markdown(domain_policies())


def domain_env(name: str | None, data_dir: str | None = None, task_set: str | None = None) -> Any:
    """The environment of ``--domain`` (the CLI default when not given) on ``--data_dir``'s or ``--task_set``'s task
    files (the domain's default ones when neither is given)."""
    from tau2_rl.domains import DEFAULT_DOMAIN, get_domain, task_files
    from tau2_rl.envs.episode import DomainEnv

    spec = get_domain(name or DEFAULT_DOMAIN)
    files = task_files([spec], data_dir, task_set)
    return DomainEnv(spec, files.get(spec.name) if isinstance(files, dict) else files)


# ------------------------------------------------------------------------------------------------ τ² results


def read_results_files(
    paths: Sequence[str | Path],
    domain: str | None = None,
    data_dir: str | None = None,
    task_set: str | None = None,
    judge: Any | None = None,
    err: Any = None,
) -> tuple[Any, ImportReport]:
    """Reads τ² results files of one domain and task set (``tau2_rl.data.tau2_results``) into PRM-Lite's import
    report, labelled by the re-scored reward; each file's summary and refused conversations go to ``err``. Returns
    (the environment they were replayed in, the report)."""
    from tau2_rl.data.tau2_results import ResultsFileError, read_results

    err = err if err is not None else sys.stderr
    read = []
    for path in paths:
        try:
            results = read_results(path, domain=domain, data_dir=data_dir, task_set=task_set, judge=judge,
                                   flag="--trajectories")  # fmt: skip
        except ResultsFileError as error:
            for refusal in error.refused:
                print(f"not replayed: {refusal.line(str(path))}", file=err)
            raise
        for refusal in results.refused:
            print(f"not replayed: {refusal.line(str(path))}", file=err)
        print(results.summary(), file=err)
        read.append(results)
        domain = results.domain
    return as_import_report(read)


def as_import_report(read: Sequence[Any]) -> tuple[Any, ImportReport]:
    """Read results files (``tau2_results.ResultsFile``, one domain and task set) as PRM-Lite's import report: each
    conversation that replayed, labelled by its re-scored reward; the refused ones listed as skipped."""
    from tau2_rl.data.tau2_results import ResultsFileError

    env = read[0].env
    report = ImportReport(path=", ".join(results.path for results in read))
    for results in read:
        if results.tasks_sha256 != env.domain.tasks_sha256 or results.domain != read[0].domain:
            raise ResultsFileError(f"{results.path}: another domain or task set than {read[0].path}'s: one report, "
                                   "one task set")  # fmt: skip
        report.skipped += [refusal.line(results.path) for refusal in results.refused]
        for replayed in results.replayed:
            report.conversations.append(
                ImportedConversation(index=replayed.index, source_task=replayed.task_id, task_id=replayed.task_id,
                                     trial=replayed.trial, reward=replayed.reward, record=replayed.record)
            )  # fmt: skip
    return env, report


def calibrate_imported(env: Any, imported: ImportReport, rules: str) -> RealCalibration:
    """PRM-Lite's real-set calibration of ``imported``; ``NothingToRank`` when no task holds both outcomes."""
    from tau2_rl.rewards.prm.stats import calibrate_real

    writes = {task_id: task.writes for task_id, task in env.domain.tasks.items()}
    calibration = calibrate_real(imported, writes, rules=rules, env=env)
    if not calibration.mixed_tasks:
        raise NothingToRank(
            f"no task holds both a success and a failure among the {calibration.n_conversations} conversations "
            f"({calibration.n_successes} successes on {calibration.n_tasks} tasks): a per-task AUC ranks a task's "
            "successes against its failures, so there is nothing to rank. Pass several agents' (or trials') "
            "conversations of the same tasks."
        )
    return calibration


def score_results(
    paths: Sequence[str], rules: str, domain: str | None, data_dir: str | None, task_set: str | None, judge: Any
) -> str:
    """The real-set report of τ² results files (``--trajectories`` in τ²'s format)."""
    env, imported = read_results_files(paths, domain, data_dir, task_set, judge)
    return real_markdown(calibrate_imported(env, imported, rules))


def results_rows(
    rule_sets: Sequence[str] = TABLE_RULE_SETS, read: Callable[..., tuple[Any, ImportReport]] | None = None
) -> list[tuple[str, str, dict[str, RealCalibration]]]:
    """The per-domain table's rows: each domain's real τ² results (``PrmTerms.real_results``) under every rule set.
    ``read(files, domain, task_set)``: how the files are read (default: replayed here, quietly)."""
    import io

    from tau2_rl.domains import DOMAINS, get_domain

    read = read or (lambda files, domain, task_set: read_results_files(files, domain, task_set=task_set,
                                                                       err=io.StringIO()))  # fmt: skip
    rows = []
    for name in DOMAINS:
        spec = get_domain(name)
        evidence = None if spec.variant_of else spec.prm_terms().real_results
        if evidence is None:
            continue
        files, task_set = evidence
        env, imported = read(files, name, task_set)
        agents = " + ".join(sorted({Path(f).name.split(f"_{name}_")[0] for f in files}))
        where = f"{agents} on {len({c.task_id for c in imported.conversations})} test tasks" + (
            f" (`--task_set {task_set}`)" if task_set else "")  # fmt: skip
        rows.append((name, where, {rules: calibrate_imported(env, imported, rules) for rules in rule_sets}))
    return rows


# ------------------------------------------------------------------------------------------------ τ-bench v1


def score_conversations(env: Any, trajectories: str, task_map: str, rules: str) -> str:
    """The real-set report of chat-format conversations (``--trajectories`` with ``--task_map``). A conversation
    that cannot be replayed refuses the file, with the count and the reasons on stderr: a figure over the rest would
    read as one over all of them."""
    from tau2_rl.rewards.prm.conversations import import_conversations

    imported = import_conversations(trajectories, task_map, env)
    for reason in imported.skipped:
        print(f"not replayed: {reason}", file=sys.stderr)
    if imported.skipped:
        total = len(imported.skipped) + len(imported.conversations)
        raise ConversationFileError(
            f"--trajectories {trajectories}: {len(imported.skipped)} of the {total} conversations could not be "
            "replayed (each named above): no figure is given; mend them or leave them out of the file"
        )
    return real_markdown(calibrate_imported(env, imported, rules))


def calibrate_all(env: Any) -> tuple[dict[str, Calibration], dict[str, RealCalibration]]:
    """Every rule set on ``env``'s scripted corpus and on the domain's chat-format real set (built and imported
    once)."""
    from tau2_rl.rewards.prm.conversations import import_conversations
    from tau2_rl.rewards.prm.corpus import build_corpus
    from tau2_rl.rewards.prm.stats import calibrate

    real = env.spec.prm_terms().real_set
    if real is None:
        raise ValueError(f"the {env.spec.name} domain has no real calibration set: pass --trajectories")
    corpus = build_corpus(env)
    imported = import_conversations(*real, env)
    return (
        {name: calibrate(corpus, rules=name, env=env) for name in PRM_RULE_SETS},
        {name: calibrate_imported(env, imported, name) for name in PRM_RULE_SETS},
    )


def write_docs(path: str) -> None:
    """Regenerates docs/prm_lite.md's rule tables, corpus and v1 calibration, and the per-domain table of real τ²
    results."""
    corpus, real = calibrate_all(domain_env(None))
    update_docs(path, {
        (DOCS_START, DOCS_END): rules_markdown(),
        (CALIBRATION_START, CALIBRATION_END): docs_calibration_markdown(corpus, real),
        (RESULTS_START, RESULTS_END): results_table_markdown(results_rows()),
    })  # fmt: skip


# ------------------------------------------------------------------------------------------------ command line


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prm_report.py", description="PRM-Lite's rule tables and calibration reports (docs/prm_lite.md)."
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--markdown", action="store_true", help="print the rule tables as markdown")
    group.add_argument("--calibration", action="store_true", help="build the scripted corpus and print its report")
    group.add_argument(
        "--update-docs", metavar="PATH", help="rewrite every generated section of PATH (docs/prm_lite.md)"
    )
    group.add_argument(
        "--trajectories",
        metavar="FILE",
        nargs="+",
        help="score real conversations and print their report: τ² results files (tau2 run's JSON; several agents' "
        "files of the same tasks are pooled), or one file of τ-bench v1's chat format with --task_map; the last line "
        "starts with the per-task AUC",
    )
    parser.add_argument("--task_map", metavar="FILE", help="chat format only: source task id -> τ² task id (JSON)")
    parser.add_argument(
        "--domain", default=None, help="the τ² domain (τ² results: the file's own, checked when given; else the "
        "CLI's default)"
    )  # fmt: skip
    parser.add_argument("--data_dir", default=None, help="the domain's task files, as evaluate.py's --data_dir")
    parser.add_argument("--task_set", default=None, help="another release of the task files, as evaluate.py's")
    parser.add_argument("--judge_base_url", default=None, help="τ²'s NL-assertion judge, for tasks that need one")
    parser.add_argument("--judge_model", default=None, help="the judge's model at --judge_base_url")
    parser.add_argument(
        "--prm_rules",
        choices=PRM_RULE_SETS,
        default=TRAINING_RULE_SET,
        help=f"rule set to score with (default {TRAINING_RULE_SET}, prm_lite's and joint's; reference and "
        "reference+v2 read the task's gold actions: training only)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tau2_rl.data.tau2_results import ResultsFileError, is_results_file
    from tau2_rl.envs.data import DomainDataError
    from tau2_rl.rewards.judge import judge_from_flags
    from tau2_rl.rewards.outcome import RewardTermError

    cli = parser()
    args = cli.parse_args(argv)
    if not (args.markdown or args.calibration or args.update_docs or args.trajectories):
        cli.error("one of --markdown, --calibration, --update-docs, --trajectories is required")
    if args.task_map and not args.trajectories:
        cli.error("--task_map goes with --trajectories")
    if args.markdown:
        sys.stdout.write(rules_markdown())
        return 0
    try:
        if args.trajectories:
            first = args.trajectories[0]
            if Path(first).is_file() and is_results_file(first):
                judge = judge_from_flags(args.judge_base_url, args.judge_model)
                if args.task_map:
                    cli.error("--task_map is for the chat format; a τ² results file names its own tasks")
                sys.stdout.write(score_results(args.trajectories, args.prm_rules, args.domain, args.data_dir,
                                               args.task_set, judge))  # fmt: skip
                return 0
            if len(args.trajectories) > 1:
                cli.error("--trajectories: the chat format takes one file (τ² results files may be several)")
            if not args.task_map:
                cli.error("--trajectories in the chat format needs --task_map FILE (source task id -> τ² task id)")
            env = domain_env(args.domain, args.data_dir, args.task_set)
            sys.stdout.write(score_conversations(env, first, args.task_map, args.prm_rules))
            return 0
        if args.calibration:
            from tau2_rl.rewards.prm.corpus import build_corpus
            from tau2_rl.rewards.prm.stats import calibrate

            env = domain_env(args.domain, args.data_dir, args.task_set)
            sys.stdout.write(calibration_markdown(calibrate(build_corpus(env), rules=args.prm_rules, env=env)))
            return 0
        write_docs(args.update_docs)
    except (ResultsFileError, ConversationFileError, NothingToRank, RewardTermError, DomainDataError,
            FileNotFoundError, ValueError) as err:  # fmt: skip
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
