"""The 14 τ²-bench airline tools: one JSON schema each (what the model is shown) and τ²'s exact behaviour.

The schemas (OpenAI function format) are what the chat template shows the model. Like τ²-bench, nothing checks a call
against them: the arguments are passed as keyword arguments to the tool, the tool builds τ²'s pydantic models from
them (lax mode: ``"100"`` becomes ``100.0`` in a certificate, a passenger's extra keys are dropped) and assigns some
of them unvalidated (``total_baggages="7"`` is stored as given). A tool that fails half-way keeps the changes it made
before the failure (a certificate listed twice in one booking is removed, then the second lookup fails). Any
exception becomes the observation ``"Error: <message>"``; a result is shown as τ²'s ``Environment.to_json_str``
shows it (``json.dumps`` of the ``model_dump``: model field order, ``null`` for unset optionals, ASCII escapes).
``tests/data/tau2_reference.json`` pins all of this against τ²'s own code (see ``benchmarks/tau2_reference.py``).

Where τ² would hang instead of answering (``calculate("9 ** 9 ** 9")``) we answer with an error; see ``calculator``.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from typing import Any

from tau2_rl.domains.airline.models import (
    AirportCode,
    Certificate,
    DirectFlight,
    Flight,
    FlightDateStatusAvailable,
    FlightInfo,
    Passenger,
    Payment,
    Reservation,
    ReservationFlight,
    User,
)
from tau2_rl.envs.calculator import calculate
from tau2_rl.envs.state import EpisodeState
from tau2_rl.envs.toolkit import Dumped, ToolError, ToolResult, respond

CURRENT_DATETIME = "2024-05-15T15:00:00"  # τ²'s fixed "now"
NEW_RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")
NEW_PAYMENT_IDS = (3221322, 3221323, 3221324)
CABINS = ["business", "economy", "basic_economy"]
AIRPORTS = [
    ("SFO", "San Francisco"), ("JFK", "New York"), ("LAX", "Los Angeles"), ("ORD", "Chicago"), ("DFW", "Dallas"),
    ("DEN", "Denver"), ("SEA", "Seattle"), ("ATL", "Atlanta"), ("MIA", "Miami"), ("BOS", "Boston"),
    ("PHX", "Phoenix"), ("IAH", "Houston"), ("LAS", "Las Vegas"), ("MCO", "Orlando"), ("EWR", "Newark"),
    ("CLT", "Charlotte"), ("MSP", "Minneapolis"), ("DTW", "Detroit"), ("PHL", "Philadelphia"), ("LGA", "LaGuardia"),
]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Schemas


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _s(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _i(description: str) -> dict[str, Any]:
    return {"type": "integer", "description": description}


def _arr(description: str, items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "description": description, "items": items}


_FLIGHT_INFO = _obj(
    {
        "flight_number": _s("Flight number, such as 'HAT001'."),
        "date": _s("The date for the flight in the format 'YYYY-MM-DD', such as '2024-05-01'."),
    }
)
_PASSENGER = _obj(
    {
        "first_name": _s("Passenger's first name"),
        "last_name": _s("Passenger's last name"),
        "dob": _s("Date of birth in YYYY-MM-DD format"),
    }
)
_PAYMENT = _obj(
    {"payment_id": _s("Unique identifier for the payment"), "amount": _i("Payment amount in dollars")},
)
_RESERVATION_ID = _s("The reservation ID, such as 'ZFA04Y'.")
_USER_ID = _s("The user ID, such as 'sara_doe_496'.")
_PAYMENT_ID = _s(
    "The payment id stored in user profile, such as 'credit_card_7815826', 'gift_card_7815826', 'certificate_7815826'."
)
_ORIGIN = _s("The origin city airport in three letters, such as 'JFK'.")
_DESTINATION = _s("The destination city airport in three letters, such as 'LAX'.")
_DATE = _s("The date of the flight in the format 'YYYY-MM-DD', such as '2024-01-01'.")

_SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "book_reservation": (
        "Book a reservation.",
        _obj(
            {
                "user_id": _s("The ID of the user to book the reservation such as 'sara_doe_496'."),
                "origin": _s("The IATA code for the origin city such as 'SFO'."),
                "destination": _s("The IATA code for the destination city such as 'JFK'."),
                "flight_type": _s(
                    "The type of flight such as 'one_way' or 'round_trip'.", enum=["round_trip", "one_way"]
                ),
                "cabin": _s("The cabin class such as 'basic_economy', 'economy', or 'business'.", enum=CABINS),
                "flights": _arr("An array of objects containing details about each piece of flight.", _FLIGHT_INFO),
                "passengers": _arr("An array of objects containing details about each passenger.", _PASSENGER),
                "payment_methods": _arr("An array of objects containing details about each payment method.", _PAYMENT),
                "total_baggages": _i("The total number of baggage items to book the reservation."),
                "nonfree_baggages": _i("The number of non-free baggage items to book the reservation."),
                "insurance": _s("Whether the reservation has insurance.", enum=["yes", "no"]),
            }
        ),
    ),
    "calculate": (
        "Calculate the result of a mathematical expression.",
        _obj(
            {
                "expression": _s(
                    "The mathematical expression to calculate, such as '2 + 2'. The expression can contain numbers, "
                    "operators (+, -, *, /), parentheses, and spaces."
                )
            }
        ),
    ),
    "cancel_reservation": ("Cancel the whole reservation.", _obj({"reservation_id": _RESERVATION_ID})),
    "get_reservation_details": ("Get the details of a reservation.", _obj({"reservation_id": _RESERVATION_ID})),
    "get_user_details": ("Get the details of a user, including their reservations.", _obj({"user_id": _USER_ID})),
    "list_all_airports": ("Returns a list of all available airports.", _obj({})),
    "search_direct_flight": (
        "Search for direct flights between two cities on a specific date.",
        _obj({"origin": _ORIGIN, "destination": _DESTINATION, "date": _DATE}),
    ),
    "search_onestop_flight": (
        "Search for one-stop flights between two cities on a specific date.",
        _obj({"origin": _ORIGIN, "destination": _DESTINATION, "date": _DATE}),
    ),
    "send_certificate": (
        "Send a certificate to a user. Be careful!",
        _obj(
            {
                "user_id": _s("The ID of the user to book the reservation, such as 'sara_doe_496'."),
                "amount": _i("The amount of the certificate to send."),
            }
        ),
    ),
    "transfer_to_human_agents": (
        "Transfer the user to a human agent, with a summary of the user's issue. Only transfer if\n"
        " -  the user explicitly asks for a human agent\n"
        " -  given the policy and the available tools, you cannot solve the user's issue.",
        _obj({"summary": _s("A summary of the user's issue.")}),
    ),
    "update_reservation_baggages": (
        "Update the baggage information of a reservation.",
        _obj(
            {
                "reservation_id": _RESERVATION_ID,
                "total_baggages": _i("The updated total number of baggage items included in the reservation."),
                "nonfree_baggages": _i("The updated number of non-free baggage items included in the reservation."),
                "payment_id": _PAYMENT_ID,
            }
        ),
    ),
    "update_reservation_flights": (
        "Update the flight information of a reservation.",
        _obj(
            {
                "reservation_id": _RESERVATION_ID,
                "cabin": _s("The cabin class of the reservation", enum=CABINS),
                "flights": _arr(
                    "An array of objects containing details about each piece of flight in the ENTIRE new "
                    "reservation. Even if the a flight segment is not changed, it should still be included in the "
                    "array.",
                    _FLIGHT_INFO,
                ),
                "payment_id": _PAYMENT_ID,
            }
        ),
    ),
    "update_reservation_passengers": (
        "Update the passenger information of a reservation.",
        _obj(
            {
                "reservation_id": _RESERVATION_ID,
                "passengers": _arr("An array of objects containing details about each passenger.", _PASSENGER),
            }
        ),
    ),
    "get_flight_status": (
        "Get the status of a flight.",
        _obj({"flight_number": _s("The flight number."), "date": _s("The date of the flight.")}),
    ),
}

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
    for name, (description, parameters) in _SCHEMAS.items()
]
"""All tool schemas in OpenAI function format, in τ²'s order; pass as ``tools=`` to ``apply_chat_template``."""

TOOL_NAMES = tuple(_SCHEMAS)
WRITE_TOOLS = frozenset(
    {
        "book_reservation",
        "cancel_reservation",
        "send_certificate",
        "update_reservation_baggages",
        "update_reservation_flights",
        "update_reservation_passengers",
    }
)
READ_TOOLS = frozenset({"get_reservation_details", "get_user_details", "list_all_airports", "search_direct_flight",
                        "search_onestop_flight", "get_flight_status"})  # fmt: skip
TERMINAL_TOOLS = frozenset({"transfer_to_human_agents"})  # ends the conversation in effect, not the episode itself


# ---------------------------------------------------------------------------------------------------------------------
# Implementations


class AirlineTools:
    """τ²'s ``AirlineTools`` semantics over one episode's ``EpisodeState``.

    The methods keep τ²'s names and parameters on purpose: a call with a missing or unknown argument fails with the
    very ``TypeError`` text τ² shows (``AirlineTools.get_user_details() missing 1 required positional argument:
    'user_id'``). Records that a tool may change are the state's private models (``state.model``); pure reads use the
    plain dicts.
    """

    def __init__(self, state: EpisodeState) -> None:
        self.state = state

    # -- lookups (τ²'s messages; an unhashable id raises Python's TypeError, as in τ²) -------------------------------

    def _user(self, user_id: Any) -> User:
        if not self.state.contains("users", user_id):
            raise ToolError(f"User {user_id} not found")
        return self.state.model("users", user_id)  # type: ignore[return-value]

    def _reservation(self, reservation_id: Any) -> Reservation:
        if not self.state.contains("reservations", reservation_id):
            raise ToolError(f"Reservation {reservation_id} not found")
        return self.state.model("reservations", reservation_id)  # type: ignore[return-value]

    def _flight(self, flight_number: Any) -> dict[str, Any]:
        if not self.state.contains("flights", flight_number):
            raise ToolError(f"Flight {flight_number} not found")
        return self.state.get("flights", flight_number)  # type: ignore[return-value]

    def _flight_instance(self, flight_number: Any, date: Any) -> dict[str, Any]:
        flight = self._flight(flight_number)
        if date not in flight["dates"]:
            raise ToolError(f"Flight {flight_number} not found on date {date}")
        return flight["dates"][date]

    def _new_reservation_id(self) -> str:
        for reservation_id in NEW_RESERVATION_IDS:
            if not self.state.contains("reservations", reservation_id):
                return reservation_id
        raise ToolError("Too many reservations")

    def _search_direct(self, date: Any, origin: Any, destination: Any, leave_after: Any = None) -> list[DirectFlight]:
        results = []
        for flight in self.state.values("flights"):
            if (
                (origin is None or flight["origin"] == origin)
                and (destination is None or flight["destination"] == destination)
                and date in flight["dates"]
                and flight["dates"][date]["status"] == "available"
                # τ² compares the "HH:MM:SS[+1]" strings lexicographically
                and (leave_after is None or flight["scheduled_departure_time_est"] >= leave_after)
            ):
                instance = flight["dates"][date]
                results.append(
                    DirectFlight(
                        flight_number=flight["flight_number"],
                        origin=flight["origin"],
                        destination=flight["destination"],
                        status="available",
                        scheduled_departure_time_est=flight["scheduled_departure_time_est"],
                        scheduled_arrival_time_est=flight["scheduled_arrival_time_est"],
                        available_seats=instance["available_seats"],
                        prices=instance["prices"],
                    )
                )
        return results

    @staticmethod
    def _payment_for_update(user: User, payment_id: Any, total_price: Any) -> Payment | None:
        """τ²'s rule for paying a change: no certificates, gift cards need the balance and are charged at once."""
        if payment_id not in user.payment_methods:
            raise ToolError("Payment method not found")
        method = user.payment_methods[payment_id]
        if method.source == "certificate":
            raise ToolError("Certificate cannot be used to update reservation")
        if method.source == "gift_card" and method.amount < total_price:  # type: ignore[union-attr]
            raise ToolError("Gift card balance is not enough")
        if method.source == "gift_card":
            method.amount -= total_price  # type: ignore[union-attr]
        return Payment(payment_id=payment_id, amount=total_price) if total_price != 0 else None

    # -- the 14 tools, in τ²'s order ---------------------------------------------------------------------------------

    def book_reservation(
        self,
        user_id: Any,
        origin: Any,
        destination: Any,
        flight_type: Any,
        cabin: Any,
        flights: Any,
        passengers: Any,
        payment_methods: Any,
        total_baggages: Any,
        nonfree_baggages: Any,
        insurance: Any,
    ) -> Reservation:
        if all(isinstance(flight, dict) for flight in flights):
            flights = [FlightInfo(**flight) for flight in flights]
        if all(isinstance(passenger, dict) for passenger in passengers):
            passengers = [Passenger(**passenger) for passenger in passengers]
        if all(isinstance(payment, dict) for payment in payment_methods):
            payment_methods = [Payment(**payment) for payment in payment_methods]
        user = self._user(user_id)
        reservation_id = self._new_reservation_id()
        reservation = Reservation(
            reservation_id=reservation_id,
            user_id=user_id,
            origin=origin,
            destination=destination,
            flight_type=flight_type,
            cabin=cabin,
            flights=[],
            passengers=deepcopy(passengers),
            payment_history=deepcopy(payment_methods),
            created_at=CURRENT_DATETIME,
            total_baggages=total_baggages,
            nonfree_baggages=nonfree_baggages,
            insurance=insurance,
        )
        total_price: Any = 0
        instances = []
        for info in flights:
            flight_number = info.flight_number
            if not self.state.contains("flights", flight_number):
                raise ToolError(f"Flight {flight_number} not found")
            flight: Flight = self.state.model("flights", flight_number)  # type: ignore[assignment]
            if info.date not in flight.dates:
                raise ToolError(f"Flight {flight_number} not found on date {info.date}")
            instance = flight.dates[info.date]
            if not isinstance(instance, FlightDateStatusAvailable):
                raise ToolError(f"Flight {flight_number} not available on date {info.date}")
            if instance.available_seats[cabin] < len(passengers):
                raise ToolError(f"Not enough seats on flight {flight_number}")
            price = instance.prices[cabin]
            reservation.flights.append(
                ReservationFlight(
                    origin=flight.origin,
                    destination=flight.destination,
                    flight_number=flight_number,
                    date=info.date,
                    price=price,
                )
            )
            instances.append(instance)
            total_price += price * len(passengers)
        if insurance == "yes":
            total_price += 30 * len(passengers)
        total_price += 50 * nonfree_baggages
        for payment in payment_methods:
            if payment.payment_id not in user.payment_methods:
                raise ToolError(f"Payment method {payment.payment_id} not found")
            method = user.payment_methods[payment.payment_id]
            if method.source in {"gift_card", "certificate"} and method.amount < payment.amount:  # type: ignore
                raise ToolError(f"Not enough balance in payment method {payment.payment_id}")
        total_payment = sum(payment.amount for payment in payment_methods)
        if total_payment != total_price:
            raise ToolError(f"Payment amount does not add up, total price is {total_price}, but paid {total_payment}")
        # All checks passed: charge. A certificate listed twice is removed by its first entry; the second lookup then
        # raises KeyError with the user already changed, exactly as in τ².
        for payment in payment_methods:
            method = user.payment_methods[payment.payment_id]
            if method.source == "gift_card":
                method.amount -= payment.amount  # type: ignore[union-attr]
            elif method.source == "certificate":
                user.payment_methods.pop(payment.payment_id)
        for instance in instances:
            instance.available_seats[cabin] -= len(passengers)
        self.state.insert("reservations", reservation_id, reservation)
        user.reservations.append(reservation_id)
        return reservation

    def calculate(self, expression: Any) -> str:
        return calculate(expression)

    def cancel_reservation(self, reservation_id: Any) -> Reservation:
        reservation = self._reservation(reservation_id)
        refunds = [Payment(payment_id=p.payment_id, amount=-p.amount) for p in reservation.payment_history]
        reservation.payment_history.extend(refunds)
        reservation.status = "cancelled"
        # τ² does not release the seats of a cancelled reservation.
        return reservation

    def get_reservation_details(self, reservation_id: Any) -> Dumped:
        if not self.state.contains("reservations", reservation_id):
            raise ToolError(f"Reservation {reservation_id} not found")
        return Dumped(self.state.get("reservations", reservation_id))  # type: ignore[arg-type]

    def get_user_details(self, user_id: Any) -> Dumped:
        if not self.state.contains("users", user_id):
            raise ToolError(f"User {user_id} not found")
        return Dumped(self.state.get("users", user_id))  # type: ignore[arg-type]

    def list_all_airports(self) -> list[AirportCode]:
        return [AirportCode(iata=iata, city=city) for iata, city in AIRPORTS]

    def search_direct_flight(self, origin: Any, destination: Any, date: Any) -> list[DirectFlight]:
        return self._search_direct(date=date, origin=origin, destination=destination)

    def search_onestop_flight(self, origin: Any, destination: Any, date: Any) -> list[list[DirectFlight]]:
        results = []
        for first in self._search_direct(date=date, origin=origin, destination=None):
            first.date = date
            # The second leg's own date: the next day when the first lands after midnight. τ² builds it as
            # f"2024-05-{day + 1}" (no zero padding); we keep that so search results match τ²'s exactly.
            second_date = f"2024-05-{int(date[-2:]) + 1}" if "+1" in first.scheduled_arrival_time_est else date
            for second in self._search_direct(
                date=second_date,
                origin=first.destination,
                destination=destination,
                leave_after=first.scheduled_arrival_time_est,
            ):
                second.date = second_date
                results.append([first, second])
        return results

    def send_certificate(self, user_id: Any, amount: Any) -> str:
        user = self._user(user_id)
        for number in NEW_PAYMENT_IDS:
            payment_id = f"certificate_{number}"
            if payment_id not in user.payment_methods:
                user.payment_methods[payment_id] = Certificate(id=payment_id, amount=amount, source="certificate")
                return f"Certificate {payment_id} added to user {user_id} with amount {amount}."
        raise ToolError("Too many certificates")

    def transfer_to_human_agents(self, summary: Any) -> str:
        return "Transfer successful"

    def update_reservation_baggages(
        self, reservation_id: Any, total_baggages: Any, nonfree_baggages: Any, payment_id: Any
    ) -> Reservation:
        reservation = self._reservation(reservation_id)
        user = self._user(reservation.user_id)
        total_price = 50 * max(0, nonfree_baggages - reservation.nonfree_baggages)
        payment = self._payment_for_update(user, payment_id, total_price)
        if payment is not None:
            reservation.payment_history.append(payment)
        reservation.total_baggages = total_baggages  # unvalidated, as in τ²
        reservation.nonfree_baggages = nonfree_baggages
        return reservation

    def update_reservation_flights(
        self, reservation_id: Any, cabin: Any, flights: Any, payment_id: Any
    ) -> Reservation:
        if all(isinstance(flight, dict) for flight in flights):
            flights = [FlightInfo(**flight) for flight in flights]
        reservation = self._reservation(reservation_id)
        user = self._user(reservation.user_id)
        n_passengers = len(reservation.passengers)
        total_price: Any = 0
        new_flights = []
        for info in flights:
            kept = next(
                (
                    f
                    for f in reservation.flights
                    if f.flight_number == info.flight_number and f.date == info.date and cabin == reservation.cabin
                ),
                None,
            )
            if kept is not None:
                total_price += kept.price * n_passengers
                new_flights.append(kept)
                continue
            flight = self._flight(info.flight_number)
            instance = self._flight_instance(info.flight_number, info.date)
            if instance["status"] != "available":
                raise ToolError(f"Flight {info.flight_number} not available on date {info.date}")
            if instance["available_seats"][cabin] < n_passengers:
                raise ToolError(f"Not enough seats on flight {info.flight_number}")
            entry = ReservationFlight(
                flight_number=info.flight_number,
                date=info.date,
                price=instance["prices"][cabin],
                origin=flight["origin"],
                destination=flight["destination"],
            )
            total_price += entry.price * n_passengers
            new_flights.append(entry)
        total_price -= sum(f.price for f in reservation.flights) * n_passengers
        payment = self._payment_for_update(user, payment_id, total_price)
        if payment is not None:
            reservation.payment_history.append(payment)
        reservation.flights = new_flights
        reservation.cabin = cabin  # unvalidated, as in τ²
        # Like τ², a flight change does not update the flights' seat counts.
        return reservation

    def update_reservation_passengers(self, reservation_id: Any, passengers: Any) -> Reservation:
        if all(isinstance(passenger, dict) for passenger in passengers):
            passengers = [Passenger(**passenger) for passenger in passengers]
        reservation = self._reservation(reservation_id)
        if len(passengers) != len(reservation.passengers):
            raise ToolError("Number of passengers does not match")
        reservation.passengers = deepcopy(passengers)
        return reservation

    def get_flight_status(self, flight_number: Any, date: Any) -> str:
        return self._flight_instance(flight_number, date)["status"]


TOOL_FUNCTIONS: dict[str, Callable[..., Any]] = {name: getattr(AirlineTools, name) for name in TOOL_NAMES}
"""The unbound tool methods by name (τ²'s ``use_tool`` calls them with the arguments as keywords)."""


def execute_tool(state: EpisodeState, name: str, arguments: Any) -> ToolResult:
    """Runs one call as τ²'s ``Environment.get_response`` does. Never raises: failures become ``Error: ...``."""
    return respond(name, arguments, getattr(AirlineTools(state), name) if name in TOOL_FUNCTIONS else None)
