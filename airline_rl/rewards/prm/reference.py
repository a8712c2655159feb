"""The reference process reward: per-turn progress against the task's own gold actions and ``communicate_info``.

PRM-Lite's rules read only the trajectory, so on a task whose right answer is "no" they cannot tell the agent that
refused from the one that did what the user asked. In training the environment knows what the task wanted: the outcome
reward replays its gold actions. This module scores each assistant turn against that reference:

- B9: a successful write that matches a gold write not yet matched (τ²'s own comparison, ``outcome.matches_gold``);
- P12: a successful write that matches no unmatched gold write;
- B10: a read (or other non-write call) that matches a gold non-write action not yet matched, at most
  ``MAX_CREDITED_READS`` per episode (reads alone must never outweigh one missing write);
- B11: a ``communicate_info`` string said to the user, on the turn that first says it (τ²'s check);
- P13: each gold write never matched, charged on the last turn.

It uses privileged task information: a training signal only, never an evaluation metric. It reads the task through
the environment object the outcome reward uses (``env.domain``), never a file; the rule modules stay pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from airline_rl.envs.episode import EpisodeRecord
from airline_rl.rewards.outcome import communicate_checks, matches_gold

if TYPE_CHECKING:
    from airline_rl.envs.data import Task

MAX_CREDITED_READS = 3
"""B10 pays at most this many gold reads per episode: 3 × 0.02 stays below one missing write's charge (P13)."""


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
        0.20,
        "Per successful write whose name and compared arguments match a gold write not matched before (τ²'s "
        "`compare_args` comparison).",
        "A right write is the progress the outcome's DB check counts; paying it on its own turn is what separates, "
        "inside an all-zero group, two right writes of three from a wrong one.",
    ),
    ReferenceTerm(
        "P12",
        "write_not_in_gold",
        -0.20,
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
        0.10,
        "Per `communicate_info` string, on the turn whose message first says it (τ²'s check: case-insensitive, the "
        "message's commas removed).",
        "The COMMUNICATE half of the outcome, credited where it happens.",
    ),
    ReferenceTerm(
        "P13",
        "gold_write_missing",
        -0.10,
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


def reference_turns(record: EpisodeRecord, task: Task) -> ReferenceTurns:
    """Which reference terms fire on each turn of ``record`` against ``task``'s gold actions and required info."""
    from airline_rl.envs.tools import WRITE_TOOLS

    gold_writes = [a for a in task.actions if a.name in WRITE_TOOLS]
    gold_other = [a for a in task.actions if a.name not in WRITE_TOOLS]
    matched_writes = [False] * len(gold_writes)
    matched_other = [False] * len(gold_other)
    said: set[str] = set()
    credited_reads = 0
    fired: list[dict[str, int]] = []
    for turn in record.turns:
        counts: dict[str, int] = {}
        for index in turn.tool_call_indices:
            if not 0 <= index < len(record.tool_calls):
                continue
            call = record.tool_calls[index]
            if call.error:
                continue  # a failed call changed nothing and looked nothing up
            if call.is_write:
                hit = _first_match(gold_writes, matched_writes, call.name, call.arguments)
                counts["B9" if hit else "P12"] = counts.get("B9" if hit else "P12", 0) + 1
            elif credited_reads < MAX_CREDITED_READS and _first_match(
                gold_other, matched_other, call.name, call.arguments
            ):
                credited_reads += 1
                counts["B10"] = counts.get("B10", 0) + 1
        if turn.message and task.communicate_info:
            new = [info for info, ok in communicate_checks(task, [turn.message]).items() if ok and info not in said]
            said.update(new)
            if new:
                counts["B11"] = len(new)
        fired.append(counts)
    missing = matched_writes.count(False)
    unattached: dict[str, int] = {}
    if missing:
        (fired[-1] if fired else unattached)["P13"] = missing
    return ReferenceTurns(fired=fired, unattached=unattached)


def _first_match(gold: list, matched: list[bool], name: str, arguments: Mapping | None) -> bool:
    """Marks and reports the first unmatched gold action the call matches."""
    for i, action in enumerate(gold):
        if not matched[i] and matches_gold(action, name, arguments):
            matched[i] = True
            return True
    return False
