"""Generates a domain's split file, ``tau2_rl/domains/<domain>/splits.json`` (committed; everything reads the file,
nothing re-derives it), by the domain's ``SplitRecipe`` (``DomainSpec.split_recipe``).

``tau2`` split: τ²'s official train / test split; ``covered``: ``recipe.covered`` tasks of the official train list.
``seed`` split (a recipe with ``seed_test``): ``seed_test`` tasks of the official test list as test, every other task
train, the same covered tasks. How the draws are made:
1. Every task is stratified by whether its gold actions write to the database ("write") or not ("read").
2. Test (``seed``): drawn from τ²'s official test list, with each stratum's share of the official test list
   (largest-remainder rounding), so both write and no-write tasks are represented.
3. Covered: drawn from τ²'s official *train* list, with each stratum's share of the train set (the ``seed`` split's
   when there is one). Drawing from the official train list keeps the covered set valid for the ``tau2`` split too.
4. Within a stratum the draw is the order of ``sha256("<order_salt>:<task id>")``: deterministic, and independent of
   file order.

Run: ``python -m tau2_rl.data.make_splits --domain <domain> [--check]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from tau2_rl.envs.data import Task, load_domain
from tau2_rl.envs.spec import DomainSpec


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


def _draw(pool: list[str], tasks: dict[str, Task], total: int, shares_from: list[str], salt: str) -> list[str]:
    shares: dict[str, int] = {}
    for task_id in shares_from:
        shares[_stratum(tasks[task_id])] = shares.get(_stratum(tasks[task_id]), 0) + 1
    counts = _allocate(total, shares)
    picked: list[str] = []
    for stratum, count in sorted(counts.items()):
        candidates = sorted(
            (t for t in pool if _stratum(tasks[t]) == stratum),
            key=lambda t: hashlib.sha256(f"{salt}:{t}".encode()).hexdigest(),
        )
        if len(candidates) < count:
            raise ValueError(f"stratum {stratum!r} has {len(candidates)} candidates, need {count}")
        picked.extend(candidates[:count])
    return _ordered(picked)


def _ordered(ids: list[str]) -> list[str]:
    return sorted(ids, key=lambda t: (int(t), t) if t.isdigit() else (10**9, t))


def build_splits(spec: DomainSpec) -> dict:
    """The split file of ``spec`` (see the module docstring)."""
    recipe = spec.split_recipe
    domain = load_domain(spec)
    tasks = domain.tasks
    official = domain.official_split  # a domain without τ²'s train / test lists (mock): every task train
    official_train = official.get("train", list(tasks) if "test" not in official else [])
    official_test = official.get("test", [])
    playable = [t for t in official_train if not tasks[t].unscorable]  # covered: the oracle plays them
    splits: dict[str, dict] = {}
    if recipe.seed_test is not None:
        seed_test = _draw(official_test, tasks, recipe.seed_test, official_test, recipe.order_salt)
        seed_train = _ordered([t for t in tasks if t not in seed_test])
        covered = _draw(playable, tasks, recipe.covered, seed_train, recipe.order_salt)
        splits["seed"] = {
            "description": f"{len(seed_train)} train ({len(covered)} covered) / {len(seed_test)} test drawn from "
            "tau2's official test list",
            "train": seed_train,
            "test": seed_test,
            "covered": covered,
        }
        same = ", same covered tasks"
    else:
        covered = _draw(playable, tasks, recipe.covered, official_train, recipe.order_salt)
        same = f" ({len(covered)} covered)"
    splits["tau2"] = {
        "description": f"tau2-bench's official {len(official_train)} train / {len(official_test)} test split{same}",
        "train": _ordered(official_train),
        "test": _ordered(official_test),
        "covered": covered,
    }
    return {
        "generated_by": f"python -m tau2_rl.data.make_splits --domain {spec.name}",
        "method": (
            "stratified by write / no-write gold actions; test drawn from tau2's official test list and covered from "
            f"its official train list, each stratum in proportion, ordered by sha256('{recipe.order_salt}:<id>')"
        ),
        "splits": splits,
    }


def main(argv: list[str] | None = None) -> None:
    from tau2_rl.domains import DEFAULT_DOMAIN, DOMAINS, get_domain

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", default=DEFAULT_DOMAIN, choices=list(DOMAINS), help="whose split file to make")
    parser.add_argument("--check", action="store_true", help="fail if the committed file differs from a fresh build")
    args = parser.parse_args(argv)
    spec = get_domain(args.domain)
    text = json.dumps(build_splits(spec), indent=2) + "\n"
    path = Path(spec.split_file())
    if args.check:
        if path.read_text() != text:
            sys.exit(f"{path} is out of date: run python -m tau2_rl.data.make_splits --domain {spec.name}")
        print(f"{path} is up to date")
        return
    path.write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
