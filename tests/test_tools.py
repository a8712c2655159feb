"""Semantics of the 14 airline tools on the real τ²-bench database, checked against τ²-bench's ``AirlineTools``.

Every test runs on a fresh copy-on-write ``EpisodeState`` over the shared base database, with real ids picked from
the data; expected prices and seat counts are read from the base database so the tests pin the rules, not the data.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import (
    READ_TOOLS,
    TERMINAL_TOOLS,
    TOOL_FUNCTIONS,
    TOOL_NAMES,
    TOOL_SCHEMAS,
    WRITE_TOOLS,
    ToolResult,
    execute_tool,
)
from tau2_rl.envs.data import load_domain
from tau2_rl.envs.episode import DomainEnv, shared_base
from tau2_rl.envs.state import CanonicalBase, EpisodeState, naive_db_hash

AIRLINE = get_domain("airline")

# Real records (see the assertions in ``test_fixture_records_are_as_expected``).
USER = "mei_hernandez_8984"  # credit cards, one gift card (98.0), two certificates (250.0 each)
CREDIT_CARD = "credit_card_6082923"
GIFT_CARD = "gift_card_5309492"
CERTIFICATE = "certificate_7502997"
OTHER_CERTIFICATE = "certificate_3321326"
RES_ROUND_TRIP = "R9QDGB"  # economy, 3 passengers, 4 segments, paid 1911 by credit card
RES_BUSINESS = "07S7FC"  # business, 2 passengers, 0 non-free bags, paid by credit card
RES_GIFT = "79G8A9"  # economy, 2 passengers, paid 1400 by the gift card
RES_ONE_WAY = "1AKIA8"  # economy one way, 2 passengers: HAT070 (2024-05-22, paid 196) + HAT297 (2024-05-23, paid 169)
DATE = "2024-05-20"  # every flight is 'available' from 2024-05-16 on

# τ²-bench's tool names, in the order of its AirlineTools class.
TAU2_TOOL_NAMES = {
    "book_reservation",
    "calculate",
    "cancel_reservation",
    "get_reservation_details",
    "get_user_details",
    "list_all_airports",
    "search_direct_flight",
    "search_onestop_flight",
    "send_certificate",
    "transfer_to_human_agents",
    "update_reservation_baggages",
    "update_reservation_flights",
    "update_reservation_passengers",
    "get_flight_status",
}


@pytest.fixture(scope="module")
def base() -> CanonicalBase:
    return shared_base(AIRLINE)


@pytest.fixture
def state(base: CanonicalBase) -> EpisodeState:
    return EpisodeState(base)


def call(state: EpisodeState, name: str, **arguments: Any) -> ToolResult:
    return execute_tool(state, name, arguments)


def ok(state: EpisodeState, name: str, **arguments: Any) -> Any:
    """Runs a call that must succeed; returns the decoded observation (JSON or a plain string)."""
    result = call(state, name, **arguments)
    assert not result.error, result.content
    assert result.error_kind is None
    try:
        return json.loads(result.content)
    except json.JSONDecodeError:
        return result.content


def error(state: EpisodeState, name: str, **arguments: Any) -> str:
    """Runs a call that must fail; returns τ²'s observation text ``Error: ...``."""
    result = call(state, name, **arguments)
    assert result.error, result.content
    assert result.content.startswith("Error: ")
    return result.content


def instance(state: EpisodeState, flight_number: str, date: str) -> dict[str, Any]:
    flight = state.get("flights", flight_number)
    assert flight is not None
    return flight["dates"][date]


def passengers(n: int) -> list[dict[str, str]]:
    people = [("Mei", "Hernandez", "1981-01-11"), ("Anya", "Anderson", "1959-05-28"), ("Raj", "Smith", "1967-04-01")]
    return [{"first_name": f, "last_name": la, "dob": d} for f, la, d in people[:n]]


def booking(**overrides: Any) -> dict[str, Any]:
    """A round trip JFK -> MIA -> JFK for two passengers (HAT014 on 05-20, HAT198 on 05-22), economy."""
    args: dict[str, Any] = {
        "user_id": USER,
        "origin": "JFK",
        "destination": "JFK",
        "flight_type": "round_trip",
        "cabin": "economy",
        "flights": [
            {"flight_number": "HAT014", "date": DATE},
            {"flight_number": "HAT198", "date": "2024-05-22"},
        ],
        "passengers": passengers(2),
        "payment_methods": [{"payment_id": CREDIT_CARD, "amount": 0}],
        "total_baggages": 0,
        "nonfree_baggages": 0,
        "insurance": "no",
    }
    args.update(overrides)
    return args


def booking_price(state: EpisodeState, args: dict[str, Any]) -> int:
    """τ²'s price: seat prices × passengers + 30 per passenger for insurance + 50 per non-free bag."""
    n = len(args["passengers"])
    total = sum(instance(state, f["flight_number"], f["date"])["prices"][args["cabin"]] * n for f in args["flights"])
    return total + (30 * n if args["insurance"] == "yes" else 0) + 50 * args["nonfree_baggages"]


def test_fixture_records_are_as_expected(base: CanonicalBase) -> None:
    db = base.db
    methods = db["users"][USER]["payment_methods"]
    assert methods[CREDIT_CARD]["source"] == "credit_card"
    assert methods[GIFT_CARD] == {"source": "gift_card", "id": GIFT_CARD, "amount": 98.0}
    assert methods[CERTIFICATE]["amount"] == methods[OTHER_CERTIFICATE]["amount"] == 250.0
    assert db["reservations"][RES_ROUND_TRIP]["payment_history"] == [{"payment_id": CREDIT_CARD, "amount": 1911}]
    assert [(f["flight_number"], f["price"]) for f in db["reservations"][RES_ONE_WAY]["flights"]] == [
        ("HAT070", 196),
        ("HAT297", 169),
    ]
    for rid in (RES_ROUND_TRIP, RES_BUSINESS, RES_GIFT, RES_ONE_WAY):
        assert db["reservations"][rid]["user_id"] == USER
    assert "HATHAT" not in db["reservations"]


# ---------------------------------------------------------------------------------------------------------------------
# book_reservation


def test_book_decrements_seats_and_charges_fares_insurance_and_bags(state: EpisodeState, base: CanonicalBase) -> None:
    args = booking(insurance="yes", total_baggages=3, nonfree_baggages=2)
    fares = [instance(state, f["flight_number"], f["date"])["prices"]["economy"] for f in args["flights"]]
    total = sum(fares) * 2 + 30 * 2 + 50 * 2
    assert total == booking_price(state, args)
    seats_before = {f["flight_number"]: dict(instance(state, f["flight_number"], f["date"])["available_seats"])
                    for f in args["flights"]}  # fmt: skip
    args["payment_methods"] = [{"payment_id": CREDIT_CARD, "amount": total}]

    reservation = ok(state, "book_reservation", **args)

    assert reservation["reservation_id"] == "HATHAT"
    assert reservation["created_at"] == "2024-05-15T15:00:00"
    assert reservation["cabin"] == "economy" and reservation["insurance"] == "yes"
    assert (reservation["total_baggages"], reservation["nonfree_baggages"]) == (3, 2)
    assert reservation["payment_history"] == [{"payment_id": CREDIT_CARD, "amount": total}]
    assert reservation["passengers"] == passengers(2)
    assert [(f["flight_number"], f["date"], f["price"]) for f in reservation["flights"]] == [
        ("HAT014", DATE, fares[0]),
        ("HAT198", "2024-05-22", fares[1]),
    ]
    assert [(f["origin"], f["destination"]) for f in reservation["flights"]] == [("JFK", "MIA"), ("MIA", "JFK")]
    for info in args["flights"]:
        seats = instance(state, info["flight_number"], info["date"])["available_seats"]
        before = seats_before[info["flight_number"]]
        assert seats == {**before, "economy": before["economy"] - 2}  # only the booked cabin, by the party size
    assert state.get("reservations", "HATHAT") == reservation
    assert state.get("users", USER)["reservations"][-1] == "HATHAT"
    assert state.get("users", USER)["payment_methods"] == base.db["users"][USER]["payment_methods"]  # card: no change


def test_book_with_certificate_removes_it_and_gift_card_is_deducted(state: EpisodeState) -> None:
    args = booking(
        passengers=passengers(2), flights=[{"flight_number": "HAT014", "date": DATE}], flight_type="one_way"
    )
    total = booking_price(state, args)
    assert 250 < total < 250 + 98
    args["payment_methods"] = [
        {"payment_id": CERTIFICATE, "amount": 250},
        {"payment_id": GIFT_CARD, "amount": total - 250},
    ]
    reservation = ok(state, "book_reservation", **args)
    assert reservation["payment_history"] == args["payment_methods"]
    methods = state.get("users", USER)["payment_methods"]
    assert CERTIFICATE not in methods  # a certificate is used up whatever its remaining value
    assert OTHER_CERTIFICATE in methods
    assert methods[GIFT_CARD]["amount"] == 98.0 - (total - 250)


def test_book_certificate_used_partially_is_still_removed(state: EpisodeState) -> None:
    args = booking(
        passengers=passengers(1), flights=[{"flight_number": "HAT001", "date": DATE}], cabin="basic_economy"
    )
    total = booking_price(state, args)
    assert total < 250
    args["payment_methods"] = [{"payment_id": OTHER_CERTIFICATE, "amount": total}]
    ok(state, "book_reservation", **args)
    assert OTHER_CERTIFICATE not in state.get("users", USER)["payment_methods"]


def test_book_gift_card_balance_too_low(state: EpisodeState) -> None:
    args = booking()
    total = booking_price(state, args)
    args["payment_methods"] = [
        {"payment_id": GIFT_CARD, "amount": 99},
        {"payment_id": CREDIT_CARD, "amount": total - 99},
    ]
    assert error(state, "book_reservation", **args) == f"Error: Not enough balance in payment method {GIFT_CARD}"
    assert state.fingerprint() == b""  # a failed booking writes nothing


def test_book_payment_sum_mismatch(state: EpisodeState) -> None:
    args = booking()
    total = booking_price(state, args)
    args["payment_methods"] = [{"payment_id": CREDIT_CARD, "amount": total - 1}]
    message = error(state, "book_reservation", **args)
    assert message == f"Error: Payment amount does not add up, total price is {total}, but paid {total - 1}"
    assert state.fingerprint() == b""


def test_book_unknown_payment_method(state: EpisodeState) -> None:
    args = booking(payment_methods=[{"payment_id": "credit_card_0000000", "amount": 100}])
    assert error(state, "book_reservation", **args) == "Error: Payment method credit_card_0000000 not found"
    # another user's card is unknown to this user
    other = next(u for u in shared_base(AIRLINE).db["users"].values() if u["user_id"] != USER)
    foreign = next(iter(other["payment_methods"]))
    args = booking(payment_methods=[{"payment_id": foreign, "amount": 100}])
    assert error(state, "book_reservation", **args) == f"Error: Payment method {foreign} not found"


def test_book_not_enough_seats(state: EpisodeState) -> None:
    assert instance(state, "HAT004", DATE)["available_seats"]["business"] == 0
    args = booking(cabin="business", flights=[{"flight_number": "HAT004", "date": DATE}])
    assert error(state, "book_reservation", **args) == "Error: Not enough seats on flight HAT004"
    # three passengers on a flight with two seats left in the cabin
    assert instance(state, "HAT007", DATE)["available_seats"]["business"] == 2
    args = booking(cabin="business", flights=[{"flight_number": "HAT007", "date": DATE}], passengers=passengers(3))
    assert error(state, "book_reservation", **args) == "Error: Not enough seats on flight HAT007"


def test_book_takes_the_last_seats(state: EpisodeState) -> None:
    args = booking(cabin="business", flights=[{"flight_number": "HAT007", "date": DATE}], flight_type="one_way")
    args["payment_methods"] = [{"payment_id": CREDIT_CARD, "amount": booking_price(state, args)}]
    ok(state, "book_reservation", **args)
    assert instance(state, "HAT007", DATE)["available_seats"]["business"] == 0
    assert error(state, "book_reservation", **args) == "Error: Not enough seats on flight HAT007"


@pytest.mark.parametrize(("date", "status"), [("2024-05-01", "landed"), ("2024-05-03", "cancelled")])
def test_book_flight_not_available(state: EpisodeState, date: str, status: str) -> None:
    assert instance(state, "HAT001", date)["status"] == status
    args = booking(flights=[{"flight_number": "HAT001", "date": date}])
    assert error(state, "book_reservation", **args) == f"Error: Flight HAT001 not available on date {date}"


def test_book_flight_not_available_while_flying(state: EpisodeState, base: CanonicalBase) -> None:
    flying = next(fn for fn, f in base.db["flights"].items() if f["dates"]["2024-05-15"]["status"] == "flying")
    args = booking(flights=[{"flight_number": flying, "date": "2024-05-15"}])
    assert error(state, "book_reservation", **args) == f"Error: Flight {flying} not available on date 2024-05-15"


def test_book_unknown_flight_date_and_user(state: EpisodeState) -> None:
    args = booking(flights=[{"flight_number": "HAT999", "date": DATE}])
    assert error(state, "book_reservation", **args) == "Error: Flight HAT999 not found"
    args = booking(flights=[{"flight_number": "HAT014", "date": "2024-06-20"}])
    assert error(state, "book_reservation", **args) == "Error: Flight HAT014 not found on date 2024-06-20"
    assert (
        error(state, "book_reservation", **booking(user_id="no_such_user_1")) == "Error: User no_such_user_1 not found"
    )
    assert state.fingerprint() == b""


def test_book_reservation_ids_sequence_then_too_many(state: EpisodeState) -> None:
    args = booking(
        passengers=passengers(1), flights=[{"flight_number": "HAT014", "date": DATE}], flight_type="one_way"
    )
    args["payment_methods"] = [{"payment_id": CREDIT_CARD, "amount": booking_price(state, args)}]
    ids = [ok(state, "book_reservation", **args)["reservation_id"] for _ in range(3)]
    assert ids == ["HATHAT", "HATHAU", "HATHAV"]
    assert error(state, "book_reservation", **args) == "Error: Too many reservations"
    assert state.get("users", USER)["reservations"][-3:] == ids


# ---------------------------------------------------------------------------------------------------------------------
# cancel_reservation


def test_cancel_appends_negative_refunds_and_keeps_seats(state: EpisodeState, base: CanonicalBase) -> None:
    before = base.db["reservations"][RES_ROUND_TRIP]
    reservation = ok(state, "cancel_reservation", reservation_id=RES_ROUND_TRIP)
    assert reservation["status"] == "cancelled"
    assert reservation["payment_history"] == [
        {"payment_id": CREDIT_CARD, "amount": 1911},
        {"payment_id": CREDIT_CARD, "amount": -1911},
    ]
    assert {k: v for k, v in reservation.items() if k not in ("status", "payment_history")} == {
        k: v for k, v in before.items() if k not in ("status", "payment_history")
    }
    # τ² does not release the seats: no flight record was even copied.
    assert state.overlay["flights"] == {}
    assert set(state.overlay["reservations"]) == {RES_ROUND_TRIP}
    assert base.db["reservations"][RES_ROUND_TRIP]["status"] is None


def test_cancel_refunds_every_payment(state: EpisodeState) -> None:
    ok(state, "update_reservation_baggages", reservation_id=RES_BUSINESS, total_baggages=4, nonfree_baggages=1,
       payment_id=GIFT_CARD)  # fmt: skip
    history = state.get("reservations", RES_BUSINESS)["payment_history"]
    assert [p["payment_id"] for p in history] == [CREDIT_CARD, GIFT_CARD]
    reservation = ok(state, "cancel_reservation", reservation_id=RES_BUSINESS)
    assert reservation["payment_history"] == history[:2] + [
        {"payment_id": p["payment_id"], "amount": -p["amount"]} for p in history[:2]
    ]
    # the refund is recorded only: the gift card balance is not restored (τ² does the same)
    assert state.get("users", USER)["payment_methods"][GIFT_CARD]["amount"] == 48.0


def test_cancel_unknown_reservation(state: EpisodeState) -> None:
    assert error(state, "cancel_reservation", reservation_id="ZZZZZZ") == "Error: Reservation ZZZZZZ not found"


# ---------------------------------------------------------------------------------------------------------------------
# update_reservation_flights


def test_update_flights_keeps_unchanged_segment_price_and_refunds(state: EpisodeState) -> None:
    new_price = instance(state, "HAT059", "2024-05-23")["prices"]["economy"]
    assert (
        instance(state, "HAT070", "2024-05-22")["prices"]["economy"] != 196
    )  # today's fare differs from the paid one
    assert instance(state, "HAT070", "2024-05-22")["available_seats"]["economy"] == 0  # kept: not re-checked
    reservation = ok(
        state,
        "update_reservation_flights",
        reservation_id=RES_ONE_WAY,
        cabin="economy",
        flights=[{"flight_number": "HAT070", "date": "2024-05-22"}, {"flight_number": "HAT059", "date": "2024-05-23"}],
        payment_id=CREDIT_CARD,
    )
    assert [(f["flight_number"], f["price"]) for f in reservation["flights"]] == [
        ("HAT070", 196),
        ("HAT059", new_price),
    ]
    assert reservation["flights"][1]["origin"] == "ATL" and reservation["flights"][1]["destination"] == "DFW"
    difference = (196 + new_price - 196 - 169) * 2
    assert difference < 0
    assert reservation["payment_history"][-1] == {"payment_id": CREDIT_CARD, "amount": difference}
    assert reservation["cabin"] == "economy"
    assert state.overlay["flights"] == {}  # like τ², a flight change does not touch seat counts


def test_update_flights_reprices_every_segment_when_cabin_changes(state: EpisodeState) -> None:
    fares = [instance(state, "HAT070", "2024-05-22")["prices"]["business"],
             instance(state, "HAT297", "2024-05-23")["prices"]["business"]]  # fmt: skip
    reservation = ok(
        state,
        "update_reservation_flights",
        reservation_id=RES_ONE_WAY,
        cabin="business",
        flights=[{"flight_number": "HAT070", "date": "2024-05-22"}, {"flight_number": "HAT297", "date": "2024-05-23"}],
        payment_id=CREDIT_CARD,
    )
    assert reservation["cabin"] == "business"
    assert [f["price"] for f in reservation["flights"]] == fares
    assert reservation["payment_history"][-1] == {"payment_id": CREDIT_CARD, "amount": (sum(fares) - 196 - 169) * 2}
    assert len(reservation["payment_history"]) == 2


def test_update_flights_same_flights_same_cabin_charges_nothing(state: EpisodeState, base: CanonicalBase) -> None:
    flights = [{"flight_number": f["flight_number"], "date": f["date"]}
               for f in base.db["reservations"][RES_GIFT]["flights"]]  # fmt: skip
    reservation = ok(
        state,
        "update_reservation_flights",
        reservation_id=RES_GIFT,
        cabin="economy",
        flights=flights,
        payment_id=GIFT_CARD,
    )
    assert reservation == base.db["reservations"][RES_GIFT]
    assert state.get("users", USER)["payment_methods"][GIFT_CARD]["amount"] == 98.0
    assert state.db_hash() == base.base_hash  # written-back identical records do not count as changes


def test_update_flights_gift_card_refund_and_balance(state: EpisodeState, base: CanonicalBase) -> None:
    record = base.db["reservations"][RES_GIFT]
    flights = [{"flight_number": f["flight_number"], "date": f["date"]} for f in record["flights"]]
    paid = sum(f["price"] for f in record["flights"]) * 2
    # an upgrade of RES_ONE_WAY to business costs far more than the 98.0 left on the card
    message = error(
        state,
        "update_reservation_flights",
        reservation_id=RES_ONE_WAY,
        cabin="business",
        flights=[{"flight_number": "HAT070", "date": "2024-05-22"}, {"flight_number": "HAT297", "date": "2024-05-23"}],
        payment_id=GIFT_CARD,
    )
    assert message == "Error: Gift card balance is not enough"
    assert state.fingerprint() == b""
    # a downgrade is refunded onto the gift card
    new = sum(instance(state, f["flight_number"], f["date"])["prices"]["basic_economy"] for f in flights) * 2
    reservation = ok(
        state,
        "update_reservation_flights",
        reservation_id=RES_GIFT,
        cabin="basic_economy",
        flights=flights,
        payment_id=GIFT_CARD,
    )
    assert reservation["cabin"] == "basic_economy"
    assert reservation["payment_history"][-1] == {"payment_id": GIFT_CARD, "amount": new - paid}
    assert state.get("users", USER)["payment_methods"][GIFT_CARD]["amount"] == 98.0 - (new - paid)


def test_update_flights_refuses_certificate_and_unknown_payment(state: EpisodeState) -> None:
    args = {"reservation_id": RES_ONE_WAY, "cabin": "business",
            "flights": [{"flight_number": "HAT070", "date": "2024-05-22"}]}  # fmt: skip
    message = error(state, "update_reservation_flights", **args, payment_id=CERTIFICATE)
    assert message == "Error: Certificate cannot be used to update reservation"
    message = error(state, "update_reservation_flights", **args, payment_id="credit_card_0000000")
    assert message == "Error: Payment method not found"
    assert state.fingerprint() == b""


def test_update_flights_checks_new_segments(state: EpisodeState) -> None:
    base_args = {"reservation_id": RES_ONE_WAY, "cabin": "economy", "payment_id": CREDIT_CARD}
    message = error(
        state, "update_reservation_flights", **base_args, flights=[{"flight_number": "HAT001", "date": "2024-05-03"}]
    )
    assert message == "Error: Flight HAT001 not available on date 2024-05-03"
    assert instance(state, "HAT004", DATE)["available_seats"]["business"] == 0
    message = error(
        state,
        "update_reservation_flights",
        **{**base_args, "cabin": "business"},
        flights=[{"flight_number": "HAT004", "date": DATE}],
    )
    assert message == "Error: Not enough seats on flight HAT004"
    message = error(
        state, "update_reservation_flights", **base_args, flights=[{"flight_number": "HAT999", "date": DATE}]
    )
    assert message == "Error: Flight HAT999 not found"
    message = error(state, "update_reservation_flights", **{**base_args, "reservation_id": "ZZZZZZ"}, flights=[])
    assert message == "Error: Reservation ZZZZZZ not found"


# ---------------------------------------------------------------------------------------------------------------------
# update_reservation_baggages / update_reservation_passengers


def test_update_baggages_charges_50_per_extra_nonfree_bag(state: EpisodeState) -> None:
    reservation = ok(
        state,
        "update_reservation_baggages",
        reservation_id=RES_BUSINESS,
        total_baggages=5,
        nonfree_baggages=2,
        payment_id=CREDIT_CARD,
    )
    assert (reservation["total_baggages"], reservation["nonfree_baggages"]) == (5, 2)
    assert reservation["payment_history"][-1] == {"payment_id": CREDIT_CARD, "amount": 100}
    # fewer non-free bags: no charge, no refund, no payment entry
    reservation = ok(
        state,
        "update_reservation_baggages",
        reservation_id=RES_BUSINESS,
        total_baggages=3,
        nonfree_baggages=1,
        payment_id=CREDIT_CARD,
    )
    assert (reservation["total_baggages"], reservation["nonfree_baggages"]) == (3, 1)
    assert len(reservation["payment_history"]) == 2


def test_update_baggages_gift_card_balance(state: EpisodeState) -> None:
    args = {"reservation_id": RES_GIFT, "total_baggages": 4, "payment_id": GIFT_CARD}
    assert error(state, "update_reservation_baggages", **args, nonfree_baggages=2) == (
        "Error: Gift card balance is not enough"
    )  # 100 > 98.0
    reservation = ok(state, "update_reservation_baggages", **args, nonfree_baggages=1)
    assert reservation["payment_history"][-1] == {"payment_id": GIFT_CARD, "amount": 50}
    assert state.get("users", USER)["payment_methods"][GIFT_CARD]["amount"] == 48.0
    # RES_BUSINESS has no non-free bag yet: one more costs 50 > 48.0
    assert error(
        state, "update_reservation_baggages", **{**args, "reservation_id": RES_BUSINESS}, nonfree_baggages=1
    ) == ("Error: Gift card balance is not enough")
    msg = error(state, "update_reservation_baggages", **{**args, "payment_id": CERTIFICATE}, nonfree_baggages=1)
    assert msg == "Error: Certificate cannot be used to update reservation"


def test_update_passengers(state: EpisodeState) -> None:
    assert error(state, "update_reservation_passengers", reservation_id=RES_GIFT, passengers=passengers(3)) == (
        "Error: Number of passengers does not match"
    )
    assert error(state, "update_reservation_passengers", reservation_id=RES_GIFT, passengers=[]) == (
        "Error: Number of passengers does not match"
    )
    new = [{"first_name": "Ann", "last_name": "Lee", "dob": "1990-01-01"}, passengers(2)[1]]
    reservation = ok(state, "update_reservation_passengers", reservation_id=RES_GIFT, passengers=new)
    assert reservation["passengers"] == new
    assert set(state.overlay["reservations"]) == {RES_GIFT}


# ---------------------------------------------------------------------------------------------------------------------
# Searches and reads


def test_search_direct_matches_brute_force(state: EpisodeState, base: CanonicalBase) -> None:
    for origin, destination, date in [
        ("JFK", "MIA", DATE),
        ("ATL", "DFW", "2024-05-23"),
        ("LAS", "ATL", "2024-05-29"),
    ]:
        results = ok(state, "search_direct_flight", origin=origin, destination=destination, date=date)
        expected = [fn for fn, f in base.db["flights"].items()
                    if f["origin"] == origin and f["destination"] == destination
                    and f["dates"].get(date, {}).get("status") == "available"]  # fmt: skip
        assert [r["flight_number"] for r in results] == expected and expected
        for r in results:
            inst = base.db["flights"][r["flight_number"]]["dates"][date]
            assert r["status"] == "available" and r["date"] is None
            assert r["prices"] == inst["prices"] and r["available_seats"] == inst["available_seats"]


def test_search_direct_only_available_instances(state: EpisodeState) -> None:
    # 2024-05-15 is "today": flights are on time / delayed / flying / landed, none bookable
    assert ok(state, "search_direct_flight", origin="JFK", destination="MIA", date="2024-05-15") == []
    assert ok(state, "search_direct_flight", origin="JFK", destination="MIA", date="2024-05-02") == []
    assert ok(state, "search_direct_flight", origin="JFK", destination="MIA", date="2024-07-01") == []
    all_flights = [
        r["flight_number"] for r in ok(state, "search_direct_flight", origin="JFK", destination="MIA", date=DATE)
    ]
    state.model("flights", all_flights[0]).dates[DATE].status = "cancelled"  # the search reads the overlay
    remaining = [
        r["flight_number"] for r in ok(state, "search_direct_flight", origin="JFK", destination="MIA", date=DATE)
    ]
    assert remaining == all_flights[1:]


def test_search_onestop_pairs(state: EpisodeState, base: CanonicalBase) -> None:
    flights = base.db["flights"]
    pairs = ok(state, "search_onestop_flight", origin="JFK", destination="SEA", date=DATE)
    assert pairs
    for first, second in pairs:
        assert first["origin"] == "JFK" and second["destination"] == "SEA"
        assert first["destination"] == second["origin"]
        assert first["date"] == DATE
        assert second["scheduled_departure_time_est"] >= first["scheduled_arrival_time_est"]
        expected_second_date = "2024-05-21" if "+1" in first["scheduled_arrival_time_est"] else DATE
        assert second["date"] == expected_second_date
        assert flights[second["flight_number"]]["dates"][second["date"]]["status"] == "available"
    # complete: every (first, second) connection satisfying the rules is listed
    expected = {
        (a, b)
        for a, fa in flights.items()
        for b, fb in flights.items()
        if fa["origin"] == "JFK" and fb["destination"] == "SEA" and fa["destination"] == fb["origin"]
        and "+1" not in fa["scheduled_arrival_time_est"]
        and fa["dates"][DATE]["status"] == "available" and fb["dates"][DATE]["status"] == "available"
        and fb["scheduled_departure_time_est"] >= fa["scheduled_arrival_time_est"]
    }  # fmt: skip
    assert {
        (a["flight_number"], b["flight_number"]) for a, b in pairs if "+1" not in a["scheduled_arrival_time_est"]
    } == (expected)


def test_search_onestop_second_leg_on_next_day_after_overnight_arrival(
    state: EpisodeState, base: CanonicalBase
) -> None:
    first = base.db["flights"]["HAT002"]
    assert (first["origin"], first["destination"], first["scheduled_arrival_time_est"]) == ("LGA", "PHX", "01:30:00+1")
    pairs = ok(state, "search_onestop_flight", origin="LGA", destination="DTW", date=DATE)
    overnight = [(a, b) for a, b in pairs if a["flight_number"] == "HAT002"]
    assert {b["flight_number"] for _, b in overnight} == {"HAT073", "HAT106", "HAT265"}
    for a, b in overnight:
        assert a["date"] == DATE and b["date"] == "2024-05-21"
        next_day = base.db["flights"][b["flight_number"]]["dates"]["2024-05-21"]
        assert b["prices"] == next_day["prices"] and b["available_seats"] == next_day["available_seats"]
        assert b["prices"] != base.db["flights"][b["flight_number"]]["dates"][DATE]["prices"]


def test_get_flight_status(state: EpisodeState) -> None:
    assert ok(state, "get_flight_status", flight_number="HAT001", date="2024-05-01") == "landed"
    assert ok(state, "get_flight_status", flight_number="HAT001", date="2024-05-03") == "cancelled"
    assert ok(state, "get_flight_status", flight_number="HAT001", date=DATE) == "available"
    assert error(state, "get_flight_status", flight_number="HAT001", date="2024-06-01") == (
        "Error: Flight HAT001 not found on date 2024-06-01"
    )
    assert error(state, "get_flight_status", flight_number="HAT000", date=DATE) == "Error: Flight HAT000 not found"


def test_list_all_airports(state: EpisodeState) -> None:
    airports = ok(state, "list_all_airports")
    assert len(airports) == 20
    assert len({a["iata"] for a in airports}) == 20
    assert airports[0] == {"iata": "SFO", "city": "San Francisco"}
    assert {"iata": "LGA", "city": "LaGuardia"} in airports
    used = {f["origin"] for f in shared_base(AIRLINE).db["flights"].values()}
    assert used <= {a["iata"] for a in airports}


def test_get_details_and_missing_ids(state: EpisodeState, base: CanonicalBase) -> None:
    assert ok(state, "get_user_details", user_id=USER) == base.db["users"][USER]
    assert ok(state, "get_reservation_details", reservation_id=RES_GIFT) == base.db["reservations"][RES_GIFT]
    assert error(state, "get_user_details", user_id="sara_doe_000") == "Error: User sara_doe_000 not found"
    assert error(state, "get_reservation_details", reservation_id="8JX2WO") == "Error: Reservation 8JX2WO not found"
    assert state.overlay == {"flights": {}, "reservations": {}, "users": {}}  # reads copy nothing


def test_send_certificate_ids_sequence(state: EpisodeState) -> None:
    messages = [ok(state, "send_certificate", user_id=USER, amount=amount) for amount in (100, 150, 200)]
    assert messages == [
        f"Certificate certificate_3221322 added to user {USER} with amount 100.",
        f"Certificate certificate_3221323 added to user {USER} with amount 150.",
        f"Certificate certificate_3221324 added to user {USER} with amount 200.",
    ]
    methods = state.get("users", USER)["payment_methods"]
    assert methods["certificate_3221322"] == {"source": "certificate", "id": "certificate_3221322", "amount": 100.0}
    assert isinstance(methods["certificate_3221324"]["amount"], float)  # τ²'s Certificate.amount is a float
    assert error(state, "send_certificate", user_id=USER, amount=50) == "Error: Too many certificates"
    assert error(state, "send_certificate", user_id="nobody_1", amount=50) == "Error: User nobody_1 not found"


def test_sent_certificate_can_pay_a_booking(state: EpisodeState) -> None:
    ok(state, "send_certificate", user_id=USER, amount=500)
    args = booking(
        passengers=passengers(1), flights=[{"flight_number": "HAT014", "date": DATE}], flight_type="one_way"
    )
    total = booking_price(state, args)
    args["payment_methods"] = [{"payment_id": "certificate_3221322", "amount": total}]
    ok(state, "book_reservation", **args)
    assert "certificate_3221322" not in state.get("users", USER)["payment_methods"]
    # the id is free again, so the next certificate reuses it
    assert ok(state, "send_certificate", user_id=USER, amount=10).startswith("Certificate certificate_3221322 added")


def test_transfer_and_calculate(state: EpisodeState) -> None:
    assert ok(state, "transfer_to_human_agents", summary="The user wants a refund.") == "Transfer successful"
    assert call(state, "calculate", expression="(1911 - 106) / 2").content == "902.5"
    assert error(state, "calculate", expression="__import__('os')") == "Error: Invalid characters in expression"
    assert state.fingerprint() == b""


def test_unknown_tool_error_text(state: EpisodeState) -> None:
    result = call(state, "think", thought="hmm")
    assert (result.content, result.error, result.error_kind) == (
        "Error: Tool 'think' not found.",
        True,
        "unknown_tool",
    )


# ---------------------------------------------------------------------------------------------------------------------
# Schemas and argument validation


def _walk_objects(schema: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    if schema.get("type") == "object":
        found.append(schema)
        for sub in schema["properties"].values():
            found.extend(_walk_objects(sub))
    if schema.get("type") == "array":
        found.extend(_walk_objects(schema["items"]))
    return found


def test_schemas_cover_the_14_tau2_tools() -> None:
    names = [s["function"]["name"] for s in TOOL_SCHEMAS]
    assert len(TOOL_SCHEMAS) == 14 and len(set(names)) == 14
    assert set(names) == TAU2_TOOL_NAMES == set(TOOL_FUNCTIONS) == set(TOOL_NAMES)
    assert WRITE_TOOLS | READ_TOOLS | TERMINAL_TOOLS | {"calculate"} == TAU2_TOOL_NAMES
    assert not (WRITE_TOOLS & READ_TOOLS)


def test_every_schema_requires_exactly_its_properties() -> None:
    for tool in TOOL_SCHEMAS:
        assert tool["type"] == "function"
        assert tool["function"]["description"]
        objects = _walk_objects(tool["function"]["parameters"])
        assert objects, tool["function"]["name"]
        for obj in objects:
            assert obj["required"] == list(obj["properties"]), tool["function"]["name"]
            assert obj["additionalProperties"] is False
            for prop in obj["properties"].values():
                assert prop["type"] in ("string", "integer", "array", "object")


def test_schema_parameters_match_tau2_signatures() -> None:
    params = {s["function"]["name"]: list(s["function"]["parameters"]["properties"]) for s in TOOL_SCHEMAS}
    assert params["book_reservation"] == ["user_id", "origin", "destination", "flight_type", "cabin", "flights",
                                          "passengers", "payment_methods", "total_baggages", "nonfree_baggages",
                                          "insurance"]  # fmt: skip
    assert params["update_reservation_flights"] == ["reservation_id", "cabin", "flights", "payment_id"]
    assert params["update_reservation_baggages"] == [
        "reservation_id",
        "total_baggages",
        "nonfree_baggages",
        "payment_id",
    ]
    assert params["search_onestop_flight"] == ["origin", "destination", "date"]
    assert params["list_all_airports"] == []
    assert params["send_certificate"] == ["user_id", "amount"]


def test_every_gold_action_succeeds() -> None:
    domain = load_domain(AIRLINE)
    count = 0
    for task in domain.tasks.values():
        state = EpisodeState(shared_base(AIRLINE))
        for action in task.actions:
            assert not execute_tool(state, action.name, action.arguments).error, (task.task_id, action.name)
            count += 1
    assert count > 100


def test_missing_and_unknown_arguments_fail_like_tau2(state: EpisodeState) -> None:
    # τ² passes the arguments as keywords: Python's own TypeError, naming τ²'s class and method.
    result = call(state, "get_user_details")
    assert result.content == "Error: AirlineTools.get_user_details() missing 1 required positional argument: 'user_id'"
    assert result.error_kind == "bad_arguments"
    args = booking()
    del args["insurance"]
    assert error(state, "book_reservation", **args) == (
        "Error: AirlineTools.book_reservation() missing 1 required positional argument: 'insurance'"
    )
    assert error(state, "get_user_details", user_id=USER, verbose=True) == (
        "Error: AirlineTools.get_user_details() got an unexpected keyword argument 'verbose'"
    )
    assert error(state, "list_all_airports", x=1) == (
        "Error: AirlineTools.list_all_airports() got an unexpected keyword argument 'x'"
    )
    assert state.fingerprint() == b""


def test_unknown_tool_and_non_object_arguments(state: EpisodeState) -> None:
    result = execute_tool(state, "fly", {})
    assert (result.content, result.error_kind) == ("Error: Tool 'fly' not found.", "unknown_tool")
    for bad in ([], "user_id=1", None, 3):
        result = execute_tool(state, "get_user_details", bad)
        assert result.error and result.error_kind == "bad_arguments" and "must be a JSON object" in result.content


def test_lax_arguments_are_coerced_like_tau2(state: EpisodeState) -> None:
    assert ok(state, "send_certificate", user_id=USER, amount="100") == (
        f"Certificate certificate_3221322 added to user {USER} with amount 100."
    )
    assert ok(state, "send_certificate", user_id=USER, amount=75.5).endswith("with amount 75.5.")
    methods = state.get("users", USER)["payment_methods"]
    assert methods["certificate_3221322"] == {"source": "certificate", "id": "certificate_3221322", "amount": 100.0}
    assert methods["certificate_3221323"]["amount"] == 75.5
    # Assigned without validation: stored and shown as given.
    reservation = ok(state, "update_reservation_baggages", reservation_id=RES_BUSINESS, total_baggages="7",
                     nonfree_baggages=0, payment_id=CREDIT_CARD)  # fmt: skip
    assert reservation["total_baggages"] == "7"
    assert state.get("reservations", RES_BUSINESS)["total_baggages"] == "7"
    # A passenger's extra key is dropped by τ²'s Passenger model.
    people = [{**p, "gender": "x"} for p in passengers(2)]
    reservation = ok(state, "update_reservation_passengers", reservation_id=RES_BUSINESS, passengers=people)
    assert reservation["passengers"] == passengers(2)


def test_numeric_string_payment_amounts_book(state: EpisodeState) -> None:
    args = booking()
    args["payment_methods"] = [{"payment_id": CREDIT_CARD, "amount": str(booking_price(state, args))}]
    reservation = ok(state, "book_reservation", **args)
    assert reservation["payment_history"][0]["amount"] == booking_price(state, args)


def test_wrong_types_fail_with_pydantic_errors(state: EpisodeState) -> None:
    text = error(state, "book_reservation", **booking(cabin="first"))
    assert text.startswith("Error: 1 validation error for Reservation\ncabin\n  Input should be 'business', ")
    text = error(state, "send_certificate", user_id=USER, amount="abc")
    assert text.startswith("Error: 1 validation error for Certificate\namount\n")
    assert state.db_hash() == state.base.base_hash


def test_certificate_listed_twice_is_removed_then_the_booking_fails(state: EpisodeState, base: CanonicalBase) -> None:
    args = booking(
        passengers=passengers(1), flights=[{"flight_number": "HAT001", "date": DATE}], cabin="basic_economy"
    )
    total = booking_price(state, args)
    args["payment_methods"] = [
        {"payment_id": CERTIFICATE, "amount": 1},
        {"payment_id": CERTIFICATE, "amount": 1},
        {"payment_id": CREDIT_CARD, "amount": total - 2},
    ]
    assert error(state, "book_reservation", **args) == f"Error: '{CERTIFICATE}'"
    # τ² removed the certificate before failing; nothing else changed (no reservation, no seats).
    assert CERTIFICATE not in state.get("users", USER)["payment_methods"]
    assert not state.contains("reservations", "HATHAT")
    assert instance(state, "HAT001", DATE) == base.db["flights"]["HAT001"]["dates"][DATE]
    assert state.db_hash() != base.base_hash


def test_huge_integer_keeps_the_database_hashable(state: EpisodeState) -> None:
    # 50 × a 4300-digit count has more digits than Python prints by default; τ² would crash serialising it.
    huge = int("9" * 4300)
    result = call(state, "update_reservation_baggages", reservation_id=RES_BUSINESS, total_baggages=1,
                  nonfree_baggages=huge, payment_id=CREDIT_CARD)  # fmt: skip
    assert not result.error and '"nonfree_baggages": 9999' in result.content
    assert state.db_hash() == naive_db_hash(state.materialize()) != state.base.base_hash


# ---------------------------------------------------------------------------------------------------------------------
# Copy-on-write


def test_reset_copies_nothing() -> None:
    env = DomainEnv(AIRLINE)
    episode = env.reset("0")
    assert episode.state.overlay == {"flights": {}, "reservations": {}, "users": {}}
    assert episode.state.base is shared_base(AIRLINE)
    assert episode.state.base.db is load_domain(AIRLINE).db  # the one parsed database, shared
    other = env.reset("1")
    assert other.state.base is episode.state.base and other.state.overlay is not episode.state.overlay


def test_write_copies_only_touched_records(state: EpisodeState, base: CanonicalBase) -> None:
    args = booking()
    args["payment_methods"] = [{"payment_id": CREDIT_CARD, "amount": booking_price(state, args)}]
    ok(state, "book_reservation", **args)
    assert set(state.overlay["flights"]) == {"HAT014", "HAT198"}
    assert set(state.overlay["users"]) == {USER}
    assert set(state.overlay["reservations"]) == {"HATHAT"}
    ok(state, "cancel_reservation", reservation_id=RES_GIFT)
    assert set(state.overlay["reservations"]) == {"HATHAT", RES_GIFT}
    # the copies are private: the base records are untouched and distinct objects
    assert state.overlay["users"][USER] is not base.db["users"][USER]
    assert base.db["users"][USER]["reservations"][-1] != "HATHAT"
    assert base.db["reservations"][RES_GIFT]["status"] is None


def test_two_episodes_do_not_interfere() -> None:
    env = DomainEnv(AIRLINE)
    a, b = env.reset("0"), env.reset("0")
    ok(a.state, "cancel_reservation", reservation_id=RES_GIFT)
    ok(b.state, "update_reservation_baggages", reservation_id=RES_GIFT, total_baggages=3, nonfree_baggages=1,
       payment_id=GIFT_CARD)  # fmt: skip
    ra, rb = a.state.get("reservations", RES_GIFT), b.state.get("reservations", RES_GIFT)
    assert ra["status"] == "cancelled" and rb["status"] is None
    assert rb["nonfree_baggages"] == 1 and ra["nonfree_baggages"] == 0
    assert len(ra["payment_history"]) == 2 and rb["payment_history"][-1]["amount"] == 50
    assert a.state.get("users", USER)["payment_methods"][GIFT_CARD]["amount"] == 98.0
    assert b.state.get("users", USER)["payment_methods"][GIFT_CARD]["amount"] == 48.0
    assert a.state.db_hash() != b.state.db_hash()
    assert env.reset("0").state.db_hash() == env.base.base_hash


def test_base_unchanged_after_many_writes(base: CanonicalBase) -> None:
    before = naive_db_hash(base.db)
    assert before == base.base_hash
    domain = load_domain(AIRLINE)
    states = []
    for task in domain.tasks.values():  # every gold action of every task
        state = EpisodeState(base)
        for action in task.actions:
            assert not execute_tool(state, action.name, action.arguments).error
        states.append(state)
    state = EpisodeState(base)
    for rid in list(base.db["reservations"])[:50]:
        ok(state, "cancel_reservation", reservation_id=rid)
    for uid in list(base.db["users"])[:50]:
        ok(state, "send_certificate", user_id=uid, amount=1)
    assert naive_db_hash(base.db) == before
    assert base.base_hash == before
    assert state.db_hash() == naive_db_hash(state.materialize()) != before
