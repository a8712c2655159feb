"""The tools against τ²-bench's own outputs: ``tests/data/tau2_reference.json`` replayed through this project.

The file was written by ``benchmarks/tau2_reference.py`` from τ²'s code (random and adversarial call sequences, one
fresh database each). Every observation must be byte-identical (compared by sha256; the short ones also as text, for
a readable diff), every error flag equal, and the database hash after every write and at the end of every sequence
equal to τ²'s ``get_db_hash()`` — the project's hash *is* τ²'s definition, so "hash equal" and "τ² hash equal"
coincide by construction, which ``test_hash_equality_coincides_with_tau2`` checks pairwise.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import execute_tool
from tau2_rl.envs.episode import shared_base
from tau2_rl.envs.state import EpisodeState, naive_db_hash

AIRLINE = get_domain("airline")

REFERENCE = Path(__file__).parent / "data" / "tau2_reference.json"
_PYDANTIC_URL = re.compile(r"https://errors\.pydantic\.dev/\d+\.\d+/")


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text())


def _same_pydantic_minor(reference: dict[str, Any]) -> bool:
    return reference["pydantic"].split(".")[:2] == pydantic.VERSION.split(".")[:2]


def _expected_text(call: dict[str, Any], reference: dict[str, Any]) -> str | None:
    """The recorded text; a validation error's docs link names pydantic's minor version: follow the installed one."""
    text = call.get("content")
    if text is not None and not _same_pydantic_minor(reference):
        minor = ".".join(pydantic.VERSION.split(".")[:2])
        text = _PYDANTIC_URL.sub(f"https://errors.pydantic.dev/{minor}/", text)
    return text


def _replay(reference: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs every sequence; returns per call what the project produced next to what τ² recorded."""
    base = shared_base(AIRLINE)
    rows = []
    for sequence in reference["sequences"]:
        state = EpisodeState(base)
        for index, call in enumerate(sequence["calls"]):
            arguments = json.loads(json.dumps(call["arguments"]))
            result = execute_tool(state, call["name"], arguments)
            row = {"sequence": sequence["name"], "index": index, "call": call, "result": result}
            if "db_hash" in call:
                row["db_hash"] = state.db_hash()
            rows.append(row)
        rows.append({"sequence": sequence["name"], "final": True, "db_hash": state.db_hash(), "state": state})
    return rows


@pytest.fixture(scope="module")
def replay(reference: dict[str, Any]) -> list[dict[str, Any]]:
    return _replay(reference)


def test_reference_file_is_substantial(reference: dict[str, Any]) -> None:
    calls = [call for sequence in reference["sequences"] for call in sequence["calls"]]
    assert len(calls) >= 300
    assert {call["name"] for call in calls} >= {
        "book_reservation", "calculate", "cancel_reservation", "get_reservation_details", "get_user_details",
        "list_all_airports", "search_direct_flight", "search_onestop_flight", "send_certificate",
        "transfer_to_human_agents", "update_reservation_baggages", "update_reservation_flights",
        "update_reservation_passengers", "get_flight_status",
    }  # fmt: skip
    errors = sum(call["error"] for call in calls)
    assert 0.2 * len(calls) < errors < 0.8 * len(calls)  # both successes and failures are well represented
    writes_ok = [c for c in calls if "db_hash" in c and not c["error"]]
    assert len(writes_ok) >= 40


def test_initial_hash_is_tau2s(reference: dict[str, Any]) -> None:
    base = shared_base(AIRLINE)
    assert base.base_hash == reference["initial_db_hash"]
    assert naive_db_hash(base.db) == reference["initial_db_hash"]


def test_observations_are_byte_identical(replay: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    mismatches = []
    compared = 0
    for row in replay:
        if row.get("final"):
            continue
        call, content = row["call"], row["result"].content
        if call.get("python_dependent"):
            continue  # the text of a Python parser message differs between Python versions; the flag is checked
        if "content" not in call and "validation error" in call["head"] and not _same_pydantic_minor(reference):
            continue  # a long validation error stored as a digest embeds the recording's pydantic version
        compared += 1
        expected = _expected_text(call, reference)
        if expected is not None:
            same = content == expected
        else:
            same = hashlib.sha256(content.encode()).hexdigest() == call["sha256"]
        if not same:
            mismatches.append((row["sequence"], row["index"], call["name"], expected or call["head"], content[:300]))
    assert compared >= 300
    assert not mismatches, f"{len(mismatches)} observations differ from τ²'s, first: {mismatches[:3]}"


def test_error_flags_are_identical(replay: list[dict[str, Any]]) -> None:
    differ = [
        (row["sequence"], row["index"], row["call"]["name"], row["result"].content[:200])
        for row in replay
        if not row.get("final") and row["result"].error != row["call"]["error"]
    ]
    assert not differ


def test_database_hashes_are_tau2s(replay: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    finals = {s["name"]: s["final_db_hash"] for s in reference["sequences"]}
    for row in replay:
        if row.get("final"):
            assert row["db_hash"] == finals[row["sequence"]], row["sequence"]
            state: EpisodeState = row["state"]
            assert row["db_hash"] == naive_db_hash(state.materialize())  # the incremental hash is the full one
        elif "db_hash" in row:
            assert row["db_hash"] == row["call"]["db_hash"], (row["sequence"], row["index"], row["call"]["name"])


def test_hash_equality_coincides_with_tau2(replay: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Across all recorded checkpoints: two project hashes are equal exactly when τ²'s two hashes are."""
    finals = {s["name"]: s["final_db_hash"] for s in reference["sequences"]}
    pairs = [(reference["initial_db_hash"], shared_base(AIRLINE).base_hash)]
    for row in replay:
        if row.get("final"):
            pairs.append((finals[row["sequence"]], row["db_hash"]))
        elif "db_hash" in row:
            pairs.append((row["call"]["db_hash"], row["db_hash"]))
    tau2_hashes = {tau2 for tau2, _ in pairs}
    assert len(tau2_hashes) > 20  # many distinct database states, and some repeated ones
    assert len(tau2_hashes) < len(pairs)
    for tau2_a, ours_a in pairs:
        for tau2_b, ours_b in pairs:
            assert (tau2_a == tau2_b) == (ours_a == ours_b)
