"""The 14 τ²-bench airline tools: one JSON schema each (the single source of truth) and their semantics.

The schemas (OpenAI function format) are what the chat template shows the model and what ``validate_arguments``
checks before a tool runs. The implementations follow τ²-bench's ``AirlineTools`` behaviour and error messages
(booking decrements seats, a flight change re-prices and updates the cabin, one-stop search dates the second leg,
certificate / gift-card / credit-card payment rules, cancellation refunds without releasing seats) and write through
``AirlineState`` so that only touched records are copied.

A tool signals a failure by raising ``ToolError``; ``execute_tool`` turns it into τ²'s ``"Error: ..."`` observation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from airline_rl.envs.calculator import CalculationError, calculate
from airline_rl.envs.state import AirlineState

logger = logging.getLogger(__name__)

CURRENT_DATETIME = "2024-05-15T15:00:00"  # τ²'s fixed "now"
NEW_RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")
NEW_PAYMENT_IDS = (3221322, 3221323, 3221324)
CABINS = ["business", "economy", "basic_economy"]
MAX_INTEGER_ARGUMENT = 2**53  # integers the JSON of the database can hold exactly (and print: no 4300-digit limit)
AIRPORTS = [
    ("SFO", "San Francisco"), ("JFK", "New York"), ("LAX", "Los Angeles"), ("ORD", "Chicago"), ("DFW", "Dallas"),
    ("DEN", "Denver"), ("SEA", "Seattle"), ("ATL", "Atlanta"), ("MIA", "Miami"), ("BOS", "Boston"),
    ("PHX", "Phoenix"), ("IAH", "Houston"), ("LAS", "Las Vegas"), ("MCO", "Orlando"), ("EWR", "Newark"),
    ("CLT", "Charlotte"), ("MSP", "Minneapolis"), ("DTW", "Detroit"), ("PHL", "Philadelphia"), ("LGA", "LaGuardia"),
]  # fmt: skip


class ToolError(Exception):
    """A tool call that τ² answers with ``Error: <message>``."""


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
TERMINAL_TOOLS = frozenset({"transfer_to_human_agents"})


# ---------------------------------------------------------------------------------------------------------------------
# Argument validation


def _check(value: Any, schema: dict[str, Any], path: str) -> Any:
    """Validates ``value`` against our schema subset; returns it with integral floats coerced to int."""
    kind = schema["type"]
    if kind == "string":
        if not isinstance(value, str):
            raise ToolError(f"Argument '{path}' must be a string, got {type(value).__name__}")
        if "enum" in schema and value not in schema["enum"]:
            raise ToolError(f"Argument '{path}' must be one of {schema['enum']}, got {value!r}")
        return value
    if kind == "integer":
        if isinstance(value, float) and value.is_integer() and abs(value) < MAX_INTEGER_ARGUMENT:
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ToolError(f"Argument '{path}' must be an integer, got {type(value).__name__}")
        if abs(value) >= MAX_INTEGER_ARGUMENT:  # a huge amount would reach the database and break its serialisation
            raise ToolError(f"Argument '{path}' is out of range (its magnitude must be below 2**53)")
        return value
    if kind == "array":
        if not isinstance(value, list):
            raise ToolError(f"Argument '{path}' must be an array, got {type(value).__name__}")
        return [_check(item, schema["items"], f"{path}[{i}]") for i, item in enumerate(value)]
    if kind == "object":
        if not isinstance(value, dict):
            raise ToolError(f"Argument '{path}' must be an object, got {type(value).__name__}")
        properties = schema["properties"]
        missing = [name for name in schema["required"] if name not in value]
        if missing:
            raise ToolError(f"Missing required argument(s) {', '.join(repr(m) for m in missing)} in '{path}'")
        extra = [name for name in value if name not in properties]
        if extra:
            raise ToolError(f"Unexpected argument(s) {', '.join(repr(e) for e in extra)} in '{path}'")
        return {name: _check(v, properties[name], f"{path}.{name}" if path else name) for name, v in value.items()}
    raise AssertionError(f"unsupported schema type {kind}")


def validate_arguments(name: str, arguments: Any) -> dict[str, Any]:
    """Checks a call against the tool's schema; raises ``ToolError`` naming the tool or argument that is wrong."""
    if name not in _SCHEMAS:
        raise ToolError(f"Tool '{name}' not found.")
    if not isinstance(arguments, dict):
        raise ToolError(f"Arguments of tool '{name}' must be a JSON object, got {type(arguments).__name__}")
    return _check(arguments, _SCHEMAS[name][1], "")


# ---------------------------------------------------------------------------------------------------------------------
# Implementations


def _user(state: AirlineState, user_id: str, mutable: bool = False) -> dict[str, Any]:
    if not state.contains("users", user_id):
        raise ToolError(f"User {user_id} not found")
    return state.get_mut("users", user_id) if mutable else state.get("users", user_id)


def _reservation(state: AirlineState, reservation_id: str, mutable: bool = False) -> dict[str, Any]:
    if not state.contains("reservations", reservation_id):
        raise ToolError(f"Reservation {reservation_id} not found")
    return state.get_mut("reservations", reservation_id) if mutable else state.get("reservations", reservation_id)


def _flight(state: AirlineState, flight_number: str) -> dict[str, Any]:
    flight = state.get("flights", flight_number)
    if flight is None:
        raise ToolError(f"Flight {flight_number} not found")
    return flight


def _flight_instance(state: AirlineState, flight_number: str, date: str) -> dict[str, Any]:
    flight = _flight(state, flight_number)
    if date not in flight["dates"]:
        raise ToolError(f"Flight {flight_number} not found on date {date}")
    return flight["dates"][date]


def _search_direct(
    state: AirlineState, date: str, origin: str | None, destination: str | None, leave_after: str | None = None
) -> list[dict[str, Any]]:
    results = []
    for flight in state.values("flights"):
        instance = flight["dates"].get(date)
        if (
            (origin is None or flight["origin"] == origin)
            and (destination is None or flight["destination"] == destination)
            and instance is not None
            and instance["status"] == "available"
            # τ² compares the "HH:MM:SS[+1]" strings lexicographically
            and (leave_after is None or flight["scheduled_departure_time_est"] >= leave_after)
        ):
            results.append(
                {
                    "flight_number": flight["flight_number"],
                    "origin": flight["origin"],
                    "destination": flight["destination"],
                    "status": "available",
                    "scheduled_departure_time_est": flight["scheduled_departure_time_est"],
                    "scheduled_arrival_time_est": flight["scheduled_arrival_time_est"],
                    "date": None,
                    "available_seats": dict(instance["available_seats"]),
                    "prices": dict(instance["prices"]),
                }
            )
    return results


def _payment_for_update(user: dict[str, Any], payment_id: str, total_price: int) -> dict[str, Any] | None:
    """τ²'s rule for paying a change: no certificates, gift cards need the balance; the user record is mutable."""
    methods = user["payment_methods"]
    if payment_id not in methods:
        raise ToolError("Payment method not found")
    method = methods[payment_id]
    if method["source"] == "certificate":
        raise ToolError("Certificate cannot be used to update reservation")
    if method["source"] == "gift_card" and method["amount"] < total_price:
        raise ToolError("Gift card balance is not enough")
    return {"payment_id": payment_id, "amount": total_price} if total_price != 0 else None


def book_reservation(state: AirlineState, args: dict[str, Any]) -> Any:
    user_id, cabin, passengers = args["user_id"], args["cabin"], args["passengers"]
    user = _user(state, user_id)
    reservation_id = next((r for r in NEW_RESERVATION_IDS if not state.contains("reservations", r)), None)
    if reservation_id is None:
        raise ToolError("Too many reservations")
    reservation_flights, instances, total_price = [], [], 0
    for info in args["flights"]:
        flight = _flight(state, info["flight_number"])
        instance = _flight_instance(state, info["flight_number"], info["date"])
        if instance["status"] != "available":
            raise ToolError(f"Flight {info['flight_number']} not available on date {info['date']}")
        if instance["available_seats"][cabin] < len(passengers):
            raise ToolError(f"Not enough seats on flight {info['flight_number']}")
        price = instance["prices"][cabin]
        reservation_flights.append(
            {
                "origin": flight["origin"],
                "destination": flight["destination"],
                "flight_number": info["flight_number"],
                "date": info["date"],
                "price": price,
            }
        )
        instances.append((info["flight_number"], info["date"]))
        total_price += price * len(passengers)
    if args["insurance"] == "yes":
        total_price += 30 * len(passengers)
    total_price += 50 * args["nonfree_baggages"]
    for payment in args["payment_methods"]:
        method = user["payment_methods"].get(payment["payment_id"])
        if method is None:
            raise ToolError(f"Payment method {payment['payment_id']} not found")
        if method["source"] in ("gift_card", "certificate") and method["amount"] < payment["amount"]:
            raise ToolError(f"Not enough balance in payment method {payment['payment_id']}")
    total_payment = sum(payment["amount"] for payment in args["payment_methods"])
    if total_payment != total_price:
        raise ToolError(f"Payment amount does not add up, total price is {total_price}, but paid {total_payment}")
    # All checks passed: write.
    user = state.get_mut("users", user_id)
    for payment in args["payment_methods"]:
        method = user["payment_methods"].get(payment["payment_id"])
        if method is None:  # a certificate listed twice was already spent
            continue
        if method["source"] == "gift_card":
            method["amount"] -= payment["amount"]
        elif method["source"] == "certificate":
            user["payment_methods"].pop(payment["payment_id"], None)
    for flight_number, date in instances:
        state.get_mut("flights", flight_number)["dates"][date]["available_seats"][cabin] -= len(passengers)
    reservation = {
        "reservation_id": reservation_id,
        "user_id": user_id,
        "origin": args["origin"],
        "destination": args["destination"],
        "flight_type": args["flight_type"],
        "cabin": cabin,
        "flights": reservation_flights,
        "passengers": [dict(p) for p in passengers],
        "payment_history": [dict(p) for p in args["payment_methods"]],
        "created_at": CURRENT_DATETIME,
        "total_baggages": args["total_baggages"],
        "nonfree_baggages": args["nonfree_baggages"],
        "insurance": args["insurance"],
    }
    state.insert("reservations", reservation_id, reservation)
    user["reservations"].append(reservation_id)
    return reservation


def calculate_tool(state: AirlineState, args: dict[str, Any]) -> Any:
    try:
        return calculate(args["expression"])
    except CalculationError as err:
        raise ToolError(str(err)) from err


def cancel_reservation(state: AirlineState, args: dict[str, Any]) -> Any:
    _reservation(state, args["reservation_id"])
    reservation = state.get_mut("reservations", args["reservation_id"])
    refunds = [{"payment_id": p["payment_id"], "amount": -p["amount"]} for p in reservation["payment_history"]]
    reservation["payment_history"].extend(refunds)
    reservation["status"] = "cancelled"
    # τ² does not release the seats of a cancelled reservation.
    return reservation


def get_reservation_details(state: AirlineState, args: dict[str, Any]) -> Any:
    return _reservation(state, args["reservation_id"])


def get_user_details(state: AirlineState, args: dict[str, Any]) -> Any:
    return _user(state, args["user_id"])


def list_all_airports(state: AirlineState, args: dict[str, Any]) -> Any:
    return [{"iata": iata, "city": city} for iata, city in AIRPORTS]


def search_direct_flight(state: AirlineState, args: dict[str, Any]) -> Any:
    return _search_direct(state, args["date"], args["origin"], args["destination"])


def search_onestop_flight(state: AirlineState, args: dict[str, Any]) -> Any:
    date = args["date"]
    results = []
    for first in _search_direct(state, date, args["origin"], None):
        first["date"] = date
        # The second leg's own date: the next day when the first leg lands after midnight. τ² builds it as
        # f"2024-05-{day + 1}" (no zero padding); we keep that so search results match τ²'s exactly.
        second_date = f"2024-05-{int(date[-2:]) + 1}" if "+1" in first["scheduled_arrival_time_est"] else date
        for second in _search_direct(
            state, second_date, first["destination"], args["destination"], first["scheduled_arrival_time_est"]
        ):
            second["date"] = second_date
            results.append([first, second])
    return results


def send_certificate(state: AirlineState, args: dict[str, Any]) -> Any:
    user_id, amount = args["user_id"], args["amount"]
    user = _user(state, user_id)
    for number in NEW_PAYMENT_IDS:
        payment_id = f"certificate_{number}"
        if payment_id not in user["payment_methods"]:
            user = state.get_mut("users", user_id)
            user["payment_methods"][payment_id] = {"source": "certificate", "id": payment_id, "amount": float(amount)}
            return f"Certificate {payment_id} added to user {user_id} with amount {amount}."
    raise ToolError("Too many certificates")


def transfer_to_human_agents(state: AirlineState, args: dict[str, Any]) -> Any:
    return "Transfer successful"


def update_reservation_baggages(state: AirlineState, args: dict[str, Any]) -> Any:
    reservation = _reservation(state, args["reservation_id"])
    user = _user(state, reservation["user_id"])
    total_price = 50 * max(0, args["nonfree_baggages"] - reservation["nonfree_baggages"])
    payment = _payment_for_update(user, args["payment_id"], total_price)
    _deduct_gift_card(state, reservation["user_id"], args["payment_id"], total_price)
    reservation = state.get_mut("reservations", args["reservation_id"])
    if payment is not None:
        reservation["payment_history"].append(payment)
    reservation["total_baggages"] = args["total_baggages"]
    reservation["nonfree_baggages"] = args["nonfree_baggages"]
    return reservation


def _deduct_gift_card(state: AirlineState, user_id: str, payment_id: str, amount: int) -> None:
    """τ² deducts the gift-card balance inside ``_payment_for_update`` (even for 0): a write to the user record."""
    user = state.get("users", user_id)
    if user["payment_methods"][payment_id]["source"] == "gift_card":
        state.get_mut("users", user_id)["payment_methods"][payment_id]["amount"] -= amount


def update_reservation_flights(state: AirlineState, args: dict[str, Any]) -> Any:
    reservation = _reservation(state, args["reservation_id"])
    user = _user(state, reservation["user_id"])
    cabin, n_passengers = args["cabin"], len(reservation["passengers"])
    total_price, new_flights = 0, []
    for info in args["flights"]:
        kept = next(
            (
                f
                for f in reservation["flights"]
                if f["flight_number"] == info["flight_number"]
                and f["date"] == info["date"]
                and cabin == reservation["cabin"]
            ),
            None,
        )
        if kept is not None:
            total_price += kept["price"] * n_passengers
            new_flights.append(dict(kept))
            continue
        flight = _flight(state, info["flight_number"])
        instance = _flight_instance(state, info["flight_number"], info["date"])
        if instance["status"] != "available":
            raise ToolError(f"Flight {info['flight_number']} not available on date {info['date']}")
        if instance["available_seats"][cabin] < n_passengers:
            raise ToolError(f"Not enough seats on flight {info['flight_number']}")
        entry = {
            "flight_number": info["flight_number"],
            "date": info["date"],
            "price": instance["prices"][cabin],
            "origin": flight["origin"],
            "destination": flight["destination"],
        }
        total_price += entry["price"] * n_passengers
        new_flights.append(entry)
    total_price -= sum(f["price"] for f in reservation["flights"]) * n_passengers
    payment = _payment_for_update(user, args["payment_id"], total_price)
    _deduct_gift_card(state, reservation["user_id"], args["payment_id"], total_price)
    reservation = state.get_mut("reservations", args["reservation_id"])
    if payment is not None:
        reservation["payment_history"].append(payment)
    reservation["flights"] = new_flights
    reservation["cabin"] = cabin
    # Like τ², a flight change does not update the flights' seat counts.
    return reservation


def update_reservation_passengers(state: AirlineState, args: dict[str, Any]) -> Any:
    reservation = _reservation(state, args["reservation_id"])
    if len(args["passengers"]) != len(reservation["passengers"]):
        raise ToolError("Number of passengers does not match")
    reservation = state.get_mut("reservations", args["reservation_id"])
    reservation["passengers"] = [dict(p) for p in args["passengers"]]
    return reservation


def get_flight_status(state: AirlineState, args: dict[str, Any]) -> Any:
    return _flight_instance(state, args["flight_number"], args["date"])["status"]


TOOL_FUNCTIONS: dict[str, Callable[[AirlineState, dict[str, Any]], Any]] = {
    "book_reservation": book_reservation,
    "calculate": calculate_tool,
    "cancel_reservation": cancel_reservation,
    "get_reservation_details": get_reservation_details,
    "get_user_details": get_user_details,
    "list_all_airports": list_all_airports,
    "search_direct_flight": search_direct_flight,
    "search_onestop_flight": search_onestop_flight,
    "send_certificate": send_certificate,
    "transfer_to_human_agents": transfer_to_human_agents,
    "update_reservation_baggages": update_reservation_baggages,
    "update_reservation_flights": update_reservation_flights,
    "update_reservation_passengers": update_reservation_passengers,
    "get_flight_status": get_flight_status,
}
assert set(TOOL_FUNCTIONS) == set(TOOL_NAMES)


@dataclass
class ToolResult:
    """What a tool call produced: the observation text shown to the model and whether it failed."""

    content: str
    error: bool
    error_kind: str | None = None  # "unknown_tool", "bad_arguments", "execution"


def format_observation(value: Any) -> str:
    """τ² shows strings as they are and everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def execute_tool(state: AirlineState, name: str, arguments: Any) -> ToolResult:
    """Validates and runs one call. Never raises for bad input: failures become ``Error: ...`` observations."""
    if name not in TOOL_FUNCTIONS:
        return ToolResult(f"Error: Tool '{name}' not found.", True, "unknown_tool")
    try:
        clean = validate_arguments(name, arguments)
    except ToolError as err:
        return ToolResult(f"Error: {err}", True, "bad_arguments")
    try:
        return ToolResult(format_observation(TOOL_FUNCTIONS[name](state, clean)), False)
    except ToolError as err:
        return ToolResult(f"Error: {err}", True, "execution")
    except Exception as err:  # a tool bug must not crash a training step; it is logged and counted as an error
        logger.exception("tool %s raised on arguments %r", name, arguments)
        return ToolResult(f"Error: {type(err).__name__}: {err}", True, "execution")
