"""The labelled behaviour corpus PRM-Lite is calibrated on: scripted behaviours × all tasks, scripted user, offline.

Every trajectory carries two labels computed from the task's gold data (labels only: the rules never see them):

- ``reward``: τ²'s outcome reward (DB × COMMUNICATE, 0 unless the episode ended by the agent or the user);
- ``progress`` ∈ [0, 1]: how close the trajectory came to completing the task, the mean of
  - *writes*: LCS(successful write calls, gold writes) / max(#gold writes, #successful writes), calls compared by name
    and exact canonical arguments, in order (a wrong extra write, a wrong argument or a wrong order all cost); a task
    without gold writes scores 1 here when the trajectory wrote nothing and 0 otherwise;
  - *communicate* (only when the task has ``communicate_info``): the fraction of the required strings said (τ²'s
    check).

It is deterministic (fixed seeds, scripted user) and takes a few seconds to build.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tau2_rl.envs.behaviours import BEHAVIOURS, get_behaviour, partial_oracle, reordered_actions
from tau2_rl.envs.data import GoldAction, Task
from tau2_rl.envs.episode import DomainEnv, EpisodeRecord
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users.scripted import ScriptedUser
from tau2_rl.rewards.outcome import communicate_checks, outcome_reward

CORPUS_SEED = 0
WRITE_BEHAVIOURS = frozenset({"unconfirmed_write", "wrong_argument"})
"""Behaviours that only exist on tasks whose gold actions write (they corrupt a gold write)."""


@dataclass
class Trajectory:
    """One labelled corpus trajectory."""

    task_id: str
    behaviour: str
    record: EpisodeRecord
    reward: float
    progress: float
    task_writes: bool

    @property
    def success(self) -> bool:
        return self.reward >= 1.0

    @property
    def writes(self) -> bool:
        """Whether the trajectory made any successful write call."""
        return any(call.is_write and not call.error for call in self.record.tool_calls)

    @property
    def attempts_write(self) -> bool:
        """Whether the trajectory made any write call at all (successful or not)."""
        return any(call.is_write for call in self.record.tool_calls)


def _signature(name: str, arguments: object) -> str:
    return json.dumps([name, arguments], sort_keys=True, separators=(",", ":"), default=str)


def _replay(env: DomainEnv, actions: Sequence[GoldAction]) -> tuple[list[str], str]:
    """Signatures of the writes that succeed when ``actions`` are replayed on a fresh state, and the final hash."""
    state = env.base.new_state()
    writes = []
    write_tools = env.spec.write_tools()
    for action in actions:
        result = env.spec.execute_tool(state, action.name, action.arguments)
        if action.name in write_tools and not result.error:
            writes.append(_signature(action.name, action.arguments))
    return writes, state.db_hash()


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        previous = 0
        for j, y in enumerate(b, start=1):
            previous, row[j] = row[j], previous + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def progress(env: DomainEnv, task: Task, record: EpisodeRecord) -> float:
    """The progress label of ``record`` on ``task`` (see the module docstring)."""
    gold, _ = _replay(env, task.actions)
    done = [_signature(c.name, c.arguments) for c in record.tool_calls if c.is_write and not c.error]
    if gold:
        components = [_lcs(done, gold) / max(len(gold), len(done))]
    else:
        components = [0.0 if done else 1.0]
    if task.communicate_info:
        checks = communicate_checks(task, record.agent_messages())
        components.append(sum(checks.values()) / len(checks))
    return sum(components) / len(components)


def order_matters(env: DomainEnv, task: Task) -> bool:
    """Whether playing the task's writes in reverse order ends in another database than the gold order."""
    if sum(action.name in task.write_tools for action in task.actions) < 2:
        return False
    return _replay(env, reordered_actions(task))[1] != _replay(env, task.actions)[1]


def applicable(env: DomainEnv, task: Task, behaviour: str) -> bool:
    """Whether ``behaviour`` is defined on ``task`` (a corrupted write needs a write, a wrong order two writes)."""
    if behaviour in WRITE_BEHAVIOURS:
        return task.writes
    if behaviour == "wrong_order":
        return order_matters(env, task)
    return True


def build_corpus(
    env: DomainEnv | None = None, task_ids: Sequence[str] | None = None, seed: int = CORPUS_SEED
) -> list[Trajectory]:
    """Plays every applicable behaviour (and the partial oracle for every k < n) on every task; labels each."""
    env = env or DomainEnv()
    user = ScriptedUser()
    tasks = [env.domain.get_task(t) for t in (task_ids if task_ids is not None else list(env.domain.tasks))]
    runs: list[tuple[str, object, list[Task]]] = [
        (name, get_behaviour(name), [t for t in tasks if applicable(env, t, name)]) for name in BEHAVIOURS
    ]
    longest = max((len(t.actions) for t in tasks), default=0)
    for k in range(longest):
        runs.append(("partial_oracle", partial_oracle(k), [t for t in tasks if len(t.actions) > k]))
    corpus = []
    for name, agent, selected in runs:
        if not selected:
            continue
        records = run_episodes(env, agent, user, [(t.task_id, seed) for t in selected], score=outcome_reward)  # type: ignore[arg-type]
        for task, record in zip(selected, records, strict=True):
            corpus.append(
                Trajectory(
                    task_id=task.task_id,
                    behaviour=name,
                    record=record,
                    reward=float((record.reward or {}).get("reward", 0.0)),
                    progress=progress(env, task, record),
                    task_writes=task.writes,
                )
            )
    return corpus
