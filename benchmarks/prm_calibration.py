"""PRM-Lite calibration: build the labelled behaviour corpus, score it, print the report's headline numbers.

The corpus is every scripted behaviour (oracle, noop, farmers, placeholder calls, unconfirmed / corrupted / reordered
writes, partial oracles, premature transfer, rambler) on all 50 tasks against the scripted user, offline; see
docs/prm_lite.md for the definitions and the full report (``python -m airline_rl.rewards.prm_lite --update-docs
docs/prm_lite.md`` regenerates it).

Usage: ``python benchmarks/prm_calibration.py [--seed 0] [--tasks 0,1,2] [--rules]``. The pooled AUC is the last line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airline_rl.envs.episode import AirlineEnv  # noqa: E402
from airline_rl.rewards.prm.corpus import build_corpus  # noqa: E402
from airline_rl.rewards.prm.report import headline  # noqa: E402
from airline_rl.rewards.prm.stats import calibrate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seed", type=int, default=0, help="episode seed of every corpus trajectory")
    parser.add_argument("--tasks", default=None, help="comma-separated task ids (default: all)")
    parser.add_argument("--rules", action="store_true", help="also print each rule's fire rates")
    args = parser.parse_args(argv)
    env = AirlineEnv()
    task_ids = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if task_ids:
        unknown = [t for t in task_ids if t not in env.domain.tasks]
        if unknown:
            parser.error(f"--tasks: unknown task id(s) {unknown}")
    start = time.perf_counter()
    corpus = build_corpus(env, task_ids, seed=args.seed)
    built = time.perf_counter() - start
    calibration = calibrate(corpus)
    scored = time.perf_counter() - start - built
    print(f"corpus: {len(corpus)} trajectories, built in {built:.1f} s, scored in {scored:.1f} s")
    if args.rules:
        for rule_id, (good, bad, diff) in calibration.rule_rates.items():
            oracle = calibration.penalty_on_oracle.get(rule_id)
            extra = f", on oracle {oracle:.0%}" if oracle is not None else ""
            print(f"  {rule_id}: fires on {good:.0%} of successes, {bad:.0%} of failures ({diff:+.2f}){extra}")
    for name, value in headline(calibration):
        print(f"{name}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
