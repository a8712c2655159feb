"""What the user agreed to pay: a write's charge against the price the agent quoted and the limit the user set.

The policy asks the agent to list a write's details and get an explicit yes before making it. A yes covers the
details listed: when the agent's listing quotes a price and the write then charges another amount, the user agreed to
something else than what happened. Likewise a charge above a limit the user stated ("under $500", "up to $200") is
one they did not ask for. Both are judged on the trajectory alone: the charge is read from the write's own tool result
(the payment entries it added), the quote from the agent's message the user answered, the limit from the user's
messages. Refunds are not judged: agents rarely quote them and no user objects to getting money back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tau2_rl.domains.airline.policy_checks import MAX_PASSENGERS, PolicyFacts, load_json
from tau2_rl.envs.episode import ToolCallRecord

CONSENT_ISSUES: dict[str, str] = {
    "misquoted_charge": "The agent's listing quoted dollar amounts, none of them the amount the write charged.",
    "over_budget": "The write charged more than the latest spending limit the user stated.",
}

_NUMBER = r"(\d{1,3}(?:,\d{3})+(?:\.\d{1,2})?|\d+(?:\.\d{1,2})?)"
_AMOUNT = rf"(?:\$\s?{_NUMBER}(?!\d)|(?<![\w.,]){_NUMBER}\s?(?:dollars?|usd)\b)"
"""An amount with a ``$`` or written in dollars; its number is group 1 or group 2 (``_value``)."""
_MONEY = re.compile(_AMOUNT, re.IGNORECASE)
_BUDGET = re.compile(
    r"(?:\b(?:under|below|less than|no more than|not more than|at most|up to|within|maximum of|max(?:imum)?|"
    r"(?:budget|limit|cap)(?: is| of)?)|"
    r"(?:n't|\bnot|\bnever)\s+(?:want\s+to\s+|wish\s+to\s+|able\s+to\s+)?(?:pay|spend)\s+(?:any\s+)?"
    r"(?:more\s+than|over))\s+(?:(?:a|my|the|of|about|around|roughly|approximately)\s+)*"
    r"(?:(?:budget|limit|total)\s+(?:of\s+)?)?" + _AMOUNT
)
_MONEY_TOLERANCE = 0.01


def _value(match: re.Match[str]) -> float:
    """The number of a ``_MONEY`` or ``_BUDGET`` match (their only groups are ``_AMOUNT``'s two)."""
    return round(float((match.group(1) or match.group(2)).replace(",", "")), 2)


def money_amounts(text: str) -> set[float]:
    """Dollar amounts in ``text`` ("$1,023", "$ 89.50", "150 dollars", "75 USD"), as numbers."""
    return {_value(match) for match in _MONEY.finditer(text)}


def stated_budget(user_messages: Sequence[str]) -> float | None:
    """The latest spending limit the user stated ("under $500", "up to $200", "my budget is $300"), if any."""
    for text in reversed(user_messages):
        limits = [_value(match) for match in _BUDGET.finditer(text.lower())]
        if limits:
            return limits[-1]
    return None


def write_charges(facts: PolicyFacts, call: ToolCallRecord) -> list[float]:
    """The positive amounts ``call`` charged to the user's payment methods, read from its own result; call it with
    ``facts`` as they stood before the call. A change on a reservation never read shows no earlier payments to tell the
    new one from, so it gives nothing."""
    if not call.is_write or call.error:
        return []
    record = load_json(str(call.result))
    if not isinstance(record, Mapping) or not isinstance(record.get("payment_history"), list):
        return []
    history = [p for p in record["payment_history"] if isinstance(p, Mapping)]
    if call.name == "book_reservation":
        new = history
    else:
        before = facts.reservation(record.get("reservation_id", ""))
        if before is None or not isinstance(before.get("payment_history"), list):
            return []
        new = history[len(before["payment_history"]) :]
    amounts = [p.get("amount") for p in new]
    return [round(float(a), 2) for a in amounts if isinstance(a, (int, float)) and not isinstance(a, bool) and a > 0]


def quotes(amount: float, quoted: set[float]) -> bool:
    """Whether a listing that states the amounts ``quoted`` tells the user ``amount``: it states it, or it follows
    from them in one step (the sum of all, the sum or difference of two: "the new fare is $172, your old one $63"; a
    per-passenger price times up to five passengers). Lenient on purpose: a charge a careful reader could work out
    from the listing was agreed to."""
    values = sorted(quoted)
    derived = set(values) | {sum(values)}
    derived |= {a + b for i, a in enumerate(values) for b in values[i + 1 :]}
    derived |= {abs(a - b) for i, a in enumerate(values) for b in values[i + 1 :]}
    derived |= {a * n for a in values for n in range(2, MAX_PASSENGERS + 1)}
    return any(abs(amount - value) <= _MONEY_TOLERANCE for value in derived)


def consent_issues(charges: Sequence[float], quoted_in: str, user_messages: Sequence[str]) -> list[str]:
    """The ids (``CONSENT_ISSUES``) a write with ``charges`` raises, given the agent message the user answered
    (``quoted_in``) and the user's messages so far."""
    if not charges:
        return []
    total = round(sum(charges), 2)
    found: list[str] = []
    quoted = money_amounts(quoted_in)
    if quoted and not quotes(total, quoted) and not all(quotes(part, quoted) for part in charges):
        found.append("misquoted_charge")
    budget = stated_budget(user_messages)
    if budget is not None and total > budget + _MONEY_TOLERANCE:
        found.append("over_budget")
    return found
