"""The airline records as τ²-bench types them: pydantic models with τ²'s fields, types, defaults and field order.

Why pydantic, and why these exact types: τ²'s tools build and read these models, so what a tool accepts and shows
follows from them. Pydantic's lax mode turns ``"100"`` into ``100.0`` for a float field and drops unknown keys of a
passenger; ``model_dump`` writes fields in declaration order with ``None`` for unset optionals (``"status": null``);
a value a tool assigns without validation (``reservation.total_baggages = "7"``) is stored and dumped as given. The
τ² database hash is the sha256 of ``json.dumps(model_dump(), sort_keys=True, default=str)``, so matching τ²'s hash
needs the same dumps. Records here are written from τ²'s published data model (field by field); descriptions are
left out because they change nothing a tool does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

DB_TABLES = ("flights", "reservations", "users")

FlightType = Literal["round_trip", "one_way"]
CabinClass = Literal["business", "economy", "basic_economy"]
Insurance = Literal["yes", "no"]
MembershipLevel = Literal["gold", "silver", "regular"]


class AirportCode(BaseModel):
    iata: str
    city: str


class Name(BaseModel):
    first_name: str
    last_name: str


class Address(BaseModel):
    address1: str
    address2: str | None = None
    city: str
    country: str
    state: str
    zip: str


class Payment(BaseModel):
    payment_id: str
    amount: int


class PaymentMethodBase(BaseModel):
    source: str
    id: str


class CreditCard(PaymentMethodBase):
    source: Literal["credit_card"]
    brand: str
    last_four: str


class GiftCard(PaymentMethodBase):
    source: Literal["gift_card"]
    amount: float
    id: str


class Certificate(PaymentMethodBase):
    source: Literal["certificate"]
    amount: float


PaymentMethod = CreditCard | GiftCard | Certificate  # a smart-mode union, in τ²'s member order


class Passenger(BaseModel):
    first_name: str
    last_name: str
    dob: str


class FlightDateStatusAvailable(BaseModel):
    status: Literal["available"]
    available_seats: dict[CabinClass, int]
    prices: dict[CabinClass, int]


class FlightDataStatusOnTime(BaseModel):
    status: Literal["on time"]
    estimated_departure_time_est: str
    estimated_arrival_time_est: str


class FlightDataStatusFlying(BaseModel):
    status: Literal["flying"]
    actual_departure_time_est: str
    estimated_arrival_time_est: str


class FlightDateStatusLanded(BaseModel):
    status: Literal["landed"]
    actual_departure_time_est: str
    actual_arrival_time_est: str


class FlightDateStatusCancelled(BaseModel):
    status: Literal["cancelled"]


class FlightDateStatusDelayed(BaseModel):
    status: Literal["delayed"]
    estimated_departure_time_est: str
    estimated_arrival_time_est: str


FlightDateStatus = (  # τ²'s member order
    FlightDateStatusAvailable
    | FlightDateStatusLanded
    | FlightDateStatusCancelled
    | FlightDateStatusDelayed
    | FlightDataStatusFlying
    | FlightDataStatusOnTime
)


class FlightBase(BaseModel):
    flight_number: str
    origin: str
    destination: str


class Flight(FlightBase):
    scheduled_departure_time_est: str
    scheduled_arrival_time_est: str
    dates: dict[str, FlightDateStatus]


class DirectFlight(FlightBase):
    status: Literal["available"]
    scheduled_departure_time_est: str
    scheduled_arrival_time_est: str
    date: str | None = None
    available_seats: dict[CabinClass, int]
    prices: dict[CabinClass, int]


class ReservationFlight(FlightBase):
    date: str
    price: int


class FlightInfo(BaseModel):
    flight_number: str
    date: str


class User(BaseModel):
    user_id: str
    name: Name
    address: Address
    email: str
    dob: str
    payment_methods: dict[str, PaymentMethod]
    saved_passengers: list[Passenger]
    membership: MembershipLevel
    reservations: list[str]


class Reservation(BaseModel):
    reservation_id: str
    user_id: str
    origin: str
    destination: str
    flight_type: FlightType
    cabin: CabinClass
    flights: list[ReservationFlight]
    passengers: list[Passenger]
    payment_history: list[Payment]
    created_at: str
    total_baggages: int
    nonfree_baggages: int
    insurance: Insurance
    status: Literal["cancelled"] | None = None


class FlightDB(BaseModel):
    """The whole database (τ²'s ``FlightDB``: unknown top-level keys are an error)."""

    model_config = ConfigDict(extra="forbid")

    flights: dict[str, Flight]
    users: dict[str, User]
    reservations: dict[str, Reservation]


TABLE_MODELS: dict[str, type[BaseModel]] = {"flights": Flight, "reservations": Reservation, "users": User}
