"""The PRM-Lite rule sets: triggers, weights, rationale, in one table per version.

A rule is a function of a ``TurnContext`` (the turn and what the agent had seen before it) returning how many times
it fires in that turn. Rules read only the trajectory: never the task's gold actions, expected outcome or
``communicate_info``.

Two versions (``RULE_SETS``; the config's ``prm_rules`` picks one, so an ablation can run both):

- ``v1``: the 15 rules calibrated on the scripted corpus (P1–P8 penalties, B1–B7 bonuses);
- ``v2`` (default): calibrated on real agents too. It checks every write against the airline policy on the records
  the agent's own tool results showed (``policy``; P9), charges a write whose charge the user did not agree to (a
  price other than the one quoted, P10; more than the user's stated limit, P11; ``consent``), credits a refusal the
  policy and the records justify (B8), pays the write bonuses only for writes that break none of P9–P11, accepts a
  confirmation said in other words (P5/B5),
  drops P4 (ids in the text are not what the policy asks), exempts justified refusals from P7, and charges P8 only
  for failed calls past the budget (a long, correct episode is not a fault).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from tau2_rl.envs.episode import ToolCallRecord, TurnRecord
from tau2_rl.rewards.prm.detectors import (
    TOOL,
    _iter_strings,
    _text_before_calls,
    call_signature,
    declines_request,
    id_values,
    is_placeholder,
    mentionable_values,
    value_strings,
)
from tau2_rl.rewards.prm.vocabulary import Vocabulary

MAX_FREE_TOOL_CALLS = 8
"""P8 charges every tool call of an episode beyond this many (the gold trajectories need few calls)."""
TRUNCATED_TURN_COST = 4
"""P8 charges a turn cut off by the token budget as this many excess calls: it executes nothing and the episode can
no longer earn reward, so it must cost more than any single call."""


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
    seen_texts: Sequence[str]  # lower-cased user messages and successful tool results, in order
    tool_values: AbstractSet[str]  # mentionable values from successful tool results
    agent_mentioned: AbstractSet[str]  # mentionable values the agent already said to the user
    last_agent_message: str  # the agent's latest non-empty message to the user before this turn
    successful_signatures: AbstractSet[str]
    failed_calls: Sequence[ToolCallRecord]  # every failed call of earlier turns, in order
    previous_call: ToolCallRecord | None  # the last call of an earlier turn
    successful_read_before: bool
    read_tools_used: AbstractSet[str]  # read tools that succeeded in an earlier turn
    read_tools_credited: AbstractSet[str]  # read tools that already earned B3
    verified_ids: AbstractSet[tuple[str, str]]  # (id argument name, value) fetched by a lookup tool
    cancelled_ids: AbstractSet[str]  # reservation ids whose latest tool result says they are cancelled
    chained_values: AbstractSet[str]  # tool-derived ids that already earned B2
    fired_before: Mapping[str, int]  # rule id -> firings in earlier turns
    vocab: Vocabulary  # the domain's ids, look-ups, examples, read and terminal tools, policy (``vocabulary``)
    user_agreed: bool = False  # the latest user message agrees, in any words (v2's confirmation detector)
    facts: Any = None  # the domain policy's record of what was seen before the turn (and within it); None: no policy
    violations: Sequence[Sequence[str]] = ()  # per call of the turn: the policy checks its write breaks (P9)
    consent: Sequence[Sequence[str]] = ()  # per call of the turn: what its charge was not agreed to (P10, P11)


def _successful_writes(ctx: TurnContext) -> list[ToolCallRecord]:
    return [call for call in ctx.calls if call.is_write and not call.error]


def _is_seen(ctx: TurnContext, value: str) -> bool:
    return any(value in text for text in ctx.seen_texts)


# Penalties -----------------------------------------------------------------------------------------------------------


def _p1_placeholder(ctx: TurnContext) -> int:
    return int(
        any(
            is_placeholder(name, value, ctx.vocab)
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
    failed = {call_signature(call) for call in ctx.failed_calls} - {None}
    for call in ctx.calls:
        signature = call_signature(call)
        if signature is not None and signature in failed:
            return 1
        if call.error and signature is not None:
            failed.add(signature)
    return 0


def _p4_no_reasoning(ctx: TurnContext) -> int:
    told = (ctx.turn.message + " " + ctx.last_agent_message).lower()
    for call in ctx.calls:
        if call.is_write:
            ids = [value for _, value in id_values(call.arguments, ctx.vocab)]
            if not any(value in told for value in ids):
                return 1
    return 0


def _p5_unconfirmed_write(ctx: TurnContext) -> int:
    return int(not ctx.user_confirmed and any(call.is_write for call in ctx.calls))


def _p6_unseen_id(ctx: TurnContext) -> int:
    return int(
        any(
            value not in ctx.seen_values
            for call in ctx.calls
            if call.error or call.arguments is None
            for _, value in id_values(call.arguments, ctx.vocab)
        )
    )


def _p7_premature_transfer(ctx: TurnContext) -> int:
    read_before = ctx.successful_read_before
    if not read_before and not ctx.calls and declines_request(ctx.turn.message or ""):
        return 1  # turned the request down without having looked at anything
    if ctx.user_asked_human:
        return 0
    for call in ctx.calls:
        if call.name in ctx.vocab.terminal_tools and not read_before:
            return 1
        read_before = read_before or (call.name in ctx.vocab.read_tools and not call.error)
    return 0


def _p8_excess_calls(ctx: TurnContext) -> int:
    cut = TRUNCATED_TURN_COST if ctx.turn.truncated else 0
    return sum(index >= MAX_FREE_TOOL_CALLS for index in ctx.call_indices) + cut


# Bonuses: every one of them needs a successful call, and all but B1 and B7 a successful write ------------------------


def _b1_recovery(ctx: TurnContext) -> int:
    if ctx.fired_before.get("B1", 0) or not ctx.failed_calls:
        return 0
    failed = ctx.failed_calls[-1]
    return int(
        any(
            not call.error and call.name == failed.name and call_signature(call) != call_signature(failed)
            for call in ctx.calls
        )
    )


def _b2_data_chain(ctx: TurnContext) -> int:
    return int(
        any(
            ctx.seen_values.get(value) == TOOL and value not in ctx.chained_values
            for call in _successful_writes(ctx)
            for _, value in id_values(call.arguments, ctx.vocab)
        )
    )


def _b3_read_diversity(ctx: TurnContext) -> int:
    if not _successful_writes(ctx):
        return 0
    return len(ctx.read_tools_used - ctx.read_tools_credited)


def _b4_conditional_reasoning(ctx: TurnContext) -> int:
    return int(
        bool(_successful_writes(ctx))
        and all(not call.error for call in ctx.calls)
        and bool(_text_before_calls(ctx.turn))
    )


def _b5_confirmed_write(ctx: TurnContext) -> int:
    return int(ctx.user_confirmed and bool(_successful_writes(ctx)))


def _b6_verified_write(ctx: TurnContext) -> int:
    for call in _successful_writes(ctx):
        ids = [
            (name, ctx.vocab.normalize_id(call.arguments[name]))
            for name in ctx.vocab.verifiable_id_names & set(call.arguments or {})
        ]
        fetched = any(key in ctx.verified_ids for key in ids)
        live = not any(value in ctx.cancelled_ids for _, value in ids)
        if fetched and live and all(_is_seen(ctx, value) for value in value_strings(call.arguments, ctx.vocab)):
            return 1
    return 0


def _b7_grounded_reply(ctx: TurnContext) -> int:
    if ctx.calls or not ctx.turn.message or ctx.fired_before.get("B7", 0):
        return 0
    values = mentionable_values(ctx.turn.message)
    return int(bool((values & ctx.tool_values) - ctx.agent_mentioned))


# Version 2 -----------------------------------------------------------------------------------------------------------


def _compliant_writes(ctx: TurnContext) -> list[ToolCallRecord]:
    """Successful writes that break no policy rule on the records seen and charge what the user agreed to: the only
    writes v2's bonuses pay for."""
    none: list[Sequence[str]] = [()] * len(ctx.calls)
    return [
        call
        for call, broken, unagreed in zip(ctx.calls, ctx.violations or none, ctx.consent or none, strict=True)
        if call.is_write and not call.error and not broken and not unagreed
    ]


def _v2(bonus: Callable[[TurnContext], int]) -> Callable[[TurnContext], int]:
    """The v1 bonus, judged as if the turn's policy-violating writes had not been made."""

    def rule(ctx: TurnContext) -> int:
        compliant = _compliant_writes(ctx)
        if not compliant:
            return 0
        calls = [call for call in ctx.calls if not call.is_write or call in compliant]
        view = TurnContext(**{**ctx.__dict__, "calls": calls, "user_confirmed": ctx.user_agreed})
        return bonus(view)

    rule.__name__ = bonus.__name__ + "_v2"
    return rule


def _detail_words(call: ToolCallRecord) -> set[str]:
    """What listing a write's details would mention: every argument value (ids, flight numbers, dates, cabins also
    with spaces, amounts, counts), lower-cased."""
    words: set[str] = set()

    def visit(value: object) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)
        elif isinstance(value, bool) or value is None:
            return
        elif isinstance(value, (int, float)):
            words.add(str(int(value)) if float(value).is_integer() else str(value))
        else:
            text = str(value).strip().lower()
            if text and text not in ("yes", "no"):
                words.add(text.replace("_", " "))
                words.add(text)

    visit(call.arguments or {})
    return words


def _p4_unlisted_write_v2(ctx: TurnContext) -> int:
    told = (ctx.turn.message + " " + ctx.last_agent_message).lower()
    return int(any(call.is_write and not any(w in told for w in _detail_words(call)) for call in ctx.calls))


def _p5_unconfirmed_write_v2(ctx: TurnContext) -> int:
    return int(not ctx.user_agreed and any(call.is_write for call in ctx.calls))


def _p7_premature_transfer_v2(ctx: TurnContext) -> int:
    policy = ctx.vocab.policy
    if (
        policy is not None
        and not ctx.calls
        and declines_request(ctx.turn.message or "")
        and policy.justified_refusal(ctx.facts, ctx.turn.message)
    ):
        return 0
    return _p7_premature_transfer(ctx)


def _p8_excess_calls_v2(ctx: TurnContext) -> int:
    cut = TRUNCATED_TURN_COST if ctx.turn.truncated else 0
    return (
        sum(
            index >= MAX_FREE_TOOL_CALLS and (call.error or not call.is_write)
            for index, call in zip(ctx.call_indices, ctx.calls, strict=True)
        )
        + cut
    )


def _p9_policy_violation(ctx: TurnContext) -> int:
    return sum(bool(broken) for broken in ctx.violations)


def _p10_misquoted_charge(ctx: TurnContext) -> int:
    return sum("misquoted_charge" in issues for issues in ctx.consent)


def _p11_over_budget(ctx: TurnContext) -> int:
    return sum("over_budget" in issues for issues in ctx.consent)


def _b8_justified_refusal(ctx: TurnContext) -> int:
    policy = ctx.vocab.policy
    if policy is None or ctx.calls or ctx.fired_before.get("B8", 0) or not ctx.turn.message:
        return 0
    if not ctx.successful_read_before:
        return 0  # v1's P7 intent: a refusal is judged on the records, and a blind one has none
    return int(policy.denies(ctx.turn.message) and policy.justified_refusal(ctx.facts, ctx.turn.message))


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
        "A call identical to any earlier call of the episode that failed.",
        "Retrying a failing call unchanged cannot succeed; the agent should read the error and change something.",
        _p3_repeat_failed,
    ),
    Rule(
        "P4",
        "no_reasoning_before_action",
        -0.04,
        "A write call none of whose ids (reservation, user, payment, flight) appears in the turn's own text or in "
        "the agent's previous message to the user.",
        "Changing the booking without telling the user what will change is unauditable; a bare read is harmless, so "
        "reads are exempt (the seed rule charged every silent call and fired on 42% of gold trajectories).",
        _p4_no_reasoning,
    ),
    Rule(
        "P5",
        "unconfirmed_write",
        -0.04,
        "A write call when the user's latest message has no explicit, non-negated confirmation (yes, go ahead, "
        "proceed, confirm, ...).",
        "τ²'s domain policies require explicit user confirmation before any action that changes the database.",
        _p5_unconfirmed_write,
    ),
    Rule(
        "P6",
        "unseen_id",
        -0.05,
        "A call that fails and has an id-valued argument (the domain's `*_id` / `*_ids` arguments and flight numbers; "
        "at any depth) "
        "whose value never appeared in a user message or a successful tool result before this turn.",
        "A hallucinated id that reaches no record is a guess; charged only when the call fails, because a successful "
        "call on an id seen nowhere cannot be told from a correct id the agent knew (the seed rule fired on 54% of "
        "gold trajectories).",
        _p6_unseen_id,
    ),
    Rule(
        "P7",
        "premature_transfer",
        -0.03,
        "Giving up before any read call has succeeded: a transfer to a human agent the user did not ask for (no "
        "human, agent, representative or supervisor mentioned), or a reply without calls that declines the request "
        '("I can\'t help / cancel / change ...", "we are unable to ...").',
        "Transferring or refusing without even looking at the case gives up on tasks the tools can solve; whether a "
        "refusal is right depends on the records, so one made before reading any is a guess even when it happens to "
        "be right.",
        _p7_premature_transfer,
    ),
    Rule(
        "P8",
        "excess_tool_calls",
        -0.02,
        f"Each tool call beyond the {MAX_FREE_TOOL_CALLS}th of the episode (per call), and a turn cut off by the "
        f"token budget (counted as {TRUNCATED_TURN_COST} calls).",
        "A length penalty: padding an episode with calls, or generating without ever closing the turn, costs.",
        _p8_excess_calls,
    ),
    Rule(
        "B1",
        "recovery_after_error",
        0.02,
        "A successful call of the same tool as the last failed call, with different arguments, the failure having "
        "been seen in an earlier turn; once per episode.",
        "Reading an error and fixing the call is the skill long episodes need; once per episode, so staging "
        "failures pays at most +0.02, and a failure staged with an invented id costs more (P6).",
        _b1_recovery,
    ),
    Rule(
        "B2",
        "data_chain",
        0.02,
        "A successful write uses an id-valued argument whose value first appeared in a tool result (not a user "
        "message) and has not earned this bonus before.",
        "Chaining ids out of tool results into the change (user → reservation → payment) is how multi-step tasks get "
        "solved; paid at the write, so reads alone earn nothing.",
        _b2_data_chain,
    ),
    Rule(
        "B3",
        "read_diversity",
        0.01,
        "In a turn with a successful write: each distinct read tool that succeeded earlier and has not been credited "
        "yet (charged per tool).",
        "Gathering information from the right sources before acting; credited when an action follows, so reading "
        "for its own sake earns nothing.",
        _b3_read_diversity,
    ),
    Rule(
        "B4",
        "conditional_reasoning",
        0.005,
        "The turn has text before its first tool call, makes a successful write, and all its calls succeed.",
        "Explaining an action in the turn that takes it; pays only for writes that work: chatty reads earn nothing.",
        _b4_conditional_reasoning,
    ),
    Rule(
        "B5",
        "confirmed_write",
        0.04,
        "A successful write when the user's latest message explicitly confirms it (the P5 detector).",
        "The policy-compliant way to change the database: ask, get a yes, then act. The main progress signal.",
        _b5_confirmed_write,
    ),
    Rule(
        "B6",
        "verified_before_write",
        0.02,
        "A successful write on a reservation_id / user_id fetched in an earlier turn (get_reservation_details / "
        "get_user_details), not cancelled as last seen, whose every looked-up value (ids, dates, names, airports) "
        "occurs in an earlier user message or tool result.",
        "Checking the record before changing it, and acting only on values that came from somewhere: a wrong or "
        "invented value forfeits it.",
        _b6_verified_write,
    ),
    Rule(
        "B7",
        "grounded_reply",
        0.02,
        "A turn without tool calls whose message mentions a value (id, flight number, amount of two or more digits) "
        "from an earlier tool result that the agent had not mentioned before; once per episode.",
        "Reporting looked-up facts to the user is what COMMUNICATE checks; once per episode, so reciting pays little.",
        _b7_grounded_reply,
    ),
]

RULES_V1: dict[str, Rule] = {rule.rule_id: rule for rule in _RULE_LIST}
"""Version 1 in table order: penalties P1–P8, then bonuses B1–B7."""


def _replace(rule_id: str, **changes: object) -> Rule:
    return dataclasses.replace(RULES_V1[rule_id], **changes)  # type: ignore[arg-type]


_BONUS_NOTE = " v2: only writes that break no policy rule (P9) and charge what the user agreed to (P10, P11) count."
_V2_LIST = [
    RULES_V1["P1"],
    RULES_V1["P2"],
    RULES_V1["P3"],
    _replace(
        "P4",
        name="unlisted_write",
        trigger="A write call none of whose argument values (ids, flight numbers, dates, cabin, amounts, bag counts) "
        "appears in the turn's own text or in the agent's previous message to the user.",
        rationale="The policy asks the agent to list the action details before a write; v1 looked for ids only and "
        "charged details listed in words (a cabin, a date).",
        fn=_p4_unlisted_write_v2,
    ),
    _replace(
        "P5",
        trigger="A write call when the user's latest message neither confirms (yes, go ahead, ...) nor agrees in "
        "other words (sounds good, okay, that works, please book ...), negations excluded.",
        rationale="The policy requires explicit confirmation before any write; real users confirm in many words, and "
        "v1's keyword list charged confirmed writes.",
        fn=_p5_unconfirmed_write_v2,
    ),
    RULES_V1["P6"],
    _replace(
        "P7",
        trigger=RULES_V1["P7"].trigger + " v2: a refusal the policy justifies on what is known (B8's test, or a "
        "request the policy always denies: changing the number of passengers, adding insurance, removing bags) is "
        "exempt.",
        rationale="A refusal straight from the policy is correct even before any read; v1 charged it.",
        fn=_p7_premature_transfer_v2,
    ),
    _replace(
        "P8",
        trigger=f"Each tool call beyond the {MAX_FREE_TOOL_CALLS}th of the episode that is not a successful write, "
        f"and a turn cut off by the token budget (counted as {TRUNCATED_TURN_COST} calls).",
        rationale="A length penalty on reading and failing, not on getting things done: v1 also charged the writes "
        "of long, legitimate episodes.",
        fn=_p8_excess_calls_v2,
    ),
    Rule(
        "P9",
        "policy_violating_write",
        -0.10,
        "Per successful write that the domain's policy forbids on the records the agent's tool results showed before "
        "it (its checks: the domain folder's `DomainPolicy.violations`, listed per domain below the tables); off on a "
        "domain without such checks.",
        "What real agents get wrong is confirmed writes the policy forbids; the records that decide them are in the "
        "agent's own context, so this is a process check. It outweighs every bonus a write can earn.",
        _p9_policy_violation,
    ),
    Rule(
        "P10",
        "misquoted_charge",
        -0.10,
        "Per successful write that charges the user (the payment entries its own result added) when the agent's "
        "message the user answered quoted dollar amounts and the charge (its total, or every part) is none of them "
        "and does not follow from them in one step (the sum of all or of two, the difference of two, one times up to "
        "five passengers).",
        "The policy asks for the action details and an explicit yes; a yes to one price is not a yes to another, "
        "and real agents that miscompute a fare difference make exactly this write.",
        _p10_misquoted_charge,
    ),
    Rule(
        "P11",
        "over_budget",
        -0.10,
        'Per successful write that charges more than the latest spending limit the user stated ("under $500", '
        '"up to $200", "my budget is $300").',
        "A charge the user said they would not pay is not what they asked for, whatever they answered afterwards; "
        "the limit is in the conversation, so this is a process check.",
        _p11_over_budget,
    ),
    RULES_V1["B1"],
    *(
        _replace(rule_id, trigger=RULES_V1[rule_id].trigger + _BONUS_NOTE, fn=_v2(RULES_V1[rule_id].fn))
        for rule_id in ("B2", "B3", "B4", "B5", "B6")
    ),
    RULES_V1["B7"],
    Rule(
        "B8",
        "justified_refusal",
        0.03,
        "A turn without calls that declines the request after a successful read, when the policy forbids it on the "
        "records seen (a reservation that cannot be cancelled, a basic-economy or flown reservation to change, "
        "compensation for an ineligible user) or always (passenger count, insurance after booking, removing bags); "
        "once per episode.",
        "Denying a request against the policy is what the policy asks; on tasks whose right answer is no, it is the "
        "progress signal.",
        _b8_justified_refusal,
    ),
]
RULES_V2: dict[str, Rule] = {rule.rule_id: rule for rule in _V2_LIST}
"""Version 2 in table order."""
POLICY_RULES = ("P9", "P10", "P11", "B8")
"""v2's rules that ask the domain policy's checks (``Vocabulary.policy``): off on a domain without one."""

RULE_SETS: dict[str, dict[str, Rule]] = {"v1": RULES_V1, "v2": RULES_V2}
DEFAULT_RULE_SET = "v2"
RULES: dict[str, Rule] = RULE_SETS[DEFAULT_RULE_SET]
"""The default rule set's rules in table order."""


class UnknownRuleSetError(KeyError):
    """A rule-set name that is not in ``RULE_SETS``; the message lists the valid names."""

    def __str__(self) -> str:
        return str(self.args[0])


def get_rule_set(name: str) -> dict[str, Rule]:
    """The rules of version ``name`` ("v1" or "v2")."""
    if name not in RULE_SETS:
        raise UnknownRuleSetError(f"unknown PRM-Lite rule set {name!r}; valid: {', '.join(RULE_SETS)}")
    return RULE_SETS[name]


class UnknownRuleError(KeyError):
    """A rule id that is not in ``RULES``; the message lists the valid ids."""

    def __str__(self) -> str:
        return str(self.args[0])


def _unknown(rule_ids: Sequence[str], rules: Mapping[str, Rule] | None = None) -> UnknownRuleError:
    valid = ", ".join(rules if rules is not None else RULES)
    return UnknownRuleError(f"unknown PRM-Lite rule id(s) {list(rule_ids)}; valid ids: {valid}")


def get_rule(rule_id: str, rule_set: str = DEFAULT_RULE_SET) -> Rule:
    """The rule with ``rule_id`` (e.g. "P5") of version ``rule_set``."""
    rules = get_rule_set(rule_set)
    if rule_id not in rules:
        raise _unknown([rule_id], rules)
    return rules[rule_id]
