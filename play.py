"""Plays τ² tasks with a scripted agent and user, and prints each task's reward and the pass rate.

    python play.py --agent oracle --user scripted            # all 50 airline tasks; the oracle must pass every one
    python play.py --domain retail                           # all 114 retail tasks, the same check
    python play.py --domain airline,retail                   # both: 164 tasks keyed <domain>/<id>
    python play.py --agent noop --tasks 0,1,2 --data_dir DIR
    python play.py --domain retail --task_set 1.0.1 --judge_base_url URL --judge_model NAME   # NL_ASSERTION judged

The oracle/scripted pairing is the end-to-end check of tools, state, reward and simulator; it needs no GPU or network.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tau2_rl.domains import DEFAULT_DOMAIN, DOMAINS, UnknownDomainError, parse_domains, task_files
from tau2_rl.envs.agents import AGENTS, get_agent
from tau2_rl.envs.data import DomainDataError
from tau2_rl.envs.multi import run_env
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users.base import UserSimulator
from tau2_rl.envs.users.scripted import ScriptedUser
from tau2_rl.rewards.judge import JudgeError, judge_from_flags
from tau2_rl.rewards.outcome import TERM_FIELDS, RewardTermError, require_scorable, scorer
from tau2_rl.run.cli import one_line_argparse_errors

logger = logging.getLogger(__name__)

USERS: dict[str, type[UserSimulator]] = {"scripted": ScriptedUser}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", default="oracle", help=f"scripted agent: {', '.join(sorted(AGENTS))}")
    parser.add_argument("--user", default="scripted", help=f"user simulator: {', '.join(sorted(USERS))}")
    parser.add_argument("--tasks", default=None, help="comma-separated task ids (default: all tasks)")
    domains = ", ".join(DOMAINS)
    parser.add_argument("--domain", default=DEFAULT_DOMAIN, help=f"τ² domain(s), comma-separated: {domains}")
    parser.add_argument("--data_dir", default=None, help="directory with the domain's files (default: package)")
    parser.add_argument("--task_set", default=None, help="another release of the task files, e.g. 1.0.1 (README)")
    parser.add_argument("--judge_base_url", default=None, help="NL-assertion judge: an OpenAI-compatible endpoint")
    parser.add_argument("--judge_model", default=None, help="NL-assertion judge: the model name at the endpoint")
    parser.add_argument("--judge_cache_dir", default=None, help="NL-assertion judge: on-disk cache of its verdicts")
    parser.add_argument("--seed", type=int, default=0, help="episode seed (the scripted user's phrasing)")
    parser.add_argument("--max_user_turns", type=int, default=15, help="scripted user's turn cap")
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Plays the tasks; bad input (unknown agent, user or task id) exits with status 2 and a message naming it."""
    parser = one_line_argparse_errors(build_parser(), "play.py")
    args = parser.parse_args(argv)
    if args.agent not in AGENTS:
        parser.error(f"unknown agent {args.agent!r}; valid agents: {', '.join(sorted(AGENTS))}")
    if args.user not in USERS:
        parser.error(f"unknown user simulator {args.user!r}; valid users: {', '.join(sorted(USERS))}")
    if args.max_user_turns < 2:
        parser.error(f"--max_user_turns must be at least 2, got {args.max_user_turns}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:  # the task files and the judge as training and evaluation read them
        specs = parse_domains(args.domain)
        env = run_env(specs, task_files(specs, args.data_dir, args.task_set))
        judge = judge_from_flags(args.judge_base_url, args.judge_model, cache_dir=args.judge_cache_dir)
    except (DomainDataError, UnknownDomainError, ValueError) as err:
        parser.error(str(err))
    all_ids = env.task_keys
    if args.tasks is None:
        task_ids = all_ids
    else:
        task_ids = [t.strip() for t in args.tasks.split(",") if t.strip()]
        known = set(all_ids)
        unknown = [t for t in task_ids if t not in known]
        if unknown or not task_ids:
            parser.error(
                f"unknown task id(s) {unknown or args.tasks!r}; valid ids are {all_ids[0]}..{all_ids[-1]} "
                f"({len(all_ids)} tasks)"
            )
    try:  # a task whose reward needs a term this run cannot compute: refused before any episode is played
        require_scorable({key: env.task(key) for key in task_ids}, judge is not None)
    except RewardTermError as err:
        parser.error(str(err))
    agent = get_agent(args.agent)
    user = USERS[args.user](max_user_turns=args.max_user_turns)
    try:
        records = run_episodes(
            env,
            agent,
            user,
            [(task_id, args.seed) for task_id in task_ids],
            progress=not args.no_progress,
            score=scorer(judge),
        )
    except JudgeError as err:  # the judge kept failing: no pass rate with the term missing
        print(f"play.py: error: {err}", file=sys.stderr)
        return 1
    passed = 0
    for record in records:
        reward = record.reward or {}
        passed += reward.get("reward") == 1.0
        missing = reward.get("communicate_missing") or []
        basis = env.task(record.task_id).reward_basis  # the terms the task's reward counts, as τ² scores it
        terms = "  ".join(f"{field}={reward.get(field)!s:5}" for term, field in TERM_FIELDS.items() if term in basis)
        print(
            f"task {record.task_id:>3}  reward {reward.get('reward', 0.0):.0f}  {terms}  "
            f"termination={record.termination:<16}  turns={len(record.turns):>2}  "
            f"tool_calls={record.num_tool_calls:>2}  tool_errors={record.num_tool_errors}"
            + (f"  user_calls={len(record.user_tool_calls)}" if record.user_tool_calls else "")
            + (f"  missing={missing}" if missing else "")
        )
    print(f"pass rate ({args.agent} agent, {args.user} user): {passed}/{len(records)} = {passed / len(records):.1%}")
    domains = [member.spec.name for member in env.members]
    if len(domains) > 1:  # each domain's own count, as evaluate.py and training report them
        for name in domains:
            mine = [r for r in records if env.task(r.task_id).domain == name]
            won = sum((r.reward or {}).get("reward") == 1.0 for r in mine)
            print(f"  {name}: {won}/{len(mine)} = {won / len(mine):.1%}" if mine else f"  {name}: no task")
    return 0


if __name__ == "__main__":
    sys.exit(main())
