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
- ENV_ASSERTION: every environment assertion of the task holds on the final state (τ²'s ``run_env_assertion``: its
  function's boolean equals ``assert_value``), for a domain that runs in τ²'s own Environment (``tau2_rl.envs.world``).
A task that names neither gold actions nor assertions (null, not empty) has DB and ENV_ASSERTION met without a look,
as τ²'s ``EnvironmentEvaluator`` returns early. ``require_scorable`` refuses, before a run starts, the tasks whose
reward needs a term the run cannot compute (ENV_ASSERTION in a domain on the copy-on-write state, a feature of the
task the loop does not run, NL_ASSERTION without a judge: ``Task.unscorable``), in one line naming the term and the
tasks; no reward is ever computed as if a term were met. An assertion whose function raises (τ²'s evaluator then
aborts the run) is recorded as not met, with the error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.data import EnvCall, GoldAction, Task

if TYPE_CHECKING:
    from tau2_rl.envs.episode import Base, Episode, EpisodeRecord
    from tau2_rl.rewards.judge import NLCheck, NLJudge

TERMS = ("DB", "COMMUNICATE", "ACTION", "ENV_ASSERTION", "NL_ASSERTION")
"""τ²'s reward terms (``RewardType``)."""
TERM_FIELDS = {"DB": "db_match", "COMMUNICATE": "communicate_ok", "ACTION": "action_ok", "ENV_ASSERTION": "env_ok",
               "NL_ASSERTION": "nl_ok"}  # fmt: skip
"""Each term → the ``RewardBreakdown`` field saying whether an episode met it."""


class RewardTermError(ValueError):
    """Tasks whose reward needs a term this run cannot compute; the message names the term, the tasks and the
    flags."""


_GOLD_HASHES: dict[tuple[int, str], str] = {}


def gold_state(base: Base, task: Task) -> Any:
    """A fresh state with the task's gold actions replayed (τ² logs and skips a failing gold action)."""
    return base.gold_state(task)


def gold_db_hash(base: Base, task: Task) -> str:
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
    env_ok: bool | None = None
    env_checks: list[dict[str, Any]] | None = None
    """Per environment assertion: τ²'s ``EnvAssertion`` fields and ``met`` (``error``: its function raised)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("action_ok", "action_checks", "nl_ok", "nl_checks", "env_ok", "env_checks"):
            if data[key] is None:
                del data[key]
        return data


def action_checks(task: Task, record: EpisodeRecord) -> list[bool]:
    """τ²'s ``ActionEvaluator``: per gold action, whether a tool call of the trajectory matches it, the agent's or
    the user's (τ² compares neither the requestor nor the order; a block that did not parse is no tool call)."""
    calls = [(call.name, call.arguments) for call in [*record.tool_calls, *record.user_tool_calls]
             if call.error_kind != "parse"]  # fmt: skip
    calls += record.history_calls()  # τ²'s trajectory begins with the task's history
    return [any(matches_gold(action, name, arguments) for name, arguments in calls) for action in task.actions]


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
    if task.unscorable:
        raise RewardTermError(f"task {record.task_id}: {task.unscorable}")
    # τ²'s environment evaluator returns early for a task naming neither gold actions nor assertions
    db_match = not task.checks_environment or episode.state.db_hash() == gold_db_hash(episode.state.base, task)
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
    to_assert = bool(task.env_assertions and task.checks_environment and rewardable)
    if to_assert and hasattr(episode.state, "assertion"):  # run where they can be, in the basis or not (τ² does)
        breakdown.env_checks = [env_check(episode.state, check) for check in task.env_assertions]
        breakdown.env_ok = all(check["met"] for check in breakdown.env_checks)
    if "ENV_ASSERTION" in basis:
        if to_assert and breakdown.env_ok is None:  # never met for want of a state that runs them
            raise RewardTermError(f"task {record.task_id}: its ENV_ASSERTION term cannot run on this domain's state")
        if breakdown.env_ok is None and rewardable:  # no assertion to run: τ²'s term is met
            breakdown.env_ok, breakdown.env_checks = True, []
        reward *= float(bool(breakdown.env_ok))
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


class _UnjudgedAssertions:
    """Stands in for the judge where no conversation is judged: every assertion counts as met."""

    @staticmethod
    def judge(record: EpisodeRecord, assertions: Sequence[str]) -> list[NLCheck]:
        from tau2_rl.rewards.judge import NLCheck

        return [NLCheck(assertion, True, "not judged") for assertion in assertions]


def empty_conversation_passes(task: Task, base: Base) -> bool:
    """What τ²'s reward gives the conversation in which the agent does nothing and says nothing (the noop floor):
    every term of the task's basis, computed as for any episode on the task's initial state (its initialization and
    message history included) with no call and no word of the agent's. A write whose gold leaves the database as it
    was meets DB (retail task 12); assertions that already hold meet ENV_ASSERTION (telecom's transfer tasks, whose
    ACTION then fails). NL_ASSERTION, which only an LLM judges, counts as met: on such tasks the floor is an upper
    bound."""
    from tau2_rl.envs.episode import USER_STOP, EnvConfig, Episode

    episode = Episode(task, base, "", 0, EnvConfig())
    episode.finish(USER_STOP)
    return compute_reward(episode, _UnjudgedAssertions()).reward == 1.0  # type: ignore[arg-type]


def env_check(state: Any, check: EnvCall) -> dict[str, Any]:
    """One environment assertion on the episode's final τ² environment, as τ²'s ``EnvAssertionCheck`` records it."""
    entry: dict[str, Any] = {"env_type": check.env_type, "func_name": check.func_name, "arguments": check.arguments,
                             "assert_value": check.assert_value, "message": check.message or None}  # fmt: skip
    try:
        entry["met"] = state.assertion(check)
    except Exception as err:  # noqa: BLE001 (τ²'s evaluator would abort the whole run here)
        entry["met"], entry["error"] = False, f"{type(err).__name__}: {err}"
    return entry


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
        judged = [e for e in episodes if needs_judge(e.task) and e.record.termination in REWARDABLE_TERMINATIONS]
        if judged:  # cached: the scoring below asks nothing again
            self.judge.verdicts([(trajectory_text(e.record), e.task.nl_assertions) for e in judged],
                                [f"task {e.record.task_id}" for e in judged])  # fmt: skip

    def __call__(self, episode: Episode) -> dict[str, Any]:
        return compute_reward(episode, self.judge).to_dict()


def scorer(judge: NLJudge | None = None) -> Any:
    """The ``score`` a run hands ``run_episodes``: the plain outcome reward, or with a judge the batched one."""
    return outcome_reward if judge is None else OutcomeReward(judge)


def require_scorable(tasks: Mapping[str, Task], judge_available: bool) -> None:
    """Refuses, in one line, a run over tasks whose reward needs a term it cannot compute: a task the project
    cannot score as its release does (``Task.unscorable``), or NL_ASSERTION without a judge (naming the flags, and
    how many tasks need it). ``tasks``: the run's tasks by their keys."""
    unscorable = [key for key, task in tasks.items() if task.unscorable]
    if unscorable:
        first = tasks[unscorable[0]]
        raise RewardTermError(
            f"{len(unscorable)} of the {len(tasks)} tasks ({_some(unscorable)}) cannot be scored as their release "
            f"scores them (task {unscorable[0]}: {first.unscorable}); leave them out with --tasks"
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
