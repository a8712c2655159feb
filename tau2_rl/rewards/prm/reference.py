"""The reference process reward: per-turn progress against the task's own gold actions and ``communicate_info``.

PRM-Lite's rules read only the trajectory, so on a task whose right answer is "no" they cannot tell the agent that
refused from the one that did what the user asked. In training the environment knows what the task wanted: the outcome
reward replays its gold actions. This module scores each assistant turn against that reference:

- B9: a successful write that matches a gold write not yet matched (τ²'s own comparison, ``outcome.matches_gold``);
- P12: a successful write that matches no unmatched gold write;
- B10: a read (or other non-write call) that matches a gold non-write action not yet matched, at most
  ``MAX_CREDITED_READS`` per episode (reads alone must never outweigh one missing write);
- B11: a ``communicate_info`` string said to the user, on the turn that first says it (τ²'s check);
- P14: a write matching a gold write out of the gold order, on a task where the order changes the database;
- P13: each gold write never matched, and P15: an episode that did not end by the agent or the user, both charged
  on the last turn.

The terms follow the task's ``reward_basis``: the write terms (B9, P12, P13, P14) only where it names DB or
ENV_ASSERTION (the state the reward checks; P14 only with DB: its gold replay), B11 only where it names COMMUNICATE
(τ²-bench 1.0.1's retail counts its ``communicate_info`` nowhere). Where the user holds tools (telecom), its own calls
are progress too, credited to the agent's turn that asked for them (the last one before the user acted): a gold write
of the user's done by the user earns that turn B9, a write of the user's no gold write wants P12.

It uses privileged task information: a training signal only, never an evaluation metric. It reads the task through
the environment object that played the episode (``env.task``), never a file; the rule modules stay pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tau2_rl.envs.behaviours import reordered_actions
from tau2_rl.envs.data import GoldAction, Task
from tau2_rl.envs.episode import REWARDABLE_TERMINATIONS, EpisodeRecord
from tau2_rl.envs.state import CanonicalBase
from tau2_rl.rewards.outcome import communicate_checks, gold_db_hash, matches_gold

MAX_CREDITED_READS = 2
"""B10 pays at most this many gold reads per episode: 2 × 0.02 stays below one missing write's charge (P13)."""


@dataclass(frozen=True)
class ReferenceTerm:
    """One term of the reference reward (the report's rule table reads the same fields as a ``Rule``)."""

    rule_id: str
    name: str
    weight: float
    trigger: str
    rationale: str


_TERMS = [
    ReferenceTerm(
        "B9",
        "gold_write_matched",
        0.10,
        "Per successful write whose name and compared arguments match a gold write not matched before (τ²'s "
        "`compare_args` comparison).",
        "A right write is the progress the outcome's DB check counts; paying it on its own turn is what separates, "
        "inside an all-zero group, two right writes of three from a wrong one.",
    ),
    ReferenceTerm(
        "P12",
        "write_not_in_gold",
        -0.10,
        "Per successful write that matches no unmatched gold write (a wrong write, a repeated one, any write on a "
        "task that needs none).",
        "It changes the database away from the gold state; as costly as a right write is worth, so write-spamming "
        "cannot pay.",
    ),
    ReferenceTerm(
        "B10",
        "gold_read",
        0.02,
        f"Per successful non-write call matching a gold non-write action not matched before, at most "
        f"{MAX_CREDITED_READS} per episode.",
        "Looking up what the gold solution looks up is a small step of progress; capped so that reads alone never "
        "outweigh a missing write.",
    ),
    ReferenceTerm(
        "B11",
        "info_communicated",
        0.05,
        "Per `communicate_info` string, on the turn whose message first says it (τ²'s check: case-insensitive, the "
        "message's commas removed).",
        "The COMMUNICATE half of the outcome, credited where it happens.",
    ),
    ReferenceTerm(
        "P14",
        "gold_write_out_of_order",
        -0.05,
        "Per successful write that matches an unmatched gold write that the gold actions make before one already "
        "matched, on a task whose writes, played in reverse, end in another database.",
        "The right call in an order that changes the outcome (a cancellation refunding what a booking then pays) "
        "is not progress; on tasks whose writes commute any order earns B9.",
    ),
    ReferenceTerm(
        "P15",
        "no_rewardable_end",
        -0.10,
        "On the last turn, when the episode did not end by the agent or the user (turn, token or error cap).",
        "The outcome is 0 whatever was done before: the reference must rank it below the same work ended properly. "
        "Read from the trajectory, not the task.",
    ),
    ReferenceTerm(
        "P13",
        "gold_write_missing",
        -0.05,
        "Per gold write no successful write matched, on the episode's last turn.",
        "What the task needed and the episode never did; half a right write, as in the issue's quick score.",
    ),
]
REFERENCE_TERMS: dict[str, ReferenceTerm] = {term.rule_id: term for term in _TERMS}
"""The reference reward's terms in table order."""


@dataclass
class ReferenceTurns:
    """Per assistant turn (of ``record.turns``): the fired terms; the weighted score is the engine's."""

    fired: list[dict[str, int]]
    unattached: dict[str, int]  # P13 when the episode has no turn to carry it


def reference_turns(record: EpisodeRecord, env: HasDomain) -> ReferenceTurns:
    """Which reference terms fire on each turn of ``record`` against its task's gold actions and required info
    (``env``: the environment that played it)."""
    task = env.task(record.task_id)
    basis = set(task.reward_basis)  # progress toward the terms the task's reward counts, none other
    ordered = "DB" in basis and write_order_matters(env.base_of(record.task_id), task)
    state_checked = bool(basis & {"DB", "ENV_ASSERTION"})  # the writes are what its DB or assertion term checks

    def writes(action: GoldAction) -> bool:
        return action.name in (task.write_tools if action.requestor == "assistant" else task.spec.user_write_tools())

    gold_writes = [a for a in task.actions if writes(a)] if state_checked else []
    gold_other = [a for a in task.actions if not writes(a)]
    asked: dict[int, list[Any]] = {}  # the user's own calls, by the agent turn that asked for them
    for call in record.user_tool_calls:
        asked.setdefault(call.turn - 1, []).append(call)
    matched_writes = [False] * len(gold_writes)
    matched_other = [False] * len(gold_other)
    said: set[str] = set()
    credited_reads = 0
    last_matched = -1  # the latest gold write (by gold position) a write of the episode matched
    fired: list[dict[str, int]] = []
    for turn in record.turns:
        counts: dict[str, int] = {}
        own = [record.tool_calls[i] for i in turn.tool_call_indices if 0 <= i < len(record.tool_calls)]
        for call in [*own, *asked.get(turn.index, [])]:
            if call.error:
                continue  # a failed call changed nothing and looked nothing up
            if call.is_write and not state_checked:
                continue  # the reward does not look at the state: a write is neither progress nor a fault
            if call.is_write:
                hit = _first_match(gold_writes, matched_writes, call.name, call.arguments)
                if hit is None:
                    term = "P12"
                elif ordered and hit < last_matched:
                    term = "P14"
                else:
                    term, last_matched = "B9", max(last_matched, hit)
                counts[term] = counts.get(term, 0) + 1
            elif (
                credited_reads < MAX_CREDITED_READS
                and _first_match(gold_other, matched_other, call.name, call.arguments) is not None
            ):
                credited_reads += 1
                counts["B10"] = counts.get("B10", 0) + 1
        if turn.message and task.communicate_info and "COMMUNICATE" in basis:
            new = [info for info, ok in communicate_checks(task, [turn.message]).items() if ok and info not in said]
            said.update(new)
            if new:
                counts["B11"] = len(new)
        fired.append(counts)
    end = fired[-1] if fired else {}
    missing = matched_writes.count(False)
    if missing:
        end["P13"] = missing
    if record.termination not in REWARDABLE_TERMINATIONS:
        end["P15"] = 1
    return ReferenceTurns(fired=fired, unattached={} if fired else end)


def write_order_matters(base: CanonicalBase, task: Task) -> bool:
    """Whether ``task``'s gold writes played in reverse order end in another database than the gold order (cached
    per base and task, as the outcome's gold hash)."""
    key = (id(base), task.task_id)
    if key not in _ORDER_MATTERS:
        writes = [a for a in task.actions if a.name in task.write_tools]
        if len(writes) < 2:
            _ORDER_MATTERS[key] = False
        else:
            state = base.new_state()
            for action in reordered_actions(task):
                base.spec.execute_tool(state, action.name, action.arguments)
            _ORDER_MATTERS[key] = state.db_hash() != gold_db_hash(base, task)
    return _ORDER_MATTERS[key]


_ORDER_MATTERS: dict[tuple[int, str], bool] = {}


class HasDomain(Protocol):
    """The environment (a ``DomainEnv`` or ``MultiDomainEnv``), as far as the reference reads it: the task a record
    played, whose gold actions it scores against, and that task's canonical database (for the gold replay)."""

    def task(self, key: str) -> Task: ...

    def base_of(self, key: str) -> CanonicalBase: ...


def _first_match(
    gold: Sequence[GoldAction], matched: list[bool], name: str, arguments: Mapping[str, Any] | None
) -> int | None:
    """Marks and returns the position of the first unmatched gold action the call matches (None: none)."""
    for i, action in enumerate(gold):
        if not matched[i] and matches_gold(action, name, arguments):
            matched[i] = True
            return i
    return None
