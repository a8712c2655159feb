"""PRM-Lite: a rule-based process reward, 15 interpretable rules scored per assistant turn, no trainable parameters.

An airline episode runs for dozens of turns and the outcome reward (τ²'s DB × COMMUNICATE) is a single bit at the
end, so GRPO cannot tell which turns helped. PRM-Lite adds dense, readable turn-level credit: penalties P1–P8 for
behaviour that is wrong whatever the task (placeholder arguments, repeated calls, writes without the user's
confirmation, ids that nobody ever said, ...) and bonuses B1–B7 for good process (recovering from an error, chaining
ids out of tool results, verifying before writing, reporting looked-up facts). Every rule is cheap to check on an
``EpisodeRecord`` and has a name and a rationale that a person can audit.

Anti-hacking: a bonus pays only when the action it rewards works (B4), at most once per turn, each looked-up value
pays once (B7), each read tool pays once (B3), evidence must come from an earlier turn (B1, B6: the agent must have
*seen* the error or the record), tool-call padding costs more than it can earn (P8), and the episode total is clipped.

Context rule: assistant turn k is judged only on what the agent could have seen when it wrote turn k: user messages
and results of *successful* tool calls that came before it in ``record.messages`` (an error result only echoes the
agent's own arguments, so it does not make a value "seen"). A context is built incrementally in one pass.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airline_rl.envs.episode import AGENT_STOP_TOKEN, EpisodeRecord, ToolCallRecord, TurnRecord
from airline_rl.envs.tool_calls import TOOL_CALL_OPEN
from airline_rl.envs.tools import READ_TOOLS, TERMINAL_TOOLS, TOOL_SCHEMAS

DEFAULT_CLIP = (-0.5, 0.5)
MAX_FREE_TOOL_CALLS = 8
"""P8 charges every tool call of an episode beyond this many (the gold trajectories need few calls)."""

DOCS_START, DOCS_END = "<!-- rules:start -->", "<!-- rules:end -->"
USER, TOOL = "user", "tool"  # where a value first appeared

# ---------------------------------------------------------------------------------------------------------------------
# Schema-derived argument sets (one place; no per-tool lists)


def _walk_properties(schema: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every (property name, property schema) of a JSON schema, nested objects and array items included."""
    for name, prop in schema.get("properties", {}).items():
        yield name, prop
        yield from _walk_properties(prop)
    if "items" in schema:
        yield from _walk_properties(schema["items"])


def _is_id_name(name: str) -> bool:
    return name.endswith("_id") or name.endswith("flight_number")


_PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOL_SCHEMAS}
ID_ARGUMENT_NAMES: frozenset[str] = frozenset(
    name for parameters in _PARAMETERS.values() for name, _ in _walk_properties(parameters) if _is_id_name(name)
)
"""Argument names whose values are entity ids (user_id, reservation_id, payment_id, flight_number), at any depth."""

LOOKUP_TOOLS: dict[str, str] = {
    name: next(iter(_PARAMETERS[name]["properties"]))
    for name in sorted(READ_TOOLS)
    if len(_PARAMETERS[name]["properties"]) == 1 and _is_id_name(next(iter(_PARAMETERS[name]["properties"])))
}
"""Read tools that fetch one record by its id (tool → id argument): what counts as verifying an entity (B6)."""

VERIFIABLE_ID_NAMES: frozenset[str] = frozenset(LOOKUP_TOOLS.values())

EXAMPLE_VALUES: frozenset[str] = frozenset(
    v.lower()
    for v in (
        "sara_doe_496",
        "ZFA04Y",
        "8JX2WO",
        "credit_card_7815826",
        "gift_card_7815826",
        "certificate_7815826",
        "2024-01-01",
    )
)
"""Example values from the tool descriptions: a model that copies them has not looked anything up."""

# ---------------------------------------------------------------------------------------------------------------------
# Text detectors

_PLACEHOLDER_WORDS = frozenset(
    {"", "xxx", "placeholder", "example", "string", "...", "…", "n/a", "unknown", "tbd", "null", "none"}
)
_TEMPLATE = re.compile(r"<[^<>]*>|\{[^{}]*\}|\[[^\[\]]*\]")
_PLACEHOLDER_PARTS = re.compile(r"xxx|placeholder")
_YOUR = re.compile(r"^your[_\s-]")


def is_placeholder(name: str | None, value: str) -> bool:
    """Whether a string argument is a template or stand-in rather than a value the agent obtained."""
    text = value.strip().lower()
    if text in _PLACEHOLDER_WORDS or text in EXAMPLE_VALUES:
        return True
    if _TEMPLATE.search(text) or _PLACEHOLDER_PARTS.search(text) or _YOUR.match(text):
        return True
    return name is not None and re.sub(r"[\s-]+", "_", text) == name.lower()


def _normalize_quotes(text: str) -> str:
    return text.lower().replace("\u2019", "'").replace("\u2018", "'")


_CONFIRM = re.compile(
    r"\b(?:yes|yeah|yep|confirm(?:ed|s)?|go ahead|proceed|(?<!make )sure|correct|please do(?!\s*(?:not|n't))"
    r"|that's right)\b"
)
_NEGATOR = re.compile(r"\b(?:no|not|don't|dont|do not|never|nope|can't|cannot|won't|isn't|wasn't|wouldn't)\b")
_REFUSAL = re.compile(r"^\W*(?:no|nope|nah)\b(?!\s+(?:problem|worries))|\bnot yet\b")
_CLAUSE_END = re.compile(r"[.!?;,:\n]")


def is_confirmation(text: str) -> bool:
    """Whether a user message explicitly confirms ("yes", "go ahead", ...) without negating it ("not yet", "don't
    proceed", a leading "no"). Policy requires explicit confirmation before any write."""
    text = _normalize_quotes(text)
    if _REFUSAL.search(text):
        return False
    for match in _CONFIRM.finditer(text):
        clause = _CLAUSE_END.split(text[: match.start()])[-1]
        if not _NEGATOR.search(" ".join(clause.split()[-4:])):
            return True
    return False


_HUMAN_REQUEST = re.compile(r"\b(?:human|agent|representative|supervisor)s?\b")


def asks_for_human(text: str) -> bool:
    """Whether a user message mentions a human / agent / representative / supervisor (a reason to transfer)."""
    return bool(_HUMAN_REQUEST.search(text.lower()))


_TOKEN = re.compile(r"[a-z0-9_]+")
_DATE_OR_TIME = re.compile(r"\d{4}-\d{2}-\d{2}(?:t\d{2}:\d{2}(?::\d{2})?)?|\d{1,2}:\d{2}(?::\d{2})?")
_NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])\d+(?:\.\d+)?(?![\w])")


def _tokens(text: str) -> list[str]:
    """Lower-cased word tokens: how ids are matched between messages, results and arguments."""
    return _TOKEN.findall(text.lower())


def _is_id_token(token: str) -> bool:
    has_digit = any(c.isdigit() for c in token)
    has_alpha = any(c.isalpha() for c in token)
    return (has_digit and has_alpha and len(token) >= 5) or (len(token) == 6 and token.isalnum() and has_alpha)


def _normalize_number(text: str) -> str | None:
    number = float(text.replace(",", ""))
    if abs(number) < 10:
        return None
    return str(int(number)) if number.is_integer() else f"{number:.2f}".rstrip("0").rstrip(".")


def mentionable_values(text: str) -> set[str]:
    """Ids, flight numbers and amounts of two or more digits in ``text`` (dates and times excluded), normalized.

    An id has letters and digits (``mia_li_3668``, ``HAT001``) or is a six-character upper-case code (``HATHAT``);
    a lower-case word such as ``origin`` or ``please`` is never an id."""
    values: set[str] = set()
    for raw in re.findall(r"[A-Za-z0-9_]+", text):
        token = raw.lower()
        if _is_id_token(token) and (any(c.isdigit() for c in raw) or raw.isupper()):
            values.add(token)
    for match in _NUMBER.finditer(_DATE_OR_TIME.sub(" ", text.lower())):
        number = _normalize_number(match.group())
        if number is not None:
            values.add(number)
    return values


# ---------------------------------------------------------------------------------------------------------------------
# Argument helpers


def _iter_strings(value: Any, name: str | None = None) -> Iterator[tuple[str | None, str]]:
    """Every string leaf of a call's arguments with the name of the argument that holds it."""
    if isinstance(value, str):
        yield name, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _iter_strings(item, str(key))
    elif isinstance(value, list):
        for item in value:
            yield from _iter_strings(item, name)


def id_values(arguments: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """(argument name, normalized value) of every id-valued argument at any depth."""
    if not arguments:
        return []
    found: list[tuple[str, str]] = []

    def visit(value: Any, name: str | None) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, str(key))
        elif isinstance(value, list):
            for item in value:
                visit(item, name)
        elif name in ID_ARGUMENT_NAMES and isinstance(value, (str, int)) and not isinstance(value, bool):
            found.append((name, str(value).strip().lower()))

    visit(arguments, None)
    return found


def call_signature(call: ToolCallRecord) -> str | None:
    """Name plus canonical JSON of the arguments (None for a block that did not parse: identity is unknowable)."""
    if call.arguments is None or not call.name:
        return None
    return json.dumps([call.name, call.arguments], sort_keys=True, separators=(",", ":"), default=str)


def _text_before_calls(turn: TurnRecord) -> str:
    return turn.raw_text.split(TOOL_CALL_OPEN, 1)[0].replace(AGENT_STOP_TOKEN, "").strip()


# ---------------------------------------------------------------------------------------------------------------------
# Rules


@dataclass
class TurnContext:
    """What a rule may look at for one assistant turn: the turn, its calls, and what came before it.

    The collections are the scorer's running state, shared and updated after the turn is scored: read them inside a
    rule, do not keep them."""

    turn: TurnRecord
    calls: list[ToolCallRecord]
    call_indices: list[int]
    user_confirmed: bool
    user_asked_human: bool
    seen_values: Mapping[str, str]  # token -> USER or TOOL, where it first appeared
    tool_values: AbstractSet[str]  # mentionable values from successful tool results
    agent_mentioned: AbstractSet[str]  # mentionable values the agent already said to the user
    successful_signatures: AbstractSet[str]
    previous_call: ToolCallRecord | None  # the last call of an earlier turn
    successful_read_before: bool
    read_tools_used: AbstractSet[str]
    verified_ids: AbstractSet[tuple[str, str]]  # (id argument name, value) fetched by a lookup tool
    chained_values: AbstractSet[str]  # tool-derived ids that already earned B2


def _p1_placeholder(ctx: TurnContext) -> int:
    return int(
        any(
            is_placeholder(name, value)
            for call in ctx.calls
            if call.arguments
            for name, value in _iter_strings(call.arguments)
        )
    )


def _p2_redundant(ctx: TurnContext) -> int:
    succeeded: set[str] = set()
    for call in ctx.calls:
        signature = call_signature(call)
        if signature is not None and (signature in ctx.successful_signatures or signature in succeeded):
            return 1
        if signature is not None and not call.error:
            succeeded.add(signature)
    return 0


def _p3_repeat_failed(ctx: TurnContext) -> int:
    previous = ctx.previous_call
    for call in ctx.calls:
        signature = call_signature(call)
        if previous is not None and previous.error and signature is not None and signature == call_signature(previous):
            return 1
        previous = call
    return 0


def _p4_no_reasoning(ctx: TurnContext) -> int:
    return int(bool(ctx.calls) and not ctx.turn.message)


def _p5_unconfirmed_write(ctx: TurnContext) -> int:
    return int(not ctx.user_confirmed and any(call.is_write for call in ctx.calls))


def _p6_unseen_id(ctx: TurnContext) -> int:
    return int(any(value not in ctx.seen_values for call in ctx.calls for _, value in id_values(call.arguments)))


def _p7_premature_transfer(ctx: TurnContext) -> int:
    if ctx.user_asked_human:
        return 0
    read_before = ctx.successful_read_before
    for call in ctx.calls:
        if call.name in TERMINAL_TOOLS and not read_before:
            return 1
        read_before = read_before or (call.name in READ_TOOLS and not call.error)
    return 0


def _p8_excess_calls(ctx: TurnContext) -> int:
    return sum(index >= MAX_FREE_TOOL_CALLS for index in ctx.call_indices)


def _b1_recovery(ctx: TurnContext) -> int:
    failed_before = ctx.previous_call is not None and ctx.previous_call.error
    return int(failed_before and any(not call.error for call in ctx.calls))


def _b2_data_chain(ctx: TurnContext) -> int:
    return int(
        any(
            ctx.seen_values.get(value) == TOOL and value not in ctx.chained_values
            for call in ctx.calls
            if not call.error
            for _, value in id_values(call.arguments)
        )
    )


def _b3_read_diversity(ctx: TurnContext) -> int:
    return int(any(not call.error and call.name in READ_TOOLS - ctx.read_tools_used for call in ctx.calls))


def _b4_conditional_reasoning(ctx: TurnContext) -> int:
    return int(bool(ctx.calls) and all(not call.error for call in ctx.calls) and bool(_text_before_calls(ctx.turn)))


def _b5_confirmed_write(ctx: TurnContext) -> int:
    return int(ctx.user_confirmed and any(call.is_write and not call.error for call in ctx.calls))


def _b6_verified_write(ctx: TurnContext) -> int:
    for call in ctx.calls:
        if call.is_write and not call.error and call.arguments:
            for name in VERIFIABLE_ID_NAMES & set(call.arguments):
                if (name, str(call.arguments[name]).strip().lower()) in ctx.verified_ids:
                    return 1
    return 0


def _b7_grounded_reply(ctx: TurnContext) -> int:
    if ctx.calls or not ctx.turn.message:
        return 0
    values = mentionable_values(ctx.turn.message)
    return int(bool((values & ctx.tool_values) - ctx.agent_mentioned))


@dataclass(frozen=True)
class Rule:
    """One PRM-Lite rule: ``fn`` says how many times it fires in a turn (0/1; a count for P8)."""

    rule_id: str
    name: str
    weight: float
    trigger: str
    rationale: str
    fn: Callable[[TurnContext], int] = field(repr=False)


_RULE_LIST = [
    Rule(
        "P1",
        "placeholder_arguments",
        -0.05,
        "A call argument (any string, nested included) is a template (`<...>`, `{...}`, `[...]`), a stand-in word "
        "(xxx, placeholder, example, your_..., string, ..., N/A, unknown, TBD, null, none, empty), its own argument "
        "name, or an example id from the tool descriptions.",
        "The agent is guessing instead of looking the value up; such calls fail or, worse, act on the wrong record.",
        _p1_placeholder,
    ),
    Rule(
        "P2",
        "redundant_call",
        -0.03,
        "A call identical (name and canonical JSON arguments) to an earlier successful call of the episode.",
        "The answer is already in the context; repeating the call wastes turns and tokens.",
        _p2_redundant,
    ),
    Rule(
        "P3",
        "repeat_failed_call",
        -0.04,
        "A call identical to the immediately preceding call, which failed.",
        "Retrying the same failing call cannot succeed; the agent should read the error and change something.",
        _p3_repeat_failed,
    ),
    Rule(
        "P4",
        "no_reasoning_before_action",
        -0.05,
        "The turn makes a tool call and has no text of its own outside the tool-call blocks.",
        "Silent actions are hard to audit and leave the user uninformed about what is happening.",
        _p4_no_reasoning,
    ),
    Rule(
        "P5",
        "unconfirmed_write",
        -0.08,
        "A write call when the user's latest message has no explicit, non-negated confirmation (yes, go ahead, "
        "proceed, confirm, ...).",
        "The airline policy requires explicit user confirmation before any action that changes the booking database.",
        _p5_unconfirmed_write,
    ),
    Rule(
        "P6",
        "unseen_id",
        -0.05,
        f"An id-valued argument ({', '.join(sorted(ID_ARGUMENT_NAMES))}; at any depth) whose value never appeared "
        "in a user message or a successful tool result before this turn.",
        "Ids the agent has never seen are hallucinated; acting on them reaches the wrong record or fails.",
        _p6_unseen_id,
    ),
    Rule(
        "P7",
        "premature_transfer",
        -0.05,
        "A transfer to a human agent when the user never asked for a human, agent, representative or supervisor "
        "and no read call has succeeded yet.",
        "Transferring without even looking at the case gives up on tasks the tools can solve.",
        _p7_premature_transfer,
    ),
    Rule(
        "P8",
        "excess_tool_calls",
        -0.05,
        f"Each tool call beyond the {MAX_FREE_TOOL_CALLS}th of the episode (charged per call, not once per turn).",
        "A length penalty, so that padding an episode with calls to farm the per-call bonuses does not pay.",
        _p8_excess_calls,
    ),
    Rule(
        "B1",
        "recovery_after_error",
        0.05,
        "A call succeeds in this turn and the last call of an earlier turn failed.",
        "Reading an error and fixing the call is the skill long episodes need; the failure must have been seen, so "
        "a deliberate failing call followed by a good one in the same turn earns nothing.",
        _b1_recovery,
    ),
    Rule(
        "B2",
        "data_chain",
        0.08,
        "A successful call uses an id-valued argument whose value first appeared in an earlier tool result (not a "
        "user message) and has not earned this bonus before.",
        "Chaining ids out of tool results (user → reservation → payment) is how multi-step tasks get solved; each "
        "id pays once, so re-using one id in padding calls earns nothing.",
        _b2_data_chain,
    ),
    Rule(
        "B3",
        "read_diversity",
        0.01,
        "A successful call of a read tool that has not succeeded before in the episode (each tool pays once).",
        "Gathering information from the right sources before acting; small, and once per tool, so it cannot be "
        "farmed.",
        _b3_read_diversity,
    ),
    Rule(
        "B4",
        "conditional_reasoning",
        0.02,
        "The turn has text before its first tool call and all its calls succeed.",
        "Explaining an action helps the user and the model; it pays only when the action it precedes works.",
        _b4_conditional_reasoning,
    ),
    Rule(
        "B5",
        "confirmed_write",
        0.05,
        "A successful write when the user's latest message explicitly confirms it (the P5 detector).",
        "The policy-compliant way to change the database: ask, get a yes, then act.",
        _b5_confirmed_write,
    ),
    Rule(
        "B6",
        "verified_before_write",
        0.03,
        "A successful write on a reservation_id / user_id fetched successfully in an earlier turn "
        "(get_reservation_details / get_user_details with that id).",
        "Checking the record before changing it is how policy conditions (cabin, dates, membership) get respected.",
        _b6_verified_write,
    ),
    Rule(
        "B7",
        "grounded_reply",
        0.02,
        "A turn without tool calls whose message mentions a value (id, flight number, amount of two or more digits) "
        "from an earlier tool result that the agent had not mentioned before.",
        "Reporting looked-up facts to the user is what COMMUNICATE checks; each value pays once.",
        _b7_grounded_reply,
    ),
]

RULES: dict[str, Rule] = {rule.rule_id: rule for rule in _RULE_LIST}
"""All rules in table order: penalties P1–P8, then bonuses B1–B7."""


class UnknownRuleError(KeyError):
    """A rule id that is not in ``RULES``; the message lists the valid ids."""

    def __str__(self) -> str:
        return str(self.args[0])


def _unknown(rule_ids: Sequence[str]) -> UnknownRuleError:
    return UnknownRuleError(f"unknown PRM-Lite rule id(s) {list(rule_ids)}; valid ids: {', '.join(RULES)}")


def get_rule(rule_id: str) -> Rule:
    """The rule with ``rule_id`` (e.g. "P5")."""
    if rule_id not in RULES:
        raise _unknown([rule_id])
    return RULES[rule_id]


# ---------------------------------------------------------------------------------------------------------------------
# Scoring


@dataclass
class PRMResult:
    """PRM-Lite's verdict on an episode: per-turn scores and firings, and the episode's (clipped) process score."""

    turn_scores: list[float]
    fired: list[dict[str, int]]  # per turn: rule id -> count (rules that fired only)
    process_score: float
    raw_score: float
    rule_counts: dict[str, int]  # episode totals for every rule id

    def to_dict(self) -> dict[str, Any]:
        return {
            "turn_scores": list(self.turn_scores),
            "fired": [dict(f) for f in self.fired],
            "process_score": self.process_score,
            "raw_score": self.raw_score,
            "rule_counts": dict(self.rule_counts),
        }


def _effective_weights(weights: Mapping[str, float] | None) -> dict[str, float]:
    resolved = {rule_id: rule.weight for rule_id, rule in RULES.items()}
    if weights:
        unknown = [rule_id for rule_id in weights if rule_id not in RULES]
        if unknown:
            raise _unknown(unknown)
        for rule_id, weight in weights.items():
            if not math.isfinite(weight):
                raise ValueError(f"weight of rule {rule_id} must be finite, got {weight}")
            resolved[rule_id] = float(weight)
    return resolved


def score_episode(
    record: EpisodeRecord,
    *,
    clip: tuple[float, float] = DEFAULT_CLIP,
    weights: dict[str, float] | None = None,
) -> PRMResult:
    """Scores every assistant turn of ``record`` with all rules, in one pass over ``record.messages``.

    Turn k is judged against the user messages and successful tool results that precede its assistant message; the
    results of its own calls are folded into the context only after it is scored.
    """
    low, high = clip
    if not low <= high:
        raise ValueError(f"clip must be (low, high) with low <= high, got {clip}")
    resolved = _effective_weights(weights)
    n_assistant = sum(message.get("role") == "assistant" for message in record.messages)
    skip = n_assistant - len(record.turns)  # the fixed greeting(s) before the first policy turn
    if skip < 0:
        raise ValueError(
            f"record of task {record.task_id} has {len(record.turns)} turns but only {n_assistant} assistant messages"
        )

    seen_values: dict[str, str] = {}
    tool_values: set[str] = set()
    agent_mentioned: set[str] = set()
    successful_signatures: set[str] = set()
    read_tools_used: set[str] = set()
    verified_ids: set[tuple[str, str]] = set()
    chained_values: set[str] = set()
    previous_call: ToolCallRecord | None = None
    successful_read_before = False
    user_asked_human = False

    turn_scores: list[float] = []
    fired_per_turn: list[dict[str, int]] = []
    rule_counts = dict.fromkeys(RULES, 0)
    assistant_seen = 0
    for message in record.messages:
        role = message.get("role")
        if role == "user":
            content = str(message.get("content") or "")
            for token in _tokens(content):
                seen_values.setdefault(token, USER)
            user_asked_human = user_asked_human or asks_for_human(content)
            continue
        if role != "assistant":
            continue  # tool messages are folded in from the call records right after their turn
        assistant_seen += 1
        if assistant_seen <= skip:
            continue
        turn = record.turns[assistant_seen - skip - 1]
        calls = [record.tool_calls[index] for index in turn.tool_call_indices]
        ctx = TurnContext(
            turn=turn,
            calls=calls,
            call_indices=list(turn.tool_call_indices),
            user_confirmed=is_confirmation(turn.last_user_message),
            user_asked_human=user_asked_human,
            seen_values=seen_values,
            tool_values=tool_values,
            agent_mentioned=agent_mentioned,
            successful_signatures=successful_signatures,
            previous_call=previous_call,
            successful_read_before=successful_read_before,
            read_tools_used=read_tools_used,
            verified_ids=verified_ids,
            chained_values=chained_values,
        )
        fired: dict[str, int] = {}
        score = 0.0
        for rule_id, rule in RULES.items():
            count = int(rule.fn(ctx))
            if count:
                fired[rule_id] = count
                rule_counts[rule_id] += count
                score += resolved[rule_id] * count
        turn_scores.append(score)
        fired_per_turn.append(fired)

        # Fold this turn into the context of the next ones.
        agent_mentioned.update(mentionable_values(turn.message))
        for call in calls:
            previous_call = call
            if call.error:
                continue
            signature = call_signature(call)
            if signature is not None:
                successful_signatures.add(signature)
            chained_values.update(value for _, value in id_values(call.arguments) if seen_values.get(value) == TOOL)
            for token in _tokens(call.result):
                seen_values.setdefault(token, TOOL)
            tool_values.update(mentionable_values(call.result))
            if call.name in READ_TOOLS:
                successful_read_before = True
                read_tools_used.add(call.name)
            id_name = LOOKUP_TOOLS.get(call.name)
            if id_name is not None and call.arguments and id_name in call.arguments:
                verified_ids.add((id_name, str(call.arguments[id_name]).strip().lower()))

    raw = sum(turn_scores)
    return PRMResult(
        turn_scores=turn_scores,
        fired=fired_per_turn,
        process_score=min(max(raw, low), high),
        raw_score=raw,
        rule_counts=rule_counts,
    )


def episode_rule_stats(results: Sequence[PRMResult], successes: Sequence[bool]) -> dict[str, float]:
    """Per rule: share of episodes where it fired, and how much more often it fires in successful episodes.

    ``prm/<id>/discriminativeness`` = fire rate among successes − fire rate among failures (0.0 when either group is
    empty): a rule that rewards good process should be positive for bonuses and negative for penalties.
    """
    if len(results) != len(successes):
        raise ValueError(f"{len(results)} results but {len(successes)} success flags")
    stats: dict[str, float] = {}

    def rate(group: list[PRMResult], rule_id: str) -> float:
        return sum(result.rule_counts.get(rule_id, 0) > 0 for result in group) / len(group) if group else 0.0

    good = [result for result, ok in zip(results, successes, strict=True) if ok]
    bad = [result for result, ok in zip(results, successes, strict=True) if not ok]
    for rule_id in RULES:
        stats[f"prm/{rule_id}/fire_rate"] = rate(list(results), rule_id)
        stats[f"prm/{rule_id}/discriminativeness"] = rate(good, rule_id) - rate(bad, rule_id) if good and bad else 0.0
    return stats


# ---------------------------------------------------------------------------------------------------------------------
# Documentation


def rules_markdown() -> str:
    """The rule table as markdown (the generated part of docs/prm_lite.md)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| ID | Name | Weight | Trigger | Rationale |", "|---|---|---|---|---|"]
    for rule in RULES.values():
        weight = f"{rule.weight:+.2f}" + (" per call" if rule.rule_id == "P8" else "")
        lines.append(f"| {rule.rule_id} | `{rule.name}` | {weight} | {cell(rule.trigger)} | {cell(rule.rationale)} |")
    return "\n".join(lines) + "\n"


def update_docs(path: str | Path) -> None:
    """Rewrites the table between the rule markers of ``path`` with ``rules_markdown()``."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    start, end = text.index(DOCS_START) + len(DOCS_START), text.index(DOCS_END)
    path.write_text(text[:start] + "\n" + rules_markdown() + text[end:], encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PRM-Lite rule table.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the rule table as markdown")
    group.add_argument("--update-docs", metavar="PATH", help="rewrite the rule table between the markers of PATH")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(rules_markdown())
    else:
        update_docs(args.update_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
