"""Per-episode environment cost on the real 7 MB airline database: copy-on-write fast path vs a naive baseline.

One episode = reset + the task's gold actions run through ``execute_tool`` + the DB reward (agent hash == gold hash).

- fast: ``AirlineState`` over the shared ``CanonicalBase`` (reset copies nothing), reward = ``state.db_hash()`` vs the
  cached ``gold_db_hash``;
- naive: reset = validating the whole database into τ²'s pydantic models (as τ² does per environment), the same tool
  functions on it (``NaiveState``), reward =
  ``naive_db_hash`` of the agent's database vs ``naive_db_hash`` of a freshly replayed gold database (what τ²-bench
  does per evaluation).

Usage: ``python benchmarks/env_bench.py [--reps 20] [--naive-reps 1] [--tasks 50]``. Prints medians; the speed-up is
the last line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airline_rl.envs.data import Task, load_domain  # noqa: E402
from airline_rl.envs.episode import shared_base  # noqa: E402
from airline_rl.envs.models import FlightDB, dump  # noqa: E402
from airline_rl.envs.state import AirlineState, CanonicalBase, naive_db_hash  # noqa: E402
from airline_rl.envs.tools import execute_tool  # noqa: E402
from airline_rl.rewards.outcome import gold_db_hash  # noqa: E402

JsonDict = dict[str, Any]


class NaiveState:
    """τ²'s way: the whole database as pydantic models, validated afresh per episode, behind ``AirlineState``'s
    interface (get/model/insert/contains/values)."""

    def __init__(self, db: dict[str, dict[str, Any]]) -> None:
        self.models = FlightDB.model_validate(db)

    def get(self, table: str, key: str) -> JsonDict | None:
        record = getattr(self.models, table).get(key)
        return None if record is None else dump(record)

    def model(self, table: str, key: str) -> Any:
        return getattr(self.models, table)[key]

    def contains(self, table: str, key: str) -> bool:
        return key in getattr(self.models, table)

    def insert(self, table: str, key: str, record: Any) -> None:
        if key in getattr(self.models, table):
            raise KeyError(f"{table} already has a record {key!r}")
        getattr(self.models, table)[key] = record

    def values(self, table: str) -> Iterator[JsonDict]:
        return (dump(record) for record in getattr(self.models, table).values())

    @property
    def db(self) -> dict[str, Any]:
        return dump(self.models)


def run_actions(state: AirlineState | NaiveState, task: Task) -> None:
    for action in task.actions:
        # The tools only use the methods above, so a NaiveState runs them unchanged.
        execute_tool(cast(AirlineState, state), action.name, action.arguments)


def fast_episode(base: CanonicalBase, task: Task) -> tuple[bool, float, float]:
    """Returns (reward, seconds for the whole episode, seconds for reset + reward alone)."""
    t0 = time.perf_counter()
    state = AirlineState(base)
    t1 = time.perf_counter()
    run_actions(state, task)
    t2 = time.perf_counter()
    reward = state.db_hash() == gold_db_hash(base, task)
    t3 = time.perf_counter()
    return reward, t3 - t0, (t1 - t0) + (t3 - t2)


def naive_episode(db: dict[str, dict[str, Any]], task: Task) -> tuple[bool, float]:
    t0 = time.perf_counter()
    state = NaiveState(db)
    run_actions(state, task)
    gold = NaiveState(db)
    run_actions(gold, task)
    reward = naive_db_hash(state.db) == naive_db_hash(gold.db)
    return reward, time.perf_counter() - t0


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20, help="repetitions of all tasks on the fast path")
    parser.add_argument("--naive-reps", type=int, default=1, help="repetitions of all tasks on the naive path")
    parser.add_argument("--tasks", type=int, default=50, help="number of tasks (the first N)")
    args = parser.parse_args(argv)

    domain = load_domain()
    t0 = time.perf_counter()
    base = shared_base()
    build_s = time.perf_counter() - t0
    tasks = sorted(domain.tasks.values(), key=lambda t: int(t.task_id))[: args.tasks]

    # Correctness first: both paths agree on every gold episode (reward 1) and on the hash itself.
    t0 = time.perf_counter()
    for task in tasks:
        gold_db_hash(base, task)  # cached once per task, as in training
    gold_s = time.perf_counter() - t0
    for task in tasks[:5]:
        fast, naive = AirlineState(base), NaiveState(domain.db)
        run_actions(fast, task)
        run_actions(naive, task)
        assert fast.db_hash() == naive_db_hash(naive.db) == naive_db_hash(fast.materialize()), task.task_id

    # Warm-up.
    for task in tasks:
        fast_episode(base, task)
    naive_episode(domain.db, tasks[0])

    fast_total: list[float] = []
    fast_reset_reward: list[float] = []
    for _ in range(args.reps):
        for task in tasks:
            reward, total, reset_reward = fast_episode(base, task)
            assert reward, f"fast path: gold episode of task {task.task_id} should earn the DB reward"
            fast_total.append(total)
            fast_reset_reward.append(reset_reward)
    # A wrong agent database is new to the memo: its hash resumes from the checkpoint before the first changed record.
    fresh_hash: list[float] = []
    for rep in range(args.reps):
        for i, task in enumerate(tasks):
            state = AirlineState(base)
            run_actions(state, task)
            execute_tool(state, "send_certificate", {"user_id": "mia_li_3668", "amount": 1 + rep * len(tasks) + i})
            t0 = time.perf_counter()
            state.db_hash()
            fresh_hash.append(time.perf_counter() - t0)
    naive_total: list[float] = []
    for _ in range(args.naive_reps):
        for task in tasks:
            reward, total = naive_episode(domain.db, task)
            assert reward, f"naive path: gold episode of task {task.task_id} should earn the DB reward"
            naive_total.append(total)

    fast_ms, naive_ms = median_ms(fast_total), median_ms(naive_total)
    records = sum(len(t) for t in domain.db.values())
    p90_ms = statistics.quantiles(fast_total, n=10)[-1] * 1000
    print(f"database: {records} records; CanonicalBase build {build_s * 1000:.0f} ms (once per process)")
    print(f"gold hashes for {len(tasks)} tasks: {gold_s * 1000:.0f} ms (once per task, cached)")
    print(f"fast  episodes: {len(fast_total):5d}  median {fast_ms:9.3f} ms/episode  (p90 {p90_ms:.3f} ms)")
    print(f"naive episodes: {len(naive_total):5d}  median {naive_ms:9.3f} ms/episode")
    print(f"fast reward of a database not seen before (no memo hit): median {median_ms(fresh_hash):.3f} ms")
    print(f"fast reset+reward alone: median {median_ms(fast_reset_reward):.4f} ms (target <= 1 ms)")
    print(f"speed-up (naive / fast, per-episode medians): {naive_ms / fast_ms:.0f}x (target >= 100x)")


if __name__ == "__main__":
    main()
