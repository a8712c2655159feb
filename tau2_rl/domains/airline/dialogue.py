"""What the offline scripted parties say in the airline: the oracle's questions and confirmations, the scripted user's
identification answers.

The airline's policy identifies a user by user id, and its reservations are six-character codes. The scripted user
reads them from the scenario (``known_info``, then the reason for the call and the task instructions); the rest of
both parties (opening, confirmations, closing, other questions) is the domain-neutral ``tau2_rl.envs.agents`` and
``tau2_rl.envs.users.scripted``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task

IDENTIFIERS = "user id, reservation number"
"""The identifying details the LLM user's project-protocol prompt lists as examples (``tau2_rl.envs.users.llm``)."""

_USER_ID = re.compile(r"\b[a-z]+(?:_[a-z]+)*_\d{3,}\b")
_RESERVATION_ID = re.compile(r"\b(?!HAT\d{3}\b)(?=[A-Z0-9]*[A-Z])(?=[A-Z0-9]*\d|[A-Z]{6}\b)[A-Z0-9]{6}\b")
_NAME = re.compile(r"\b(?:You are|Your name is|I am|My name is)\s+([A-Z][a-z]+(?: [A-Z][a-z]+)+)")
_NO_RESERVATION_ID = re.compile(
    r"(?:don't|do not|doesn't|can't|cannot)\s+(?:remember|know|recall)[^.]*reservation", re.I
)

_ASKS_USER_ID = re.compile(r"\buser[ _-]?id\b|\busername\b|\baccount\b|\bprofile\b|\bidentif|\bverify\b", re.I)
_ASKS_RESERVATION = re.compile(
    r"\b(?:reservation|confirmation|booking)[ _-]?(?:id|number|code|reference|#)|\bwhich reservation\b", re.I
)
_ASKS_NAME = re.compile(r"\b(?:full |first |last )?name\b", re.I)
_REQUEST = re.compile(r"\?|\bplease (?:provide|share|give|tell|send)\b|\bmay i have\b|\bi (?:will )?need\b", re.I)


@dataclass(frozen=True)
class AirlineIdentity:
    """What the scripted user can say to be identified, parsed once per task."""

    user_id: str | None
    name: str | None
    reservation_ids: tuple[str, ...]


def identity(task: Task) -> AirlineIdentity:
    """The user id, name and reservation ids of the task's scenario (``None`` / empty when it has none)."""
    instr = task.instructions
    user_ids = _USER_ID.findall(instr.known_info) or _USER_ID.findall(instr.task_instructions)
    names = _NAME.findall(instr.known_info)
    reservations: list[str] = []
    if not _NO_RESERVATION_ID.search(instr.unknown_info):
        for text in (instr.known_info, instr.reason_for_call, instr.task_instructions):
            for rid in _RESERVATION_ID.findall(text):
                if rid not in reservations:
                    reservations.append(rid)
    return AirlineIdentity(
        user_id=user_ids[0] if user_ids else None,
        name=names[0] if names else None,
        reservation_ids=tuple(reservations),
    )


def identity_answer(known: AirlineIdentity, text: str) -> str:
    """The ids and name the agent asked for, or "" when it asked for none of them."""
    if not _REQUEST.search(text):
        return ""
    wants_user = bool(_ASKS_USER_ID.search(text))
    wants_reservation = bool(_ASKS_RESERVATION.search(text))
    wants_name = bool(_ASKS_NAME.search(text))
    if not (wants_user or wants_reservation or wants_name):
        return ""
    parts = []
    if wants_user:
        parts.append(f"My user id is {known.user_id}." if known.user_id else "I don't remember my user id.")
    if wants_reservation:
        rids = known.reservation_ids
        if not rids:
            parts.append("I don't remember my reservation id.")
        elif len(rids) == 1:
            parts.append(f"My reservation id is {rids[0]}.")
        else:
            parts.append(f"My reservation ids are {', '.join(rids[:-1])} and {rids[-1]}.")
    if wants_name:
        parts.append(f"My name is {known.name}." if known.name else "I'd rather not say my name.")
    return " ".join(parts)


def opening_question(task: Task) -> str:
    """Asks for the ids the gold actions use that the user can know (the user id always, as the policy requires)."""
    scenario = " ".join(
        (task.instructions.known_info, task.instructions.reason_for_call, task.instructions.task_instructions)
    )
    known_reservations = [
        action.arguments["reservation_id"]
        for action in task.actions
        if isinstance(action.arguments.get("reservation_id"), str) and action.arguments["reservation_id"] in scenario
    ]
    wanted = "your user id and your reservation id" if known_reservations else "your user id"
    return f"I'd be happy to look into that. Could you please give me {wanted}?"


def _flights(flights: list[dict[str, Any]]) -> str:
    return " and ".join(f"{f.get('flight_number')} on {f.get('date')}" for f in flights) or "no flights"


def _passengers(passengers: list[dict[str, Any]]) -> str:
    return (
        " and ".join(f"{p.get('first_name')} {p.get('last_name')} (born {p.get('dob')})" for p in passengers)
        or "no passengers"
    )


def describe_action(name: str, args: dict[str, Any]) -> str:
    """A plain-language description of a write action, for the confirmation question the policy requires."""
    rid = args.get("reservation_id")
    if name == "cancel_reservation":
        return f"cancel reservation {rid}"
    if name == "update_reservation_flights":
        return (
            f"change reservation {rid} to {args.get('cabin')} class on the flights {_flights(args.get('flights', []))}"
            f" with any price difference settled with {args.get('payment_id')}"
        )
    if name == "update_reservation_baggages":
        return (
            f"set reservation {rid} to {args.get('total_baggages')} checked bags ({args.get('nonfree_baggages')} of "
            f"them paid) using {args.get('payment_id')} for any fee"
        )
    if name == "update_reservation_passengers":
        return f"update the passengers of reservation {rid} to {_passengers(args.get('passengers', []))}"
    if name == "book_reservation":
        payments = " and ".join(
            f"${p.get('amount')} from {p.get('payment_id')}" for p in args.get("payment_methods", [])
        )
        return (
            f"book a {str(args.get('flight_type', '')).replace('_', ' ')} {args.get('cabin')} trip from "
            f"{args.get('origin')} to {args.get('destination')} on the flights {_flights(args.get('flights', []))} "
            f"for {_passengers(args.get('passengers', []))} with {args.get('total_baggages')} checked bags "
            f"({args.get('nonfree_baggages')} of them paid) and insurance {args.get('insurance')} paying {payments}"
        )
    if name == "send_certificate":
        return f"send a certificate of ${args.get('amount')} to user {args.get('user_id')}"
    return f"run {name} with {json.dumps(args, sort_keys=True)}"
