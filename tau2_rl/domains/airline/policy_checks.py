"""The airline policy as checks on a write, judged only on the records the trajectory's own tool results showed.

The policy is in the agent's prompt, and every fact a check reads (membership, payment methods and balances, cabin,
insurance, booking time, flight dates and statuses, passenger counts) came back from a tool call the agent made
earlier in the same episode, so a check is a process check, not a look at the answer: it never reads the task, its
gold actions or its expected outcome. What the records do not show is not charged: a write on a reservation the
agent never read breaks no check here (B6 pays for reading first), and an unread user profile makes the baggage
allowance unknown.

Each check is one sentence of the policy (quoted in ``VIOLATIONS``); ``write_violations`` returns the ids of those a
write breaks, ``justified_refusal`` says whether a refusal is one the policy and the records back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from tau2_rl.domains.airline.tools import CURRENT_DATETIME
from tau2_rl.envs.episode import ToolCallRecord
from tau2_rl.rewards.prm.detectors import declines_request

NOW = datetime.fromisoformat(CURRENT_DATETIME)
"""The policy's "current time" (the tools' fixed clock)."""
TODAY = NOW.date().isoformat()

FREE_BAGS: dict[str, dict[str, int]] = {
    "regular": {"basic_economy": 0, "economy": 1, "business": 2},
    "silver": {"basic_economy": 1, "economy": 2, "business": 3},
    "gold": {"basic_economy": 2, "economy": 3, "business": 4},
}
"""Free checked bags per passenger by membership and cabin (policy: "Checked bag allowance")."""
MAX_PASSENGERS = 5
MAX_PAYMENTS = {"certificate": 1, "credit_card": 1, "gift_card": 3}
COMPENSATION_PER_PASSENGER = (50, 100)  # delayed / cancelled flights

VIOLATIONS: dict[str, str] = {
    "flown": "If any portion of the flight has been flown, the agent cannot help (no cancel, no cabin change).",
    "not_cancellable": "Cancel only if booked within 24 h, cancelled by the airline, business, or insured.",
    "basic_economy_change": "Basic economy flights cannot be modified.",
    "trip_changed": "A flight change keeps the origin, destination and trip type.",
    "remove_bags": "The user can add but not remove checked bags.",
    "baggage_fee": "Free bags follow membership × cabin × passengers; each extra bag is 50 dollars.",
    "passenger_count": "The user cannot modify the number of passengers; at most five passengers.",
    "payment_not_in_profile": "All payment methods must already be in the user profile.",
    "payment_mix": "At most one certificate, one credit card and three gift cards; changes pay by card.",
    "balance": "A certificate or gift card cannot pay more than its balance.",
    "not_bookable": "Only a flight whose status is available can be booked.",
    "compensation_ineligible": "Only compensate a silver/gold member, an insured traveller or a business flyer.",
    "compensation_amount": "A certificate is $100 (cancelled) or $50 (delayed) times the number of passengers.",
    "delay_compensation_without_change": "For a delay, a certificate only after changing or cancelling the booking.",
    "compensation_unasked": "Do not proactively offer compensation unless the user explicitly asks for one.",
    "insurance_not_offered": "When booking, the agent should ask if the user wants to buy the travel insurance.",
}

_ASKED_COMPENSATION = re.compile(r"\b(?:compensat|certificate|voucher|refund|reimburs|gesture|make up for)")


def load_json(result: str) -> Any:
    """A tool result as JSON, or None when it is not (an error text, a plain string)."""
    try:
        return json.loads(result)
    except ValueError:
        return None


@dataclass
class PolicyFacts:
    """What the agent's successful tool results have shown so far: profiles, reservations, flight statuses."""

    users: dict[str, dict[str, Any]] = field(default_factory=dict)
    reservations: dict[str, dict[str, Any]] = field(default_factory=dict)
    flight_status: dict[tuple[str, str], str] = field(default_factory=dict)
    routes: dict[str, tuple[str, str]] = field(default_factory=dict)  # flight number -> (origin, destination)
    changed: set[str] = field(default_factory=set)  # reservations whose flights were changed or that were cancelled
    user_said: list[str] = field(default_factory=list)  # the user's messages so far, lower-cased
    agent_said: list[str] = field(default_factory=list)  # the agent's messages to the user so far, lower-cased
    last_reservation: str | None = None
    last_user: str | None = None

    def observe(self, call: ToolCallRecord) -> None:
        """Folds one executed call's result in (a failed call shows nothing)."""
        if call.error:
            return
        if call.name in ("update_reservation_flights", "cancel_reservation") and call.arguments:
            self.changed.add(str(call.arguments.get("reservation_id", "")).strip().upper())
        if call.name == "get_flight_status" and call.arguments:
            key = (str(call.arguments.get("flight_number", "")).upper(), str(call.arguments.get("date", "")))
            self.flight_status[key] = str(call.result).strip().strip('"').lower()
            return
        value = load_json(call.result)
        if isinstance(value, list):
            for item in value:
                for flight in item if isinstance(item, list) else [item]:
                    if isinstance(flight, Mapping):
                        self._route(flight)
                    if isinstance(flight, Mapping) and flight.get("date") and flight.get("status"):
                        key = (str(flight.get("flight_number", "")).upper(), str(flight["date"]))
                        self.flight_status[key] = str(flight["status"]).lower()
            return
        if not isinstance(value, Mapping):
            return
        if "reservation_id" in value and "flights" in value:
            reservation_id = str(value["reservation_id"]).upper()
            self.reservations[reservation_id] = dict(value)
            self.last_reservation = reservation_id
            for flight in value["flights"] if isinstance(value["flights"], list) else []:
                if isinstance(flight, Mapping):
                    self._route(flight)
        elif "user_id" in value and "payment_methods" in value:
            user_id = str(value["user_id"]).lower()
            self.users[user_id] = dict(value)
            self.last_user = user_id

    def _route(self, flight: Mapping[str, Any]) -> None:
        if flight.get("flight_number") and flight.get("origin") and flight.get("destination"):
            self.routes[str(flight["flight_number"]).upper()] = (str(flight["origin"]), str(flight["destination"]))

    def reservation(self, reservation_id: Any) -> dict[str, Any] | None:
        return self.reservations.get(str(reservation_id).strip().upper())

    def user(self, user_id: Any) -> dict[str, Any] | None:
        return self.users.get(str(user_id).strip().lower())

    def owner(self, reservation: Mapping[str, Any]) -> dict[str, Any] | None:
        return self.user(reservation.get("user_id", ""))


def _segments(flights: Any) -> set[tuple[str, str]]:
    if not isinstance(flights, list):
        return set()
    return {
        (str(f.get("flight_number", "")).upper(), str(f.get("date", ""))) for f in flights if isinstance(f, Mapping)
    }


def _keeps_trip(facts: PolicyFacts, reservation: Mapping[str, Any], flights: Any) -> bool:
    """Whether new ``flights`` keep the reservation's origin, destination and trip type, as far as the routes of the
    flights seen tell (an unknown segment gives the benefit of the doubt)."""
    if not isinstance(flights, list) or not flights:
        return True
    ordered = sorted(
        (f for f in flights if isinstance(f, Mapping)), key=lambda f: str(f.get("date", ""))
    )  # same-day legs keep their listed order (sorted is stable)
    legs = [facts.routes.get(str(f.get("flight_number", "")).upper()) for f in ordered]
    if any(leg is None for leg in legs):
        return True
    origin, destination = reservation.get("origin"), reservation.get("destination")
    airports = [legs[0][0], *(leg[1] for leg in legs)]  # type: ignore[index]
    if airports[0] != origin:
        return False
    if reservation.get("flight_type") == "round_trip":
        return airports[-1] == origin and destination in airports[1:-1]
    return airports[-1] == destination


def _flown(facts: PolicyFacts, reservation: Mapping[str, Any]) -> bool:
    """A segment dated before today, or one whose status was seen as flying or landed."""
    for number, date in _segments(reservation.get("flights")):
        if date and date < TODAY:
            return True
        if facts.flight_status.get((number, date)) in ("flying", "landed"):
            return True
    return False


def cancellable(facts: PolicyFacts, reservation: Mapping[str, Any]) -> bool:
    """The policy's four grounds; insurance counts as a ground (whether the reason is covered is the user's word)."""
    created = str(reservation.get("created_at") or "")
    try:
        recent = NOW - datetime.fromisoformat(created) <= timedelta(hours=24)
    except ValueError:
        recent = False
    airline_cancelled = any(
        facts.flight_status.get(segment) == "cancelled" for segment in _segments(reservation.get("flights"))
    )
    insured = reservation.get("insurance") == "yes"
    return recent or airline_cancelled or insured or reservation.get("cabin") == "business"


def _expected_nonfree(membership: Any, cabin: Any, passengers: int, total: Any) -> int | None:
    allowance = FREE_BAGS.get(str(membership), {}).get(str(cabin))
    if allowance is None or not isinstance(total, int) or isinstance(total, bool):
        return None
    return max(0, total - allowance * passengers)


def _payment_source(user: Mapping[str, Any], payment_id: Any) -> tuple[str | None, float | None]:
    method = (user.get("payment_methods") or {}).get(str(payment_id))
    if not isinstance(method, Mapping):
        return None, None
    amount = method.get("amount")
    return str(method.get("source")), float(amount) if isinstance(amount, (int, float)) else None


def _check_payment(user: Mapping[str, Any] | None, payment_id: Any, found: list[str], card_only: bool) -> None:
    if user is None:
        return
    source, _ = _payment_source(user, payment_id)
    if source is None:
        found.append("payment_not_in_profile")
    elif card_only and source == "certificate":
        found.append("payment_mix")


def _own_reservations(facts: PolicyFacts, user: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The reservations read so far that belong to ``user``."""
    return [r for r in facts.reservations.values() if str(r.get("user_id", "")).lower() == str(user["user_id"])]


def _compensation_eligible(user: Mapping[str, Any], own: list[dict[str, Any]]) -> bool:
    """Policy: compensation only for a silver or gold member, or a traveller with insurance or in business."""
    return user.get("membership") in ("silver", "gold") or any(
        r.get("insurance") == "yes" or r.get("cabin") == "business" for r in own
    )


def write_violations(facts: PolicyFacts, call: ToolCallRecord) -> list[str]:
    """The ids (``VIOLATIONS``) of the policy rules ``call`` breaks, judged on ``facts`` as they stood before it."""
    args = call.arguments or {}
    found: list[str] = []
    if call.name in ("cancel_reservation", "update_reservation_flights", "update_reservation_baggages",
                     "update_reservation_passengers"):  # fmt: skip
        reservation = facts.reservation(args.get("reservation_id", ""))
        if reservation is None:
            return []  # nothing shown: nothing to judge (B6 pays for reading first)
        owner = facts.owner(reservation)
        passengers = len(reservation.get("passengers") or [])
        if call.name == "cancel_reservation":
            if _flown(facts, reservation):
                found.append("flown")
            elif not cancellable(facts, reservation):
                found.append("not_cancellable")
        elif call.name == "update_reservation_flights":
            changed = _segments(args.get("flights")) != _segments(reservation.get("flights"))
            if changed and reservation.get("cabin") == "basic_economy":
                found.append("basic_economy_change")
            if changed and not _keeps_trip(facts, reservation, args.get("flights")):
                found.append("trip_changed")
            new = _segments(args.get("flights")) - _segments(reservation.get("flights"))
            if any(facts.flight_status.get(segment, "available") != "available" for segment in new):
                found.append("not_bookable")
            if args.get("cabin") != reservation.get("cabin") and _flown(facts, reservation):
                found.append("flown")
            _check_payment(owner, args.get("payment_id"), found, card_only=True)
        elif call.name == "update_reservation_baggages":
            total, current = args.get("total_baggages"), reservation.get("total_baggages")
            if isinstance(total, int) and isinstance(current, int) and total < current:
                found.append("remove_bags")
            if owner is not None:
                expected = _expected_nonfree(owner.get("membership"), reservation.get("cabin"), passengers, total)
                if expected is not None and args.get("nonfree_baggages") != expected:
                    found.append("baggage_fee")
            _check_payment(owner, args.get("payment_id"), found, card_only=True)
        elif isinstance(args.get("passengers"), list) and len(args["passengers"]) != passengers:
            found.append("passenger_count")
    elif call.name == "book_reservation":
        user = facts.user(args.get("user_id", ""))
        if user is None:
            return []
        passengers = args.get("passengers") if isinstance(args.get("passengers"), list) else []
        if len(passengers) > MAX_PASSENGERS:
            found.append("passenger_count")
        counts: dict[str, int] = {}
        for payment in args.get("payment_methods") or []:
            payment = payment if isinstance(payment, Mapping) else {}
            source, balance = _payment_source(user, payment.get("payment_id"))
            if source is None:
                found.append("payment_not_in_profile")
                continue
            counts[source] = counts.get(source, 0) + 1
            amount = payment.get("amount")
            if balance is not None and isinstance(amount, (int, float)) and amount > balance + 1e-9:
                found.append("balance")
        if any(counts.get(source, 0) > limit for source, limit in MAX_PAYMENTS.items()):
            found.append("payment_mix")
        expected = _expected_nonfree(user.get("membership"), args.get("cabin"), len(passengers),
                                     args.get("total_baggages"))  # fmt: skip
        if expected is not None and args.get("nonfree_baggages") != expected:
            found.append("baggage_fee")
        if any(facts.flight_status.get(s, "available") != "available" for s in _segments(args.get("flights"))):
            found.append("not_bookable")
        if not any("insurance" in text for text in facts.agent_said):
            found.append("insurance_not_offered")
    elif call.name == "send_certificate":
        user = facts.user(args.get("user_id", ""))
        if user is None:
            return []
        own = _own_reservations(facts, user)
        if not _compensation_eligible(user, own):
            found.append("compensation_ineligible")
        delayed, cancelled = (
            {per * len(r.get("passengers") or []) for r in own} for per in COMPENSATION_PER_PASSENGER
        )
        amount = args.get("amount")
        if amount not in delayed | cancelled:
            found.append("compensation_amount")
        elif amount not in cancelled and not facts.changed:
            found.append("delay_compensation_without_change")
        if not any(_ASKED_COMPENSATION.search(text) for text in facts.user_said):
            found.append("compensation_unasked")
    return sorted(set(found))


# Refusals ------------------------------------------------------------------------------------------------------------

_TOPICS: dict[str, re.Pattern[str]] = {
    "cancel": re.compile(r"\b(?:cancel|refund)"),
    "change": re.compile(r"\b(?:chang|modif|rebook|reschedul)"),
    "compensation": re.compile(r"\b(?:compensat|certificate|voucher|refund)"),
    "always": re.compile(
        r"\b(?:remov|add|chang|reduc|modif|cancel)\w*\b[^.?!]{0,40}\b(?:passengers?|travell?ers?)\b"
        r"|\bwithout (?:the|your) user id"
        r"|\bnumber of passengers\b|\binsurance\b|\bremov\w*[^.?!]{0,30}\bbag"
    ),
}
"""What a refusal is about. ``always``: requests the policy forbids whatever the records say (changing the number of
passengers, adding insurance after booking, removing bags, acting without the user id)."""


_DENIAL = re.compile(
    r"\b(?:not (?:be )?(?:allowed|permitted|possible|eligible|able to)|(?:cannot|can't|can not) be"
    r"|unable to|isn't possible|no way to|(?:does|do) not (?:allow|permit|qualify)|doesn't (?:allow|permit|qualify)"
    r"|(?:is|are) non-?(?:refundable|modifiable|changeable))\b"
)


def denies(text: str) -> bool:
    """Whether an agent message says a request cannot be done ("basic economy flights cannot be modified", "is not
    eligible", "the policy does not allow"): ``declines_request`` plus the impersonal ways agents say no."""
    return declines_request(text) or bool(_DENIAL.search(text.lower().replace("\u2019", "'")))


def justified_refusal(facts: PolicyFacts, text: str) -> bool:
    """Whether declining the request the message talks about is what the policy says, given the records read."""
    lowered = text.lower()
    topics = {name for name, pattern in _TOPICS.items() if pattern.search(lowered)}
    if "always" in topics:
        return True
    reservation = facts.reservation(facts.last_reservation) if facts.last_reservation else None
    if reservation is not None:
        if "cancel" in topics and (_flown(facts, reservation) or not cancellable(facts, reservation)):
            return True
        if "change" in topics and (reservation.get("cabin") == "basic_economy" or _flown(facts, reservation)):
            return True
    user = facts.user(facts.last_user) if facts.last_user else None
    if "compensation" in topics and user is not None:
        return not _compensation_eligible(user, _own_reservations(facts, user))
    return False
