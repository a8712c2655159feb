"""Per-episode environment cost on the real 7 MB airline database: copy-on-write fast path vs a naive baseline.

One episode = reset + the task's gold actions run through ``execute_tool`` + the DB reward (agent hash == gold hash).

- fast: ``EpisodeState`` over the shared ``CanonicalBase`` (reset copies nothing), reward = ``state.db_hash()`` vs the
  cached ``gold_db_hash``;
- naive: reset = validating the whole database into τ²'s pydantic models (as τ² does per environment), the same tool
  functions on it (``NaiveState``), reward =
  ``naive_db_hash`` of the agent's database vs ``naive_db_hash`` of a freshly replayed gold database (what τ²-bench
  does per evaluation).

Usage: ``python benchmarks/env_bench.py [--reps 20] [--naive-reps 1] [--tasks 50]``. Prints medians; the speed-up is
the last line.

``--domain telecom``: an episode in τ²'s own environment on copies of the databases against τ²'s harness per
episode (``telecom_bench``). ``--domain retail`` measures τ²'s retail domain the same way (the 114 tasks' gold
actions; 1,000 orders, 500 users,
50 products): fast = the episode's copy-on-write state under τ²'s own ``RetailTools`` (``tau2_rl.domains``), naive
= τ²'s own environment per episode as τ²'s harness builds it (its RetailDB read and validated from db.json, the
gold replay on a second one, ``get_db_hash`` on both). ``--run DIR`` (a training run's output directory, e.g. the
retail quick start's ``outputs/grpo-cpu-smoke-retail``) adds the share of that run's step time the environment, the
scripted user and the reward took (the trainer's ``timing/env_user_reward_share``, median over its logged steps).
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

from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.domains.airline.models import FlightDB  # noqa: E402
from tau2_rl.domains.airline.tools import execute_tool  # noqa: E402
from tau2_rl.envs.data import Task, load_domain  # noqa: E402
from tau2_rl.envs.episode import shared_base  # noqa: E402
from tau2_rl.envs.state import (  # noqa: E402
    CanonicalBase,
    EpisodeState,
    dump,
    naive_db_hash,
)
from tau2_rl.rewards.outcome import gold_db_hash  # noqa: E402

AIRLINE = get_domain("airline")

JsonDict = dict[str, Any]


class NaiveState:
    """τ²'s way: the whole database as pydantic models, validated afresh per episode, behind ``EpisodeState``'s
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


def run_actions(state: EpisodeState | NaiveState, task: Task, execute: Any = execute_tool) -> None:
    for action in task.actions:
        # The tools only use the methods above, so a NaiveState runs them unchanged.
        execute(cast(EpisodeState, state), action.name, action.arguments)


def fast_episode(base: CanonicalBase, task: Task, execute: Any = execute_tool) -> tuple[bool, float, float]:
    """Returns (reward, seconds for the whole episode, seconds for reset + reward alone); ``execute``: the domain's
    tools (the airline's by default)."""
    t0 = time.perf_counter()
    state = EpisodeState(base)
    t1 = time.perf_counter()
    run_actions(state, task, execute)
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
    parser.add_argument("--tasks", type=int, default=None, help="number of tasks (the first N; default: all)")
    parser.add_argument("--domain", default="airline", choices=("airline", "retail", "telecom"), help="τ² domain")
    parser.add_argument("--run", default=None, help="a training run's output_dir: its environment share of a step")
    args = parser.parse_args(argv)
    if args.domain != "airline":
        (telecom_bench if args.domain == "telecom" else retail_bench)(args)
        if args.run:
            print(run_share(args.run))
        return
    args.tasks = args.tasks or 50

    domain = load_domain(AIRLINE)
    t0 = time.perf_counter()
    base = shared_base(AIRLINE)
    build_s = time.perf_counter() - t0
    tasks = sorted(domain.tasks.values(), key=lambda t: int(t.task_id))[: args.tasks]

    # Correctness first: both paths agree on every gold episode (reward 1) and on the hash itself.
    t0 = time.perf_counter()
    for task in tasks:
        gold_db_hash(base, task)  # cached once per task, as in training
    gold_s = time.perf_counter() - t0
    for task in tasks[:5]:
        fast, naive = EpisodeState(base), NaiveState(domain.db)
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
            state = EpisodeState(base)
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
    print(f"database: {records} records; CanonicalBase build {build_s * 1000:.0f} ms (once per process)")
    print_episodes(len(tasks), gold_s, fast_total, naive_total, "")
    print(f"fast reward of a database not seen before (no memo hit): median {median_ms(fresh_hash):.3f} ms")
    print(f"fast reset+reward alone: median {median_ms(fast_reset_reward):.4f} ms (target <= 1 ms)")
    print(f"speed-up (naive / fast, per-episode medians): {naive_ms / fast_ms:.0f}x (target >= 100x)")


def print_episodes(tasks: int, gold_s: float, fast_total: list[float], naive_total: list[float], naive: str) -> None:
    """The lines every domain's report shares: gold hashes, fast and naive episodes (``naive``: what it is)."""
    p90_ms = statistics.quantiles(fast_total, n=10)[-1] * 1000
    fast_ms = median_ms(fast_total)
    print(f"gold hashes for {tasks} tasks: {gold_s * 1000:.0f} ms (once per task, cached)")
    print(f"fast  episodes: {len(fast_total):5d}  median {fast_ms:9.3f} ms/episode  (p90 {p90_ms:.3f} ms)")
    print(f"naive episodes: {len(naive_total):5d}  median {median_ms(naive_total):9.3f} ms/episode{naive}")


def retail_bench(args: argparse.Namespace) -> None:
    """The retail domain: our copy-on-write state under τ²'s tools against τ²'s own environment per episode."""
    import json
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from tau2_rl.envs.protocol import tau2_reference

    tau2_reference()  # τ²'s loggers quiet (its environment logs every response at DEBUG)
    from tau2.data_model.message import ToolCall
    from tau2.domains.retail.data_model import RetailDB
    from tau2.domains.retail.environment import get_environment
    from tau2.domains.retail.utils import RETAIL_DB_PATH

    spec = get_domain(args.domain)
    domain_tool = spec.execute_tool
    domain = load_domain(spec)
    t0 = time.perf_counter()
    base = shared_base(spec)
    build_s = time.perf_counter() - t0
    tasks = sorted(domain.tasks.values(), key=lambda t: int(t.task_id))[: args.tasks]
    t0 = time.perf_counter()
    for task in tasks:
        gold_db_hash(base, task)
    gold_s = time.perf_counter() - t0

    def replay(task: Task) -> str:
        env = get_environment(db=RetailDB.load(RETAIL_DB_PATH))  # what τ²'s registry builds per simulation
        for action in task.actions:
            env.get_response(ToolCall(id="c", name=action.name, arguments=json.loads(json.dumps(action.arguments)),
                                      requestor="assistant"))  # fmt: skip
        return env.get_db_hash()

    def naive(task: Task) -> tuple[bool, float]:
        t0 = time.perf_counter()
        reward = replay(task) == replay(task)  # the agent's database, then the gold replay's (τ²'s evaluator)
        return reward, time.perf_counter() - t0

    for task in tasks[:5]:  # the same database hash both ways
        state = EpisodeState(base)
        run_actions(state, task, domain_tool)
        assert state.db_hash() == replay(task), task.task_id
    for task in tasks:
        fast_episode(base, task, domain_tool)
    fast_total: list[float] = []
    fast_reset_reward: list[float] = []
    for _ in range(args.reps):
        for task in tasks:
            reward, total, reset_reward = fast_episode(base, task, domain_tool)
            assert reward, f"fast path: gold episode of task {task.task_id} should earn the DB reward"
            fast_total.append(total)
            fast_reset_reward.append(reset_reward)
    naive_total = [naive(task)[1] for _ in range(args.naive_reps) for task in tasks]
    fast_ms, naive_ms = median_ms(fast_total), median_ms(naive_total)
    records = sum(len(t) for t in domain.db.values())
    print(f"retail database: {records} records; CanonicalBase build {build_s * 1000:.0f} ms (once per process)")
    print_episodes(len(tasks), gold_s, fast_total, naive_total, "  (τ²'s environment, twice)")
    print(f"fast reset+reward alone: median {median_ms(fast_reset_reward):.4f} ms")
    print(f"speed-up (naive / fast, per-episode medians): {naive_ms / fast_ms:.0f}x")


def telecom_bench(args: argparse.Namespace) -> None:
    """Telecom: an episode in τ²'s own environment, copy-on-write (``tau2_rl.envs.world``: reset onto the task's
    shared initialized state, the first write copying it, both sides' gold actions with ``sync_tools`` after each,
    the assertions on the live final state) against τ²'s harness per episode (``get_environment`` reading its TOML
    files, ``set_state``, the same calls through ``get_response``, then its evaluator: two more environments, the
    strict replay of the conversation, the gold replay, the assertions), and against the same episode on a state of
    its own from reset."""
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from tau2_rl.envs.protocol import tau2_reference

    tau2_reference()
    from tau2.data_model.message import AssistantMessage, ToolCall, UserMessage
    from tau2.data_model.simulation import SimulationRun
    from tau2.data_model.tasks import Task as Tau2Task
    from tau2.domains.telecom.environment import get_environment
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    from tau2_rl.envs.world import Snapshot, World
    from tau2_rl.rewards.outcome import env_check

    spec = get_domain("telecom")
    domain = load_domain(spec)
    t0 = time.perf_counter()
    base = shared_base(spec)
    build_s = time.perf_counter() - t0
    tasks = list(domain.tasks.values())[: args.tasks]

    def played(task: Task, world: Any, t0: float) -> tuple[bool, float, float]:
        """The task's gold calls of both sides on ``world`` (set up since ``t0``), then its assertions: whether they
        hold, the episode's time and its reset + reward part."""
        t1 = time.perf_counter()
        for action in task.actions:
            world.call(action.requestor, action.name, action.arguments)
        t2 = time.perf_counter()
        met = all(env_check(world, check)["met"] for check in task.env_assertions)
        t3 = time.perf_counter()
        return met, t3 - t0, (t1 - t0) + (t3 - t2)

    def ours(task: Task) -> tuple[bool, float, float]:
        t0 = time.perf_counter()
        world = base.new_state()
        world.initialize(task)
        return played(task, world, t0)

    def copied(task: Task) -> tuple[bool, float, float]:
        """The same episode on a state of its own from the start (the initialization run for each episode on fresh
        copies of the databases: what copy-on-write saves)."""
        t0 = time.perf_counter()
        env = base.environment()
        state = base.tau2_task(task).initial_state
        env.set_state(state.initialization_data, state.initialization_actions, state.message_history or [])
        env.sync_tools()
        return played(task, World(base, Snapshot(env), own=True), t0)

    def theirs(task: Task) -> tuple[bool, float]:
        t0 = time.perf_counter()
        model = Tau2Task.model_validate(task.raw)
        env = get_environment()
        state = model.initial_state
        env.set_state(state.initialization_data, state.initialization_actions, [])
        messages: list[Any] = []
        for k, action in enumerate(task.actions):
            call = ToolCall(id=f"c{k}", name=action.name, arguments=dict(action.arguments), requestor=action.requestor)
            if action.requestor == "assistant":
                messages.append(AssistantMessage(role="assistant", tool_calls=[call]))
            else:
                messages.append(UserMessage(role="user", tool_calls=[call]))
            messages.append(env.get_response(call))
        run = SimulationRun(id="bench", task_id=task.task_id, start_time="", end_time="", duration=0.0,
                            termination_reason="user_stop", messages=messages)  # fmt: skip
        info = evaluate_simulation(run, model, EvaluationType.ALL, False, "telecom")
        return all(check.met for check in info.env_assertions or []), time.perf_counter() - t0

    for task in tasks:  # the same assertion outcomes both ways, gold played by the side that holds each tool
        assert ours(task)[0] == theirs(task)[0] == copied(task)[0], task.task_id
    fast_total: list[float] = []
    fast_reset_reward: list[float] = []
    copy_total: list[float] = []
    copy_reset_reward: list[float] = []
    for _ in range(args.reps):
        for task in tasks:
            met, total, reset_reward = ours(task)
            fast_total.append(total)
            fast_reset_reward.append(reset_reward)
            met, total, reset_reward = copied(task)
            copy_total.append(total)
            copy_reset_reward.append(reset_reward)
    naive_total = [theirs(task)[1] for _ in range(args.naive_reps) for task in tasks]
    fast_ms, naive_ms = median_ms(fast_total), median_ms(naive_total)
    print(f"telecom: {len(tasks)} tasks; WorldBase build {build_s * 1000:.0f} ms (once per process)")
    print(f"ours  episodes: {len(fast_total):5d}  median {fast_ms:9.3f} ms/episode  (reset + gold calls + assertions)")
    print(f"τ²'s  episodes: {len(naive_total):5d}  median {naive_ms:9.3f} ms/episode  (its environment, calls, "
          "evaluator)")  # fmt: skip
    print(f"ours reset+reward alone: median {median_ms(fast_reset_reward):.4f} ms")
    copy_ms, copy_reset_ms = median_ms(copy_total), median_ms(copy_reset_reward)
    print(
        f"a state of its own from reset (no copy-on-write): median {copy_ms:.3f} ms/episode, reset+reward alone "
        f"{copy_reset_ms:.4f} ms; copy-on-write: {copy_ms / fast_ms:.2f}x per episode of gold writes, "
        f"{copy_reset_ms / median_ms(fast_reset_reward):.1f}x on reset+reward"
    )
    print(f"speed-up (τ²'s / ours, per-episode medians): {naive_ms / fast_ms:.1f}x")


def run_share(run_dir: str) -> str:
    """The median share of a training run's step time spent in the environment, the user and the reward."""
    import json

    root = Path(run_dir)
    states = sorted(root.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    path = root / "trainer_state.json" if (root / "trainer_state.json").is_file() else (states or [None])[-1]
    if path is None:
        raise SystemExit(f"--run {run_dir}: no trainer_state.json (in it or in a checkpoint-* of it)")
    logs = json.loads(path.read_text(encoding="utf-8")).get("log_history", [])
    shares = [e["timing/env_user_reward_share"] for e in logs if "timing/env_user_reward_share" in e]
    steps = [e["step_time"] for e in logs if "step_time" in e]
    if not shares:
        raise SystemExit(f"--run {run_dir}: {path} logs no timing/env_user_reward_share")
    return (f"run {run_dir}: environment + user + reward {statistics.median(shares) * 100:.2f}% of a step (median "
            f"over {len(shares)} steps; step {statistics.median(steps):.2f} s; goal <= 5%)")  # fmt: skip


if __name__ == "__main__":
    main()
