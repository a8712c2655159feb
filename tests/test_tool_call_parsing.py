"""Parsing ``<tool_call>`` blocks out of untrusted model text, and running them through ``Episode.env_response``.

Unit tests pin ``parse_assistant_text``; a hypothesis fuzz test feeds thousands of hostile turns (random text, random
JSON, valid gold calls with characters deleted / inserted / duplicated, wrong types) to real episodes and checks that
nothing raises, every block becomes exactly one recorded call, and every failure is recorded as a tool error.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import TOOL_NAMES
from tau2_rl.envs.data import load_domain
from tau2_rl.envs.episode import (
    AGENT_STOP,
    AGENT_STOP_TOKEN,
    MAX_TOOL_ERRORS,
    DomainEnv,
    Episode,
)
from tau2_rl.envs.state import naive_db_hash
from tau2_rl.envs.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, format_tool_call, parse_assistant_text

AIRLINE = get_domain("airline")

ENV = DomainEnv(AIRLINE)


def block(payload: Any) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


# ---------------------------------------------------------------------------------------------------------------------
# parse_assistant_text


def test_several_blocks_in_order_and_text_outside_is_the_message() -> None:
    text = (
        "Let me check. "
        + block({"name": "get_user_details", "arguments": {"user_id": "mia_li_3668"}})
        + " and then "
        + block({"name": "get_reservation_details", "arguments": {"reservation_id": "4WQ150"}})
        + block({"name": "list_all_airports", "arguments": {}})
        + "  Done."
    )
    turn = parse_assistant_text(text)
    assert [c.name for c in turn.tool_calls] == ["get_user_details", "get_reservation_details", "list_all_airports"]
    assert turn.tool_calls[0].arguments == {"user_id": "mia_li_3668"}
    assert turn.tool_calls[1].arguments == {"reservation_id": "4WQ150"}
    assert all(c.parse_error is None for c in turn.tool_calls)
    assert turn.text == "Let me check.  and then   Done."


def test_plain_text_has_no_calls() -> None:
    turn = parse_assistant_text("  Your flight is booked.\n")
    assert turn.text == "Your flight is booked." and turn.tool_calls == []
    assert parse_assistant_text("").tool_calls == []
    assert parse_assistant_text(None).text == ""  # type: ignore[arg-type]


def test_unclosed_block() -> None:
    turn = parse_assistant_text('Sure. <tool_call>{"name": "list_all_airports", "arguments": {}}')
    assert len(turn.tool_calls) == 1
    assert turn.tool_calls[0].parse_error == "Tool call block is not closed with </tool_call>"
    assert turn.text == "Sure."
    # an unclosed block swallows the rest, including later opening tags
    turn = parse_assistant_text("<tool_call>{}<tool_call>{}")
    assert len(turn.tool_calls) == 1 and turn.tool_calls[0].parse_error is not None


def test_closed_then_unclosed() -> None:
    turn = parse_assistant_text(block({"name": "calculate", "arguments": {"expression": "1+1"}}) + "<tool_call>{")
    assert [c.parse_error is None for c in turn.tool_calls] == [True, False]


@pytest.mark.parametrize(
    "body", ['{"name": "calculate", "arguments": {', "{'name': 'calculate'}", "calculate(1+1)", ""]
)
def test_bad_json(body: str) -> None:
    (call,) = parse_assistant_text(block(body)).tool_calls
    assert call.parse_error is not None and call.parse_error.startswith("Tool call is not valid JSON")
    assert call.name == ""


def test_arguments_as_json_string() -> None:
    (call,) = parse_assistant_text(block({"name": "calculate", "arguments": '{"expression": "2+2"}'})).tool_calls
    assert call.parse_error is None and call.arguments == {"expression": "2+2"}
    (call,) = parse_assistant_text(block({"name": "calculate", "arguments": "{bad"})).tool_calls
    assert call.parse_error is not None and "arguments are not valid JSON" in call.parse_error
    (call,) = parse_assistant_text(block({"name": "calculate", "arguments": "[1]"})).tool_calls
    assert call.parse_error == "Tool call 'arguments' must be a JSON object"


@pytest.mark.parametrize("payload", [[1, 2], "calculate", 3, None, True])
def test_non_object_payload(payload: Any) -> None:
    (call,) = parse_assistant_text(block(json.dumps(payload))).tool_calls
    assert call.parse_error is not None and "must be a JSON object" in call.parse_error


@pytest.mark.parametrize("payload", [{"arguments": {}}, {"name": ""}, {"name": 3}, {"name": None}, {"name": ["x"]}])
def test_missing_or_bad_name(payload: dict[str, Any]) -> None:
    (call,) = parse_assistant_text(block(payload)).tool_calls
    assert call.parse_error == "Tool call has no 'name' string"


def test_extra_keys() -> None:
    (call,) = parse_assistant_text(block({"name": "calculate", "arguments": {}, "id": "call_1"})).tool_calls
    assert call.parse_error == "Tool call has unexpected keys ['id']"
    assert call.name == "calculate"


@pytest.mark.parametrize("arguments", [[], 1, None, True])
def test_non_object_arguments(arguments: Any) -> None:
    (call,) = parse_assistant_text(block({"name": "calculate", "arguments": arguments})).tool_calls
    assert call.parse_error == "Tool call 'arguments' must be a JSON object"


def test_missing_arguments_default_to_empty() -> None:
    (call,) = parse_assistant_text(block({"name": "list_all_airports"})).tool_calls
    assert call.parse_error is None and call.arguments == {}


def test_hostile_json_is_a_parse_error_not_an_exception() -> None:
    huge = "9" * 5000
    bodies = [huge, '{"name": "calculate", "arguments": {"expression": ' + huge + "}}",
              '{"name": "calculate", "arguments": "' + huge + '"}', "[" * 100000, '{"a":' * 50000]  # fmt: skip
    for body in bodies:
        (call,) = parse_assistant_text(block(body)).tool_calls
        assert call.parse_error is not None and "not valid JSON" in call.parse_error


def test_stray_closing_tags_are_dropped_from_the_message() -> None:
    turn = parse_assistant_text("Hello</tool_call> there")
    assert turn.text == "Hello there" and turn.tool_calls == []


def test_format_round_trip() -> None:
    domain = load_domain(AIRLINE)
    for task in domain.tasks.values():
        for action in task.actions:
            (call,) = parse_assistant_text(format_tool_call(action.name, action.arguments)).tool_calls
            assert (call.name, call.arguments, call.parse_error) == (action.name, action.arguments, None)


# ---------------------------------------------------------------------------------------------------------------------
# Episode.env_response


def test_env_response_counts_every_block_and_classifies_errors() -> None:
    episode = ENV.reset("0")
    text = (
        "One moment."
        + block({"name": "get_user_details", "arguments": {"user_id": "mia_li_3668"}})
        + block("{not json")
        + block({"name": "fly_me", "arguments": {}})
        + block({"name": "get_user_details", "arguments": {}})
        + block({"name": "get_user_details", "arguments": {"user_id": "nobody_1"}})
    )
    messages = episode.env_response(text)
    kinds = [(c.error, c.error_kind) for c in episode.record.tool_calls]
    assert kinds == [(False, None), (True, "parse"), (True, "unknown_tool"), (True, "bad_arguments"),
                     (True, "execution")]  # fmt: skip
    assert [m["role"] for m in messages] == ["tool"] * 5
    assert [m["content"] for m in messages] == [c.result for c in episode.record.tool_calls]
    assert messages[1]["name"] == "invalid_tool_call"
    assert messages[4]["content"] == "Error: User nobody_1 not found"
    assert episode.record.num_tool_errors == 4 and not episode.is_completed
    assert episode.messages[-6]["content"] == text  # a turn with a parse error keeps its raw text
    assert episode.record.turns[0].message == "One moment."


def test_env_response_transfer_ends_nothing_by_itself() -> None:
    # τ²: the transfer is an ordinary tool call; the conversation ends when the user answers it (###TRANSFER###).
    episode = ENV.reset("0")
    text = block({"name": "transfer_to_human_agents", "arguments": {"summary": "x"}}) + block(
        {"name": "calculate", "arguments": {"expression": "1 + 1"}}
    )
    messages = episode.env_response(text)
    assert [m["content"] for m in messages] == ["Transfer successful", "2.0"]
    assert not episode.is_completed
    episode.env_response("You are being transferred to a human agent.")
    episode.user_response("###TRANSFER###", termination="user_transfer")
    assert episode.record.termination == "user_transfer"


def test_env_response_tool_error_cap_and_stop_token() -> None:
    episode = ENV.reset("0")
    episode.env_response(block("{") * 10)
    assert episode.record.num_tool_errors == 10 and episode.record.termination == MAX_TOOL_ERRORS
    episode = ENV.reset("0")
    episode.env_response(f"Goodbye! {AGENT_STOP_TOKEN}")
    assert episode.record.termination == AGENT_STOP and episode.record.turns[0].message == "Goodbye!"


# ---------------------------------------------------------------------------------------------------------------------
# Fuzz


def count_blocks(text: str) -> int:
    """An independent count of tool-call blocks: each opening tag up to its closing tag (or the end of the text)."""
    count, position = 0, 0
    while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
        count += 1
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end == -1:
            break
        position = end + len(TOOL_CALL_CLOSE)
    return count


GOLD_BLOCKS = sorted(
    {format_tool_call(a.name, a.arguments) for t in load_domain(AIRLINE).tasks.values() for a in t.actions}
    | {format_tool_call("transfer_to_human_agents", {"summary": "help"})}
)
SPECIALS = [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, AGENT_STOP_TOKEN, "{", "}", "[", "]", '"', ":", ",", "\n", "\\", "<", ">"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8,
)


@st.composite
def mutated_gold(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(GOLD_BLOCKS))
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["delete", "insert", "duplicate"]))
        if op == "delete":
            text = text[:i] + text[i + 1 :]
        elif op == "insert":
            text = text[:i] + draw(st.sampled_from(SPECIALS) | st.characters()) + text[i:]
        else:
            j = draw(st.integers(i, min(len(text), i + 30)))
            text = text[:j] + text[i:j] + text[j:]
    return text


@st.composite
def wrong_types(draw: st.DrawFn) -> str:
    payload: dict[str, Any] = {
        "name": draw(st.sampled_from(TOOL_NAMES) | json_values),
        "arguments": draw(json_values | st.dictionaries(st.sampled_from(["user_id", "reservation_id", "amount",
                                                                         "flights", "expression"]), json_values)),
    }  # fmt: skip
    if draw(st.booleans()):
        payload["arguments"] = json.dumps(payload["arguments"])  # OpenAI-style string arguments
    if draw(st.integers(0, 5)) == 0:
        payload[draw(st.text(max_size=5))] = draw(json_values)
    if draw(st.integers(0, 5)) == 0:
        payload.pop("name")
    return block(payload)


segment = st.one_of(
    st.text(max_size=40),
    st.sampled_from(SPECIALS),
    mutated_gold(),
    st.sampled_from(GOLD_BLOCKS),
    wrong_types(),
    json_values.map(lambda v: block(json.dumps(v))),
    st.text(max_size=40).map(lambda t: TOOL_CALL_OPEN + t),
)
turn_text = st.lists(segment, max_size=5).map("".join)


def check_turn(episode: Episode, text: str) -> None:
    before = len(episode.record.tool_calls)
    messages = episode.env_response(text)
    new = episode.record.tool_calls[before:]
    parsed = parse_assistant_text(text)
    expected = count_blocks(text)
    assert len(parsed.tool_calls) == expected
    assert len(new) == expected  # every block is one recorded call (a transfer ends nothing by itself)
    assert [m["content"] for m in messages] == [c.result for c in new]
    for record, call in zip(new, parsed.tool_calls, strict=False):
        if call.parse_error is not None:
            assert record.error and record.error_kind == "parse" and record.arguments is None
        elif call.name not in TOOL_NAMES:
            assert record.error and record.error_kind == "unknown_tool"
        if record.error:
            assert record.result.startswith("Error: ")
        else:
            assert record.error_kind is None and record.name in TOOL_NAMES
    errors = episode.record.num_tool_errors
    assert errors == sum(c.error for c in episode.record.tool_calls)
    if not episode.is_completed:
        assert errors < ENV.config.max_tool_errors
    elif episode.record.termination == MAX_TOOL_ERRORS:
        assert errors >= ENV.config.max_tool_errors


@settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(turns=st.lists(turn_text, min_size=1, max_size=2), task=st.integers(0, 49))
def test_fuzz_env_response_never_raises(turns: list[str], task: int) -> None:
    episode = ENV.reset(str(task))
    for text in turns:
        if episode.is_completed:
            break
        check_turn(episode, text)
    for call in episode.record.tool_calls:
        event(f"{call.error_kind} {'write' if call.is_write else ''}")
    digest = episode.state.db_hash()  # the database stays serialisable whatever was executed
    fingerprint = episode.state.fingerprint()
    if fingerprint and zlib.crc32(fingerprint) % 16 == 0:  # a deterministic sample of the changed states
        assert digest == naive_db_hash(episode.state.materialize())
