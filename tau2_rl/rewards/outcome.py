"""τ²-bench's outcome reward: the product of the terms each task's ``reward_basis`` names, with a breakdown.

reward = 0 unless the episode ended by the agent or the user (not the turn, error or token cap, not a simulator
failure); otherwise reward = the product, over the task's ``reward_basis`` (τ²'s default: DB and COMMUNICATE), of
- DB: the sha256 of the agent's final database equals the hash after replaying the task's gold actions on a fresh
  state (computed once per task and cached);
- COMMUNICATE: every ``communicate_info`` string occurs, case-insensitively, in some agent message to the user with
  that message's commas removed (τ²'s exact check);
- ACTION: every gold action is matched by some tool call of the trajectory (τ²'s ``ActionEvaluator``: the same name,
  equal values on its ``compare_args``; ``matches_gold``);
- NL_ASSERTION: every natural-language assertion met, as an LLM judges it (τ²'s ``NLAssertionsEvaluator``:
  ``tau2_rl.rewards.judge``); an empty assertion list is met without asking.
``ENV_ASSERTION`` (telecom's) is not computed yet: ``require_scorable`` refuses, before a run starts, the tasks that
need a term the run cannot compute (that one, or NL_ASSERTION without a judge), in one line naming the term and the
tasks; no reward is ever computed as if a term were met.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.data import GoldAction, Task
from tau2_rl.envs.state import CanonicalBase, EpisodeState

if TYPE_CHECKING:
    from tau2_rl.envs.episode import Episode, EpisodeRecord
    from tau2_rl.rewards.judge import NLCheck, NLJudge

TERMS = ("DB", "COMMUNICATE", "ACTION", "ENV_ASSERTION", "NL_ASSERTION")
"""τ²'s reward terms (``RewardType``)."""
NOT_COMPUTED = {"ENV_ASSERTION": "the environment assertions on the final state (a domain whose user holds tools): "
                "not computed by this project yet"}  # fmt: skip
"""Terms no run can compute yet, and why: a task that needs one is refused, never scored without it."""


class RewardTermError(ValueError):
    """Tasks whose reward needs a term this run cannot compute; the message names the term, the tasks and the
    flags."""


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
    """The reward and why; logging and evaluation read these fields instead of recomputing. The ACTION and
    NL_ASSERTION fields are set only for tasks whose basis names them (``to_dict`` leaves the others out)."""

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
    action_ok: bool | None = None
    action_checks: list[bool] | None = None
    """Per gold action: whether some tool call of the trajectory matches it (τ²'s ``ActionCheck.action_match``)."""
    nl_ok: bool | None = None
    nl_checks: list[dict[str, Any]] | None = None
    """The judge's verdicts (τ²'s ``NLAssertionCheck``: ``nl_assertion``, ``met``, ``justification``)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("action_ok", "action_checks", "nl_ok", "nl_checks"):
            if data[key] is None:
                del data[key]
        return data


def action_checks(task: Task, record: EpisodeRecord) -> list[bool]:
    """τ²'s ``ActionEvaluator``: per gold action, whether a tool call of the trajectory matches it (a block that did
    not parse is no tool call)."""
    calls = [call for call in record.tool_calls if call.error_kind != "parse"]
    return [any(matches_gold(action, call.name, call.arguments) for call in calls) for action in task.actions]


def needs_judge(task: Task) -> bool:
    """Whether the task's reward asks an LLM judge (NL_ASSERTION in its basis and assertions to judge)."""
    return "NL_ASSERTION" in task.reward_basis and bool(task.nl_assertions)


def compute_reward(episode: Episode, judge: NLJudge | None = None) -> RewardBreakdown:
    """Scores a finished episode with τ²'s rule: the product of the terms its task's basis names (module docstring).
    ``judge``: τ²'s NL-assertion judge, for tasks that need it (``require_scorable`` refused the run otherwise)."""
    from tau2_rl.envs.episode import REWARDABLE_TERMINATIONS, USER_ERROR

    record = episode.record
    task = episode.task
    basis = set(task.reward_basis)
    unscorable = basis & set(NOT_COMPUTED)
    if unscorable:
        raise RewardTermError(f"task {record.task_id}: its reward needs {', '.join(sorted(unscorable))}, which "
                              "this project does not compute yet")  # fmt: skip
    db_match = episode.state.db_hash() == gold_db_hash(episode.state.base, task)
    checks = communicate_checks(task, record.agent_messages())
    communicate_ok = all(checks.values())
    rewardable = record.termination in REWARDABLE_TERMINATIONS
    reward = 1.0 if rewardable else 0.0
    breakdown = RewardBreakdown(
        reward=0.0,
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
    if "DB" in basis:
        reward *= float(db_match)
    if "COMMUNICATE" in basis:
        reward *= float(communicate_ok)
    if "ACTION" in basis:
        breakdown.action_checks = action_checks(task, record)
        breakdown.action_ok = all(breakdown.action_checks)
        reward *= float(breakdown.action_ok)
    if "NL_ASSERTION" in basis:
        verdicts: Sequence[NLCheck] = []
        if needs_judge(task) and rewardable:  # τ² judges only a conversation that ended as it should
            if judge is None:
                raise RewardTermError(f"task {record.task_id}: its reward needs NL_ASSERTION, judged by an LLM: pass "
                                      "--judge_base_url and --judge_model")  # fmt: skip
            verdicts = judge.judge(record, task.nl_assertions)
        breakdown.nl_checks = [vars(check) for check in verdicts]
        breakdown.nl_ok = all(check.met for check in verdicts)
        reward *= float(breakdown.nl_ok)
    breakdown.reward = reward
    return breakdown


def outcome_reward(episode: Episode) -> dict[str, Any]:
    """``compute_reward`` without a judge, as the dict ``run_episodes`` stores in each record (its ``score``)."""
    return compute_reward(episode).to_dict()


class OutcomeReward:
    """The outcome reward with τ²'s NL-assertion judge: ``run_episodes`` asks ``prepare`` first, which sends every
    finished episode's judge request at once (``concurrency`` in flight, cached), then scores each episode."""

    def __init__(self, judge: NLJudge | None = None) -> None:
        self.judge = judge

    def prepare(self, episodes: Sequence[Episode]) -> None:
        from tau2_rl.envs.episode import REWARDABLE_TERMINATIONS
        from tau2_rl.rewards.judge import trajectory_text

        if self.judge is None:
            return
        items = [(trajectory_text(e.record), e.task.nl_assertions) for e in episodes
                 if needs_judge(e.task) and e.record.termination in REWARDABLE_TERMINATIONS]  # fmt: skip
        if items:
            self.judge.verdicts(items)  # cached: the scoring below asks nothing again

    def __call__(self, episode: Episode) -> dict[str, Any]:
        return compute_reward(episode, self.judge).to_dict()


def scorer(judge: NLJudge | None = None) -> Any:
    """The ``score`` a run hands ``run_episodes``: the plain outcome reward, or with a judge the batched one."""
    return outcome_reward if judge is None else OutcomeReward(judge)


def require_scorable(tasks: Mapping[str, Task], judge_available: bool) -> None:
    """Refuses, in one line, a run over tasks whose reward needs a term it cannot compute: a term nobody computes
    yet (``NOT_COMPUTED``), or NL_ASSERTION without a judge (naming the flags, and how many tasks need it).
    ``tasks``: the run's tasks by their keys."""
    unscorable = [key for key, task in tasks.items() if task.unscorable]
    if unscorable:
        first = tasks[unscorable[0]]
        raise RewardTermError(
            f"{len(unscorable)} of the {len(tasks)} tasks ({_some(unscorable)}) cannot be scored as their release "
            f"scores them (task {unscorable[0]}: {first.unscorable}); leave them out with --tasks"
        )
    for term, why in NOT_COMPUTED.items():
        needing = [key for key, task in tasks.items() if term in task.reward_basis]
        if needing:
            raise RewardTermError(
                f"{len(needing)} of the {len(tasks)} tasks ({_some(needing)}) need the reward term {term}: {why}; "
                "leave them out with --tasks"
            )
    if not judge_available:
        needing = [key for key, task in tasks.items() if needs_judge(task)]
        if needing:
            raise RewardTermError(
                f"{len(needing)} of the {len(tasks)} tasks ({_some(needing)}) need the reward term NL_ASSERTION, "
                "judged by an LLM as τ²'s evaluator judges it: pass --judge_base_url and --judge_model (an "
                "OpenAI-compatible endpoint), or leave them out with --tasks"
            )


def _some(keys: Sequence[str], shown: int = 8) -> str:
    return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")
