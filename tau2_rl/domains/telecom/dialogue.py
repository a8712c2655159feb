"""What the offline scripted parties say in telecom: the oracle's questions and confirmations, the scripted user's
identification.

Telecom's policy identifies a customer by the phone number of the line (``get_customer_by_phone``), or by name and
date of birth; every scenario's ``known_info`` reads "You are <name> with phone number <555-123-2002>". The rest of
both parties is the domain-neutral ``tau2_rl.envs.users.scripted`` and oracle.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task

IDENTIFIERS = "phone number, full name"
"""The identifying details the LLM user's project-protocol prompt lists as examples (``tau2_rl.envs.users.llm``)."""

_PHONE = re.compile(r"\b\d{3}-\d{3}-\d{4}\b")
_NAME = re.compile(r"\bYou are ([A-Z][a-z]+(?: [A-Z][a-z]+)+)")
_REQUEST = re.compile(r"\?|\bplease (?:provide|share|give|tell|confirm)\b|\bi (?:will )?need\b", re.I)
_ASKS_PHONE = re.compile(r"\bphone(?:[ -]?number)?\b|\bnumber\b|\bline\b", re.I)
_ASKS_NAME = re.compile(r"\b(?:full |first |last )?name\b", re.I)


@dataclass(frozen=True)
class TelecomIdentity:
    name: str | None
    phone_number: str | None


def identity(task: Task) -> TelecomIdentity:
    known = task.instructions.known_info
    names, phones = _NAME.findall(known), _PHONE.findall(known)
    return TelecomIdentity(names[0] if names else None, phones[0] if phones else None)


def identity_answer(known: TelecomIdentity, text: str) -> str:
    """The identification the agent asked for, or "" when it asked for none."""
    if not _REQUEST.search(text):
        return ""
    parts = []
    if _ASKS_NAME.search(text) and known.name:
        parts.append(f"My name is {known.name}.")
    if _ASKS_PHONE.search(text) and known.phone_number:
        parts.append(f"My phone number is {known.phone_number}.")
    return " ".join(parts)


def opening_question(task: Task) -> str:
    """The oracle's first question: the line's phone number, which its gold look-up uses."""
    return "I'd be happy to help. Could you please give me your full name and the phone number of your line?"


def describe_action(name: str, args: dict[str, Any]) -> str:
    """A telecom write of the agent in plain words, for the confirmation question the policy requires."""
    line = args.get("line_id")
    if name == "refuel_data":
        return f"add {args.get('gb_amount')} GB of data to line {line}"
    if name in ("enable_roaming", "disable_roaming"):
        return f"{name.split('_')[0]} roaming on line {line}"
    if name in ("suspend_line", "resume_line"):
        return f"{name.split('_')[0]} line {line}"
    if name == "send_payment_request":
        return f"send a payment request for bill {args.get('bill_id')}"
    return f"run {name} with {json.dumps(args, sort_keys=True)}"
