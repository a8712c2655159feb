"""The copy-on-write state's hash is exactly the naive full-database hash, on random tool-call sequences.

A seeded generator draws plausible calls from the real database (real users, reservations, flights, dates, payment
methods; correctly priced bookings so that writes succeed) mixed with deliberately bad ones (unknown tools, missing,
extra and wrongly typed arguments, nonexistent ids). After every sequence ``state.db_hash()`` must equal
``naive_db_hash(state.materialize())``; across sequences, equal fingerprints must coincide with equal hashes; and the
shared base database must come out unchanged.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import pytest

import tau2_rl.envs.state as state_module
from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.models import TABLE_MODELS
from tau2_rl.domains.airline.tools import AIRPORTS, CABINS, ToolResult, execute_tool
from tau2_rl.envs.episode import shared_base
from tau2_rl.envs.state import CanonicalBase, EpisodeState, copy_json, naive_db_hash

AIRLINE = get_domain("airline")

NUM_SEQUENCES = 300
MAX_STEPS = 12
SEED = 20240515

Call = tuple[str, Any]


@pytest.fixture(scope="module")
def base() -> CanonicalBase:
    return shared_base(AIRLINE)


@dataclass
class Pools:
    users: list[str]
    reservations: list[str]
    flights: list[str]
    dates: list[str]


def make_pools(base: CanonicalBase) -> Pools:
    dates = sorted({d for f in base.db["flights"].values() for d in f["dates"]})
    return Pools(sorted(base.db["users"]), sorted(base.db["reservations"]), sorted(base.db["flights"]), dates)


class CallGenerator:
    """Random tool calls that depend on the current state (prices, seats, payment methods) to be plausible."""

    def __init__(self, rng: random.Random, pools: Pools) -> None:
        self.rng = rng
        self.pools = pools

    # -- helpers -------------------------------------------------------------------------------------------------

    def user_id(self) -> str:
        return self.rng.choice(self.pools.users) if self.rng.random() < 0.95 else "nobody_0000"

    def reservation_id(self) -> str:
        r = self.rng.random()
        if r < 0.1:
            return self.rng.choice(["HATHAT", "HATHAU", "HATHAV"])
        return self.rng.choice(self.pools.reservations) if r < 0.97 else "ZZZZZZ"

    def flight_number(self) -> str:
        return self.rng.choice(self.pools.flights) if self.rng.random() < 0.97 else "HAT999"

    def date(self) -> str:
        r = self.rng.random()
        if r < 0.75:
            return f"2024-05-{self.rng.randint(16, 30)}"  # bookable
        return self.rng.choice(self.pools.dates) if r < 0.97 else self.rng.choice(["2024-06-01", "2024-05-9", "x"])

    def payment_id(self, state: EpisodeState, user_id: str | None) -> str:
        user = state.get("users", user_id) if user_id else None
        if user is None or not user["payment_methods"] or self.rng.random() < 0.05:
            return self.rng.choice(["credit_card_0000000", "gift_card_0000000", "certificate_0000000"])
        return self.rng.choice(sorted(user["payment_methods"]))

    def passengers(self, n: int) -> list[dict[str, str]]:
        names = ["Ava", "Noah", "Mia", "Liam", "Yara", "Omar"]
        return [{"first_name": self.rng.choice(names), "last_name": self.rng.choice(names),
                 "dob": f"19{self.rng.randint(40, 99)}-0{self.rng.randint(1, 9)}-1{self.rng.randint(0, 9)}"}
                for _ in range(n)]  # fmt: skip

    def reservation_user(self, state: EpisodeState, reservation_id: str) -> str | None:
        reservation = state.get("reservations", reservation_id)
        return reservation["user_id"] if reservation else None

    # -- tools ---------------------------------------------------------------------------------------------------

    def book_reservation(self, state: EpisodeState) -> dict[str, Any]:
        rng = self.rng
        user_id = self.user_id()
        cabin = rng.choice(CABINS)
        n = rng.randint(1, 3)
        flights = [{"flight_number": self.flight_number(), "date": self.date()} for _ in range(rng.randint(1, 2))]
        insurance = rng.choice(["yes", "no"])
        nonfree = rng.randint(0, 2)
        total = 30 * n * (insurance == "yes") + 50 * nonfree
        for info in flights:
            flight = state.get("flights", info["flight_number"])
            instance = flight["dates"].get(info["date"]) if flight else None
            total += instance["prices"][cabin] * n if instance and "prices" in instance else rng.randint(50, 500)
        user = state.get("users", user_id)
        methods = sorted(user["payment_methods"].items()) if user else []
        payments: list[dict[str, Any]] = []
        remaining = total
        for payment_id, method in rng.sample(methods, k=min(len(methods), rng.randint(1, 2))):
            if method["source"] == "credit_card":
                amount = remaining
            else:
                amount = min(remaining, int(method["amount"]))
            payments.append({"payment_id": payment_id, "amount": amount})
            remaining -= amount
            if remaining == 0:
                break
        if remaining and payments:
            payments[-1]["amount"] += remaining  # may exceed a balance: an error, which is fine too
        if not payments or rng.random() < 0.1:
            payments.append({"payment_id": self.payment_id(state, user_id), "amount": rng.randint(0, 100)})
        return {
            "user_id": user_id,
            "origin": rng.choice(AIRPORTS)[0],
            "destination": rng.choice(AIRPORTS)[0],
            "flight_type": rng.choice(["one_way", "round_trip"]),
            "cabin": cabin,
            "flights": flights,
            "passengers": self.passengers(n),
            "payment_methods": payments,
            "total_baggages": nonfree + rng.randint(0, 2),
            "nonfree_baggages": nonfree,
            "insurance": insurance,
        }

    def update_reservation_flights(self, state: EpisodeState) -> dict[str, Any]:
        rid = self.reservation_id()
        reservation = state.get("reservations", rid)
        flights = (
            [{"flight_number": f["flight_number"], "date": f["date"]} for f in reservation["flights"]]
            if reservation
            else []
        )
        if flights and self.rng.random() < 0.6:
            flights[self.rng.randrange(len(flights))] = {"flight_number": self.flight_number(), "date": self.date()}
        cabin = reservation["cabin"] if reservation and self.rng.random() < 0.5 else self.rng.choice(CABINS)
        return {"reservation_id": rid, "cabin": cabin, "flights": flights,
                "payment_id": self.payment_id(state, self.reservation_user(state, rid))}  # fmt: skip

    def update_reservation_baggages(self, state: EpisodeState) -> dict[str, Any]:
        rid = self.reservation_id()
        nonfree = self.rng.randint(0, 3)
        return {"reservation_id": rid, "total_baggages": nonfree + self.rng.randint(0, 3), "nonfree_baggages": nonfree,
                "payment_id": self.payment_id(state, self.reservation_user(state, rid))}  # fmt: skip

    def update_reservation_passengers(self, state: EpisodeState) -> dict[str, Any]:
        rid = self.reservation_id()
        reservation = state.get("reservations", rid)
        if reservation and self.rng.random() < 0.3:  # identical passengers: a write that changes nothing
            return {"reservation_id": rid, "passengers": copy_json(reservation["passengers"])}
        n = len(reservation["passengers"]) if reservation and self.rng.random() < 0.8 else self.rng.randint(0, 4)
        return {"reservation_id": rid, "passengers": self.passengers(n)}

    def good_call(self, state: EpisodeState) -> Call:
        rng = self.rng
        name = rng.choices(
            ["book_reservation", "cancel_reservation", "update_reservation_flights", "update_reservation_baggages",
             "update_reservation_passengers", "send_certificate", "get_user_details", "get_reservation_details",
             "search_direct_flight", "search_onestop_flight", "get_flight_status", "list_all_airports", "calculate",
             "transfer_to_human_agents"],
            weights=[5, 3, 4, 3, 2, 2, 1, 1, 1, 0.5, 1, 0.3, 0.5, 0.3],
        )[0]  # fmt: skip
        if hasattr(self, name):
            return name, getattr(self, name)(state)
        if name == "cancel_reservation":
            return name, {"reservation_id": self.reservation_id()}
        if name == "send_certificate":
            return name, {"user_id": self.user_id(), "amount": rng.choice([0, 50, 100, 250, rng.randint(1, 1000)])}
        if name == "get_user_details":
            return name, {"user_id": self.user_id()}
        if name == "get_reservation_details":
            return name, {"reservation_id": self.reservation_id()}
        if name in ("search_direct_flight", "search_onestop_flight"):
            origin, destination = rng.sample([a for a, _ in AIRPORTS], 2)
            return name, {"origin": origin, "destination": destination, "date": self.date()}
        if name == "get_flight_status":
            return name, {"flight_number": self.flight_number(), "date": self.date()}
        if name == "calculate":
            return name, {"expression": rng.choice(["1+2", "10/4", "2**99", "1/0", "abc"])}
        if name == "transfer_to_human_agents":
            return name, {"summary": "help"}
        return name, {}

    def bad_call(self, state: EpisodeState) -> Call:
        rng = self.rng
        name, arguments = self.good_call(state)
        kind = rng.randrange(6)
        if kind == 0:
            return rng.choice(["fly", "", "get_user_detail", "book_reservations", "think"]), arguments
        if kind == 1:
            return name, rng.choice([[], "user_id", None, 5, [arguments]])
        if kind == 2 and arguments:
            arguments.pop(rng.choice(sorted(arguments)))
        elif kind == 3:
            arguments[rng.choice(["extra", "verbose", "id"])] = rng.choice([1, "x", None])
        elif kind == 4 and arguments:
            key = rng.choice(sorted(arguments))
            arguments[key] = rng.choice([None, 1.5, "x", [], {}, True, 10**30, -1, float("nan"), [None]])
        elif arguments:  # nested damage: a flight/passenger/payment entry of the wrong shape
            for value in arguments.values():
                if isinstance(value, list) and value:
                    value[rng.randrange(len(value))] = rng.choice([{}, {"a": 1}, "HAT001", 3])
                    break
        return name, arguments

    def call(self, state: EpisodeState) -> Call:
        return self.bad_call(state) if self.rng.random() < 0.2 else self.good_call(state)


def run_sequence(base: CanonicalBase, gen: CallGenerator) -> tuple[EpisodeState, list[Call], list[ToolResult]]:
    state = EpisodeState(base)
    calls, results = [], []
    for _ in range(gen.rng.randint(1, MAX_STEPS)):
        name, arguments = gen.call(state)
        calls.append((name, copy_json(arguments)))
        results.append(execute_tool(state, name, arguments))
    return state, calls, results


def replay(base: CanonicalBase, calls: list[Call]) -> tuple[EpisodeState, list[ToolResult]]:
    state = EpisodeState(base)
    return state, [execute_tool(state, name, copy_json(arguments)) for name, arguments in calls]


def test_hash_equals_naive_hash_on_random_sequences(base: CanonicalBase, caplog: pytest.LogCaptureFixture) -> None:
    base_before = naive_db_hash(base.db)
    assert base_before == base.base_hash
    rng = random.Random(SEED)
    gen = CallGenerator(rng, make_pools(base))
    seen: list[tuple[bytes, str]] = []
    stats = {"calls": 0, "errors": 0, "writes_ok": 0, "changed": 0, "twins": 0, "kinds": set()}
    with caplog.at_level(logging.ERROR, logger="tau2_rl.envs.toolkit"):
        for i in range(NUM_SEQUENCES):
            state, calls, results = run_sequence(base, gen)
            digest = state.db_hash()
            assert digest == naive_db_hash(state.materialize()), f"sequence {i}: {calls}"
            fingerprint = state.fingerprint()
            seen.append((fingerprint, digest))
            stats["calls"] += len(calls)
            stats["errors"] += sum(r.error for r in results)
            stats["kinds"] |= {r.error_kind for r in results}
            stats["writes_ok"] += sum(
                not r.error and name.startswith(("book", "cancel", "update", "send"))
                for (name, _), r in zip(calls, results, strict=True)
            )
            stats["changed"] += fingerprint != b""
            if i % 5 == 0:  # the same calls on a fresh state give the same observations, changes and hash
                twin, twin_results = replay(base, calls)
                assert [r.content for r in twin_results] == [r.content for r in results]
                assert twin.fingerprint() == fingerprint and twin.db_hash() == digest
                seen.append((twin.fingerprint(), twin.db_hash()))
                stats["twins"] += 1
    # no call crashed inside a tool (execute_tool logs unexpected exceptions before turning them into errors)
    assert not [r for r in caplog.records if r.name == "tau2_rl.envs.toolkit"], caplog.text
    # the generator really exercised the tools
    assert stats["calls"] > 5 * NUM_SEQUENCES
    assert stats["writes_ok"] > 300 and stats["changed"] > NUM_SEQUENCES // 2
    assert 0.2 < stats["errors"] / stats["calls"] < 0.8
    assert stats["kinds"] == {None, "unknown_tool", "bad_arguments", "execution"}
    # fingerprint equality <=> hash equality, over all pairs
    by_fingerprint: dict[bytes, str] = {}
    by_hash: dict[str, bytes] = {}
    for fingerprint, digest in seen:
        assert by_fingerprint.setdefault(fingerprint, digest) == digest
        assert by_hash.setdefault(digest, fingerprint) == fingerprint
    assert len(by_hash) > NUM_SEQUENCES // 2  # mostly distinct databases
    assert by_fingerprint.get(b"", base.base_hash) == base.base_hash
    # the shared base is unchanged
    assert naive_db_hash(base.db) == base_before


def test_commuting_writes_give_equal_fingerprints(base: CanonicalBase) -> None:
    calls: list[Call] = [
        ("cancel_reservation", {"reservation_id": "R9QDGB"}),
        ("send_certificate", {"user_id": "mia_li_3668", "amount": 100}),
        ("update_reservation_baggages", {"reservation_id": "4WQ150", "total_baggages": 6, "nonfree_baggages": 1,
                                         "payment_id": "gift_card_3576581"}),
    ]  # fmt: skip
    forward, results = replay(base, calls)
    backward, _ = replay(base, calls[::-1])
    assert not any(r.error for r in results)
    assert forward.fingerprint() == backward.fingerprint() != b""
    assert forward.db_hash() == backward.db_hash() == naive_db_hash(backward.materialize())
    partial, _ = replay(base, calls[:2])
    assert partial.fingerprint() != forward.fingerprint()
    assert partial.db_hash() != forward.db_hash()


# ---------------------------------------------------------------------------------------------------------------------
# Direct edge cases of the incremental hash (positions no tool reaches)


def _check(state: EpisodeState) -> None:
    assert state.db_hash() == naive_db_hash(state.materialize())


def _touch(state: EpisodeState, table: str, key: str, value: Any) -> None:
    """Assigns ``value`` unvalidated to the record's first field (what τ²'s tools do with some arguments)."""
    model = state.model(table, key)
    setattr(model, next(iter(type(model).model_fields)), value)


def _new(table: str, record: dict[str, Any], first: Any = None) -> Any:
    model = TABLE_MODELS[table].model_validate(record)
    if first is not None:
        setattr(model, next(iter(type(model).model_fields)), first)
    return model


@pytest.mark.parametrize("table", ["flights", "reservations", "users"])
def test_edges_of_each_table(base: CanonicalBase, table: str) -> None:
    keys = base.keys[table]
    record = copy_json(base.db[table][keys[0]])
    cases = [
        ("change first", lambda s: _touch(s, table, keys[0], "x1")),
        ("change last", lambda s: _touch(s, table, keys[-1], 2)),
        ("change middle", lambda s: _touch(s, table, keys[len(keys) // 2], [1.5, None])),
        ("insert before first", lambda s: s.insert(table, "", _new(table, record))),
        ("insert after last", lambda s: s.insert(table, "~~~~", _new(table, record))),
        ("insert between", lambda s: s.insert(table, keys[0] + "0", _new(table, record))),
        ("insert both ends", lambda s: (s.insert(table, "!", _new(table, record, "a")),
                                        s.insert(table, "\U0001f600", _new(table, record, {"é": [1.5, None]})))),
    ]  # fmt: skip
    digests = set()
    for label, mutate in cases:
        state = EpisodeState(base)
        mutate(state)
        assert state.fingerprint() != b"", label
        _check(state)
        digests.add(state.db_hash())
    assert len(digests) == len(cases)


def test_changes_in_every_table_and_many_records(base: CanonicalBase) -> None:
    state = EpisodeState(base)
    for table in base.table_order:
        for key in base.keys[table][::97]:
            _touch(state, table, key, f"touched {key}")
    state.insert("reservations", "HATHAT", _new("reservations", base.db["reservations"]["4WQ150"], "HATHAT"))
    _check(state)


def test_written_back_identical_record_is_not_a_change(base: CanonicalBase) -> None:
    state = EpisodeState(base)
    user = state.model("users", "mia_li_3668")
    user.membership = "platinum"
    assert state.fingerprint() != b""
    user.membership = base.db["users"]["mia_li_3668"]["membership"]
    assert state.overlay["users"]  # still copied...
    assert state.fingerprint() == b"" and state.db_hash() == base.base_hash  # ...but equal to the base


def test_values_reads_through_the_overlay(base: CanonicalBase) -> None:
    state = EpisodeState(base)
    state.model("flights", "HAT001").origin = "XXX"
    state.insert("flights", "HAT999", _new("flights", base.db["flights"]["HAT002"], "HAT999"))
    flights = list(state.values("flights"))
    assert len(flights) == len(base.db["flights"]) + 1
    assert flights[0]["origin"] == "XXX" and flights[-1]["flight_number"] == "HAT999"
    assert base.db["flights"]["HAT001"]["origin"] == "PHL"
    with pytest.raises(KeyError):
        state.insert("flights", "HAT001", _new("flights", base.db["flights"]["HAT001"]))


def test_hash_correct_after_memo_eviction(base: CanonicalBase, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_module, "_MAX_MEMO", 3)
    states = []
    for i in range(6):
        state = EpisodeState(base)
        execute_tool(state, "send_certificate", {"user_id": base.keys["users"][i], "amount": 10 + i})
        states.append(state)
    for state in states + states[::-1]:  # evicted, recomputed, memoised again
        _check(state)
    assert len(base._memo) <= 3
    assert base._memo[b""] == base.base_hash
