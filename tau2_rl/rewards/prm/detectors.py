"""PRM-Lite text and argument detectors: what counts as a placeholder, a confirmation, an id, a reportable value.

Every argument set comes from the domain's ``Vocabulary`` (derived from its tool schemas: no per-tool lists), so a
new tool with an ``*_id`` argument is covered without editing the rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from tau2_rl.envs.episode import AGENT_STOP_TOKEN, ToolCallRecord, TurnRecord
from tau2_rl.envs.tool_calls import TOOL_CALL_OPEN
from tau2_rl.rewards.prm.vocabulary import Vocabulary

USER, TOOL = "user", "tool"  # where a value first appeared

# ---------------------------------------------------------------------------------------------------------------------
# Text detectors

_PLACEHOLDER_WORDS = frozenset(
    {"", "xxx", "placeholder", "example", "string", "...", "…", "n/a", "unknown", "tbd", "null", "none"}
)
_TEMPLATE = re.compile(r"<[^<>]*>|\{[^{}]*\}|\[[^\[\]]*\]")
_PLACEHOLDER_PARTS = re.compile(r"xxx|placeholder")
_YOUR = re.compile(r"^your[_\s-]")


def is_placeholder(name: str | None, value: str, vocab: Vocabulary) -> bool:
    """Whether a string argument is a template or stand-in rather than a value the agent obtained."""
    text = value.strip().lower()
    if text in _PLACEHOLDER_WORDS or text in vocab.example_values:
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


_AGREE = re.compile(
    r"\b(?:sounds? (?:good|great|fine|perfect)|ok(?:ay)?|alright|all right|that works|works for me"
    r"|let's do (?:it|that)|let's go|(?:please|kindly) (?:book|change|cancel|update|make|add|upgrade|downgrade|modify"
    r"|process|send|switch|apply|issue)|i(?:'d| would) like to proceed|perfect|great|agreed|i agree"
    r"|fine with (?:me|that)|do it)\b"
)


def is_agreement(text: str) -> bool:
    """``is_confirmation`` or an agreement said in other words ("sounds good", "okay, please book it", "that works
    for me"), not negated within its clause: PRM-Lite v2's confirmation detector (the engine counts the other words
    only as the answer to a question of the agent). Real users rarely say "yes"; the v1 keyword list charged
    confirmed writes as unconfirmed."""
    if is_confirmation(text):
        return True
    text = _normalize_quotes(text)
    if _REFUSAL.search(text):
        return False
    for match in _AGREE.finditer(text):
        clause = _CLAUSE_END.split(text[: match.start()])[-1]
        if not _NEGATOR.search(" ".join(clause.split()[-4:])):
            return True
    return False


_HUMAN_REQUEST = re.compile(r"\b(?:human|agent|representative|supervisor)s?\b")


def asks_for_human(text: str) -> bool:
    """Whether a user message mentions a human / agent / representative / supervisor (a reason to transfer)."""
    return bool(_HUMAN_REQUEST.search(text.lower()))


_DECLINE = re.compile(
    r"\b(?:i|we)(?: am|'m| are|'re)? (?:unable|not able) to (?:help|assist|do|process|proceed|make|offer|cancel|change"
    r"|modify|book|issue|refund)\b"
    r"|\b(?:i|we) (?:cannot|can't|can not|won't be able to) (?:help|assist|do|process|proceed|make|offer|cancel|change"
    r"|modify|book|issue|refund)\b"
)


def declines_request(text: str) -> bool:
    """Whether an agent message turns the user's request down ("I can't help with that", "we are unable to cancel");
    "I can't find ..." is not a refusal."""
    return bool(_DECLINE.search(_normalize_quotes(text)))


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


def id_values(arguments: Mapping[str, Any] | None, vocab: Vocabulary) -> list[tuple[str, str]]:
    """(argument name, normalized value) of every id-valued argument at any depth (``vocab``: the domain's id
    arguments and how its ids are normalized)."""
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
        elif name in vocab.id_argument_names and isinstance(value, (str, int)) and not isinstance(value, bool):
            found.append((name, vocab.normalize_id(value)))

    visit(arguments, None)
    return found


def call_signature(call: ToolCallRecord) -> str | None:
    """Name plus canonical JSON of the arguments (None for a block that did not parse: identity is unknowable)."""
    if call.arguments is None or not call.name:
        return None
    return json.dumps([call.name, call.arguments], sort_keys=True, separators=(",", ":"), default=str)


def _text_before_calls(turn: TurnRecord) -> str:
    return turn.raw_text.split(TOOL_CALL_OPEN, 1)[0].replace(AGENT_STOP_TOKEN, "").strip()


def value_strings(arguments: Mapping[str, Any] | None, vocab: Vocabulary) -> list[str]:
    """The lower-cased string values of a call's arguments that the agent must have obtained from somewhere: every
    string leaf except enum choices (ids, dates, names, airport codes)."""
    return [
        value.strip().lower()
        for name, value in _iter_strings(arguments or {})
        if name not in vocab.enum_argument_names and value.strip()
    ]
