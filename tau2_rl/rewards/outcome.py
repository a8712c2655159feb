"""τ²-bench's outcome reward (any domain whose reward basis is DB and COMMUNICATE), with a structured breakdown.

reward = 0 unless the episode ended by the agent or the user (not the turn, error or token cap, not a simulator
failure); otherwise reward = DB × COMMUNICATE where
- DB: the sha256 of the agent's final database equals the hash after replaying the task's gold actions on a fresh
  state (computed once per task and cached);
- COMMUNICATE: every ``communicate_info`` string occurs, case-insensitively, in some agent message to the user with
  that message's commas removed (τ²'s exact check).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.data import GoldAction, Task
from tau2_rl.envs.state import CanonicalBase, EpisodeState

if TYPE_CHECKING:
    from tau2_rl.envs.episode import Episode

_GOLD_HASHES: dict[tuple[int, str], str] = {}


def gold_state(base: CanonicalBase, task: Task) -> EpisodeState:
    """A fresh state with the task's gold actions replayed (τ² logs and skips a failing gold action)."""
    state = EpisodeState(base)
    for action in task.actions:
        base.spec.execute_tool(state, action.name, action.arguments)
    return state


def gold_db_hash(base: CanonicalBase, task: Task) -> str:
    """The expected final database hash of ``task``, cached per (base database, task)."""
    key = (id(base), task.task_id)
    if key not in _GOLD_HASHES:
        _GOLD_HASHES[key] = gold_state(base, task).db_hash()
    return _GOLD_HASHES[key]


def matches_gold(action: GoldAction, name: str, arguments: Mapping[str, Any] | None) -> bool:
    """τ²'s comparison of a tool call with a gold action (``Action.compare_with_tool_call``): the same name, and equal
    values on the action's ``compare_args`` (all of the call's own arguments when it names none)."""
    if name != action.name:
        return False
    arguments = arguments or {}
    keys = arguments.keys() if action.compare_args is None else action.compare_args
    return {k: arguments[k] for k in keys if k in arguments} == {
        k: action.arguments[k] for k in keys if k in action.arguments
    }


def communicate_checks(task: Task, agent_messages: list[str]) -> dict[str, bool]:
    """For each required info string: was it said to the user."""
    lowered = [message.lower().replace(",", "") for message in agent_messages]
    return {info: any(info.lower() in message for message in lowered) for info in task.communicate_info}


@dataclass
class RewardBreakdown:
    """The reward and why; logging and evaluation read these fields instead of recomputing."""

    reward: float
    db_match: bool
    communicate_ok: bool
    communicate_missing: list[str] = field(default_factory=list)
    termination: str | None = None
    rewardable_termination: bool = False
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_turns: int = 0
    user_error: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_reward(episode: Episode) -> RewardBreakdown:
    """Scores a finished episode with τ²'s rule (reward basis DB and COMMUNICATE)."""
    from tau2_rl.envs.episode import REWARDABLE_TERMINATIONS, USER_ERROR

    record = episode.record
    task = episode.task
    db_match = episode.state.db_hash() == gold_db_hash(episode.state.base, task)
    checks = communicate_checks(task, record.agent_messages())
    communicate_ok = all(checks.values())
    rewardable = record.termination in REWARDABLE_TERMINATIONS
    basis = set(task.reward_basis)
    reward = 1.0 if rewardable else 0.0
    if "DB" in basis:
        reward *= float(db_match)
    if "COMMUNICATE" in basis:
        reward *= float(communicate_ok)
    return RewardBreakdown(
        reward=reward,
        db_match=db_match,
        communicate_ok=communicate_ok,
        communicate_missing=[info for info, ok in checks.items() if not ok],
        termination=record.termination,
        rewardable_termination=rewardable,
        num_tool_calls=record.num_tool_calls,
        num_tool_errors=record.num_tool_errors,
        num_turns=len(record.turns),
        user_error=record.termination == USER_ERROR,
    )


def outcome_reward(episode: Episode) -> dict[str, Any]:
    """``compute_reward`` as the dict ``run_episodes`` stores in each record (its ``score``)."""
    return compute_reward(episode).to_dict()
