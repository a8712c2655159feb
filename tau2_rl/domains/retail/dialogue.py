"""What the offline scripted parties say in retail: the oracle's questions and confirmations, the scripted user's
identity answers.

Retail's policy authenticates a user by email, or by first name + last name + zip code (``find_user_id_by_email``,
``find_user_id_by_name_zip``), and its orders are ``#W`` followed by seven digits. The scripted user reads them from
the scenario (``known_info`` first, then the reason for the call and the task instructions); a scenario that names
the user by id only (``mei_kovacs_8020``) gives the name the id is made of. The rest of the scripted user (opening,
confirmations, closing, other questions) is the domain-neutral ``tau2_rl.envs.users.scripted``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task

IDENTIFIERS = "email, zip code, order number"
"""The identifying details the LLM user's project-protocol prompt lists as examples (``tau2_rl.envs.users.llm``)."""

_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_ZIP = re.compile(r"\b\d{5}\b")
_ORDER_ID = re.compile(r"#W\d{7}\b")
_USER_ID = re.compile(r"\b([a-z]+)_([a-z]+)_\d{4}\b")
_NAME = re.compile(
    r"\b(?:You are|You're|Your name is|called|I am|My name is)\s+(?:an? [a-z ]+? called\s+)?"
    r"([A-Z][a-z]+(?: [A-Z][a-z]+)+)"
)
_NO_EMAIL = re.compile(r"(?:don't|do not|doesn't)\s+(?:remember|know|have|recall)[^.]*e-?mail", re.I)
_NO_ORDER = re.compile(r"(?:don't|do not|doesn't|can't|cannot)\s+(?:remember|know|recall)[^.]*order", re.I)

_REQUEST = re.compile(r"\?|\bplease (?:provide|share|give|tell|send)\b|\bmay i have\b|\bi (?:will )?need\b", re.I)
_ASKS_EMAIL = re.compile(r"\be-?mail\b", re.I)
_ASKS_NAME = re.compile(r"\b(?:full |first |last )?name\b", re.I)
_ASKS_ZIP = re.compile(r"\bzip(?:\s?code)?\b|\bpostal code\b", re.I)
_ASKS_ORDER = re.compile(r"\border[ _-]?(?:id|number|#)|\bwhich order\b", re.I)


@dataclass(frozen=True)
class RetailIdentity:
    """What the scripted user can say to be identified, parsed once per task."""

    email: str | None
    name: str | None
    zip_code: str | None
    order_ids: tuple[str, ...]


def identity(task: Task) -> RetailIdentity:
    """The email, name, zip code and order ids of the task's scenario (``None`` / empty when it has none)."""
    instr = task.instructions
    known = instr.known_info
    texts = (known, instr.reason_for_call, instr.task_instructions)
    emails = [] if _NO_EMAIL.search(instr.unknown_info) else _EMAIL.findall(known)
    names = _NAME.findall(known)
    if not names:
        names = [f"{first.title()} {last.title()}" for first, last in _USER_ID.findall(known)]
    zips = _ZIP.findall(known)
    orders: list[str] = []
    if not _NO_ORDER.search(instr.unknown_info):
        for text in texts:
            for order in _ORDER_ID.findall(text):
                if order not in orders:
                    orders.append(order)
    return RetailIdentity(
        email=emails[0] if emails else None,
        name=names[0] if names else None,
        zip_code=zips[-1] if zips else None,  # "moved from Florida (32169) to Phoenix (85033)": the new one
        order_ids=tuple(orders),
    )


def identity_answer(known: RetailIdentity, text: str) -> str:
    """The identification the agent asked for, or "" when it asked for none. Asked for "your email, or your name and
    zip code", the user gives what it knows (the email when it has one)."""
    if not _REQUEST.search(text):
        return ""
    wants_email, wants_name = bool(_ASKS_EMAIL.search(text)), bool(_ASKS_NAME.search(text))
    wants_zip, wants_order = bool(_ASKS_ZIP.search(text)), bool(_ASKS_ORDER.search(text))
    if not (wants_email or wants_name or wants_zip or wants_order):
        return ""
    parts: list[str] = []
    gave_email = wants_email and known.email is not None
    if gave_email:
        parts.append(f"My email is {known.email}.")
    elif wants_email:
        parts.append("I don't remember my email address.")
    # name and zip: when asked (unless asked as the alternative to an email just given), or instead of an email
    if (wants_name or wants_zip) and not gave_email or wants_email and not gave_email:
        if known.name:
            parts.append(f"My name is {known.name}.")
        if known.zip_code:
            parts.append(f"My zip code is {known.zip_code}.")
    if wants_order:
        orders = known.order_ids
        if not orders:
            parts.append("I don't remember the order id.")
        elif len(orders) == 1:
            parts.append(f"The order id is {orders[0]}.")
        else:
            parts.append(f"The order ids are {', '.join(orders[:-1])} and {orders[-1]}.")
    return " ".join(parts)


def opening_question(task: Task) -> str:
    """The oracle's first question: the identification its gold look-up uses, and the order ids the user knows."""
    first = task.actions[0].name if task.actions else ""
    wanted = "your email address" if first == "find_user_id_by_email" else "your first and last name and zip code"
    scenario = " ".join((task.instructions.known_info, task.instructions.reason_for_call))
    if any(isinstance(a.arguments.get("order_id"), str) and a.arguments["order_id"] in scenario for a in task.actions):
        wanted += ", and the order id"
    return f"I'd be happy to help. To find your account, could you please give me {wanted}?"


def _items(ids: Any) -> str:
    return ", ".join(str(i) for i in ids) if isinstance(ids, list) and ids else "no items"


def describe_action(name: str, args: dict[str, Any]) -> str:
    """A plain-language description of a retail write, for the confirmation question the policy requires."""
    order = args.get("order_id")
    if name == "cancel_pending_order":
        return f"cancel order {order} (reason: {args.get('reason')})"
    if name == "exchange_delivered_order_items":
        return (
            f"exchange items {_items(args.get('item_ids'))} of order {order} for {_items(args.get('new_item_ids'))},"
            f" settling the difference with {args.get('payment_method_id')}"
        )
    if name == "return_delivered_order_items":
        refund = args.get("payment_method_id")
        return f"return items {_items(args.get('item_ids'))} of order {order}, refunded to {refund}"
    if name == "modify_pending_order_items":
        return (
            f"change items {_items(args.get('item_ids'))} of order {order} to {_items(args.get('new_item_ids'))},"
            f" settling the difference with {args.get('payment_method_id')}"
        )
    if name == "modify_pending_order_payment":
        return f"pay order {order} with {args.get('payment_method_id')} instead"
    if name in ("modify_pending_order_address", "modify_user_address"):
        where = f"order {order}" if name == "modify_pending_order_address" else f"user {args.get('user_id')}"
        address = ", ".join(
            str(args.get(key)) for key in ("address1", "address2", "city", "state", "country", "zip") if args.get(key)
        )
        return f"change the address of {where} to {address}"
    return f"run {name} with {json.dumps(args, sort_keys=True)}"
