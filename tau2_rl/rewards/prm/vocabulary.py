"""What PRM-Lite's rules know of a domain: its tools' id arguments, look-ups, examples, read and terminal tools.

The rules are statements about a trajectory ("a failed call with an id nobody showed", "a write on a record the agent
fetched first"), not about the airline; what makes them airline rules is only which arguments are ids, which tools
fetch one record, which values the tool descriptions give as examples, and which records can be cancelled. A
``Vocabulary`` holds exactly that per domain, derived from the domain's tool schemas where it can be (one place; no
per-tool lists), so retail's 15 tools get the rules' retail form and telecom's will get its own.

What is not in a vocabulary is the airline *policy*: P9–P11, B8 and P7's exemption for justified refusals read the
airline's reservations, fares, bags and certificates (``policy``, ``consent``). A domain without
``checks_airline_policy`` has them switched off (they never fire; docs/prm_lite.md says why).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


def walk_properties(schema: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every (property name, property schema) of a JSON schema, nested objects and array items included."""
    for name, prop in schema.get("properties", {}).items():
        yield name, prop
        yield from walk_properties(prop)
    if "items" in schema:
        yield from walk_properties(schema["items"])


def is_id_name(name: str) -> bool:
    """An argument that names entities: ``*_id``, ``*_ids`` (retail's item lists) or a flight number."""
    return name.endswith("_id") or name.endswith("_ids") or name.endswith("flight_number")


@dataclass(frozen=True)
class Vocabulary:
    """One domain's terms for PRM-Lite (``vocabulary(domain)``)."""

    domain: str
    id_argument_names: frozenset[str]
    """Argument names whose values are entity ids, at any depth of a call's arguments."""
    lookup_tools: Mapping[str, str]
    """Read tools that fetch one record by its id (tool → id argument): what counts as verifying an entity (B6)."""
    example_values: frozenset[str]
    """Example values of the tool descriptions, lower-cased: a model that copies them has looked nothing up (P1)."""
    enum_argument_names: frozenset[str]
    """Arguments whose value is one of a fixed set: chosen, never looked up (B6)."""
    read_tools: frozenset[str]
    terminal_tools: frozenset[str]
    record_id_field: str
    """The id field of the records whose latest status, "cancelled", makes a write on them dead (B6)."""
    id_prefix: str = ""
    """Leading characters of ids that are not part of a word token (retail's ``#W…`` order ids): stripped when ids are
    matched against the tokens of messages and results."""
    checks_airline_policy: bool = False
    """P9–P11, B8 and P7's refusal exemption apply (they read the airline policy's records)."""

    @property
    def verifiable_id_names(self) -> frozenset[str]:
        return frozenset(self.lookup_tools.values())

    def normalize_id(self, value: Any) -> str:
        """An id argument's value as the rules compare it (lower-cased, the domain's prefix stripped)."""
        text = str(value).strip().lower()
        return text.lstrip(self.id_prefix) if self.id_prefix else text


def _derived(
    domain: str,
    schemas: list[dict[str, Any]],
    read_tools: frozenset[str],
    terminal_tools: frozenset[str],
    examples: tuple[str, ...],
    record_id_field: str,
    id_prefix: str = "",
    checks_airline_policy: bool = False,
) -> Vocabulary:
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in schemas}
    lookups = {}
    for name in sorted(read_tools):
        properties = list(parameters.get(name, {}).get("properties", {}))
        if len(properties) == 1 and is_id_name(properties[0]):
            lookups[name] = properties[0]
    return Vocabulary(
        domain=domain,
        id_argument_names=frozenset(
            name for params in parameters.values() for name, _ in walk_properties(params) if is_id_name(name)
        ),
        lookup_tools=lookups,
        example_values=frozenset(value.lower() for value in examples),
        enum_argument_names=frozenset(
            name for params in parameters.values() for name, prop in walk_properties(params) if "enum" in prop
        ),
        read_tools=read_tools,
        terminal_tools=terminal_tools,
        record_id_field=record_id_field,
        id_prefix=id_prefix,
        checks_airline_policy=checks_airline_policy,
    )


def _airline() -> Vocabulary:
    from tau2_rl.envs.tools import READ_TOOLS, TERMINAL_TOOLS, TOOL_SCHEMAS

    examples = ("sara_doe_496", "ZFA04Y", "8JX2WO", "credit_card_7815826", "gift_card_7815826",
                "certificate_7815826", "2024-01-01")  # fmt: skip
    return _derived("airline", TOOL_SCHEMAS, READ_TOOLS, TERMINAL_TOOLS, examples, "reservation_id",
                    checks_airline_policy=True)  # fmt: skip


def _retail() -> Vocabulary:
    from tau2_rl.domains import get_domain
    from tau2_rl.envs.protocol import TAU2, agent_tool_schemas

    spec = get_domain("retail")
    # τ²'s retail descriptions' examples (none of them is a value of the database: tests/test_prm_domains.py).
    examples = ("#W0000000", "1008292230", "6086499569", "gift_card_0000000", "credit_card_0000000", "sara_doe_496",
                "something@example.com", "123 Main St")  # fmt: skip
    return _derived("retail", agent_tool_schemas(TAU2, "retail"), spec.read_tools(), spec.terminal_tools, examples,
                    "order_id", id_prefix="#")  # fmt: skip


VOCABULARIES = {"airline": _airline, "retail": _retail}
"""Domain name → its vocabulary's builder (a domain that joins adds one line here)."""


@functools.cache
def vocabulary(domain: str = "airline") -> Vocabulary:
    """The PRM-Lite vocabulary of ``domain`` (``--domain``)."""
    if domain not in VOCABULARIES:
        raise ValueError(f"PRM-Lite has no vocabulary for domain {domain!r}; known: {', '.join(VOCABULARIES)}")
    return VOCABULARIES[domain]()
