"""The PRM-Lite engine: one pass over an episode's messages, every rule on every assistant turn, a clipped total.

Context rule: assistant turn k is judged only on what the agent could have seen when it wrote turn k: user messages
and results of *successful* tool calls that came before it in ``record.messages`` (an error result only echoes the
agent's own arguments, so it does not make a value "seen"). The context is built incrementally in one pass.

The reference sets (``REFERENCE_SETS``) add ``reference``'s per-turn terms, the only path by which a score reads the
task (its gold actions, through the environment passed as ``env``); the rule modules never do.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tau2_rl.envs.episode import EpisodeRecord, ToolCallRecord
from tau2_rl.envs.spec import DomainSpec
from tau2_rl.rewards.prm.detectors import (
    TOOL,
    USER,
    _tokens,
    asks_for_human,
    call_signature,
    id_values,
    is_agreement,
    is_confirmation,
    mentionable_values,
)
from tau2_rl.rewards.prm.reference import REFERENCE_TERMS, HasDomain, ReferenceTerm, reference_turns
from tau2_rl.rewards.prm.rules import (
    DEFAULT_RULE_SET,
    Rule,
    TurnContext,
    UnknownRuleSetError,
    _unknown,
    get_rule_set,
)
from tau2_rl.rewards.prm.vocabulary import Vocabulary, vocabulary

DEFAULT_CLIP = (-0.5, 0.5)
REFERENCE_SETS: dict[str, str | None] = {"reference": None, "reference+v2": "v2"}
"""Rule sets that also score against the task's gold actions (``reference``): name -> the trajectory-only rule set
summed with it (None: the reference terms alone)."""
PRM_RULE_SETS: tuple[str, ...] = ("v1", "v2", *REFERENCE_SETS)
"""Every name ``score_episode(rules=...)`` and the config's ``prm_rules`` accept."""
TRAINING_RULE_SET = "reference"
"""The process reward prm_lite and joint train with unless ``prm_rules`` says otherwise: the one that ranks real
agents' conversations by their outcome in every domain with both outcomes (docs/prm_lite.md, "Real agents' τ²
results": per-task AUC 0.83-1.00, where v2 gave 0.17-0.63). It reads the task's gold actions, so it is a training
signal only; evaluation's verdicts use ``DEFAULT_RULE_SET``, which reads the trajectory alone."""


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


def _effective_weights(
    rules: Mapping[str, Rule | ReferenceTerm], weights: Mapping[str, float] | None
) -> dict[str, float]:
    resolved = {rule_id: rule.weight for rule_id, rule in rules.items()}
    if weights:
        unknown = [rule_id for rule_id in weights if rule_id not in rules]
        if unknown:
            raise _unknown(unknown, rules)
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
    rules: str = DEFAULT_RULE_SET,
    env: HasDomain | None = None,
    spec: DomainSpec | None = None,
) -> PRMResult:
    """Scores every assistant turn of ``record`` with the rules of version ``rules``, in one pass over
    ``record.messages``.

    Turn k is judged against the user messages and successful tool results that precede its assistant message; the
    results of its own calls are folded into the context only after it is scored, except that each write's policy
    check (``DomainPolicy.write_violations``) sees the records returned by the calls before it in the same turn.

    The reference sets (``REFERENCE_SETS``: "reference", "reference+v2") also score each turn against the task's
    gold actions, which only they read, from ``env`` (the environment that played the episode: ``env.task``); the
    turn scores are summed and the episode total clipped once.

    The record's domain (``spec``, else that of its task in ``env``) picks the rules' vocabulary (``vocabulary``):
    which arguments are ids, which tools look a record up, and whether a domain policy's rules (P9–P11, B8) apply.
    """
    low, high = clip
    if not low <= high:
        raise ValueError(f"clip must be (low, high) with low <= high, got {clip}")
    if rules not in PRM_RULE_SETS:
        raise UnknownRuleSetError(f"unknown PRM-Lite rule set {rules!r}; valid: {', '.join(PRM_RULE_SETS)}")
    if spec is None and env is None:
        raise ValueError("score_episode needs the record's domain: pass spec=... or the environment (env=...)")
    vocab = vocabulary(spec if spec is not None else env.task(record.task_id).spec)  # type: ignore[union-attr]
    if rules in REFERENCE_SETS:
        return _score_with_reference(record, (low, high), weights, rules, env, vocab)
    rule_set = get_rule_set(rules)
    resolved = _effective_weights(rule_set, weights)
    turn_scores, fired_per_turn, rule_counts = _score_rules(record, rule_set, resolved, vocab)
    return _clipped(turn_scores, fired_per_turn, sum(turn_scores), rule_counts, (low, high))


def _clipped(
    turn_scores: list[float],
    fired: list[dict[str, int]],
    raw: float,
    rule_counts: dict[str, int],
    clip: tuple[float, float],
) -> PRMResult:
    """The result with the process score clipped to ``clip`` (the raw sum kept for the report)."""
    low, high = clip
    return PRMResult(turn_scores=turn_scores, fired=fired, process_score=min(max(raw, low), high), raw_score=raw,
                     rule_counts=rule_counts)  # fmt: skip


def _score_with_reference(
    record: EpisodeRecord,
    clip: tuple[float, float],
    weights: dict[str, float] | None,
    rules: str,
    env: HasDomain | None,
    vocab: Vocabulary,
) -> PRMResult:
    if env is None:
        raise ValueError(
            f"prm_rules {rules!r} scores against the task's gold actions: pass the environment (env=...) that holds it"
        )
    base = REFERENCE_SETS[rules]
    tables: dict[str, Any] = dict(REFERENCE_TERMS)
    if base is not None:
        tables.update(get_rule_set(base))
    resolved = _effective_weights(tables, weights)
    reference = reference_turns(record, env)
    if base is not None:
        turn_scores, fired_per_turn, rule_counts = _score_rules(record, get_rule_set(base), resolved, vocab)
    else:
        turn_scores, fired_per_turn, rule_counts = [0.0] * len(record.turns), [{} for _ in record.turns], {}
    rule_counts.update(dict.fromkeys(REFERENCE_TERMS, 0))
    for turn, fired in enumerate(reference.fired):
        for rule_id, count in fired.items():
            fired_per_turn[turn][rule_id] = count
            rule_counts[rule_id] += count
            turn_scores[turn] += resolved[rule_id] * count
    raw = sum(turn_scores)
    for rule_id, count in reference.unattached.items():  # an episode without a turn still owes its missing writes
        rule_counts[rule_id] += count
        raw += resolved[rule_id] * count
    return _clipped(turn_scores, fired_per_turn, raw, rule_counts, clip)


def _score_rules(
    record: EpisodeRecord, rule_set: Mapping[str, Rule], resolved: Mapping[str, float], vocab: Vocabulary
) -> tuple[list[float], list[dict[str, int]], dict[str, int]]:
    """One pass of ``rule_set`` over ``record``: per-turn scores and firings, and the episode's firing counts.
    Without a domain policy (``vocab.policy``) no policy or consent verdict is made: P9–P11 and B8 read the
    records a domain's policy checks."""
    n_assistant = sum(message.get("role") == "assistant" for message in record.messages)
    skip = n_assistant - len(record.turns)  # the fixed greeting(s) before the first policy turn
    if skip < 0:
        raise ValueError(
            f"record of task {record.task_id} has {len(record.turns)} turns but only {n_assistant} assistant messages"
        )

    seen_values: dict[str, str] = {}
    seen_texts: list[str] = []
    seen_users: list[str] = []
    tool_values: set[str] = set()
    agent_mentioned: set[str] = set()
    successful_signatures: set[str] = set()
    read_tools_used: set[str] = set()
    read_tools_credited: set[str] = set()
    failed_calls: list[ToolCallRecord] = []
    last_agent_message = ""
    verified_ids: set[tuple[str, str]] = set()
    cancelled_ids: set[str] = set()
    chained_values: set[str] = set()
    previous_call: ToolCallRecord | None = None
    successful_read_before = False
    user_asked_human = False
    policy = vocab.policy
    facts = policy.new_facts() if policy is not None else None

    turn_scores: list[float] = []
    fired_per_turn: list[dict[str, int]] = []
    rule_counts = dict.fromkeys(rule_set, 0)
    assistant_seen = 0
    for message in record.messages:
        role = message.get("role")
        if role == "user":
            content = str(message.get("content") or "")
            seen_texts.append(content.lower())
            seen_users.append(content)
            if facts is not None:
                facts.user_said.append(content.lower())
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
        indices = [index for index in turn.tool_call_indices if 0 <= index < len(record.tool_calls)]
        calls = [record.tool_calls[index] for index in indices]
        violations: list[list[str]] = []
        consent: list[list[str]] = []
        for call in calls if policy is not None else ():  # in order: earlier reads inform later writes
            violations.append(policy.write_violations(facts, call) if call.is_write and not call.error else [])
            consent.append(policy.consent_issues(facts, call, last_agent_message))
            facts.observe(call)
        last_user = str(turn.last_user_message or "")
        ctx = TurnContext(
            turn=turn,
            calls=calls,
            call_indices=indices,
            user_confirmed=is_confirmation(last_user),
            user_asked_human=user_asked_human,
            seen_values=seen_values,
            seen_texts=seen_texts,
            tool_values=tool_values,
            agent_mentioned=agent_mentioned,
            last_agent_message=last_agent_message,
            successful_signatures=successful_signatures,
            failed_calls=failed_calls,
            previous_call=previous_call,
            successful_read_before=successful_read_before,
            read_tools_used=read_tools_used,
            read_tools_credited=read_tools_credited,
            verified_ids=verified_ids,
            cancelled_ids=cancelled_ids,
            chained_values=chained_values,
            fired_before=rule_counts,
            # other words agree only to something the agent said ("please cancel X" opening the call is a request)
            user_agreed=is_confirmation(last_user) or (is_agreement(last_user) and len(seen_users) > 1),
            facts=facts,
            violations=violations,
            consent=consent,
            vocab=vocab,
        )
        fired: dict[str, int] = {}
        score = 0.0
        for rule_id, rule in rule_set.items():
            count = int(rule.fn(ctx))
            if count:
                fired[rule_id] = count
                rule_counts[rule_id] += count
                score += resolved[rule_id] * count
        turn_scores.append(score)
        fired_per_turn.append(fired)

        # Fold this turn into the context of the next ones (rule_counts already is: rules read it as fired_before).
        message_text = str(turn.message or "")
        if message_text and facts is not None:
            facts.agent_said.append(message_text.lower())
        agent_mentioned.update(mentionable_values(message_text))
        last_agent_message = message_text or last_agent_message
        if "B3" in fired:
            read_tools_credited.update(read_tools_used)
        for call in calls:
            previous_call = call
            if call.error:
                failed_calls.append(call)
                continue
            signature = call_signature(call)
            if signature is not None:
                successful_signatures.add(signature)
            if call.is_write:
                chained_values.update(v for _, v in id_values(call.arguments, vocab) if seen_values.get(v) == TOOL)
            result = str(call.result)
            seen_texts.append(result.lower())
            for token in _tokens(result):
                seen_values.setdefault(token, TOOL)
            tool_values.update(mentionable_values(result))
            _track_status(result, cancelled_ids, vocab)
            if call.name in vocab.read_tools:
                successful_read_before = True
                read_tools_used.add(call.name)
            id_name = vocab.lookup_tools.get(call.name)
            if id_name is not None and call.arguments and id_name in call.arguments:
                verified_ids.add((id_name, vocab.normalize_id(call.arguments[id_name])))

    return turn_scores, fired_per_turn, rule_counts


def _track_status(result: str, cancelled_ids: set[str], vocab: Vocabulary) -> None:
    """Keeps ``cancelled_ids`` equal to the records (the airline's reservations, retail's orders:
    ``vocab.record_id_field``) whose latest result (a JSON record) says "cancelled"."""
    key = vocab.record_id_field
    if f'"{key}"' not in result:
        return
    try:
        record = json.loads(result)
    except ValueError:
        return
    if isinstance(record, dict) and isinstance(record.get(key), str):
        record_id = vocab.normalize_id(record[key])
        if record.get("status") == "cancelled":
            cancelled_ids.add(record_id)
        else:
            cancelled_ids.discard(record_id)
