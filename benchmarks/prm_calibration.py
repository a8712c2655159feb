"""PRM-Lite calibration: every rule set on the scripted corpus and on real conversations, the acceptance numbers.

The corpus is every scripted behaviour (oracle, noop, farmers, placeholder calls, unconfirmed / corrupted / reordered
writes, partial oracles, premature transfer, rambler) on all 50 tasks against the scripted user, offline. The real set
is 100 GPT-4o conversations of τ-bench v1 airline tasks 0–24 (``tests/data/real_trajectories``), replayed through our
environment under their τ² tasks, labelled by the recorded reward. The reference sets (``reference``,
``reference+v2``) read the tasks' gold actions (training only). docs/prm_lite.md has the definitions and the full
reports (``python prm_report.py --update-docs docs/prm_lite.md`` regenerates them).

Usage: ``python benchmarks/prm_calibration.py [--domain airline] [--seed 0] [--tasks 0,1,2] [--rules]
[--trajectories F --task_map F]``.
The last line is the real-set per-task AUC of the default rule set.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tau2_rl.domains import DEFAULT_DOMAIN, DOMAINS, UnknownDomainError, get_domain  # noqa: E402
from tau2_rl.envs.episode import DomainEnv  # noqa: E402
from tau2_rl.rewards.prm.conversations import ConversationFileError, import_conversations  # noqa: E402
from tau2_rl.rewards.prm.corpus import build_corpus  # noqa: E402
from tau2_rl.rewards.prm.engine import PRM_RULE_SETS  # noqa: E402
from tau2_rl.rewards.prm.report import headline, real_headline  # noqa: E402
from tau2_rl.rewards.prm.rules import DEFAULT_RULE_SET, get_rule  # noqa: E402
from tau2_rl.rewards.prm.stats import calibrate, calibrate_real  # noqa: E402

ABLATED_RULES = ("P9", "P10", "P11", "B8")
"""The v2 rules written from the real set: the benchmark shows what each carries there."""
WEIGHT_SCALES = (0.0, 0.5, 2.0)
"""Each is scored with its weight times these: 0 shows what the rule carries, half and double how sensitive it is."""

ACCEPTANCE_ROWS = (
    "oracle strictly above every non-completing trajectory",
    "best farming (mean score of no-write trajectories over the write tasks)",
    "Spearman(process, progress) among failures of a task, mean",
    "AUC success vs failure, mean over tasks with both",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seed", type=int, default=0, help="episode seed of every corpus trajectory")
    parser.add_argument("--tasks", default=None, help="comma-separated corpus task ids (default: all)")
    parser.add_argument("--rules", action="store_true", help="also print each rule's fire rates")
    parser.add_argument("--domain", default=DEFAULT_DOMAIN, help=f"the τ² domain: {', '.join(DOMAINS)}")
    parser.add_argument("--trajectories", default=None, help="real conversations (JSON list; default: the domain's)")
    parser.add_argument("--task_map", default=None, help="source task id -> τ² task id (JSON; default: the domain's)")
    args = parser.parse_args(argv)
    try:
        spec = get_domain(args.domain)
    except UnknownDomainError as err:
        parser.error(f"--domain: {err}")
    if (args.trajectories is None) != (args.task_map is None):
        parser.error("--trajectories and --task_map go together")
    if args.trajectories is None:
        if spec.prm_terms().real_set is None:
            parser.error(f"the {spec.name} domain has no real calibration set: pass --trajectories and --task_map")
        args.trajectories, args.task_map = spec.prm_terms().real_set
    env = DomainEnv(spec)
    task_ids = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if task_ids:
        unknown = [t for t in task_ids if t not in env.domain.tasks]
        if unknown:
            parser.error(f"--tasks: unknown task id(s) {unknown}")
    try:
        imported = import_conversations(args.trajectories, args.task_map, env)
    except ConversationFileError as err:
        parser.error(str(err))
    start = time.perf_counter()
    corpus = build_corpus(env, task_ids, seed=args.seed)
    print(f"corpus: {len(corpus)} trajectories, built in {time.perf_counter() - start:.1f} s")
    print(
        f"real set: {len(imported.conversations)} conversations, {imported.tool_calls} tool calls replayed, "
        f"{imported.dropped_calls} think calls dropped, {len(imported.skipped)} not replayed"
    )
    for reason in imported.skipped:
        print(f"  not replayed: {reason}")
    writes = {task_id: task.writes for task_id, task in env.domain.tasks.items()}
    order = sorted(PRM_RULE_SETS, key=lambda name: name == DEFAULT_RULE_SET)  # the default last
    for name in order:
        calibration = calibrate(corpus, rules=name, env=env)
        print(f"[rules {name}] scripted corpus")
        for row, value in headline(calibration):
            if row in ACCEPTANCE_ROWS:
                print(f"  {row}: {value}")
        if args.rules:
            for rule_id, (good, bad, diff) in calibration.rule_rates.items():
                print(f"  {rule_id}: fires on {good:.0%} of successes, {bad:.0%} of failures ({diff:+.2f})")
    real = {name: calibrate_real(imported, writes, rules=name, env=env) for name in order}
    for name in order:
        cal = real[name]
        print(f"[rules {name}] real set")
        print(f"  successes minus failures, mean score within task: {cal.within_task_gap:+.3f}")
        print(f"  mean score of successes / failures: {cal.mean_success:+.3f} / {cal.mean_failure:+.3f}")
        print(f"  Spearman(score, reward): {cal.spearman:+.3f}; sign agreement {cal.sign_agreement:.0%}")
        if args.rules:
            for rule_id, (good, bad, _diff) in cal.rule_rates.items():
                corr = cal.rule_corr[rule_id]
                print(f"  {rule_id}: {good:.0%} of successes, {bad:.0%} of failures, within-task corr {corr:+.2f}")
        if name != DEFAULT_RULE_SET:
            print(f"  real-set per-task AUC: {real_headline(cal)}")
    print(f"[rules {DEFAULT_RULE_SET}] real set, one rule's weight scaled (at 0 the bonuses still skip the writes it "
          "judges)")  # fmt: skip
    for rule_id in ABLATED_RULES:
        base = get_rule(rule_id).weight
        for scale in WEIGHT_SCALES:
            weight = base * scale or 0.0  # no "-0.000"
            cal = calibrate_real(imported, writes, weights={rule_id: weight}, env=env)
            print(f"  {rule_id} at {weight:+.3f}: per-task AUC {cal.per_task_auc:.3f}, "
                  f"no-write {cal.no_write_auc:.3f}")  # fmt: skip
    print(f"real-set per-task AUC: {real_headline(real[DEFAULT_RULE_SET])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
