"""Generates ``tau2_rl/data/splits.json`` (committed; everything reads the file, nothing re-derives it).

``seed`` split (40 train / 10 test, 16 covered):
1. Every task is stratified by whether its gold actions write to the database ("write") or not ("read").
2. Test: 10 tasks drawn from τ²'s official test list, with each stratum's share of the official test list
   (largest-remainder rounding), so both write and no-write tasks are represented.
3. Covered: 16 tasks drawn from τ²'s official *train* list, with each stratum's share of the seed train set. Drawing
   from the official train list keeps the covered set (the teacher data set) valid for the ``tau2`` split too.
4. Within a stratum the draw is the order of ``sha256("airline-rl-splits:<task id>")``: deterministic, and
   independent of file order.
``tau2`` split: τ²'s official 30 train / 20 test, with the same 16 covered tasks.

Run: ``python -m tau2_rl.data.make_splits [--check]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from tau2_rl.envs.data import Task, load_domain
from tau2_rl.envs.splits import default_splits_path

SEED_TEST_SIZE = 10
COVERED_SIZE = 16


def _order(task_id: str) -> str:
    return hashlib.sha256(f"airline-rl-splits:{task_id}".encode()).hexdigest()


def _stratum(task: Task) -> str:
    return "write" if task.writes else "read"


def _allocate(total: int, shares: dict[str, int]) -> dict[str, int]:
    """Largest-remainder apportionment of ``total`` picks over strata with population ``shares``."""
    population = sum(shares.values())
    exact = {k: total * v / population for k, v in shares.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (-(exact[k] - counts[k]), k))[: total - sum(counts.values())]:
        counts[k] += 1
    return counts


def _draw(pool: list[str], tasks: dict[str, Task], total: int, shares_from: list[str]) -> list[str]:
    shares: dict[str, int] = {}
    for task_id in shares_from:
        shares[_stratum(tasks[task_id])] = shares.get(_stratum(tasks[task_id]), 0) + 1
    counts = _allocate(total, shares)
    picked: list[str] = []
    for stratum, count in sorted(counts.items()):
        candidates = sorted((t for t in pool if _stratum(tasks[t]) == stratum), key=_order)
        if len(candidates) < count:
            raise ValueError(f"stratum {stratum!r} has {len(candidates)} candidates, need {count}")
        picked.extend(candidates[:count])
    return sorted(picked, key=int)


def build_splits() -> dict:
    domain = load_domain()
    tasks = domain.tasks
    official_train, official_test = domain.official_split["train"], domain.official_split["test"]
    seed_test = _draw(official_test, tasks, SEED_TEST_SIZE, official_test)
    seed_train = sorted((t for t in tasks if t not in seed_test), key=int)
    covered = _draw(official_train, tasks, COVERED_SIZE, seed_train)
    by_int = lambda ids: sorted(ids, key=int)  # noqa: E731
    return {
        "generated_by": "python -m tau2_rl.data.make_splits",
        "method": (
            "stratified by write / no-write gold actions; test drawn from tau2's official test list and covered from "
            "its official train list, each stratum in proportion, ordered by sha256('airline-rl-splits:<id>')"
        ),
        "splits": {
            "seed": {
                "description": "40 train (16 covered) / 10 test drawn from tau2's official test list",
                "train": seed_train,
                "test": seed_test,
                "covered": covered,
            },
            "tau2": {
                "description": "tau2-bench's official 30 train / 20 test split, same covered tasks",
                "train": by_int(official_train),
                "test": by_int(official_test),
                "covered": covered,
            },
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed file differs from a fresh build")
    args = parser.parse_args()
    text = json.dumps(build_splits(), indent=2) + "\n"
    path: Path = default_splits_path()
    if args.check:
        if path.read_text() != text:
            sys.exit(f"{path} is out of date: run python -m tau2_rl.data.make_splits")
        print(f"{path} is up to date")
        return
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
